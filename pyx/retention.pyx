# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""Retention hints of a KV cache core (module lifecycle._retention).

An engine says what it wants kept, in TensorRT-LLM's terms: a priority from 0 to 100 per token
range of a request's prompt, each for a duration after which it decays to the default (35), a
priority for the generated tokens, and (as agent frameworks keep KV between tool calls) a session
TTL: the request's whole path stays above the default for that long. The hint is kept per request
and applied when the request's blocks enter the trie at its finish, as a priority per run of blocks
(a run spanning two priorities is cut); the trie then evicts the lowest priority first, least
recently used within it (``lifecycle._radix``). A block a request only reused keeps the higher of
its priority and the hint's: one request cannot lower what another asked to keep.

Pinned prefixes (a system prompt that must stay) are trie pins, as a live request's, within a
budget in blocks; ``pin_prefix`` pins the cached blocks of a prefix, so pin it once it is cached.
"""

cimport cython
cimport numpy as cnp
from libc.math cimport INFINITY, isfinite
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, malloc, realloc

from lifecycle._args cimport ssize_arg as _as_count
from lifecycle._int32 cimport token_vector as _token_vector
from lifecycle._radix cimport DEFAULT_PRIORITY, MAX_PRIORITY, RNode, WalkEnd
from lifecycle._records cimport E_NO_MEMORY, Failure, handle_arg as _handle_arg, ok

from lifecycle.errors import RetentionError

cnp.import_array()

#: The priority of a block no hint speaks for (TensorRT-LLM's default).
DEFAULT_RETENTION = DEFAULT_PRIORITY
# A session TTL keeps a path just above the default: it goes after every unhinted block and
# before any range given a higher priority.
TTL_PRIORITY = DEFAULT_PRIORITY + 1


cdef Retention new_retention(RadixTrie trie, Records records, CoreLock lock, Py_ssize_t block_size, bint grouped):
    """The retention state of one core (no hints, no pins, a pin budget of 0 blocks); ``grouped``: the
    core has several KV cache groups, whose finish and eviction rules hints do not follow yet."""
    cdef Retention r = Retention.__new__(Retention)
    r._trie = trie
    r._records = records
    r._lock = lock
    r._block_size = block_size
    r._pins = []
    r._grouped = grouped
    return r


cdef int _priority(object value, str name) except -1:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise RetentionError(f"{name} must be an int in [0, {MAX_PRIORITY}], got {value!r}")
    return <int>value


cdef double _seconds(object value, str name) except? -2:
    """A duration in seconds (>= 0, finite); None: for good (-1)."""
    if value is None:
        return -1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not isfinite(value) or value < 0:
        raise RetentionError(f"{name} must be None or a finite number of seconds >= 0, got {value!r}")
    return <double>value


def block_spans(ranges, Py_ssize_t prompt_len, Py_ssize_t block_size, decode_priority=None,
                decode_duration_s=None, ttl_s=None):
    """The hint as ``[(first block, priority, duration or -1.0), ...]``: where each priority
    starts, over every block of a request's path. A block takes the highest priority of the
    ranges it overlaps (the longest duration among those), else the generated tokens' priority
    if it starts past the prompt, else the default; a TTL lifts what is left at the default.
    Refuses (``RetentionError`` naming the value) a range outside ``[0, prompt_len]``, a priority
    outside ``[0, 100]`` or a negative duration."""
    cdef Py_ssize_t bs = block_size, decode_block = (prompt_len + bs - 1) // bs
    cdef double ttl = _seconds(ttl_s, "ttl_s")
    decode_d = _seconds(decode_duration_s, "decode_duration_s")
    decode_p = DEFAULT_PRIORITY if decode_priority is None else _priority(decode_priority, "decode_priority")
    spans = []
    cuts = {0, decode_block}
    for item in ranges:
        if not isinstance(item, (tuple, list)) or len(item) not in (3, 4):
            raise RetentionError(f"a retention range is (start, end, priority[, duration_s]), got {item!r}")
        start, end, priority = item[0], item[1], item[2]
        for name, value in (("start", start), ("end", end)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise RetentionError(f"range {name} must be an int, got {value!r}")
        if not 0 <= start < end <= prompt_len:
            raise RetentionError(
                f"range [{start}, {end}) must lie in the prompt's {prompt_len} tokens and hold at least one"
            )
        p = _priority(priority, "range priority")
        d = _seconds(item[3] if len(item) == 4 else None, "range duration_s")
        lo, hi = start // bs, (end + bs - 1) // bs
        spans.append((lo, hi, p, d))
        cuts.update((lo, hi))
    out = []
    for b in sorted(cuts):
        best = None
        for lo, hi, p, d in spans:
            if lo <= b < hi:
                if best is None or p > best[0]:
                    best = (p, d)
                elif p == best[0] and best[1] >= 0 and (d < 0 or d > best[1]):
                    best = (p, d)
        if best is None:
            best = (decode_p, decode_d) if b >= decode_block else (int(DEFAULT_PRIORITY), -1.0)
        if ttl >= 0 and best == (int(DEFAULT_PRIORITY), -1.0):
            best = (TTL_PRIORITY, ttl)
        if not out or (out[len(out) - 1][1], out[len(out) - 1][2]) != best:
            out.append((b, best[0], best[1]))
    return out


cdef void _apply_spans(RadixTrie t, int32_t end, const Span *spans, Py_ssize_t n, Py_ssize_t first_new) noexcept nogil:
    """Give the path ending at node ``end`` the spans' priorities: its runs are cut where a span
    starts inside one, then, root first, a run from block ``first_new`` on with no branch off the
    path takes its span's priority and any other run only a higher one (or the same for longer).
    Out of memory: nothing."""
    cdef Py_ssize_t i, k, count = 0, alone
    cdef int32_t v, b, lo, hi
    cdef int32_t *path
    cdef RNode *node
    cdef double now, at
    if t._reserve(n):
        return
    v = end
    while t._nodes[v].parent >= 0:
        lo = t._nodes[v].depth
        hi = lo + t._nodes[v].length
        for k in range(n - 1, 0, -1):
            b = spans[k].start
            if lo < b < hi:
                v = t._split(v, b - lo)
                hi = b
        v = t._nodes[v].parent
    v = end
    while t._nodes[v].parent >= 0:
        count += 1
        v = t._nodes[v].parent
    path = <int32_t *>malloc(count * sizeof(int32_t))
    if path == NULL:
        return
    v = end
    for k in range(count - 1, -1, -1):
        path[k] = v
        v = t._nodes[v].parent
    # The runs from ``alone`` on have no branch off the path below them (the path's end has no child).
    alone = count
    while alone > 0 and t._nodes[path[alone - 1]].num_children == (0 if alone == count else 1):
        alone -= 1
    now = t._now()
    k = 0
    for i in range(count):
        node = &t._nodes[path[i]]
        while k + 1 < n and spans[k + 1].start <= node.depth:
            k += 1
        at = now + spans[k].duration if spans[k].duration >= 0 else INFINITY
        # A run may go lower only if the request cached it and nothing branches off the path
        # anywhere below it (a lower parent than a child off the path would break the lists'
        # order; the path's own runs below are set next, each lifting its ancestors).
        if node.depth >= first_new and i >= alone:
            t._set_priority(path[i], spans[k].priority, at)
        elif spans[k].priority > node.priority or (spans[k].priority == node.priority and at > node.expiry):
            # Raised, it keeps its old rank's expiry if later: its children's ranks last that long.
            if node.priority > DEFAULT_PRIORITY and node.expiry > at:
                at = node.expiry
            t._set_priority(path[i], spans[k].priority, at)
    free(path)


@cython.final
@cython.auto_pickle(False)
cdef class Retention:
    """A KV cache core's retention hints and pinned prefixes (``KVCacheCore.retention``)."""

    def __init__(self, *args, **kwargs):
        """Not for callers: a ``KVCacheCore`` makes its own."""
        raise TypeError("Retention is made by KVCacheCore")

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self._num_hints):
            free(self._hints[i].spans)
        free(self._hints)

    @property
    def num_hinted(self):
        """Live requests holding a hint."""
        return self._num_hints

    # -- hints --

    def set(self, handle, ranges=(), decode_priority=None, decode_duration_s=None, ttl_s=None):
        """Keep request ``handle``'s hint (replacing any it had): ``ranges`` of its prompt as
        ``(start, end, priority[, duration_s])`` token ranges, ``decode_priority`` (and
        ``decode_duration_s``) for its generated tokens, ``ttl_s`` for its whole path. Applied
        at its finish. Bad input raises ``RetentionError`` and keeps the old hint."""
        cdef int64_t h = _handle_arg(handle, "set_retention")
        cdef Failure f
        cdef SeqRec *rec
        cdef Span *spans
        cdef Hint *grown
        cdef Py_ssize_t i, n, prompt_len, found = -1
        ok(&f)
        self._lock.enter_gil()
        try:
            rec = self._records.active(h, &f)
            if rec == NULL:
                prompt_len = -1
            else:
                prompt_len = rec.prompt_len if rec.prompt_len > 0 else rec.num_tokens
                seq_id = rec.seq_id
        finally:
            self._lock.leave(NULL)
        if rec == NULL:
            self._records.raise_failure(&f, "set_retention")
        out = block_spans(ranges, prompt_len, self._block_size, decode_priority, decode_duration_s, ttl_s)
        n = len(out)
        spans = <Span *>malloc(n * sizeof(Span))
        if spans == NULL:
            raise MemoryError("set_retention: cannot allocate the hint")
        for i in range(n):
            spans[i].start = <int32_t>out[i][0]
            spans[i].priority = <int32_t>out[i][1]
            spans[i].duration = <double>out[i][2]
        self._lock.enter_gil()
        try:
            if self._records.active(h, &f) == NULL:
                free(spans)
                spans = NULL
            else:
                self._purge()
                for i in range(self._num_hints):
                    if self._hints[i].seq_id == seq_id:
                        found = i
                if found < 0 and self._num_hints == self._hints_capacity:
                    grown = <Hint *>realloc(self._hints, max(16, 2 * self._hints_capacity) * sizeof(Hint))
                    if grown == NULL:
                        f.code = E_NO_MEMORY
                        free(spans)
                        spans = NULL
                    else:
                        self._hints = grown
                        self._hints_capacity = max(16, 2 * self._hints_capacity)
                if spans != NULL:
                    if found < 0:
                        found = self._num_hints
                        self._num_hints += 1
                    else:
                        free(self._hints[found].spans)
                    self._hints[found].seq_id = seq_id
                    self._hints[found].handle = h
                    self._hints[found].num_spans = <int32_t>n
                    self._hints[found].spans = spans
                    if n == 1 and spans[0].priority == DEFAULT_PRIORITY and spans[0].duration < 0:
                        self._drop(found)  # the default everywhere: nothing to keep
        finally:
            self._lock.leave(NULL)
        if spans == NULL:
            self._records.raise_failure(&f, "set_retention")
        return out

    cdef void _purge(self):
        # (Lock held) Hints of requests that closed without a finish (cleared ones).
        cdef Failure f
        cdef SeqRec *rec
        cdef Py_ssize_t i = 0
        while i < self._num_hints:
            rec = self._records.get(self._hints[i].handle, &f)
            if rec == NULL or rec.seq_id != self._hints[i].seq_id:
                self._drop(i)
            else:
                i += 1

    cdef void _drop(self, Py_ssize_t i) noexcept nogil:
        free(self._hints[i].spans)
        self._num_hints -= 1
        self._hints[i] = self._hints[self._num_hints]

    cdef void apply(self, SeqRec *rec, int32_t end, Py_ssize_t first_new) noexcept nogil:
        """(Lock held, at the finish of ``rec``, before its pin goes) Apply and forget its hint:
        its cached path ends at node ``end`` (-1: nothing cached) and its nodes from block
        ``first_new`` on were cached by it (past its prefix hit). Out of memory the hint is
        dropped unapplied."""
        cdef Py_ssize_t i
        for i in range(self._num_hints):
            if self._hints[i].seq_id == rec.seq_id:
                if end >= 0:
                    self.hinted = True
                    _apply_spans(self._trie, end, self._hints[i].spans, self._hints[i].num_spans, first_new)
                self._drop(i)
                return

    def prioritize(self, tokens, int64_t key, priority, duration_s=None):
        """Raise the cached whole blocks of ``tokens`` under adapter ``key`` to ``priority``
        (0-100) for ``duration_s`` seconds (None: for good), as SGLang's priority policy keeps a
        node at the highest priority of the requests that inserted it; a block already higher
        keeps its own. Returns how many blocks it reached."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0, matched = 0
        cdef WalkEnd walk
        cdef int32_t root
        cdef Span span
        span.start = 0
        span.priority = _priority(priority, "priority")
        span.duration = _seconds(duration_s, "duration_s")
        tokens = _token_vector(tokens, &data, &n)
        self._lock.enter_gil()
        try:
            root = self._trie._find_root(key)
            if root >= 0 and n >= self._block_size:
                matched = self._trie._walk(root, data, n // self._block_size, &walk)
            if matched > 0:
                if self._trie._reserve(1):
                    raise MemoryError("prioritize: cannot grow the trie")
                self.hinted = True
                _apply_spans(self._trie, self._trie._settle(&walk), &span, 1, matched)
        finally:
            self._lock.leave(NULL)
        return matched

    # -- pins --

    def set_pin_budget(self, blocks):
        """At most ``blocks`` blocks in pinned prefixes (each prefix counted whole); refused
        below what is pinned now."""
        cdef Py_ssize_t n = _as_count(blocks, "pin budget", 0, 1 << 40)
        if n < self.pinned_blocks:
            raise RetentionError(f"pin budget {n} is below the {self.pinned_blocks} blocks pinned now")
        self.pin_budget = n

    def pin(self, tokens, int64_t key):
        """Pin the cached whole blocks of ``tokens`` under adapter ``key``; returns how many (0:
        none cached, nothing pinned). Over the budget: ``RetentionError``, nothing pinned."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0, blocks, matched = 0
        cdef WalkEnd walk
        cdef int32_t root, v = -1
        cdef RadixTrie t = self._trie
        tokens = _token_vector(tokens, &data, &n)
        blocks = n // self._block_size
        self._lock.enter_gil()
        try:
            root = t._find_root(key)
            if root >= 0 and blocks > 0:
                matched = t._walk(root, data, blocks, &walk)
            if matched > 0:
                if self.pinned_blocks + matched > self.pin_budget:
                    raise RetentionError(
                        f"pinning {matched} blocks would hold {self.pinned_blocks + matched} pinned blocks, "
                        f"over the pin budget of {self.pin_budget}"
                    )
                if t._reserve(1):
                    raise MemoryError("pin_prefix: cannot grow the trie")
                v = t._settle(&walk)
                t._pin(v)
                self._pins.append((key, bytes((<const char *>data)[:matched * self._block_size * 4]), v, matched))
                self.pinned_blocks += matched
        finally:
            self._lock.leave(NULL)
        return matched

    def unpin(self, tokens, int64_t key):
        """Undo the latest ``pin`` of the same prefix (``tokens`` starting with its pinned
        blocks); returns the blocks it had pinned. No such pin: ``RetentionError``."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0, i
        tokens = _token_vector(tokens, &data, &n)
        raw = bytes((<const char *>data)[:n * 4])
        self._lock.enter_gil()
        try:
            for i in range(len(self._pins) - 1, -1, -1):
                pin_key, pinned, v, blocks = self._pins[i]
                if pin_key == key and raw.startswith(pinned):
                    del self._pins[i]
                    self._trie._unpin(v)
                    self.pinned_blocks -= blocks
                    return blocks
        finally:
            self._lock.leave(NULL)
        raise RetentionError(f"no pinned prefix of these {n} tokens under adapter {key}")

    cdef int count_pins(self, dict pins) except -1:
        """(Lock held) Add this state's pins per node to ``pins`` (the core's invariant check)."""
        for _, _, v, _ in self._pins:
            pins[v] = pins.get(v, 0) + 1
        return 0

    # -- the clock --

    def set_time(self, double seconds):
        """Run the retention clock (durations, TTLs) by this time from now on, as a replay does;
        without a call it is CLOCK_MONOTONIC."""
        self._lock.enter_gil()
        self._trie._set_time(seconds)
        self._lock.leave(NULL)

    def time(self):
        """The retention clock now, in seconds."""
        return self._trie._now()
