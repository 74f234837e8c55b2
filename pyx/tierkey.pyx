# cython: autotestdict=False
"""Keyed chain keys of the tiers below the device: SipHash-1-3 with a 128-bit output, over a
block's parent key and tokens, under a secret 128-bit key.

The key of block ``i`` of a token sequence is ``SipHash-1-3-128(secret, parent || tokens_i)``:
``parent`` is the key of block ``i - 1`` (a root key for the first block) as 16 bytes (high
word, then low word, each little-endian), ``tokens_i`` the block's token ids as little-endian
int32. The result is the pair (high, low) of 64-bit words (SipHash's first and second output
words). Without the secret nobody can aim two prefixes at one key, which the core's public
content hash does not offer (docs/tiers.md).

An argument of the wrong kind raises ``InvalidId`` naming what was expected and what came.
"""

cimport cython
cimport numpy as cnp

import numpy as np
from libc.stdint cimport int32_t, uint32_t, uint64_t, uint8_t

from lifecycle.errors import InvalidId

cnp.import_array()


cdef inline uint64_t _rotl(uint64_t x, int b) noexcept nogil:
    return (x << b) | (x >> (64 - b))


cdef struct _Sip:
    uint64_t v0
    uint64_t v1
    uint64_t v2
    uint64_t v3


cdef inline void _round(_Sip *s) noexcept nogil:
    s.v0 += s.v1
    s.v1 = _rotl(s.v1, 13)
    s.v1 ^= s.v0
    s.v0 = _rotl(s.v0, 32)
    s.v2 += s.v3
    s.v3 = _rotl(s.v3, 16)
    s.v3 ^= s.v2
    s.v0 += s.v3
    s.v3 = _rotl(s.v3, 21)
    s.v3 ^= s.v0
    s.v2 += s.v1
    s.v1 = _rotl(s.v1, 17)
    s.v1 ^= s.v2
    s.v2 = _rotl(s.v2, 32)


cdef inline void _start(_Sip *s, uint64_t k0, uint64_t k1) noexcept nogil:
    s.v0 = k0 ^ 0x736F6D6570736575ULL
    s.v1 = k1 ^ 0x646F72616E646F6DULL ^ 0xEE
    s.v2 = k0 ^ 0x6C7967656E657261ULL
    s.v3 = k1 ^ 0x7465646279746573ULL


cdef inline void _word(_Sip *s, uint64_t m) noexcept nogil:
    s.v3 ^= m
    _round(s)
    s.v0 ^= m


cdef inline void _finish(_Sip *s, uint64_t last, uint64_t *hi, uint64_t *lo) noexcept nogil:
    _word(s, last)
    s.v2 ^= 0xEE
    _round(s)
    _round(s)
    _round(s)
    hi[0] = s.v0 ^ s.v1 ^ s.v2 ^ s.v3
    s.v1 ^= 0xDD
    _round(s)
    _round(s)
    _round(s)
    lo[0] = s.v0 ^ s.v1 ^ s.v2 ^ s.v3


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _chain(const int32_t *tokens, Py_ssize_t count, Py_ssize_t block_size, uint64_t k0, uint64_t k1,
                 uint64_t hi, uint64_t lo, uint64_t *out) noexcept nogil:
    cdef Py_ssize_t block, i
    cdef const int32_t *row
    cdef uint64_t length = (16 + 4 * <uint64_t>block_size) << 56
    cdef uint64_t last
    cdef _Sip s
    for block in range(count):
        row = tokens + block * block_size
        _start(&s, k0, k1)
        _word(&s, hi)
        _word(&s, lo)
        i = 0
        while i + 1 < block_size:
            _word(&s, <uint64_t><uint32_t>row[i] | (<uint64_t><uint32_t>row[i + 1] << 32))
            i += 2
        last = length
        if i < block_size:
            last |= <uint64_t><uint32_t>row[i]
        _finish(&s, last, &hi, &lo)
        out[2 * block] = hi
        out[2 * block + 1] = lo


def chain_keys(tokens, Py_ssize_t block_size, uint64_t k0, uint64_t k1, uint64_t parent_hi, uint64_t parent_lo):
    """The keys of the whole blocks of ``tokens`` (a 1-D int32 array of a multiple of
    ``block_size`` ids) chained from the key ``(parent_hi, parent_lo)`` under the secret
    ``(k0, k1)``: a ``(blocks, 2)`` uint64 array of (high, low) rows."""
    if not isinstance(tokens, np.ndarray) or tokens.dtype != np.int32 or tokens.ndim != 1:
        raise InvalidId(f"chain_keys: tokens must be a 1-D int32 array, got {type(tokens).__name__}")
    if block_size < 1:
        raise InvalidId(f"chain_keys: block_size={block_size} must be >= 1")
    if tokens.shape[0] % block_size:
        raise InvalidId(f"chain_keys: {tokens.shape[0]} tokens are not whole blocks of block_size={block_size}")
    cdef const int32_t[::1] view = np.ascontiguousarray(tokens)
    cdef Py_ssize_t count = view.shape[0] // block_size
    out = np.empty((count, 2), dtype=np.uint64)
    cdef uint64_t[:, ::1] keys = out
    if count:
        with nogil:
            _chain(&view[0], count, block_size, k0, k1, parent_hi, parent_lo, &keys[0, 0])
    return out


@cython.boundscheck(False)
@cython.wraparound(False)
def siphash128(const uint8_t[::1] data, uint64_t k0, uint64_t k1):
    """SipHash-1-3-128 of the bytes ``data`` under ``(k0, k1)``: ``(high, low)``."""
    cdef Py_ssize_t n = data.shape[0], i = 0, j
    cdef uint64_t word, hi = 0, lo = 0
    cdef _Sip s
    _start(&s, k0, k1)
    while i + 8 <= n:
        word = 0
        for j in range(8):
            word |= <uint64_t>data[i + j] << (8 * j)
        _word(&s, word)
        i += 8
    word = (<uint64_t>n) << 56
    j = 0
    while i < n:
        word |= <uint64_t>data[i] << (8 * j)
        i += 1
        j += 1
    _finish(&s, word, &hi, &lo)
    return hi, lo
