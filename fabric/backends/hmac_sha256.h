/* SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104) for fabric's peer
 * authentication, written for this project so the connection set-up can run
 * them without the GIL and without OpenSSL's headers at build time.
 *
 * Only for the handshake's few hundred bytes: clear code over fast code.
 * Tested against FIPS 180-4's examples, RFC 4231's HMAC cases and Python's
 * hashlib/hmac on random inputs (tests/test_auth_crypto.py).
 *
 * Everything is static: each extension that includes this gets its own copy.
 */
#ifndef FABRIC_HMAC_SHA256_H
#define FABRIC_HMAC_SHA256_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FAB_SHA256_BLOCK 64
#define FAB_SHA256_DIGEST 32

typedef struct {
    uint32_t h[8];
    uint64_t length;                    /* bytes hashed so far */
    uint8_t block[FAB_SHA256_BLOCK];
    size_t filled;                      /* bytes waiting in block */
} fab_sha256;

typedef struct {
    fab_sha256 inner;
    fab_sha256 outer;
} fab_hmac_sha256;

/* the first 32 bits of the fractional parts of the cube roots of the first
 * 64 primes (FIPS 180-4, 4.2.2) */
static const uint32_t fab_sha256_k[64] = {
    0x428a2f98U, 0x71374491U, 0xb5c0fbcfU, 0xe9b5dba5U,
    0x3956c25bU, 0x59f111f1U, 0x923f82a4U, 0xab1c5ed5U,
    0xd807aa98U, 0x12835b01U, 0x243185beU, 0x550c7dc3U,
    0x72be5d74U, 0x80deb1feU, 0x9bdc06a7U, 0xc19bf174U,
    0xe49b69c1U, 0xefbe4786U, 0x0fc19dc6U, 0x240ca1ccU,
    0x2de92c6fU, 0x4a7484aaU, 0x5cb0a9dcU, 0x76f988daU,
    0x983e5152U, 0xa831c66dU, 0xb00327c8U, 0xbf597fc7U,
    0xc6e00bf3U, 0xd5a79147U, 0x06ca6351U, 0x14292967U,
    0x27b70a85U, 0x2e1b2138U, 0x4d2c6dfcU, 0x53380d13U,
    0x650a7354U, 0x766a0abbU, 0x81c2c92eU, 0x92722c85U,
    0xa2bfe8a1U, 0xa81a664bU, 0xc24b8b70U, 0xc76c51a3U,
    0xd192e819U, 0xd6990624U, 0xf40e3585U, 0x106aa070U,
    0x19a4c116U, 0x1e376c08U, 0x2748774cU, 0x34b0bcb5U,
    0x391c0cb3U, 0x4ed8aa4aU, 0x5b9cca4fU, 0x682e6ff3U,
    0x748f82eeU, 0x78a5636fU, 0x84c87814U, 0x8cc70208U,
    0x90befffaU, 0xa4506cebU, 0xbef9a3f7U, 0xc67178f2U,
};

/* ... and of the square roots of the first 8 primes (5.3.3) */
static const uint32_t fab_sha256_h0[8] = {
    0x6a09e667U, 0xbb67ae85U, 0x3c6ef372U, 0xa54ff53aU,
    0x510e527fU, 0x9b05688cU, 0x1f83d9abU, 0x5be0cd19U,
};

static inline uint32_t fab_rotr32(uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

static void fab_sha256_compress(uint32_t h[8], const uint8_t block[FAB_SHA256_BLOCK])
{
    uint32_t w[64], a, b, c, d, e, f, g, k, t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = ((uint32_t)block[4 * i] << 24) | ((uint32_t)block[4 * i + 1] << 16) |
               ((uint32_t)block[4 * i + 2] << 8) | (uint32_t)block[4 * i + 3];
    for (i = 16; i < 64; i++) {
        uint32_t s0 = fab_rotr32(w[i - 15], 7) ^ fab_rotr32(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = fab_rotr32(w[i - 2], 17) ^ fab_rotr32(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = h[0]; b = h[1]; c = h[2]; d = h[3]; e = h[4]; f = h[5]; g = h[6]; k = h[7];
    for (i = 0; i < 64; i++) {
        uint32_t S1 = fab_rotr32(e, 6) ^ fab_rotr32(e, 11) ^ fab_rotr32(e, 25);
        uint32_t ch = (e & f) ^ (~e & g);
        uint32_t S0 = fab_rotr32(a, 2) ^ fab_rotr32(a, 13) ^ fab_rotr32(a, 22);
        uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
        t1 = k + S1 + ch + fab_sha256_k[i] + w[i];
        t2 = S0 + maj;
        k = g; g = f; f = e; e = d + t1;
        d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

static void fab_sha256_init(fab_sha256* s)
{
    memcpy(s->h, fab_sha256_h0, sizeof(s->h));
    s->length = 0;
    s->filled = 0;
}

static void fab_sha256_update(fab_sha256* s, const void* data, size_t n)
{
    const uint8_t* p = (const uint8_t*)data;
    s->length += n;
    while (n > 0) {
        size_t take = FAB_SHA256_BLOCK - s->filled;
        if (take > n)
            take = n;
        memcpy(s->block + s->filled, p, take);
        s->filled += take;
        p += take;
        n -= take;
        if (s->filled == FAB_SHA256_BLOCK) {
            fab_sha256_compress(s->h, s->block);
            s->filled = 0;
        }
    }
}

static void fab_sha256_final(fab_sha256* s, uint8_t out[FAB_SHA256_DIGEST])
{
    uint64_t bits = s->length * 8;
    int i;
    /* 0x80, zeros up to 56 mod 64, then the length in bits, big-endian */
    s->block[s->filled++] = 0x80;
    if (s->filled > FAB_SHA256_BLOCK - 8) {
        memset(s->block + s->filled, 0, FAB_SHA256_BLOCK - s->filled);
        fab_sha256_compress(s->h, s->block);
        s->filled = 0;
    }
    memset(s->block + s->filled, 0, FAB_SHA256_BLOCK - 8 - s->filled);
    for (i = 0; i < 8; i++)
        s->block[FAB_SHA256_BLOCK - 1 - i] = (uint8_t)(bits >> (8 * i));
    fab_sha256_compress(s->h, s->block);
    for (i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)s->h[i];
    }
}

/* Overwrite memory that held a secret; the compiler may not drop it. */
static void fab_wipe(void* p, size_t n)
{
    volatile uint8_t* v = (volatile uint8_t*)p;
    while (n--)
        *v++ = 0;
}

/* HMAC (RFC 2104): H((K ^ opad) || H((K ^ ipad) || message)); a key longer
 * than a block is hashed first. */
static void fab_hmac_init(fab_hmac_sha256* m, const void* key, size_t key_len)
{
    uint8_t pad[FAB_SHA256_BLOCK];
    uint8_t hashed[FAB_SHA256_DIGEST];
    size_t i;
    memset(pad, 0, sizeof(pad));
    if (key_len > FAB_SHA256_BLOCK) {
        fab_sha256_init(&m->inner);
        fab_sha256_update(&m->inner, key, key_len);
        fab_sha256_final(&m->inner, hashed);
        memcpy(pad, hashed, FAB_SHA256_DIGEST);
    } else if (key_len > 0) {
        memcpy(pad, key, key_len);
    }
    for (i = 0; i < FAB_SHA256_BLOCK; i++)
        pad[i] ^= 0x36;
    fab_sha256_init(&m->inner);
    fab_sha256_update(&m->inner, pad, FAB_SHA256_BLOCK);
    for (i = 0; i < FAB_SHA256_BLOCK; i++)
        pad[i] ^= 0x36 ^ 0x5c;
    fab_sha256_init(&m->outer);
    fab_sha256_update(&m->outer, pad, FAB_SHA256_BLOCK);
    fab_wipe(pad, sizeof(pad));
    fab_wipe(hashed, sizeof(hashed));
}

static void fab_hmac_update(fab_hmac_sha256* m, const void* data, size_t n)
{
    fab_sha256_update(&m->inner, data, n);
}

static void fab_hmac_final(fab_hmac_sha256* m, uint8_t out[FAB_SHA256_DIGEST])
{
    uint8_t inner[FAB_SHA256_DIGEST];
    fab_sha256_final(&m->inner, inner);
    fab_sha256_update(&m->outer, inner, FAB_SHA256_DIGEST);
    fab_sha256_final(&m->outer, out);
    fab_wipe(inner, sizeof(inner));
    fab_wipe(m, sizeof(*m));
}

/* 1 if the n bytes at a and b are equal; the time depends only on n. */
static int fab_equal_ct(const void* a, const void* b, size_t n)
{
    const volatile uint8_t* x = (const volatile uint8_t*)a;
    const volatile uint8_t* y = (const volatile uint8_t*)b;
    uint8_t diff = 0;
    size_t i;
    for (i = 0; i < n; i++)
        diff |= (uint8_t)(x[i] ^ y[i]);
    return diff == 0;
}

#endif
