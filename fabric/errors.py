"""The one exception hierarchy of fabric.

Every error fabric raises derives from FabricError; where a builtin exception
means the same thing, the fabric error also derives from it, so code that
catches TimeoutError or ConnectionError keeps working.
"""


class FabricError(Exception):
    """Base of every error raised by fabric."""


class ProtocolError(FabricError):
    """The peer broke the wire protocol; the connection was closed."""


class ConnectionLost(FabricError, ConnectionError):
    """The connection failed or the peer went away; pending operations fail with it."""


class ConnectionClosed(ConnectionLost):
    """The endpoint was closed, locally or by the peer."""


class Timeout(FabricError, TimeoutError):
    """The operation did not complete within its timeout; nothing was lost."""


class BackendUnavailable(FabricError):
    """The requested backend cannot be used here; the message says why."""


class AddressError(FabricError, ValueError):
    """An address fabric cannot parse, or one naming another backend than the
    Fabric it was given to."""


class MessageTooLarge(FabricError, ValueError):
    """recv_into's buffer is smaller than the next message (which is kept),
    or a message exceeds the configured maximum."""

    def __init__(self, message, size=None):
        super().__init__(message)
        self.size = size


class RemoteAccessError(FabricError):
    """A peer offered memory it could not serve, or refused a read."""


class ResourceLimit(FabricError, MemoryError):
    """The engine could not get memory, descriptors or registrations for a
    connection or a message; the message says which."""


class BusyError(FabricError):
    """Another operation of the same kind is already in progress on this object."""


class AuthenticationError(FabricError, PermissionError):
    """The peer failed fabric's authentication (no key, another key, or a
    replayed or reflected handshake), or refused ours; nothing of the
    connection was set up."""
