# Little-endian field access for wire formats (x86-64 and aarch64 are little-endian;
# memcpy keeps unaligned access defined).
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

cdef inline void wr16(void* p, uint16_t v) noexcept nogil:
    memcpy(p, &v, 2)

cdef inline void wr32(void* p, uint32_t v) noexcept nogil:
    memcpy(p, &v, 4)

cdef inline void wr64(void* p, uint64_t v) noexcept nogil:
    memcpy(p, &v, 8)

cdef inline uint16_t rd16(const void* p) noexcept nogil:
    cdef uint16_t v
    memcpy(&v, p, 2)
    return v

cdef inline uint32_t rd32(const void* p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v

cdef inline uint64_t rd64(const void* p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v
