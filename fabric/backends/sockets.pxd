# Socket helpers shared by the backends that use TCP (the tcp fabric itself,
# and the bootstrap connections of ucx and verbs).
from fabric._posix cimport sockaddr, socklen_t

cdef void format_name(sockaddr* sa, socklen_t salen, char* out, size_t n) noexcept nogil
cdef void local_and_peer_names(int fd, char* local, char* peer, size_t n) noexcept nogil
cdef int peer_on_this_host(int fd) noexcept nogil
cdef int set_int_opt(int fd, int level, int name, int value) noexcept nogil
cdef int tune_socket(int fd, int user_timeout_ms, int keepalive_s) noexcept nogil
cdef int listen_socket(str host, int port, char* address, size_t address_len) except -1
cdef int connect_socket(str host, int port, double timeout) except -1
cdef int accept_socket(int lfd) noexcept nogil
