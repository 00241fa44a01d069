# cython: language_level=3
"""Peer authentication's cryptography (issue 15, in progress): SHA-256 and
HMAC-SHA256 from hmac_sha256.h, which the connection set-up will run without
the GIL. This module exposes them to the tests only; nothing calls it yet.
"""
from libc.stdint cimport uint8_t

cdef extern from "hmac_sha256.h" nogil:
    ctypedef struct fab_sha256:
        pass
    ctypedef struct fab_hmac_sha256:
        pass
    void fab_sha256_init(fab_sha256* s)
    void fab_sha256_update(fab_sha256* s, const void* data, size_t n)
    void fab_sha256_final(fab_sha256* s, uint8_t* out)
    void fab_hmac_init(fab_hmac_sha256* m, const void* key, size_t key_len)
    void fab_hmac_update(fab_hmac_sha256* m, const void* data, size_t n)
    void fab_hmac_final(fab_hmac_sha256* m, uint8_t* out)
    int fab_equal_ct(const void* a, const void* b, size_t n)


def _sha256(data) -> bytes:
    """Test hook: SHA-256 of a bytes-like object."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef fab_sha256 s
    cdef uint8_t out[32]
    fab_sha256_init(&s)
    if view.shape[0]:
        fab_sha256_update(&s, &view[0], view.shape[0])
    fab_sha256_final(&s, out)
    return out[:32]


def _hmac_sha256(key, *parts) -> bytes:
    """Test hook: HMAC-SHA256 of the concatenated parts under key."""
    cdef const unsigned char[::1] k = memoryview(key).cast("B")
    cdef const unsigned char[::1] view
    cdef fab_hmac_sha256 m
    cdef uint8_t out[32]
    fab_hmac_init(&m, &k[0] if k.shape[0] else NULL, k.shape[0])
    for part in parts:
        view = memoryview(part).cast("B")
        if view.shape[0]:
            fab_hmac_update(&m, &view[0], view.shape[0])
    fab_hmac_final(&m, out)
    return out[:32]


def _equal(a, b) -> bool:
    """Test hook: constant-time comparison of two bytes-likes of one length."""
    cdef const unsigned char[::1] x = memoryview(a).cast("B")
    cdef const unsigned char[::1] y = memoryview(b).cast("B")
    if x.shape[0] != y.shape[0]:
        raise ValueError("compared values differ in length")
    if x.shape[0] == 0:
        return True
    return bool(fab_equal_ct(&x[0], &y[0], x.shape[0]))
