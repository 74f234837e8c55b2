/* W1 through a plain C free-list: the floor any block pool is measured against.
 *
 * The same work as lifecycle's BlockPool on the same trace, minus every Python and safety cost:
 * a LIFO stack of free ids, a refcount per block (set to 1 on allocate, decremented on free, the
 * block pushed back when it reaches 0), and per sequence the ids it holds. No validation, no lock.
 *
 * Built at run time by bench/w1.py with `cc -O2 -shared -fPIC` and called once through ctypes.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Replays `n_ops` rows (op, seq_id, k) of `ops`: op 1 allocates k blocks for sequence seq_id,
 * op 0 frees every block of seq_id. Sequence ids are < n_seqs and k <= max_k. Each live sequence
 * keeps its ids in a row of max_k entries; rows are recycled most recently freed first, as an
 * allocator would recycle small block tables.
 *
 * Returns the nanoseconds the replay took; -1 if the buffers cannot be allocated, -2 if an
 * allocation did not fit (the trace never asks for more than is free), -3 if the pool does not end
 * whole. `*blocks_freed` receives the number of blocks that went back on the free list. */
int64_t w1_replay(const int32_t *ops, int64_t n_ops, int32_t num_blocks, int32_t n_seqs, int32_t max_k,
                  int64_t *blocks_freed) {
    /* Every live sequence holds at least one block, so num_blocks rows always suffice. */
    const size_t n_rows = num_blocks > 0 ? (size_t)num_blocks : 1;
    int32_t *free_stack = malloc(sizeof(int32_t) * n_rows);
    int32_t *refcounts = calloc(n_rows, sizeof(int32_t));
    int32_t *seq_row = malloc(sizeof(int32_t) * (size_t)(n_seqs > 0 ? n_seqs : 1));
    int32_t *seq_len = calloc((size_t)(n_seqs > 0 ? n_seqs : 1), sizeof(int32_t));
    int32_t *free_rows = malloc(sizeof(int32_t) * n_rows);
    int32_t *rows = malloc(sizeof(int32_t) * n_rows * (size_t)max_k);
    int64_t result = -1;
    if (!free_stack || !refcounts || !seq_row || !seq_len || !free_rows || !rows) goto done;
    /* Touch every page now so that page faults stay outside the measurement. */
    memset(rows, 0, sizeof(int32_t) * n_rows * (size_t)max_k);
    memset(seq_row, 0, sizeof(int32_t) * (size_t)(n_seqs > 0 ? n_seqs : 1));
    for (int32_t i = 0; i < num_blocks; i++) {
        free_stack[i] = num_blocks - 1 - i;
        free_rows[i] = num_blocks - 1 - i;
    }

    int64_t num_free = num_blocks, num_free_rows = num_blocks, freed = 0;
    int64_t start = now_ns();
    for (int64_t row = 0; row < n_ops; row++) {
        const int32_t op = ops[3 * row], seq = ops[3 * row + 1], k = ops[3 * row + 2];
        if (op) {
            if (k > num_free || k > max_k) { result = -2; goto done; }
            const int32_t table = free_rows[--num_free_rows];
            int32_t *ids = rows + (size_t)table * (size_t)max_k;
            seq_row[seq] = table;
            seq_len[seq] = k;
            for (int32_t j = 0; j < k; j++) {
                const int32_t block = free_stack[--num_free];
                refcounts[block] = 1;
                ids[j] = block;
            }
        } else {
            const int32_t table = seq_row[seq];
            const int32_t *ids = rows + (size_t)table * (size_t)max_k;
            for (int32_t j = 0, n = seq_len[seq]; j < n; j++) {
                const int32_t block = ids[j];
                if (--refcounts[block] == 0) {
                    free_stack[num_free++] = block;
                    freed++;
                }
            }
            free_rows[num_free_rows++] = table;
        }
    }
    int64_t elapsed = now_ns() - start;
    *blocks_freed = freed;
    result = num_free == num_blocks ? elapsed : -3;
done:
    free(free_stack);
    free(refcounts);
    free(seq_row);
    free(seq_len);
    free(free_rows);
    free(rows);
    return result;
}
