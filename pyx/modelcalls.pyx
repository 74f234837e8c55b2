# cython: autotestdict=False, binding=False
"""The calls a scheduler makes for every request of a :class:`~lifecycle.model.HybridModel`
(``alloc_sequence_for``, ``attach_prefix``, ``finish_sequence``), compiled into the model's base
class so that no Python frame runs between the engine and the KV cache core.

On a model whose call is one core call (pure attention, no host tier, no SSM snapshots) each method
is its argument checks and that call; on any other model it goes to the model's composed path
(``_zero_slot``, ``_attach_composed``, ``_finish_composed`` of ``HybridModel``). Either way the
call's rules, refusals and messages are the model's (:mod:`lifecycle.model`).
"""

from lifecycle._kvcache cimport KVCacheCore
from lifecycle._slots cimport SlotPool

from lifecycle.block_tables import raise_if_wrong_type
from lifecycle.errors import InvalidId


cdef class ModelCalls:
    """The per-request calls of a model (a base of ``HybridModel``, which binds them once it has
    built its parts: :meth:`_bind_calls`)."""

    cdef KVCacheCore _core
    cdef SlotPool _slots
    cdef object _parts, _addrs_by_slot, _drop_queue, _on_release, _budget_limit
    cdef bint _plain_alloc, _plain_attach, _plain_finish
    cdef public bint _torn_down

    def _bind_calls(self, parts, on_release, budget_limit, bint plain_alloc, bint plain_attach,
                    bint plain_finish):
        """What the calls read: the model's ``parts`` (core, slots, SSM addresses, drop queue), the
        adapter release ``on_release``, the per-sequence token limit, and which calls are one core
        call on this model (the others take the model's composed path)."""
        self._parts, self._on_release, self._budget_limit = parts, on_release, budget_limit
        self._core, self._slots, self._drop_queue = parts.core, parts.slots, parts.drop_queue
        self._addrs_by_slot = parts.memory.addrs_by_slot
        self._plain_alloc, self._plain_attach, self._plain_finish = plain_alloc, plain_attach, plain_finish

    def alloc_sequence_for(self, budget_tokens):
        """``alloc_sequence`` for a request that reaches at most ``budget_tokens`` tokens: its
        proposer (draft) state and token buffer are sized to that budget."""
        if type(budget_tokens) is not int or budget_tokens < 0:
            if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 0:
                raise InvalidId(f"budget_tokens={budget_tokens!r} must be an int >= 0")
        if budget_tokens > self._budget_limit:
            raise InvalidId(
                f"budget_tokens={budget_tokens} exceeds the per-sequence limit of {self._budget_limit} tokens"
            )
        if self._torn_down or self._drop_queue:
            self._enter()
        seq = self._core.alloc(self._slots, budget_tokens, self._addrs_by_slot, self._drop_queue)
        if self._plain_alloc:
            return seq
        return self._zero_slot(seq)

    def attach_prefix(self, seq, prompt, *, grow_to=None, cache_salt=None, mm_keys=None):
        """Record ``prompt`` as the sequence's tokens and pin its longest cached prefix under the
        sequence's adapter at the head of its table; returns the tokens reused (the rules, ``grow_to``,
        ``cache_salt`` and ``mm_keys``: :mod:`lifecycle.attach`). A retried call takes no second set of
        references."""
        if self._plain_attach and cache_salt is None and not mm_keys:
            if self._drop_queue:
                self._parts.reap(self._on_release)
            try:
                return self._core.attach_seq(seq, prompt, grow_to)
            except InvalidId as error:
                raise_if_wrong_type(error, "attach_prefix", {"prompt": prompt})
                raise
        return self._attach_composed(seq, prompt, grow_to, cache_salt, mm_keys)

    def finish_sequence(self, seq):
        """``cache_sequence`` then ``free_sequence`` in one core call (a request's end). A second call is
        a no-op while the model lives; after ``teardown``, ``TornDown`` (as for every call but it)."""
        if not self._plain_finish:
            self._finish_composed(seq)
            return
        if self._torn_down or self._drop_queue:
            self._enter()
        self._core.release(seq, True, self._on_release)  # the slot, then the record: one C call
