# cython: language_level=3
"""Base class of every backend (see interface.pxd for the contract)."""
from fabric.backends.sockets cimport connect_socket, tune_socket


cdef class Backend:
    """Python-visible description of a backend and its connection factories."""

    def __init__(self):
        raise TypeError("Backend is abstract; use fabric.backends.get(name)")

    cdef fab_listener* listen(self, object domain, str host, int port, dict options) except NULL:
        raise NotImplementedError

    cdef int dial(self, object domain, str host, int port, double timeout, dict options) except -1:
        cdef int fd = connect_socket(host, port, timeout)
        tune_socket(fd, int(options.get("tcp_user_timeout_ms", 30000)), int(options.get("tcp_keepalive_s", 10)))
        return fd

    def _tune(self, int fd, dict options):
        """What dial() sets on a socket, for sockets connected elsewhere
        (asyncio's own non-blocking connect)."""
        tune_socket(fd, int(options.get("tcp_user_timeout_ms", 30000)), int(options.get("tcp_keepalive_s", 10)))

    cdef int prepare_attach(self, object domain, dict options, fab_attach* out) except -1:
        raise NotImplementedError

    cdef fab_hub* hub(self, object domain) except? NULL:
        return NULL

    def open_domain(self, dict options):
        """Per-Fabric backend state, kept alive by the Fabric; None if unused."""
        return None

    def open_domain_tls(self, dict options, ssl):
        """open_domain for Fabric(ssl=...): only the tcp fabric runs TLS."""
        from fabric.errors import BackendUnavailable
        raise BackendUnavailable(f"TLS (ssl=) is for the tcp fabric; {self.name} protects its bootstrap "
                                 f"with authentication (auth_key) and its data path is the fabric's own")

    def close_domain(self, domain):
        """Release the per-Fabric state now (the Fabric is closing and every
        channel and listener of the domain is closed)."""
        if domain is not None and hasattr(domain, "close"):
            domain.close()

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
                           (FAB_CAP_SEND_COPIES, "send_copies"),
                           (FAB_CAP_NATIVE_LARGE, "native_large"),
                           (FAB_CAP_ORDERED_CLOSE, "ordered_close"),
                           (FAB_CAP_LARGE_NATIVE_ONLY, "large_native_only"),
                           (FAB_CAP_READS_SERVED, "reads_served"),
                           (FAB_CAP_ORDERED_WRITE, "ordered_write")):
            if self.caps & flag:
                names.append(name)
        return tuple(names)

    def __repr__(self):
        return f"<fabric backend {self.name} caps={','.join(self.capabilities)}>"

