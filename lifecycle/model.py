"""``HybridModel``: the seventeen ``ModelLifecycle`` methods and their companions for a model of
attention and SSM layers, composed from the block pool, the prefix cache, the slot pool, the device
pools, the SSM snapshot pool and the swap format.

Every public method takes the model's lock, so a scheduler thread and worker threads may call it at
once. Bad input raises a :class:`~lifecycle.errors.LifecycleError` before anything changes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Final, cast

import numpy as np
import numpy.typing as npt

from lifecycle._blockpool import BlockPool
from lifecycle._hostcopy import put_int32 as _put_int32
from lifecycle._prefix_trie import PrefixTrie
from lifecycle._slots import SlotPool
from lifecycle.adapters import AdapterInfo, AdapterTable
from lifecycle.config import ModelConfig, ModelDims
from lifecycle.device import Device, open_device
from lifecycle.errors import (
    ConfigError,
    ForeignSequence,
    InvalidId,
    InvariantViolation,
    LifecycleError,
    OutOfBlocks,
    SequenceStateError,
    SlotInUse,
    SlotOutOfRange,
    TornDown,
)
from lifecycle.pools import KVPool, SSMPool
from lifecycle.prefix_cache import PrefixCache, reusable_blocks
from lifecycle.protocol import LifecycleDefaults, PrefixReclaim
from lifecycle.sequence import DETACHED_SLOT, NO_ADAPTER, Holdings, SeqStatus, SequenceState
from lifecycle.snapshots import SnapshotPool
from lifecycle.stats import Stats
from lifecycle.swap import StagingBuffer, SwapContext, restore as swap_restore, save as swap_save

__all__ = ["HybridModel", "TeardownReport"]

_log = logging.getLogger("lifecycle.model")
_now = time.perf_counter_ns
_model_ids = itertools.count(1)
_NO_ROOT: Final = 0
_EMPTY_I32: Final = np.empty(0, dtype=np.int32)
_INT32: Final = np.dtype(np.int32)
# Module globals read faster than the enum's class attributes (the hot paths test them every call).
_ACTIVE: Final = SeqStatus.ACTIVE
_FREED: Final = SeqStatus.FREED


@dataclass(frozen=True, slots=True)
class TeardownReport:
    """What ``teardown`` found still referenced. Everything was released all the same."""

    live_sequences: int
    live_blocks: int
    cached_blocks: int
    detached_slots: int
    adapter_references: int

    @property
    def leaked(self) -> int:
        """References that callers still held (0 for a clean shutdown)."""
        return self.live_sequences + self.live_blocks + self.detached_slots + self.adapter_references


class HybridModel(LifecycleDefaults):
    """The memory lifecycle of one hybrid (attention + SSM) model; pure-attention and pure-SSM
    configurations work too. ``device`` is a :class:`~lifecycle.device.Device` or a kind for
    :func:`~lifecycle.device.open_device` (a device opened here is closed by ``teardown``)."""

    def __init__(self, config: ModelConfig, device: Device | str = "auto", *, ordinal: int = 0) -> None:
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"config must be a ModelConfig, got {type(config).__name__}")
        self._config = config
        self._dims = config.dims()
        self._block_size = config.block_size
        self._lock = threading.RLock()
        self._model_id = next(_model_ids)
        self._torn_down = False
        self.teardown_report: TeardownReport | None = None
        self._stats = Stats()
        self._owns_device = isinstance(device, str)
        self._device: Device = open_device(device, ordinal) if isinstance(device, str) else device  # type: ignore[arg-type]
        self._releases: list[Callable[[], None]] = []  # device memory, released newest first
        try:
            self._kv = KVPool(self._device, config) if config.kv_block_bytes() > 0 else None
            if self._kv is not None:
                self._releases.append(self._kv.release)
            self._ssm = SSMPool(self._device, config) if config.ssm_layers else None
            if self._ssm is not None:
                self._releases.append(self._ssm.release)
            self._snapshots = (
                SnapshotPool(self._device, self._ssm, config.num_snapshots)
                if self._ssm is not None and config.num_snapshots > 0
                else None
            )
            if self._snapshots is not None:
                self._releases.append(self._snapshots.release)
        except BaseException:
            self._release_device_memory()
            raise
        # Pinned staging for swap, allocated on first use on CUDA, freed at teardown.
        self._swap_staging = StagingBuffer(self._device)
        self._releases.append(self._swap_staging.release)
        self._pool = BlockPool(config.num_blocks_resolved)
        self._trie = PrefixTrie(self._block_size, capacity=config.num_blocks_resolved)
        self._prefix = PrefixCache(self._pool, self._trie, enabled=config.enable_prefix_cache)
        self._core = self._prefix.core
        self._slots = SlotPool(config.max_seqs)
        self._adapters = AdapterTable(config.num_adapter_slots)
        self._live: dict[int, Holdings] = {}
        self._slot_owner: dict[int, weakref.ref[SequenceState]] = {}
        self._drop_queue: deque[int] = deque()
        self._seq_ids = itertools.count()
        self._innerq_hook: Callable[[], None] | None = None
        self._kv_block_bytes = config.kv_block_bytes()
        # Fixed for the model's life; read on every request, so computed once.
        self._max_blocks_per_seq = config.max_blocks_per_seq_resolved
        self._max_budget_tokens = self._max_blocks_per_seq * self._block_size if self._kv is not None else None
        # Without snapshots every matched prefix block is reusable, so a finishing request can cache
        # and release in one C call; without SSM layers the same holds for attach_prefix.
        self._fused_finish = self._snapshots is None and config.enable_prefix_cache
        self._fused_attach = self._ssm is None and config.enable_prefix_cache
        ssm = self._ssm
        # Per slot, the (h, conv) addresses of every SSM layer: what a sequence in that slot holds.
        self._addrs_by_slot: list[tuple[tuple[int, int], ...]] = [
            tuple((ssm.h_addr(layer, slot), ssm.conv_addr(layer, slot)) for layer in range(ssm.num_layers))
            if ssm is not None
            else ()
            for slot in range(config.max_seqs)
        ]
        self._swap_ctx = SwapContext(
            config, self._device, self._kv, self._ssm, staging=self._swap_staging, adapters=self._adapters
        )

    # ------------------------------------------------------------------ plumbing

    def _enter(self) -> int:
        """Start of every public call (lock held): refuse after teardown, reap dropped sequences.
        The request-path methods inline it as ``if self._torn_down or self._drop_queue:
        self._enter_slow()`` then ``started = _now()``."""
        if self._torn_down or self._drop_queue:
            self._enter_slow()
        return _now()

    def _enter_slow(self) -> None:
        if self._torn_down:
            raise TornDown(f"model {self._config.name!r} was torn down; only teardown() may be called again")
        self._reap_dropped()

    def _leave(self, started: int) -> None:
        self._stats.time_in_library_ns += _now() - started

    def _holdings(self, seq: SequenceState) -> Holdings:
        if not isinstance(seq, SequenceState):
            raise ForeignSequence(f"expected a SequenceState, got {type(seq).__name__}")
        if seq._model_id != self._model_id:
            raise ForeignSequence(
                f"sequence {seq.seq_id} belongs to model #{seq._model_id}, not to model #{self._model_id}"
            )
        return seq._holdings

    def _active(self, seq: SequenceState, what: str) -> Holdings:
        """The holdings of an active sequence of this model. The request-path methods inline it as
        ``holdings = seq._holdings if type(seq) is SequenceState and seq._model_id ==
        self._model_id else self._holdings(seq)`` (SequenceState is final) then the status test."""
        holdings = self._holdings(seq)
        if holdings.status is not _ACTIVE:
            raise _not_active(seq, holdings, what)
        return holdings

    def _root_of(self, adapter_slot: int) -> int:
        if adapter_slot == NO_ADAPTER:
            return _NO_ROOT
        return self._adapters.uid_of_loaded(adapter_slot)

    def _reusable_blocks(self, node_ids: npt.NDArray[np.int32]) -> int:
        """How many matched blocks a prefill can reuse: all of them for a model without SSM layers;
        for a hybrid model only up to the deepest node that has an SSM snapshot."""
        if self._ssm is None or node_ids.shape[0] == 0:
            return int(node_ids.shape[0])
        return self._trie.deepest_tagged(node_ids) + 1

    # ------------------------------------------------------------------ required methods

    def bind_gpu_to_thread(self) -> None:
        """Make the device context current on the calling thread (every thread calls it first)."""
        with self._lock:
            self._enter()
            self._device.bind_to_thread()

    def alloc_sequence(self) -> SequenceState:
        """A new sequence owning a zeroed SSM slot. Raises ``OutOfSlots`` when none is free."""
        return self.alloc_sequence_for(0)

    def alloc_sequence_for(self, budget_tokens: int) -> SequenceState:
        """``alloc_sequence`` for a request that reaches at most ``budget_tokens`` tokens: its
        proposer (draft) state and token buffer are sized to that budget."""
        if not isinstance(budget_tokens, int) or budget_tokens < 0:
            raise InvalidId(f"budget_tokens={budget_tokens!r} must be an int >= 0")
        limit = self._max_budget_tokens
        if limit is not None and budget_tokens > limit:
            raise InvalidId(f"budget_tokens={budget_tokens} exceeds the per-sequence limit of {limit} tokens")
        with self._lock:
            if self._torn_down or self._drop_queue:
                self._enter_slow()
            started = _now()
            guard = self._slots.acquire()
            slot = guard.slot
            if self._ssm is not None:
                try:
                    self._ssm.zero_slot(slot)
                    self._device.synchronize()  # the engine's kernels may run on another stream
                except BaseException:
                    guard.release()
                    raise
            seq_id = next(self._seq_ids)
            holdings = Holdings(seq_id, max(-(-budget_tokens // self._block_size), 4))
            seq = SequenceState(
                seq_id, self._model_id, holdings, guard, self._addrs_by_slot[slot], budget_tokens, self._drop_queue
            )
            self._live[seq_id] = holdings
            self._slot_owner[slot] = weakref.ref(seq)
            stats = self._stats
            stats.sequences_allocated += 1
            stats.time_in_library_ns += _now() - started
            return seq

    def cache_sequence(self, seq: SequenceState) -> None:
        """Insert the sequence's full blocks (prompt and generated) into the prefix cache under its
        adapter; where a block's node already exists the node keeps its own block. A failed or freed
        sequence is never cached. Call it before ``free_sequence``."""
        with self._lock:
            started = self._enter()
            self._cache(seq, self._holdings(seq), pin=True)
            self._leave(started)

    def finish_sequence(self, seq: SequenceState) -> None:
        """``cache_sequence`` then ``free_sequence`` in one step (what a scheduler does when a
        request finishes). Nothing can evict in between, so the cached path needs no pins."""
        with self._lock:
            if self._torn_down or self._drop_queue:
                self._enter_slow()
            started = _now()
            holdings = (
                seq._holdings
                if type(seq) is SequenceState and seq._model_id == self._model_id
                else self._holdings(seq)
            )
            fused = self._fused_finish and not seq._failed and not holdings.cache_pins
            try:
                if not fused:
                    self._cache(seq, holdings, pin=False)
            finally:
                self._free(seq, holdings, cache=fused)
                self._stats.time_in_library_ns += _now() - started

    def _cache(self, seq: SequenceState, holdings: Holdings, *, pin: bool) -> None:
        if seq.failed or holdings.status is _FREED or not self._prefix.enabled:
            return
        full = min(seq.num_tokens // self._block_size, holdings.num_blocks)
        if full <= 0:
            return
        tokens = seq.tokens[: full * self._block_size]
        taken, _, node_ids = self._prefix.insert_path(
            tokens, holdings.blocks[:full], holdings.adapter_uid, known_prefix=holdings.pinned_nodes
        )
        self._stats.blocks_cached += taken
        if pin:
            self._pin_path(holdings, node_ids)
        ssm_tokens = seq.num_tokens if seq.ssm_tokens is None else seq.ssm_tokens
        if self._snapshots is not None and ssm_tokens == full * self._block_size and not seq.is_detached:
            self._save_snapshot(seq.slot_idx, int(node_ids[full - 1]))

    def _pin_path(self, holdings: Holdings, node_ids: npt.NDArray[np.int32]) -> None:
        """Pin the nodes of the sequence's cached path it does not pin yet: while the sequence
        lives they hold its blocks, so evicting them would free nothing and lose the entry."""
        depth = holdings.pinned_depth
        if node_ids.shape[0] > depth:
            extra = node_ids[depth:]
            self._trie.pin(extra)
            holdings.cache_pins += (extra,)
            holdings.pinned_depth = int(node_ids.shape[0])

    def free_sequence(self, seq: SequenceState) -> None:
        """Release the SSM slot first (unless detached), then the adapter reference, the prefix
        pins and one reference on every block. A second call is a no-op."""
        with self._lock:
            started = self._enter()
            try:
                self._free(seq, self._holdings(seq))
            finally:
                self._leave(started)

    def _free(self, seq: SequenceState, holdings: Holdings, *, cache: bool = False) -> None:
        """The release order of free_sequence; ``cache`` inserts the full blocks into the prefix
        cache in the same C call that drops the sequence's pins and block references."""
        if holdings.status is _FREED:
            return
        guard = seq._guard
        seq._guard = None
        try:
            if guard is not None:
                self._slot_owner.pop(guard.slot, None)
                guard.release()
        finally:
            self._release_holdings(holdings, seq if cache else None)
            self._stats.sequences_freed += 1

    def compact_sequence(self, seq: SequenceState, new_slot: int) -> None:
        """Move the sequence's SSM state to ``new_slot`` (one batched copy of every SSM layer,
        waited for before the old slot can be reused), claim ``new_slot``, release the old slot.

        ``new_slot`` may be free, detached, or owned by a *retired* sequence (whose slot is then
        detached in the same step). A slot owned by an active sequence raises ``SlotInUse``."""
        with self._lock:
            started = self._enter()
            self._active(seq, "compact_sequence")
            old_guard = seq._guard
            if old_guard is None:
                raise SequenceStateError(f"compact_sequence: sequence {seq.seq_id} is detached and owns no slot")
            if not isinstance(new_slot, int) or not 0 <= new_slot < self._config.max_seqs:
                raise SlotOutOfRange(f"compact_sequence: slot {new_slot!r} out of range [0, {self._config.max_seqs})")
            old_slot = old_guard.slot
            if new_slot == old_slot:
                self._leave(started)
                return
            retired = self._retired_owner(new_slot)
            if self._ssm is not None:
                self._ssm.copy_slot(old_slot, new_slot)
                self._device.synchronize()  # the old slot may be handed out as soon as it is released
            if retired is not None:
                new_guard = retired._guard.move()  # type: ignore[union-attr]
                retired._guard = None
                self._detach_fields(retired)
            else:
                new_guard = self._slots.claim_specific(new_slot)
            seq._guard = new_guard
            seq._slot_idx = new_slot
            seq._ssm_addrs = self._addrs_by_slot[new_slot]
            self._slot_owner[new_slot] = weakref.ref(seq)
            self._slot_owner.pop(old_slot, None)
            old_guard.release()
            self._stats.compactions += 1
            self._leave(started)

    def _retired_owner(self, slot: int) -> SequenceState | None:
        """The retired sequence owning ``slot``, None if the slot is free or detached; raises if an
        active sequence owns it. Changes nothing."""
        if self._slots.is_free(slot) or self._slots.is_detached(slot):
            return None
        ref = self._slot_owner.get(slot)
        owner = ref() if ref is not None else None
        if owner is None or owner._guard is None or owner._guard.slot != slot:
            raise SlotInUse(f"slot {slot} is held by a guard this model does not know (max_seqs={self._config.max_seqs})")
        if owner.status is not SeqStatus.RETIRED:
            raise SlotInUse(
                f"slot {slot} is owned by active sequence {owner.seq_id}; retire it (retire_sequence) "
                "or detach it before compacting another sequence into its slot"
            )
        return owner

    def detach_slot_for_reuse(self, seq: SequenceState) -> None:
        """Give up the sequence's slot without releasing it (a survivor owns or will own it): the
        guard is emptied and ``slot_idx`` becomes ``DETACHED_SLOT``. A second call is a no-op."""
        with self._lock:
            started = self._enter()
            self._holdings(seq)
            guard = seq._guard
            seq._guard = None
            if guard is not None:
                if self._slot_owner.get(guard.slot) is not None:
                    del self._slot_owner[guard.slot]
                guard.take()
            if seq._slot_idx != DETACHED_SLOT:
                self._detach_fields(seq)
            self._leave(started)

    def _detach_fields(self, seq: SequenceState) -> None:
        seq._slot_idx = DETACHED_SLOT
        seq._ssm_addrs = ()
        self._stats.detaches += 1

    def kv_block_bytes(self) -> int:
        """Bytes one block index holds across every attention layer, K and V (0 without any)."""
        with self._lock:
            self._enter()
            return self._kv_block_bytes

    # ------------------------------------------------------------------ provided methods

    def teardown(self) -> None:
        """Release every pool (device memory newest first), exactly once. What callers still held
        is released all the same and reported in ``teardown_report`` (and logged). A second call is
        a no-op; any other call afterwards raises ``TornDown``."""
        with self._lock:
            if self._torn_down:
                return
            if self._drop_queue:
                self._reap_dropped()
            live = [h for h in self._live.values() if h.status is not _FREED]
            report = TeardownReport(
                live_sequences=len(live),
                live_blocks=sum(h.num_blocks for h in live),
                cached_blocks=self._trie.num_cached_blocks,
                detached_slots=self._slots.num_detached,
                adapter_references=sum(self._adapters.refcounts()),
            )
            self._torn_down = True
            self.teardown_report = report
            self._live.clear()
            self._slot_owner.clear()
            try:
                self._release_device_memory()
            finally:
                if self._owns_device:
                    self._device.close()
            if report.leaked:
                _log.warning("teardown of %r released memory still referenced: %s", self._config.name, report)

    def _release_device_memory(self) -> None:
        errors: list[BaseException] = []
        while self._releases:
            release = self._releases.pop()
            try:
                release()
            except LifecycleError as exc:  # keep releasing the rest; report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]

    def poll_innerq(self) -> None:
        """Run the registered KV-quantization calibration hook, if any (once per prefill step)."""
        with self._lock:
            self._enter()
            hook = self._innerq_hook
        if hook is not None:
            hook()

    def set_innerq_hook(self, hook: Callable[[], None] | None) -> None:
        """Register the calibration driver ``poll_innerq`` calls (None removes it)."""
        with self._lock:
            self._enter()
            self._innerq_hook = hook

    def high_speed_swap_dims(self) -> ModelDims:
        """The model's dimensions for a swap orchestrator."""
        with self._lock:
            self._enter()
            return self._dims

    def save_sequence_state(self, seq: SequenceState, writer: BinaryIO) -> None:
        """Write the sequence's KV blocks and SSM state to ``writer`` as a self-describing,
        checksummed record (see :mod:`lifecycle.swap`). Frees nothing."""
        with self._lock:
            started = self._enter()
            holdings = self._holdings(seq)
            if holdings.status is _FREED:
                raise SequenceStateError(f"save_sequence_state: sequence {seq.seq_id} was freed")
            if self._ssm is not None and seq.is_detached:
                raise SequenceStateError(
                    f"save_sequence_state: sequence {seq.seq_id} is detached; its SSM slot now holds another sequence's state"
                )
            try:
                written = swap_save(self._swap_ctx, seq, writer)
            except BaseException:
                self._stats.swap_failures += 1
                raise
            self._stats.swaps_out += 1
            self._stats.bytes_swapped_out += written
            self._leave(started)

    def restore_sequence_state(self, seq: SequenceState, num_blocks: int, reader: BinaryIO) -> None:
        """Allocate ``num_blocks`` blocks (all or nothing) and stream a record written by
        ``save_sequence_state`` into them and into the sequence's SSM slot, verifying everything.
        On any failure everything allocated is freed and the sequence is unchanged."""
        with self._lock:
            started = self._enter()
            holdings = self._active(seq, "restore_sequence_state")
            if holdings.num_blocks or seq.num_tokens:
                raise SequenceStateError(
                    f"restore_sequence_state: sequence {seq.seq_id} already holds {holdings.num_blocks} blocks "
                    f"and {seq.num_tokens} tokens; restore needs a freshly allocated sequence"
                )
            if self._ssm is not None and seq.is_detached:
                raise SequenceStateError(f"restore_sequence_state: sequence {seq.seq_id} is detached")
            if not isinstance(num_blocks, int) or not 0 <= num_blocks <= self._config.max_blocks_per_seq_resolved:
                raise InvalidId(
                    f"restore_sequence_state: num_blocks={num_blocks!r} must be an int in "
                    f"[0, {self._config.max_blocks_per_seq_resolved}] (the per-sequence block limit)"
                )
            try:
                read = swap_restore(
                    self._swap_ctx, seq, num_blocks, reader, allocate=lambda: self._grow_blocks(holdings, num_blocks)
                )
            except BaseException:
                if holdings.num_blocks:
                    self._pool.dec_ref(holdings.block_ids())
                    holdings.num_blocks = 0
                self._stats.swap_failures += 1
                raise
            self._stats.swaps_in += 1
            self._stats.bytes_swapped_in += read
            self._leave(started)

    def num_free_blocks(self) -> int:
        """Blocks with refcount 0 (blocks only the prefix cache holds are not free until evicted)."""
        with self._lock:
            self._enter()
            return self._pool.num_free

    def num_total_blocks(self) -> int:
        with self._lock:
            self._enter()
            return self._pool.num_total

    def reclaim_prefix_blocks(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` blocks from the prefix cache (least recently used leaves no
        live sequence holds); returns how many blocks became free (0: nothing evictable)."""
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidId(f"reclaim_prefix_blocks: num_blocks={num_blocks!r} must be an int >= 0")
        with self._lock:
            started = self._enter()
            freed = self._evict(num_blocks)
            self._leave(started)
            return freed

    def reclaim_prefix_blocks_for(
        self, prompt: Sequence[int] | npt.NDArray[np.integer], adapter_slot: int, blocks_needed: int
    ) -> PrefixReclaim:
        """Evict until the free blocks cover a prefill of ``prompt``: ``blocks_needed`` less the
        cached prefix it will reuse (which is pinned meanwhile, so never evicted). An empty prompt
        reuses nothing."""
        if not isinstance(blocks_needed, int) or blocks_needed < 0:
            raise InvalidId(f"reclaim_prefix_blocks_for: blocks_needed={blocks_needed!r} must be an int >= 0")
        tokens = _as_tokens(prompt)
        with self._lock:
            started = self._enter()
            free_before = self._pool.num_free
            result = self._prefix.reclaim_prefix_blocks_for(
                tokens, self._root_of(adapter_slot), blocks_needed, self._reusable_blocks
            )
            self._evicted(result.free - free_before)
            self._leave(started)
            return result

    # ------------------------------------------------------------------ companions

    def retire_sequence(self, seq: SequenceState) -> None:
        """Mark a finished sequence retired: it no longer grows, and another sequence may be
        compacted into its slot (which detaches it). It can still be cached, saved and freed."""
        with self._lock:
            started = self._enter()
            holdings = self._active(seq, "retire_sequence")
            holdings.status = SeqStatus.RETIRED
            self._leave(started)

    def attach_prefix(
        self, seq: SequenceState, prompt: Sequence[int] | npt.NDArray[np.integer], *, grow_to: int | None = None
    ) -> int:
        """Record ``prompt`` as the sequence's tokens, find its longest cached prefix under the
        sequence's adapter (whole blocks, never the prompt's last token; for a hybrid model only up
        to a node with an SSM snapshot, which is restored into the slot), pin it and put its blocks
        at the head of the block table. Returns the reused token count. Calling it again for the
        same sequence and prompt (a retried lookup) takes no second set of references.

        ``grow_to``: then grow the block table to cover that many tokens, as ``grow(seq, grow_to)``
        would, in the same call (for a pure-attention model, the same C call). It ends as the two
        calls would: when the growth raises ``OutOfBlocks``, the prefix stays attached. A
        ``grow_to`` that ``grow`` would refuse (not an int >= 0, over the per-sequence limit) is
        refused first, before anything is attached or recorded."""
        # An int32 vector needs no conversion (the dtype identity test is the cheap common case).
        tokens: npt.NDArray[np.int32] = (
            cast("npt.NDArray[np.int32]", prompt)
            if isinstance(prompt, np.ndarray) and prompt.ndim == 1 and prompt.dtype is _INT32
            else _as_tokens(prompt)
        )
        with self._lock:
            if self._torn_down or self._drop_queue:
                self._enter_slow()
            started = _now()
            holdings = (
                seq._holdings
                if type(seq) is SequenceState and seq._model_id == self._model_id
                else self._holdings(seq)
            )
            if holdings.status is not _ACTIVE:
                raise _not_active(seq, holdings, "attach_prefix")
            retry = len(holdings.pinned_nodes)
            if holdings.num_blocks != retry:
                raise SequenceStateError(
                    f"attach_prefix: sequence {seq.seq_id} already grew to {holdings.num_blocks} blocks; "
                    "attach a prefix before allocating the rest"
                )
            if seq._num_tokens and not np.array_equal(seq.tokens, tokens):
                raise SequenceStateError(
                    f"attach_prefix: sequence {seq.seq_id} already holds {seq.num_tokens} other tokens"
                )
            if self._ssm is not None and seq._slot_idx == DETACHED_SLOT:
                raise SequenceStateError(f"attach_prefix: sequence {seq.seq_id} is detached")
            num_tokens = len(tokens)
            block_size = self._block_size
            capacity = -(-num_tokens // block_size) + 1
            if capacity > len(holdings.blocks):
                holdings.ensure_capacity(capacity)
            wanted = -1 if grow_to is None else self._wanted_blocks(grow_to, "attach_prefix")
            if self._fused_attach and not retry and num_tokens > 1:
                self._attach_fused(seq, holdings, tokens, wanted, reusable_blocks(num_tokens, block_size))
                try:
                    if wanted > holdings.num_blocks:  # no grow_to, or admit could not make room
                        self._grow_blocks(holdings, wanted - holdings.num_blocks)
                finally:
                    self._stats.time_in_library_ns += _now() - started
                return seq.num_cached_tokens
            block_ids, node_ids = self._match(tokens, holdings.adapter_uid)
            matched = int(node_ids.shape[0])
            reused = self._reusable_blocks(node_ids)
            block_ids, node_ids = block_ids[:reused], node_ids[:reused]
            if self._snapshots is not None and reused:
                # First, so that a failing copy leaves nothing to undo (the lock keeps the
                # snapshot from being evicted meanwhile).
                self._snapshots.restore_into(self._trie.get_tag(int(node_ids[reused - 1])), seq.slot_idx)
            # New references first, then the retry's old ones: a block in both never reaches 0.
            self._trie.pin(node_ids)
            self._pool.inc_ref(block_ids)
            if retry:
                self._trie.unpin(holdings.pinned_nodes)
                self._pool.dec_ref(holdings.block_ids())
            holdings.pinned_nodes = node_ids
            holdings.pinned_depth = reused
            holdings.blocks[:reused] = block_ids
            holdings.num_blocks = reused
            self._record_prompt(seq, tokens, reused)
            if not retry:
                self._count_lookup(int(tokens.shape[0]), matched, reused)
            try:
                if wanted > holdings.num_blocks:
                    self._grow_blocks(holdings, wanted - holdings.num_blocks)
            finally:
                self._leave(started)
            return seq.num_cached_tokens

    def _record_prompt(self, seq: SequenceState, tokens: npt.NDArray[np.int32], reused: int) -> None:
        if not seq._num_tokens:
            # The prompt was validated (int32, 1-D) and the sequence is active: write it directly.
            num_tokens = len(tokens)
            if num_tokens > len(seq._tokens):
                seq._grow_tokens(num_tokens)
            if not _put_int32(seq._tokens, 0, tokens):
                seq._tokens[:num_tokens] = tokens
            seq._num_tokens = seq.prompt_len = num_tokens
        seq.num_cached_tokens = reused * self._block_size

    def _match(self, tokens: npt.NDArray[np.int32], root: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """(block ids, node ids) of the cached prefix a prefill of ``tokens`` may use: whole blocks,
        never covering the last token (its logits must be computed)."""
        if not self._prefix.enabled or tokens.shape[0] <= 1:
            return _EMPTY_I32, _EMPTY_I32
        return self._trie.match(tokens, root, reusable_blocks(len(tokens), self._block_size))

    def _count_lookup(self, prompt_tokens: int, matched: int, reused: int) -> None:
        stats = self._stats
        stats.prefix_lookups += 1
        stats.prefix_lookup_tokens += prompt_tokens
        if reused:
            stats.prefix_hits += 1
            stats.prefix_hit_tokens += reused * self._block_size
        else:
            stats.prefix_misses += 1
        if self._ssm is not None and matched:
            if reused:
                stats.snapshot_hits += 1
            if reused < matched:
                stats.snapshot_hits_cut_short += 1

    def grow(self, seq: SequenceState, num_tokens: int) -> int:
        """Grow the block table to cover ``num_tokens`` tokens, all or nothing, evicting cached
        prefix blocks when the free list runs short. Returns the number of blocks added."""
        with self._lock:
            if self._torn_down or self._drop_queue:
                self._enter_slow()
            started = _now()
            holdings = (
                seq._holdings
                if type(seq) is SequenceState and seq._model_id == self._model_id
                else self._holdings(seq)
            )
            if holdings.status is not _ACTIVE:
                raise _not_active(seq, holdings, "grow")
            wanted = self._wanted_blocks(num_tokens, "grow")
            added = wanted - holdings.num_blocks
            if added > 0:
                self._grow_blocks(holdings, added)
            else:
                added = 0
            self._stats.time_in_library_ns += _now() - started
            return added

    def _wanted_blocks(self, num_tokens: int, what: str) -> int:
        """Blocks that cover ``num_tokens`` tokens, checked against the per-sequence limit."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidId(f"{what}: num_tokens={num_tokens!r} must be an int >= 0")
        wanted = -(-num_tokens // self._block_size)
        limit = self._max_blocks_per_seq
        if wanted > limit:
            raise InvalidId(f"{what}: {num_tokens} tokens need {wanted} blocks, over the per-sequence limit of {limit}")
        return wanted

    def _attach_fused(
        self, seq: SequenceState, holdings: Holdings, tokens: npt.NDArray[np.int32], wanted: int, reusable: int
    ) -> None:
        """Attach for a fresh sequence of a pure-attention model, where every matched block is
        reusable, in one C call straight into the block table: ``admit`` (the prefix and the
        rest of ``wanted`` blocks) when there is a rest, else ``acquire_prefix`` (the prefix
        alone); also when admit could not make room, which leaves the growth to the caller."""
        node_ids = None
        if wanted >= reusable:
            if wanted > len(holdings.blocks):
                holdings.ensure_capacity(wanted)
            free_before = self._pool.num_free
            try:
                _, node_ids, freed = self._core.admit(tokens, wanted, holdings.adapter_uid, reusable, holdings.blocks)
            except OutOfBlocks:
                freed = self._pool.num_free - free_before  # nothing taken; what eviction freed stays free
            if freed:
                self._evicted(freed)
        if node_ids is None:
            node_ids = self._core.acquire_prefix(tokens, holdings.blocks, holdings.adapter_uid, reusable)
            holdings.num_blocks = len(node_ids)
        else:
            holdings.num_blocks = wanted
            self._stats.blocks_allocated += wanted - len(node_ids)
        reused = len(node_ids)
        holdings.pinned_nodes = node_ids
        holdings.pinned_depth = reused
        self._record_prompt(seq, tokens, reused)
        self._count_lookup(len(tokens), reused, reused)

    def _grow_blocks(self, holdings: Holdings, count: int) -> None:
        """Append ``count`` fresh blocks to the table, evicting cached blocks first when the free
        list is short (one C call); all or nothing."""
        start = holdings.num_blocks
        if start + count > len(holdings.blocks):
            holdings.ensure_capacity(start + count)
        free_before = self._pool.num_free
        try:
            freed = self._core.allocate(holdings.blocks, start, count)
        except OutOfBlocks:
            self._evicted(self._pool.num_free - free_before)
            raise OutOfBlocks(
                f"need {count} blocks, {self._pool.num_free} free of {self._pool.num_total} after evicting "
                "every evictable cached block"
            ) from None
        if freed:
            self._evicted(freed)
        holdings.num_blocks = start + count
        self._stats.blocks_allocated += count

    def _evict(self, num_blocks: int) -> int:
        freed = self._core.evict(num_blocks)
        self._evicted(freed)
        return freed

    def _evicted(self, freed: int) -> None:
        """Account for an eviction: count the freed blocks, drop the evicted nodes' snapshots."""
        self._stats.blocks_evicted += freed
        if self._snapshots is not None:
            self._stats.snapshots_evicted += self._snapshots.drop(self._trie.evicted_tags())

    def load_adapter(self, name: str) -> int:
        """Load (or reload, as a new generation) a LoRA adapter; returns its slot."""
        with self._lock:
            self._enter()
            return self._adapters.load(name)

    def unload_adapter(self, name: str) -> None:
        """Unload an adapter; its slot is reused once no sequence references it."""
        with self._lock:
            self._enter()
            self._adapters.unload(name)

    def adapter_info(self, adapter_slot: int) -> AdapterInfo:
        with self._lock:
            self._enter()
            return self._adapters.info(adapter_slot)

    def bind_adapter(self, seq: SequenceState, adapter_slot: int) -> None:
        """Serve the sequence with the adapter loaded in ``adapter_slot``: takes one reference on
        that slot index (released by ``free_sequence``, to the same index, even if the adapter was
        reloaded meanwhile). Bind before ``attach_prefix``."""
        with self._lock:
            started = self._enter()
            holdings = self._active(seq, "bind_adapter")
            if holdings.adapter_slot != NO_ADAPTER:
                raise SequenceStateError(
                    f"bind_adapter: sequence {seq.seq_id} already holds adapter slot {holdings.adapter_slot}"
                )
            if holdings.num_blocks:
                raise SequenceStateError(f"bind_adapter: sequence {seq.seq_id} already has KV blocks")
            holdings.adapter_uid = self._adapters.acquire(adapter_slot)
            holdings.adapter_slot = adapter_slot
            self._leave(started)

    def block_table(self, seq: SequenceState) -> npt.NDArray[np.int32]:
        """The sequence's block ids as an int32 array (a copy, safe to hand to a kernel)."""
        with self._lock:
            self._enter()
            return self._holdings(seq).block_ids().copy()

    def wait_stream(self, stream: object) -> None:
        """Order the library's later device work after everything the engine has issued so far on
        ``stream`` (a raw ``CUstream`` int, or an object with ``__cuda_stream__`` or
        ``cuda_stream`` such as ``torch.cuda.current_stream()``), without blocking. Call it before
        ``save_sequence_state``, ``save_snapshot``, ``cache_sequence`` or ``compact_sequence`` when
        kernels on that stream may still be writing the sequence's KV or SSM state: otherwise the
        library's copies, on its own stream, can read the state from before those writes."""
        with self._lock:
            self._enter()
            self._device.wait_stream(stream)

    def stats(self) -> Stats:
        """A snapshot of the counters."""
        with self._lock:
            return self._stats.copy()

    @property
    def config(self) -> ModelConfig:
        return self._config

    @property
    def device(self) -> Device:
        return self._device

    @property
    def kv_pool(self) -> KVPool | None:
        """The paged KV memory (addresses, strides and array views for kernels)."""
        return self._kv

    @property
    def ssm_pool(self) -> SSMPool | None:
        return self._ssm

    @property
    def num_live_sequences(self) -> int:
        with self._lock:
            if self._drop_queue and not self._torn_down:
                self._reap_dropped()
            return sum(1 for h in self._live.values() if h.status is not _FREED)

    # ------------------------------------------------------------------ release paths

    def _release_holdings(self, holdings: Holdings, cached_by: SequenceState | None = None) -> None:
        """Adapter reference, prefix pins, block references: each step runs even if one before it
        failed; the first failure is raised at the end. The sequence counts as freed either way.
        With ``cached_by``, that sequence's full blocks are cached as its references are dropped."""
        first_error: BaseException | None = None
        adapter_uid = holdings.adapter_uid
        # Each step is skipped when there is nothing to release (the common request holds no
        # adapter, and the fused cache-and-release leaves no pins or blocks).
        if holdings.adapter_slot != NO_ADAPTER or adapter_uid:
            try:
                self._release_adapter(holdings)
            except BaseException as exc:
                first_error = exc
        if cached_by is not None:
            try:
                self._cache_and_release(cached_by, holdings, adapter_uid)
            except BaseException as exc:
                first_error = first_error or exc
        if len(holdings.pinned_nodes) or holdings.cache_pins or holdings.rolling_snapshot is not None:
            try:
                self._release_pins(holdings)
            except BaseException as exc:
                first_error = first_error or exc
        if holdings.num_blocks:
            try:
                self._release_blocks(holdings)
            except BaseException as exc:
                first_error = first_error or exc
        holdings.status = _FREED
        self._live.pop(holdings.seq_id, None)
        if first_error is not None:
            raise first_error

    def _cache_and_release(self, seq: SequenceState, holdings: Holdings, adapter_uid: int) -> None:
        """Cache the sequence's full blocks, unpin its prefix and drop its block references in one
        all-or-nothing C call (on failure the separate release steps that follow still run)."""
        num_blocks = holdings.num_blocks
        full = min(seq._num_tokens // self._block_size, num_blocks)
        # The whole token buffer: the call reads only the first ``full`` blocks' tokens, all written.
        taken, freed = self._core.cache_and_release(
            seq._tokens, holdings.blocks[:num_blocks], full, adapter_uid, holdings.pinned_nodes
        )
        holdings.pinned_nodes = _EMPTY_I32
        holdings.pinned_depth = holdings.num_blocks = 0
        stats = self._stats
        stats.blocks_cached += taken
        stats.blocks_freed += freed

    def _release_adapter(self, holdings: Holdings) -> None:
        slot, uid = holdings.adapter_slot, holdings.adapter_uid
        holdings.adapter_slot, holdings.adapter_uid = NO_ADAPTER, 0
        if slot != NO_ADAPTER:
            self._adapters.release(slot, uid)

    def _release_pins(self, holdings: Holdings) -> None:
        holdings.rolling_snapshot = None  # the snapshot stays cached with its node
        pinned, holdings.pinned_nodes = holdings.pinned_nodes, _EMPTY_I32
        cache_pins, holdings.cache_pins = holdings.cache_pins, ()
        holdings.pinned_depth = 0
        if len(pinned):
            self._trie.unpin(pinned)
        for path in cache_pins:
            self._trie.unpin(path)

    def _release_blocks(self, holdings: Holdings) -> None:
        blocks = holdings.block_ids()
        holdings.num_blocks = 0
        if blocks.shape[0]:
            self._stats.blocks_freed += self._pool.dec_ref(blocks)

    def _reap_dropped(self) -> None:
        """Release what sequences dropped without ``free_sequence`` still held (their slot guard
        already released the slot)."""
        while self._drop_queue:
            holdings = self._live.get(self._drop_queue.popleft())
            if holdings is not None and holdings.status is not _FREED:
                self._release_holdings(holdings)
                self._stats.sequences_freed += 1

    # ------------------------------------------------------------------ snapshots

    def _save_snapshot(self, slot: int, node_id: int) -> int:
        """Snapshot ``slot`` at ``node_id`` (or refresh the node's existing snapshot's LRU
        position); returns the snapshot id."""
        snapshots = self._snapshots
        assert snapshots is not None
        existing = self._trie.get_tag(node_id)
        if existing >= 0:
            snapshots.touch(existing)
            return existing
        snapshot_id = snapshots.save(slot, node_id, self._forget_snapshot)
        self._trie.set_tag(node_id, snapshot_id)
        self._stats.snapshots_saved += 1
        return snapshot_id

    def _forget_snapshot(self, node_id: int) -> None:
        """The snapshot pool reused ``node_id``'s snapshot (LRU): the node keeps its KV only."""
        self._trie.set_tag(node_id, -1)
        self._stats.snapshots_evicted += 1

    def _owns_rolling(self, rolling: tuple[int, int, int]) -> bool:
        """Whether a sequence's rolling snapshot (node, id, generation) is still the one it took:
        the pool may have reused the id since (LRU), even for the same node."""
        node_id, snapshot_id, generation = rolling
        snapshots = self._snapshots
        return (
            snapshots is not None
            and self._trie.get_tag(node_id) == snapshot_id
            and snapshots.generation(snapshot_id) == generation
        )

    def _drop_snapshot(self, rolling: tuple[int, int, int]) -> None:
        """Drop a sequence's previous rolling snapshot, if it is still the one it took."""
        if self._owns_rolling(rolling):
            node_id, snapshot_id, _ = rolling
            self._trie.set_tag(node_id, -1)
            assert self._snapshots is not None
            self._snapshots.drop(np.array([snapshot_id], dtype=np.int32))
            self._stats.snapshots_evicted += 1

    def save_snapshot(self, seq: SequenceState, num_tokens: int, *, rolling: bool = False) -> bool:
        """Cache the sequence's first ``num_tokens`` tokens (a whole number of blocks, which the
        SSM state in its slot has consumed exactly) with an SSM snapshot at that point, so a later
        hybrid lookup can reuse them. Returns False when snapshots are disabled.

        ``rolling=True`` replaces the sequence's previous rolling snapshot: an engine can take one
        at every block boundary while decoding, so that the state at the last whole block of the
        finished sequence (where the next turn of a chat resumes) is cached, at the cost of one
        snapshot per live sequence."""
        with self._lock:
            started = self._enter()
            holdings = self._holdings(seq)
            snapshots = self._snapshots
            if snapshots is None or not self._prefix.enabled or seq.failed:
                self._leave(started)
                return False
            if num_tokens <= 0 or num_tokens % self._block_size or num_tokens > seq.num_tokens:
                raise InvalidId(
                    f"save_snapshot: num_tokens={num_tokens} must be a positive multiple of the block size "
                    f"{self._block_size}, at most the sequence's {seq.num_tokens} tokens"
                )
            full = num_tokens // self._block_size
            if full > holdings.num_blocks or seq.is_detached:
                raise SequenceStateError(
                    f"save_snapshot: sequence {seq.seq_id} has {holdings.num_blocks} blocks "
                    f"({'detached' if seq.is_detached else 'attached'}); {full} needed"
                )
            taken, _, node_ids = self._prefix.insert_path(
                seq.tokens[:num_tokens], holdings.blocks[:full], holdings.adapter_uid
            )
            self._stats.blocks_cached += taken
            self._pin_path(holdings, node_ids)
            node = int(node_ids[full - 1])
            previous = holdings.rolling_snapshot
            repeat = previous is not None and previous[0] == node and self._owns_rolling(previous)
            if rolling and previous is not None and not repeat:
                self._drop_snapshot(previous)
            # Only a snapshot this sequence took may be dropped by its next rolling save.
            own = repeat or self._trie.get_tag(node) < 0
            snapshot_id = self._save_snapshot(seq.slot_idx, node)
            holdings.rolling_snapshot = (
                (node, snapshot_id, snapshots.generation(snapshot_id)) if rolling and own else None
            )
            self._leave(started)
            return True

    # ------------------------------------------------------------------ invariants

    def _check_slot_owners(self) -> None:
        """Every guarded slot has a live owner whose guard holds it, and no live owner's slot is
        free or detached. A slot whose owner was just dropped (on another thread, its guard
        releasing the slot outside our lock) is in flight and accepted."""
        slots = self._slots
        for slot in range(self._config.max_seqs):
            ref = self._slot_owner.get(slot)
            owner = ref() if ref is not None else None
            owns = owner is not None and owner._guard is not None and owner._guard.slot == slot
            if slots.is_free(slot) or slots.is_detached(slot):
                if owner is not None and owns:
                    raise InvariantViolation(f"slot {slot} is not guarded in the pool, yet sequence {owner.seq_id} owns it")
            elif ref is None or (owner is not None and not owns):
                raise InvariantViolation(f"slot {slot} is guarded, but no live sequence of this model owns it")

    def check_invariants(self) -> None:
        """Recount every reference from scratch (blocks, pins, slots, adapters, snapshots) and
        raise ``InvariantViolation`` on any mismatch."""
        with self._lock:
            self._enter()
            self._prefix.check_invariants()  # the pool, the trie, and the cache's references
            self._slots.check_invariants()
            expected = np.zeros(self._pool.num_total, dtype=np.int64)
            pins: dict[int, int] = {}
            adapter_refs = [0] * self._adapters.num_slots
            live = [h for h in self._live.values() if h.status is not _FREED]
            for holdings in live:
                np.add.at(expected, holdings.block_ids(), 1)
                for path in (holdings.pinned_nodes, *holdings.cache_pins):
                    for node in path.tolist():
                        pins[node] = pins.get(node, 0) + 1
                if holdings.adapter_slot != NO_ADAPTER:
                    adapter_refs[holdings.adapter_slot] += 1
            cached = self._trie.cached_block_ids()
            np.add.at(expected, cached, 1)
            actual = self._pool.refcounts()
            if not np.array_equal(expected, actual):
                bad = int(np.flatnonzero(expected != actual)[0])
                raise InvariantViolation(
                    f"block {bad}: refcount {int(actual[bad])} but sequences and cache hold {int(expected[bad])}"
                )
            pinned_nodes, pin_counts = self._trie.pin_counts()
            trie_pins = dict(zip(pinned_nodes.tolist(), pin_counts.tolist()))
            if trie_pins != pins:
                bad = min(set(trie_pins.items()) ^ set(pins.items()))[0]
                raise InvariantViolation(
                    f"trie node {bad} pinned {trie_pins.get(bad, 0)}x, but live sequences hold {pins.get(bad, 0)} pins on it"
                )
            if adapter_refs != self._adapters.refcounts():
                raise InvariantViolation(f"adapter refcounts {self._adapters.refcounts()} but sequences hold {adapter_refs}")
            self._check_slot_owners()
            if self._snapshots is not None:
                self._snapshots.check_invariants(self._trie)


def _not_active(seq: SequenceState, holdings: Holdings, what: str) -> SequenceStateError:
    return SequenceStateError(f"{what}: sequence {seq.seq_id} is {holdings.status.value}, not active")


def _as_tokens(prompt: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int32]:
    if isinstance(prompt, np.ndarray) and prompt.dtype == np.int32 and prompt.ndim == 1:
        return cast("npt.NDArray[np.int32]", prompt)
    try:
        tokens = np.asarray(prompt, dtype=np.int64)
    except OverflowError:
        raise InvalidId("prompt token ids must lie in [0, 2147483647]; one does not fit 64 bits") from None
    if tokens.ndim != 1:
        raise InvalidId(f"prompt must be a one-dimensional token sequence, got shape {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0x7FFFFFFF):
        raise InvalidId(f"prompt token ids must lie in [0, 2147483647], got [{int(tokens.min())}, {int(tokens.max())}]")
    return tokens.astype(np.int32)
