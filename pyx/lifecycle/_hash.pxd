# Block hashing and token comparison shared by the trie and the KV cache core (cimport only).
#
# Content hash of a block (stable: the same on every process and machine, documented in
# docs/content-hashes.md): with k[0..block_size] the hash keys below,
#   nh(block)     = sum over token pairs of (t[2i] + k[2i] mod 2^32) * (t[2i+1] + k[2i+1] mod 2^32) mod 2^64
#                   (an odd last token pairs with k[block_size])
#   digest(block) = fmix64(nh(block) ^ extra)             extra = the block's extra key, 0 if none
#   hash(block i) = digest(block i) + hash(block i-1) * 0x9E3779B97F4A7C15 mod 2^64
# where hash(block -1) is the root hash of the sequence's adapter key (``lc_root_hash``).
# Matching never relies on a hash: tokens are always compared exactly.

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

cdef extern from *:
    """
    #include <string.h>
    #include <stdint.h>
    #if defined(__SSE2__) && (defined(__x86_64__) || defined(_M_X64))
    #define LC_SSE2 1
    #include <emmintrin.h>
    #else
    #define LC_SSE2 0
    #endif

    #define LC_GOLDEN 0x9E3779B97F4A7C15ULL

    static inline uint64_t lc_fmix64(uint64_t h) {
        h ^= h >> 33;
        h *= 0xFF51AFD7ED558CCDULL;
        h ^= h >> 33;
        h *= 0xC4CEB9FE1A85EC53ULL;
        h ^= h >> 33;
        return h;
    }

    /* NH (the UMAC inner hash) of one block; with SSE2 four tokens per step, one multiply forming
     * both products of the step. The sum does not depend on the grouping, so the vector and the
     * scalar paths agree. */
    #if LC_SSE2
    static inline __m128i lc_nh_step(__m128i sum, const int32_t *t, const uint32_t *k) {
        __m128i x = _mm_add_epi32(_mm_loadu_si128((const __m128i *)t), _mm_loadu_si128((const __m128i *)k));
        return _mm_add_epi64(sum, _mm_mul_epu32(x, _mm_srli_epi64(x, 32)));
    }
    #endif
    static inline uint64_t lc_nh_block(const int32_t *t, Py_ssize_t n, const uint32_t *k) {
        uint64_t acc = 0;
        Py_ssize_t i = 0;
    #if LC_SSE2
        __m128i sum = _mm_setzero_si128();
        if (n == 16) {
            sum = lc_nh_step(lc_nh_step(lc_nh_step(lc_nh_step(sum, t, k), t + 4, k + 4), t + 8, k + 8), t + 12, k + 12);
            i = 16;
        } else {
            for (; i + 4 <= n; i += 4)
                sum = lc_nh_step(sum, t + i, k + i);
        }
        acc = (uint64_t)_mm_cvtsi128_si64(sum) + (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(sum, sum));
    #endif
        for (; i + 2 <= n; i += 2)
            acc += (uint64_t)((uint32_t)t[i] + k[i]) * (uint64_t)((uint32_t)t[i + 1] + k[i + 1]);
        if (i < n)
            acc += (uint64_t)((uint32_t)t[i] + k[i]) * (uint64_t)k[n];
        return acc;
    }

    /* The keys: the upper halves of a splitmix64 sequence from a fixed seed. */
    static inline void lc_fill_keys(uint32_t *keys, Py_ssize_t n) {
        uint64_t state = 0x243F6A8885A308D3ULL, z;
        for (Py_ssize_t i = 0; i < n; i++) {
            state += LC_GOLDEN;
            z = state;
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
            keys[i] = (uint32_t)((z ^ (z >> 31)) >> 32);
        }
    }

    /* The hash before a sequence's first block: its adapter key mixed. */
    static inline uint64_t lc_root_hash(int64_t adapter) {
        return lc_fmix64((uint64_t)adapter * 0xD6E8FEB86659FD93ULL + 0x5851F42D4C957F2DULL);
    }

    /* Content hashes of n consecutive blocks after one whose hash is parent. The chain is one
     * multiply-add per block; the finalizers of a window are independent of each other. */
    static inline void lc_content_hashes(uint64_t parent, const int32_t *tokens, Py_ssize_t n,
                                         Py_ssize_t block_size, const uint32_t *keys, uint64_t *out) {
        for (Py_ssize_t i = 0; i < n; i++) {
            parent = lc_fmix64(lc_nh_block(tokens + i * block_size, block_size, keys)) + parent * LC_GOLDEN;
            out[i] = parent;
        }
    }

    /* lc_content_hashes that also copies the blocks' tokens to copy and their hashes to out2 as it
     * reads them (one pass over the tokens, for the event log). 16-token blocks keep the keys in
     * registers; the sums are those of lc_nh_block, so the hashes are the same. */
    static inline void lc_content_hashes_copy(uint64_t parent, const int32_t *tokens, Py_ssize_t n,
                                              Py_ssize_t block_size, const uint32_t *keys, uint64_t *out,
                                              uint64_t *out2, int32_t *copy) {
        Py_ssize_t i;
    #if LC_SSE2
        if (block_size == 16) {
            const __m128i k0 = _mm_loadu_si128((const __m128i *)keys);
            const __m128i k1 = _mm_loadu_si128((const __m128i *)(keys + 4));
            const __m128i k2 = _mm_loadu_si128((const __m128i *)(keys + 8));
            const __m128i k3 = _mm_loadu_si128((const __m128i *)(keys + 12));
            for (i = 0; i < n; i++) {
                const __m128i *t = (const __m128i *)(tokens + i * 16);
                __m128i *d = (__m128i *)(copy + i * 16);
                __m128i t0 = _mm_loadu_si128(t), t1 = _mm_loadu_si128(t + 1);
                __m128i t2 = _mm_loadu_si128(t + 2), t3 = _mm_loadu_si128(t + 3);
                _mm_storeu_si128(d, t0);
                _mm_storeu_si128(d + 1, t1);
                _mm_storeu_si128(d + 2, t2);
                _mm_storeu_si128(d + 3, t3);
                __m128i x0 = _mm_add_epi32(t0, k0), x1 = _mm_add_epi32(t1, k1);
                __m128i x2 = _mm_add_epi32(t2, k2), x3 = _mm_add_epi32(t3, k3);
                __m128i sum = _mm_add_epi64(
                    _mm_add_epi64(_mm_mul_epu32(x0, _mm_srli_epi64(x0, 32)),
                                  _mm_mul_epu32(x1, _mm_srli_epi64(x1, 32))),
                    _mm_add_epi64(_mm_mul_epu32(x2, _mm_srli_epi64(x2, 32)),
                                  _mm_mul_epu32(x3, _mm_srli_epi64(x3, 32))));
                uint64_t acc = (uint64_t)_mm_cvtsi128_si64(sum)
                               + (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(sum, sum));
                parent = lc_fmix64(acc) + parent * LC_GOLDEN;
                out[i] = parent;
                out2[i] = parent;
            }
            return;
        }
    #endif
        for (i = 0; i < n; i++) {
            memcpy(copy + i * block_size, tokens + i * block_size, (size_t)block_size * sizeof(int32_t));
            parent = lc_fmix64(lc_nh_block(tokens + i * block_size, block_size, keys)) + parent * LC_GOLDEN;
            out[i] = parent;
            out2[i] = parent;
        }
    }

    /* Whether two blocks are equal; 16 tokens as four vector compares. */
    static inline int lc_block_equal(const int32_t *a, const int32_t *b, Py_ssize_t n) {
    #if LC_SSE2
        if (n == 16) {
            const __m128i *x = (const __m128i *)a, *y = (const __m128i *)b;
            __m128i e0 = _mm_cmpeq_epi32(_mm_loadu_si128(x), _mm_loadu_si128(y));
            __m128i e1 = _mm_cmpeq_epi32(_mm_loadu_si128(x + 1), _mm_loadu_si128(y + 1));
            __m128i e2 = _mm_cmpeq_epi32(_mm_loadu_si128(x + 2), _mm_loadu_si128(y + 2));
            __m128i e3 = _mm_cmpeq_epi32(_mm_loadu_si128(x + 3), _mm_loadu_si128(y + 3));
            return _mm_movemask_epi8(_mm_and_si128(_mm_and_si128(e0, e1), _mm_and_si128(e2, e3))) == 0xFFFF;
        }
    #endif
        return memcmp(a, b, (size_t)n * sizeof(int32_t)) == 0;
    }

    /* How many of the first n blocks of a and b are equal, counted from the start. Runs are
     * compared in spans with memcmp (the C library's widest loop) and only a differing span
     * is looked at block by block. */
    static inline Py_ssize_t lc_equal_blocks(const int32_t *a, const int32_t *b, Py_ssize_t n, Py_ssize_t block_size) {
        Py_ssize_t done = 0, span, i;
        while (done < n) {
            span = n - done < 64 ? n - done : 64;
            size_t bytes = (size_t)(span * block_size) * sizeof(int32_t);
            if (memcmp(a + done * block_size, b + done * block_size, bytes) != 0) {
                for (i = 0; i < span; i++)
                    if (!lc_block_equal(a + (done + i) * block_size, b + (done + i) * block_size, block_size))
                        return done + i;
            }
            done += span;
        }
        return n;
    }

    /* Copy n int32 values, returning whether any is negative (one pass: tokens are checked as
     * they are recorded). */
    static inline int lc_copy_tokens_checked(int32_t *dst, const int32_t *src, Py_ssize_t n) {
        Py_ssize_t i = 0;
    #if LC_SSE2
        __m128i sign = _mm_setzero_si128();
        for (; i + 8 <= n; i += 8) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 4));
            sign = _mm_or_si128(sign, _mm_or_si128(a, b));
            _mm_storeu_si128((__m128i *)(dst + i), a);
            _mm_storeu_si128((__m128i *)(dst + i + 4), b);
        }
        int negative = _mm_movemask_ps(_mm_castsi128_ps(sign)) != 0;
    #else
        int negative = 0;
    #endif
        for (; i < n; i++) {
            negative |= src[i] < 0;
            dst[i] = src[i];
        }
        return negative;
    }

    /* The same with streaming stores for long runs: the copy is read again only much later (when
     * the request finishes), so it should not push the cache's working set out. */
    static inline int lc_stream_tokens_checked(int32_t *dst, const int32_t *src, Py_ssize_t n) {
    #if LC_SSE2
        if (n >= 4096 && ((uintptr_t)dst & 15) == 0) {
            Py_ssize_t i = 0;
            __m128i sign = _mm_setzero_si128();
            for (; i + 16 <= n; i += 16) {
                __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
                __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 4));
                __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 8));
                __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 12));
                sign = _mm_or_si128(sign, _mm_or_si128(_mm_or_si128(a, b), _mm_or_si128(c, d)));
                _mm_stream_si128((__m128i *)(dst + i), a);
                _mm_stream_si128((__m128i *)(dst + i + 4), b);
                _mm_stream_si128((__m128i *)(dst + i + 8), c);
                _mm_stream_si128((__m128i *)(dst + i + 12), d);
            }
            _mm_sfence();
            int negative = _mm_movemask_ps(_mm_castsi128_ps(sign)) != 0;
            return lc_copy_tokens_checked(dst + i, src + i, n - i) | negative;
        }
    #endif
        return lc_copy_tokens_checked(dst, src, n);
    }
    """
    uint64_t lc_fmix64(uint64_t h) noexcept nogil
    uint64_t lc_nh_block(const int32_t *tokens, Py_ssize_t n, const uint32_t *keys) noexcept nogil
    void lc_fill_keys(uint32_t *keys, Py_ssize_t n) noexcept nogil
    uint64_t lc_root_hash(int64_t adapter) noexcept nogil
    void lc_content_hashes(uint64_t parent, const int32_t *tokens, Py_ssize_t n, Py_ssize_t block_size,
                           const uint32_t *keys, uint64_t *out) noexcept nogil
    void lc_content_hashes_copy(uint64_t parent, const int32_t *tokens, Py_ssize_t n, Py_ssize_t block_size,
                                const uint32_t *keys, uint64_t *out, uint64_t *out2, int32_t *copy) noexcept nogil
    bint lc_block_equal(const int32_t *a, const int32_t *b, Py_ssize_t n) noexcept nogil
    Py_ssize_t lc_equal_blocks(const int32_t *a, const int32_t *b, Py_ssize_t n, Py_ssize_t block_size) noexcept nogil
    bint lc_copy_tokens_checked(int32_t *dst, const int32_t *src, Py_ssize_t n) noexcept nogil
    bint lc_stream_tokens_checked(int32_t *dst, const int32_t *src, Py_ssize_t n) noexcept nogil
    uint64_t LC_GOLDEN


cdef inline bint lc_tokens_differ(const int32_t *a, const int32_t *b, Py_ssize_t n) noexcept nogil:
    """Whether the ``n`` token ids at ``a`` and ``b`` differ anywhere."""
    cdef Py_ssize_t i
    for i in range(n):
        if a[i] != b[i]:
            return True
    return False
