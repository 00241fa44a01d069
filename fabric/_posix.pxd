# POSIX and Linux declarations used by the engine and the socket backends.
# Declares only what fabric uses (one .pxd per C library family).
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from posix.uio cimport iovec

cdef extern from "<errno.h>" nogil:
    int errno
    enum:
        EAGAIN
        EWOULDBLOCK
        EINTR
        EINPROGRESS
        ECONNRESET
        EPIPE
        ETIMEDOUT
        ENOMEM
        EPROTO
        EINVAL
        ENOTCONN
        ECONNABORTED
        EMSGSIZE
        ECANCELED

cdef extern from "<string.h>" nogil:
    char* strerror(int errnum)

cdef extern from "<stdio.h>" nogil:
    int snprintf(char* buf, size_t n, const char* fmt, ...)

cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t
    ctypedef unsigned short sa_family_t
    struct sockaddr:
        sa_family_t sa_family
    struct sockaddr_storage:
        sa_family_t ss_family
    struct msghdr:
        void* msg_name
        socklen_t msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    enum:
        AF_INET
        AF_INET6
        AF_UNSPEC
        SOCK_STREAM
        SOCK_NONBLOCK
        SOCK_CLOEXEC
        SOL_SOCKET
        SO_REUSEADDR
        SO_ERROR
        SO_KEEPALIVE
        SO_SNDBUF
        SO_RCVBUF
        MSG_DONTWAIT
        MSG_NOSIGNAL
        SHUT_RDWR
        SOMAXCONN
    int socket(int domain, int type, int protocol)
    int bind(int fd, const sockaddr* addr, socklen_t len)
    int listen(int fd, int backlog)
    int accept4(int fd, sockaddr* addr, socklen_t* len, int flags)
    int connect(int fd, const sockaddr* addr, socklen_t len)
    int getsockname(int fd, sockaddr* addr, socklen_t* len)
    int getpeername(int fd, sockaddr* addr, socklen_t* len)
    int setsockopt(int fd, int level, int name, const void* val, socklen_t len)
    int getsockopt(int fd, int level, int name, void* val, socklen_t* len)
    ssize_t sendmsg(int fd, const msghdr* msg, int flags)
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    ssize_t send(int fd, const void* buf, size_t n, int flags)
    int shutdown(int fd, int how)

cdef extern from "<netinet/in.h>" nogil:
    enum:
        IPPROTO_TCP
        IPPROTO_IPV6
        IPV6_V6ONLY

cdef extern from "<netinet/tcp.h>" nogil:
    enum:
        TCP_NODELAY
        TCP_KEEPIDLE
        TCP_KEEPINTVL
        TCP_KEEPCNT
        TCP_USER_TIMEOUT

cdef extern from "<netdb.h>" nogil:
    struct addrinfo:
        int ai_flags
        int ai_family
        int ai_socktype
        int ai_protocol
        socklen_t ai_addrlen
        sockaddr* ai_addr
        char* ai_canonname
        addrinfo* ai_next
    enum:
        AI_PASSIVE
        AI_NUMERICSERV
        AI_ADDRCONFIG
        NI_MAXHOST
        NI_MAXSERV
        NI_NUMERICHOST
        NI_NUMERICSERV
    int getaddrinfo(const char* node, const char* service, const addrinfo* hints, addrinfo** res)
    void freeaddrinfo(addrinfo* res)
    const char* gai_strerror(int errcode)
    int getnameinfo(const sockaddr* sa, socklen_t salen, char* host, socklen_t hostlen,
                    char* serv, socklen_t servlen, int flags)

cdef extern from "<unistd.h>" nogil:
    int close(int fd)
    ssize_t read(int fd, void* buf, size_t n)
    ssize_t write(int fd, const void* buf, size_t n)
    int getpid()

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    enum:
        POLLIN
        POLLOUT
        POLLERR
        POLLHUP
    int poll(pollfd* fds, unsigned long nfds, int timeout)

cdef extern from "<sys/epoll.h>" nogil:
    union epoll_data_t:
        void* ptr
        int fd
        uint64_t u64
    struct epoll_event:
        uint32_t events
        epoll_data_t data
    enum:
        EPOLLIN
        EPOLLOUT
        EPOLLERR
        EPOLLHUP
        EPOLL_CTL_ADD
        EPOLL_CTL_MOD
        EPOLL_CTL_DEL
        EPOLL_CLOEXEC
    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event* ev)
    int epoll_wait(int epfd, epoll_event* events, int maxevents, int timeout)

cdef extern from "<sys/eventfd.h>" nogil:
    enum:
        EFD_NONBLOCK
        EFD_CLOEXEC
    int eventfd(unsigned int initval, int flags)

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    enum:
        CLOCK_MONOTONIC
        CLOCK_REALTIME
    int clock_gettime(int clk, timespec* ts)

cdef extern from "<sys/timerfd.h>" nogil:
    struct itimerspec:
        timespec it_interval
        timespec it_value
    enum:
        TFD_NONBLOCK
        TFD_CLOEXEC
        TFD_TIMER_ABSTIME
    int timerfd_create(int clockid, int flags)
    int timerfd_settime(int fd, int flags, const itimerspec* new_value, itimerspec* old_value)

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_mutex_init(pthread_mutex_t* m, void* attr)
    int pthread_mutex_destroy(pthread_mutex_t* m)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)
    int pthread_condattr_init(pthread_condattr_t* a)
    int pthread_condattr_setclock(pthread_condattr_t* a, int clk)
    int pthread_cond_init(pthread_cond_t* c, pthread_condattr_t* a)
    int pthread_cond_destroy(pthread_cond_t* c)
    int pthread_cond_broadcast(pthread_cond_t* c)
    int pthread_cond_timedwait(pthread_cond_t* c, pthread_mutex_t* m, const timespec* t)
    int pthread_cond_wait(pthread_cond_t* c, pthread_mutex_t* m)
    int pthread_cond_signal(pthread_cond_t* c)
    ctypedef unsigned long pthread_t
    int pthread_create(pthread_t* t, void* attr, void* (*start)(void*) noexcept nogil, void* arg)
    int pthread_join(pthread_t t, void** ret)
    pthread_t pthread_self()

cdef extern from "<sys/random.h>" nogil:
    ssize_t getrandom(void* buf, size_t n, unsigned int flags)

cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef inline double monotonic_now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9

cdef extern from "<sched.h>" nogil:
    int sched_yield()
