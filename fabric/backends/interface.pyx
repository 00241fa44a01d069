# cython: language_level=3
"""Base class of every backend (see interface.pxd for the contract)."""


cdef class Backend:
    """Python-visible description of a backend and its connection factories."""

    def __init__(self):
        raise TypeError("Backend is abstract; use fabric.backends.get(name)")

    cdef fab_listener* listen(self, object domain, str host, int port, dict options) except NULL:
        raise NotImplementedError

    cdef fab_channel* connect(self, object domain, str host, int port, double timeout,
                              size_t max_recv, dict options) except NULL:
        raise NotImplementedError

    def open_domain(self, dict options):
        """Per-Fabric backend state, kept alive by the Fabric; None if unused."""
        return None

    def default_options(self):
        """Per-backend defaults of the engine's thresholds (see fabric.options)."""
        return {}

    @property
    def capabilities(self):
        names = []
        for flag, name in ((FAB_CAP_NATIVE_READ, "native_read"),
                           (FAB_CAP_NATIVE_WRITE, "native_write"),
                           (FAB_CAP_SEND_ANY_MEMORY, "send_any_memory"),
                           (FAB_CAP_READ_ANY_MEMORY, "read_any_memory"),
                           (FAB_CAP_SEND_COPIES, "send_copies")):
            if self.caps & flag:
                names.append(name)
        return tuple(names)

    def __repr__(self):
        return f"<fabric backend {self.name} caps={','.join(self.capabilities)}>"

