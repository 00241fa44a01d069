"""fabric: adaptive message and tensor transport (TCP, UCX, RDMA verbs).

    import fabric
    fab = fabric.Fabric()                 # backend: argument, $FABRIC_BACKEND, or auto
    lst = fab.listen("127.0.0.1:0")
    ep = fab.connect(lst.address)         # in another process or thread
    peer = lst.accept()
    ep.send(b"hello")                     # any C-contiguous buffer, or a list of them
    msg = peer.recv()                     # a writable buffer (fabric.Message)
    n = peer.recv_into(bytearray(1 << 20))
    buf = fabric.empty(1 << 20)           # a buffer from fabric's receive memory

Large received messages (1 MiB and up) land in huge-page blocks that fabric
faults in once and reuses (bounded by FABRIC_RECV_CACHE; Fabric.receive_memory
counts them; prepare_receive_memory maps some ahead, trim_receive_memory gives
the free ones back).

The distribution is `fabric-transport`; it cannot share an environment with
the unrelated SSH tool published on PyPI as `fabric` (same import name).
"""
from fabric.errors import (AddressError, AuthenticationError, BackendUnavailable, BusyError, ConnectionClosed,
                           ConnectionLost, FabricError, MessageTooLarge, ProtocolError, RemoteAccessError,
                           ResourceLimit, Timeout)
from fabric.protocol.engine import Endpoint, Listener, Message, Request
from fabric.protocol.engine import new_message as empty
from fabric.protocol.engine import prepare_recv_memory as prepare_receive_memory
from fabric.protocol.engine import trim_recv_memory as trim_receive_memory
from fabric.api import Fabric, aconnect, connect, default_fabric, listen
from fabric.backends import available as available_backends

__version__ = "0.2.0"

import logging as _logging

# Quiet unless the application configures logging (logger "fabric": the
# backend chosen and why at INFO, connections at DEBUG, failures at INFO).
_logging.getLogger("fabric").addHandler(_logging.NullHandler())

__all__ = [
    "Fabric", "Endpoint", "Listener", "Message", "Request", "listen", "connect", "aconnect",
    "default_fabric", "available_backends", "empty", "prepare_receive_memory", "trim_receive_memory", "FabricError", "ProtocolError", "ConnectionLost",
    "ConnectionClosed", "Timeout", "BackendUnavailable", "MessageTooLarge",
    "RemoteAccessError", "BusyError", "ResourceLimit", "AddressError", "AuthenticationError",
]
