# The KV cache core's calls off the request path, module lifecycle._coreviews: what a
# ``KVCacheCore`` method of the same name does, given the core (the GIL held, the lock not: each
# takes the core's lock itself). The core's methods are their only callers.

from libc.stdint cimport int64_t

from lifecycle._kvcache cimport KVCacheCore


cdef snapshot_point(KVCacheCore core, handle, num_blocks, bint rolling)
cdef drop_snapshot(KVCacheCore core, snapshot_id)
cdef prefix_snapshot(KVCacheCore core, handle)
cdef content_hashes(KVCacheCore core, tokens, adapter)
cdef cached_prefix_blocks(KVCacheCore core, tokens, adapter)
cdef counters(KVCacheCore core)
cdef unpin_prefix(KVCacheCore core, tokens, adapter)
cdef close(KVCacheCore core)
cdef memory(KVCacheCore core)
cdef reset(KVCacheCore core)
cdef set_events(KVCacheCore core, bint events, bint demote, max_pending_tokens)
cdef take_events(KVCacheCore core)
cdef evict_blocks(KVCacheCore core, ids)
cdef evict_group(KVCacheCore core, group, num_blocks)
cdef check_invariants(KVCacheCore core)
cdef fail_growth(KVCacheCore core, groups, chunks)
cdef group_stats(KVCacheCore core)
cdef int allocate_columns(KVCacheCore core, int64_t h, Py_ssize_t wanted, object held, object kv_tokens,
                          str call) except -1
