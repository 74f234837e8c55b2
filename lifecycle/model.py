"""``HybridModel``: the seventeen ``ModelLifecycle`` methods and their companions for a model of
attention and SSM layers, composed of the layers below it:

- the KV cache core (``lifecycle._kvcache``): every request's tokens, block table, pinned prefix and
  content hashes, the prefix trie, the snapshot ids and the cache salts; one C call per scheduler step;
- the slot pool (``lifecycle._slots``): SSM state slots, each owned through a guard;
- the device memory (:mod:`lifecycle.memory`: pools, snapshots, staging) and the swap record
  (:mod:`lifecycle.swap`), which move bytes;
- the adapters (:mod:`lifecycle.lora`), the attach paths past the core's one call
  (:mod:`lifecycle.attach`: salts, snapshots, tiers), the step's CUDA path (:mod:`lifecycle.stepping`).

The model keeps no copy of what those own. Bookkeeping calls on a pure-attention model go straight
to the core (which has its own lock); calls that touch device memory or the adapter table take the
model's lock, so teardown never frees memory under them. Bad input raises a
:class:`~lifecycle.errors.LifecycleError` before anything changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, BinaryIO, Final, final

import numpy as np
import numpy.typing as npt

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore
from lifecycle._slots import SlotPool
from lifecycle.attach import PrefixAttach
from lifecycle.block_tables import host_table, raise_if_wrong_type, write_block_tables
from lifecycle.cache_keys import MMKey
from lifecycle.config import ModelConfig, ModelDims
from lifecycle.device import Device, open_device
from lifecycle.errors import ConfigError, InvalidId, SequenceStateError, SlotInUse, SlotOutOfRange, TornDown
from lifecycle.events.translate import KVEventLog
from lifecycle.events.types import KVEventBatch
from lifecycle.lora import AdapterBindings, AdapterInfo, AdapterTable
from lifecycle.memory import ModelMemory
from lifecycle.pools import KVPool, SSMPool
from lifecycle.protocol import LifecycleDefaults, PrefixReclaim
from lifecycle.sequence import NO_ADAPTER, SequenceState
from lifecycle.snapshots import cache_sequence, snapshot_point
from lifecycle.stats import DeviceClock, ModelCounters, Stats, TeardownReport
from lifecycle.stepping import cuda_handles, step_cuda, step_refused
from lifecycle.swap import SwapContext
from lifecycle.swap.sequences import restore_sequence, save_sequence
from lifecycle.tiers.host import HostTier
from lifecycle.tiers.promote import ModelTiers, open_tiers

__all__ = ["HybridModel", "TeardownReport"]

_log = logging.getLogger("lifecycle.model")
_ACTIVE: Final = 1
_RETIRED: Final = 2


@final
class _Gate:
    """``with gate:``: the model's lock, then its entry check (refused after teardown, dropped
    sequences reaped); the lock is released again if the check raises."""

    __slots__ = ("_enter", "_lock")

    def __init__(self, lock: threading.RLock, enter: Callable[[], None]) -> None:
        self._lock, self._enter = lock, enter

    def __enter__(self) -> None:
        self._lock.acquire()
        try:
            self._enter()
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, *_: object) -> None:
        self._lock.release()


class HybridModel(LifecycleDefaults):
    """The memory lifecycle of one hybrid (attention + SSM) model; pure-attention and pure-SSM
    configurations work too. ``device`` is a :class:`~lifecycle.device.Device` or a kind for
    :func:`~lifecycle.device.open_device` (a device opened here is closed by ``teardown``).

    ``events``: log KV events (``take_events``). ``host_tier_blocks``: keep up to that many
    evicted prefix-cache blocks in host memory and promote them back at admission; ``store``: a
    Redis / Valkey URL shared by engines, written behind the host tier (see
    :mod:`lifecycle.tiers.promote`). Tiers need a model without SSM layers (its reuse needs snapshots).
    ``null_block``: block 0 is held for good (never handed out), for engines that pad their block
    tables with it (vLLM's null block)."""

    def __init__(
        self,
        config: ModelConfig,
        device: Device | str = "auto",
        *,
        ordinal: int = 0,
        events: bool = False,
        host_tier_blocks: int = 0,
        store: str | None = None,
        null_block: bool = False,
    ) -> None:
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"config must be a ModelConfig, got {type(config).__name__}")
        self._config = config
        self._dims = config.dims()
        self._block_size = config.block_size
        self._lock = threading.RLock()
        self._entered = _Gate(self._lock, self._enter)
        self._torn_down = False
        self.teardown_report: TeardownReport | None = None
        self._counters = ModelCounters()
        self._owns_device = isinstance(device, str)
        if isinstance(device, str):
            # A kind other than open_device's three is refused there, with ConfigError naming them.
            device = open_device(device, ordinal)  # type: ignore[arg-type]
        self._device: Device = device
        self._memory = ModelMemory(self._device, config)
        self._kv, self._ssm, self._snapshots = self._memory.kv, self._memory.ssm, self._memory.snapshots
        self._pool = BlockPool(config.num_blocks_resolved)
        self._core = KVCacheCore(
            self._pool,
            self._block_size,
            enable_prefix_cache=config.enable_prefix_cache,
            snapshot_cut=self._ssm is not None,
            num_snapshots=self._snapshots.capacity if self._snapshots is not None else 0,
            max_blocks_per_seq=config.max_blocks_per_seq_resolved,
            # Without attention layers a sequence holds no blocks, and its tokens are not bounded by them.
            max_tokens_per_seq=None if self._kv is not None else 2**31 - 1,
            null_block=null_block,
        )
        self._clock = DeviceClock(self._counters, self._core.time_ns)
        self._slots = SlotPool(config.max_seqs)
        self._adapters = AdapterTable(config.num_adapter_slots)
        self._lora = AdapterBindings(self._adapters, self._core)
        self._drop_queue: deque[int] = deque()
        self._innerq_hook: Callable[[], None] | None = None
        self._max_budget_tokens = (
            config.max_blocks_per_seq_resolved * self._block_size if self._kv is not None else None
        )
        self._addrs_by_slot = self._memory.addrs_by_slot
        self._swap_ctx = SwapContext(
            config, self._device, self._kv, self._ssm, staging=self._memory.staging, adapters=self._adapters
        )
        self._stats_base: Stats | None = None
        self._tiers: ModelTiers | None = None
        self._events = (
            KVEventLog(config.block_size, adapter_of=self._lora.adapter_of, salt_of=self._core.salts.salt_of)
            if events else None
        )
        if events or host_tier_blocks or store is not None:
            try:
                self._tiers = open_tiers(
                    self._core, self._device, self._kv, config, ssm=self._ssm is not None,
                    host_blocks=host_tier_blocks, store_url=store, events=self._events,
                )
            except BaseException:
                self._core.close()
                self._memory.release()
                if self._owns_device:
                    self._device.close()
                raise
        self._demoting = self._tiers is not None and self._tiers.host is not None
        self._attach = PrefixAttach(self._core, self._block_size, self._snapshots, self._tiers)

    # ------------------------------------------------------------------ plumbing

    def _enter(self) -> None:
        """Start of a call (under the lock): refuse after teardown, reap dropped sequences."""
        if self._torn_down:
            raise TornDown(f"model {self._config.name!r} was torn down; only teardown() may be called again")
        if self._drop_queue:
            self._reap_dropped()

    def _reap_dropped(self) -> None:
        """Release what sequences dropped without ``free_sequence`` still held (their slot guard
        already released the slot)."""
        while self._drop_queue:
            try:
                slot = self._core.finish(self._drop_queue.popleft(), False)
            except (SequenceStateError, TornDown, IndexError):
                continue
            if slot != NO_ADAPTER:
                self._release_adapter(slot)

    def _release_adapter(self, adapter_slot: int) -> None:
        """What the core calls back as it releases a record bound to an adapter."""
        with self._lock:
            self._adapters.release_ref(adapter_slot)

    def _drained(self) -> None:
        """After a core call that may have evicted: demote what it evicted (host tier)."""
        if self._demoting:
            assert self._tiers is not None
            with self._lock:
                self._tiers.drain()

    def _read_events(self) -> None:
        """The core's pending log into the event log, through the tiers where there are some (what
        it evicted is demoted on the way)."""
        assert self._events is not None
        if self._tiers is not None:
            self._tiers.drain()
        else:
            self._events.read(self._core)

    # ------------------------------------------------------------------ required methods

    def bind_gpu_to_thread(self) -> None:
        """Make the device context current on the calling thread (every thread calls it first)."""
        with self._entered:
            self._device.bind_to_thread()

    def alloc_sequence(self) -> SequenceState:
        """A new sequence owning a zeroed SSM slot. Raises ``OutOfSlots`` when none is free."""
        return self.alloc_sequence_for(0)

    def alloc_sequence_for(self, budget_tokens: int) -> SequenceState:
        """``alloc_sequence`` for a request that reaches at most ``budget_tokens`` tokens: its
        proposer (draft) state and token buffer are sized to that budget."""
        if type(budget_tokens) is not int or budget_tokens < 0:
            if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 0:
                raise InvalidId(f"budget_tokens={budget_tokens!r} must be an int >= 0")
        limit = self._max_budget_tokens
        if limit is not None and budget_tokens > limit:
            raise InvalidId(f"budget_tokens={budget_tokens} exceeds the per-sequence limit of {limit} tokens")
        if self._torn_down or self._drop_queue:
            self._enter()
        seq = self._core.alloc(self._slots, budget_tokens, self._addrs_by_slot, self._drop_queue)
        if self._ssm is not None:
            try:
                with self._entered, self._clock:
                    self._ssm.zero_slot(seq.slot_idx)
                    self._device.synchronize()  # the engine's kernels may run on another stream
            except BaseException:
                self._core.release(seq, False)
                raise
        return seq

    def cache_sequence(self, seq: SequenceState) -> None:
        """Insert the sequence's full blocks into the prefix cache under its adapter (an existing node keeps
        its own block); the path stays pinned while the sequence lives. A failed or freed one is never cached."""
        self._core.handle_of(seq)
        with self._entered, self._clock:
            if seq.is_open:
                cache_sequence(self._core, self._snapshots, seq, self._block_size)

    def finish_sequence(self, seq: SequenceState) -> None:
        """``cache_sequence`` then ``free_sequence`` in one core call (a request's end). A second call is a
        no-op while the model lives; after ``teardown``, ``TornDown`` (as for every call but ``teardown``)."""
        if self._snapshots is not None:
            self._core.handle_of(seq)
            with self._entered, self._clock:
                if seq.is_open:
                    try:
                        cache_sequence(self._core, self._snapshots, seq, self._block_size)
                    finally:
                        self._core.release(seq, False, self._release_adapter)
            return
        if self._torn_down or self._drop_queue:
            self._enter()
        self._core.release(seq, True, self._release_adapter)  # the slot, then the record: one C call

    def free_sequence(self, seq: SequenceState) -> None:
        """Release the SSM slot (unless detached), the adapter reference, the prefix pins and one reference on
        every block. A second call is a no-op while the model lives; after ``teardown``, ``TornDown``."""
        if self._torn_down or self._drop_queue:
            self._enter()
        self._core.release(seq, False, self._release_adapter)

    def compact_sequence(self, seq: SequenceState, new_slot: int) -> None:
        """Move the sequence's SSM state to ``new_slot`` (one batched copy, waited for), claim it, release the old
        slot. ``new_slot`` may be free, detached or a *retired* sequence's (detached in the same step); an active
        sequence's raises ``SlotInUse``."""
        handle = self._core.handle_of(seq)
        with self._entered:
            if self._core.status(handle) != _ACTIVE:
                raise SequenceStateError(f"compact_sequence: sequence {seq.seq_id} is {seq.status.value}, not active")
            old_guard = seq.guard
            if old_guard is None or not old_guard.held:
                raise SequenceStateError(f"compact_sequence: sequence {seq.seq_id} is detached and owns no slot")
            if isinstance(new_slot, bool) or not isinstance(new_slot, int) or not 0 <= new_slot < self._config.max_seqs:
                raise SlotOutOfRange(f"compact_sequence: slot {new_slot!r} out of range [0, {self._config.max_seqs})")
            old_slot = old_guard.slot
            if new_slot == old_slot:
                return
            retired = self._slots.guard_of(new_slot)
            if retired is not None and self._core.status(retired.owner) != _RETIRED:
                raise SlotInUse(
                    f"slot {new_slot} is owned by an active sequence; retire it (retire_sequence) "
                    "or detach it before compacting another sequence into its slot"
                )
            if self._ssm is not None:
                with self._clock:
                    self._ssm.copy_slot(old_slot, new_slot)
                    self._device.synchronize()  # the old slot may be handed out as soon as it is released
            if retired is not None:
                new_guard = retired.move()  # the retired sequence's guard is empty now: it is detached
                self._counters.detaches += 1
            else:
                new_guard = self._slots.claim_specific(new_slot)
            new_guard.owner = handle
            seq.rebind_guard(new_guard)
            old_guard.release()
            self._counters.compactions += 1

    def detach_slot_for_reuse(self, seq: SequenceState) -> None:
        """Give up the sequence's slot without releasing it (a survivor owns or will own it): ``slot_idx``
        becomes ``DETACHED_SLOT``. A second call is a no-op."""
        self._core.handle_of(seq)
        with self._entered:
            guard = seq.detach_guard()
            if guard is not None and guard.held:
                guard.take()
                self._counters.detaches += 1

    def kv_block_bytes(self) -> int:
        """Bytes one block index holds across every attention layer, K and V (0 without any)."""
        with self._entered:
            return self._config.kv_block_bytes()

    # ------------------------------------------------------------------ provided methods

    def teardown(self) -> None:
        """Release every pool (device memory newest first), exactly once; what callers still held is
        released all the same and reported in ``teardown_report`` (and logged). Afterwards every other
        call raises ``TornDown``."""
        with self._lock:
            if self._torn_down:
                return
            self._reap_dropped()
            if self._tiers is not None:
                self._tiers.close()
            live, blocks, cached = self._core.close()
            report = TeardownReport(live, blocks, cached, self._slots.num_detached, sum(self._adapters.refcounts()))
            self._torn_down = True
            self.teardown_report = report
            try:
                self._memory.release()
            finally:
                if self._owns_device:
                    self._device.close()
            if report.leaked:
                _log.warning("teardown of %r released memory still referenced: %s", self._config.name, report)

    def poll_innerq(self) -> None:
        """Run the registered KV-quantization calibration hook, if any (once per prefill step)."""
        with self._entered:
            hook = self._innerq_hook
        if hook is not None:
            hook()

    def set_innerq_hook(self, hook: Callable[[], None] | None) -> None:
        """Register the calibration driver ``poll_innerq`` calls (None removes it)."""
        with self._entered:
            self._innerq_hook = hook

    def high_speed_swap_dims(self) -> ModelDims:
        """The model's dimensions for a swap orchestrator."""
        with self._entered:
            return self._dims

    def save_sequence_state(self, seq: SequenceState, writer: BinaryIO) -> None:
        """Write the sequence's KV blocks and SSM state to ``writer`` as a checksummed record
        (:mod:`lifecycle.swap`). Frees nothing."""
        self._core.handle_of(seq)
        with self._entered:
            save_sequence(self._swap_ctx, seq, writer, self._counters, self._clock)

    def restore_sequence_state(self, seq: SequenceState, num_blocks: int, reader: BinaryIO) -> None:
        """Take ``num_blocks`` free blocks for a fresh sequence (all or nothing, never evicting) and stream a
        ``save_sequence_state`` record into them and its slot, verified; on any failure the sequence is unchanged."""
        self._core.handle_of(seq)
        with self._entered:
            restore_sequence(self._swap_ctx, self._core, seq, num_blocks, reader, self._counters, self._clock)

    def num_free_blocks(self) -> int:
        """Blocks with refcount 0 (blocks only the prefix cache holds are not free until evicted)."""
        if self._torn_down or self._drop_queue:
            self._enter()
        return self._pool.num_free

    def num_total_blocks(self) -> int:
        if self._torn_down or self._drop_queue:
            self._enter()
        return self._pool.num_total

    def reclaim_prefix_blocks(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` blocks from the prefix cache (least recently used leaves no live
        sequence holds); returns how many became free."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidId(f"reclaim_prefix_blocks: num_blocks={num_blocks!r} must be an int >= 0")
        with self._entered:
            try:
                return int(self._core.evict(min(num_blocks, self._pool.num_total)))
            finally:
                self._drained()

    def reclaim_prefix_blocks_for(
        self, prompt: Sequence[int] | npt.NDArray[np.integer], adapter_slot: int, blocks_needed: int
    ) -> PrefixReclaim:
        """Evict until the free blocks cover a prefill of ``prompt``: ``blocks_needed`` less the cached
        prefix it reuses (pinned meanwhile); with a host tier, ``host_blocks`` counts its run past the
        device's match."""
        if isinstance(blocks_needed, bool) or not isinstance(blocks_needed, int) or blocks_needed < 0:
            raise InvalidId(f"reclaim_prefix_blocks_for: blocks_needed={blocks_needed!r} must be an int >= 0")
        with self._entered:
            return self._attach.reclaim_for(prompt, self._lora.root_of(adapter_slot), blocks_needed)

    # ------------------------------------------------------------------ companions

    def retire_sequence(self, seq: SequenceState) -> None:
        """Mark a finished sequence retired: it no longer grows, and another sequence may be
        compacted into its slot (which detaches it). It can still be cached, saved and freed."""
        self._core.retire(self._core.handle_of(seq))

    def attach_prefix(
        self,
        seq: SequenceState,
        prompt: Sequence[int] | npt.NDArray[np.integer],
        *,
        grow_to: int | None = None,
        cache_salt: bytes | str | int | None = None,
        mm_keys: Sequence[MMKey] | None = None,
    ) -> int:
        """Record ``prompt`` as the sequence's tokens, pin its longest cached prefix under the sequence's adapter
        (whole blocks, never the last token; on a hybrid model up to a snapshot, restored into the slot) at the head
        of its table; returns the tokens reused. A retried call takes no second set of references.

        ``grow_to``: then ``grow(seq, grow_to)`` in the same call (refused first if ``grow`` would refuse it; on
        ``OutOfBlocks`` the prefix stays attached). ``cache_salt`` and ``mm_keys`` (``(content_hash, start, end)``)
        are part of the blocks' identity (:mod:`lifecycle.cache_keys`). With a host tier the lookup continues into
        the tiers (:mod:`lifecycle.attach`)."""
        if cache_salt is not None or mm_keys:
            keyed, unsalted = self._attach.keyed(seq, prompt, cache_salt, mm_keys)
            try:
                return self.attach_prefix(seq, keyed, grow_to=grow_to)
            except BaseException:
                if unsalted is not None:
                    self._attach.unsalt(seq, unsalted)
                raise
        if self._ssm is None:
            if self._drop_queue:
                self._reap_dropped()
            if not self._demoting:
                try:
                    return self._core.attach_seq(seq, prompt, grow_to)
                except InvalidId as error:
                    raise_if_wrong_type(error, "attach_prefix", {"prompt": prompt})
                    raise
            with self._entered, self._clock:
                return self._attach.tiered(seq, prompt, grow_to)
        self._core.handle_of(seq)
        with self._entered, self._clock:
            return self._attach.hybrid(seq, prompt, grow_to)

    def grow(self, seq: SequenceState, num_tokens: int) -> int:
        """Grow the block table to cover ``num_tokens`` tokens, all or nothing, evicting cached blocks when
        short; returns the blocks added. A freed or retired sequence raises ``SequenceStateError``."""
        if self._torn_down or self._drop_queue:
            self._enter()
        if not self._demoting:
            return self._core.grow_seq(seq, num_tokens)
        try:
            return self._core.grow_seq(seq, num_tokens)
        finally:
            self._drained()

    def step(
        self,
        seqs: Sequence[SequenceState] | Sequence[int] | npt.NDArray[np.int64] | Any,
        tokens: Sequence[int] | npt.NDArray[np.integer] | Any,
        *,
        counts: Sequence[int] | npt.NDArray[np.integer] | Any | None = None,
        table: npt.NDArray[np.int32] | Any | None = None,
        rows: Sequence[int] | npt.NDArray[np.integer] | Any | None = None,
        cache: bool | None = None,
        pad: int | None = None,
    ) -> npt.NDArray[np.int32]:
        """One decode step of the running sequences in one core call with the GIL released: append a token each
        (or ``counts[i]`` of ``tokens``), grow the tables whose last block filled (evicting when short), write the
        new block ids into row ``rows[i]`` (default ``i``) of ``table``, cache the blocks that filled (``cache``;
        default: pure attention with the prefix cache on). ``seqs``: the sequences or their ``handle`` values.
        The arguments' forms and the CUDA table (``pad``) are in :mod:`lifecycle.stepping`. All or nothing per
        sequence: returns the positions of those that could not grow, unchanged, for the scheduler to preempt."""
        handles: Any
        if isinstance(seqs, np.ndarray):
            handles = seqs
        else:
            try:
                handles = np.fromiter((s.handle for s in seqs), np.int64, len(seqs))  # type: ignore[union-attr]
            except AttributeError:  # handles (a list, a tuple, a tensor): the core converts them
                handles = seqs
            except TypeError as error:
                raise_if_wrong_type(InvalidId(str(error)), "step", {"seqs": seqs})
                raise
        if cache is None:
            cache = self._ssm is None and self._config.enable_prefix_cache
        if self._torn_down or self._drop_queue:
            self._enter()
        if table is not None and not isinstance(table, np.ndarray):
            host = host_table(table, "step")
            if host is None:
                return self._step_cuda(handles, tokens, counts, table, rows, cache, pad)
            if not host.flags.c_contiguous:  # rows apart in memory (a slice of rows): stepped in a copy
                scratch = np.ascontiguousarray(host)
                refused = self.step(handles, tokens, counts=counts, table=scratch, rows=rows, cache=cache)
                host[...] = scratch
                return refused
            table = host
        try:
            if not self._demoting:
                return self._core.step(handles, tokens, counts, table, rows, cache)
            try:
                return self._core.step(handles, tokens, counts, table, rows, cache)
            finally:
                self._drained()
        except InvalidId as error:
            step_refused(error, handles, tokens, counts, rows, table)
            raise

    def _step_cuda(
        self, handles: object, tokens: object, counts: object, table: object, rows: object, cache: bool,
        pad: int | None,
    ) -> npt.NDArray[np.int32]:
        """:meth:`step` into a table in CUDA memory (:func:`lifecycle.stepping.step_cuda`)."""
        wanted = cuda_handles(handles)
        if pad is None and self.null_block >= 0:
            pad = self.null_block
        with self._entered, self._clock:
            try:
                return step_cuda(self._core, self._device, self._memory.tables, wanted, tokens, counts, table, rows,
                                 pad, cache)
            finally:
                self._drained()

    def save_snapshot(self, seq: SequenceState, num_tokens: int, *, rolling: bool = False) -> bool:
        """Cache the sequence's first ``num_tokens`` tokens (whole blocks, which its SSM state consumed
        exactly) with an SSM snapshot there; False, changing nothing, when snapshots or the cache are off or the
        sequence cannot be cached. ``rolling=True`` replaces its previous rolling snapshot (one per block boundary)."""
        self._core.handle_of(seq)
        with self._entered:
            if self._snapshots is None or not self._core.enabled or not seq.is_open or seq.failed:
                return False
            blocks = snapshot_point(seq, num_tokens, self._block_size)
            with self._clock:
                return self._snapshots.snapshot(self._core, seq, blocks, rolling=rolling)

    def load_adapter(self, name: str) -> int:
        """Load (or reload, as a new generation) a LoRA adapter; returns its slot. With KV events, a reload
        publishes the removal of every block cached under the previous generation, and nothing more of it."""
        with self._entered:
            slot, retired = self._lora.load(name)
            if retired and self._events is not None:
                self._read_events()
                self._events.retire(set(retired))
            return slot

    def unload_adapter(self, name: str) -> None:
        """Unload an adapter; its slot is reused once no sequence references it."""
        with self._entered:
            self._adapters.unload(name)

    def adapter_info(self, adapter_slot: int) -> AdapterInfo:
        with self._entered:
            return self._adapters.info(adapter_slot)

    def bind_adapter(self, seq: SequenceState, adapter_slot: int) -> None:
        """Serve the sequence with the adapter in ``adapter_slot``: one reference on that slot index (released
        by ``free_sequence``, even after a reload). Bind before ``attach_prefix``."""
        handle = self._core.handle_of(seq)
        with self._entered:
            self._lora.bind(seq, handle, adapter_slot)

    def block_table(self, seq: SequenceState) -> npt.NDArray[np.int32]:
        """The sequence's block ids as an int32 array (a copy, safe to hand to a kernel)."""
        return self._core.block_table(self._core.handle_of(seq))

    def wait_stream(self, stream: object) -> None:
        """Order the library's later device work after what the engine issued on ``stream`` (a ``CUstream``
        int, or an object with ``__cuda_stream__`` / ``cuda_stream``), without blocking: call it before the saves,
        caches and compactions that read state kernels on that stream may still be writing."""
        with self._entered:
            self._device.wait_stream(stream)

    def use_stream(self, stream: object) -> AbstractContextManager[None]:
        """Within the block, the library's copies on this thread run on the engine's ``stream``
        (ordered with its kernels, no device-wide sync); see ``Device.use_stream``."""
        return self._device.use_stream(stream)

    def record_event(self, event: object) -> None:
        """Record ``event`` (a CUDA event or an object carrying one) after the library's copies so far."""
        with self._entered:
            self._device.record_event(event)

    def wait_event(self, event: object) -> None:
        """Order the library's later copies after ``event`` (recorded by the engine)."""
        with self._entered:
            self._device.wait_event(event)

    # ------------------------------------------------------------------ engine integration

    def take_events(self, data_parallel_rank: int | None = None) -> KVEventBatch:
        """The KV events since the last call, in vLLM's layout (:mod:`lifecycle.events`); empty without
        ``events=True``."""
        with self._entered:
            if self._events is None:
                return KVEventBatch(ts=time.time(), events=(), data_parallel_rank=data_parallel_rank)
            self._read_events()
            return self._events.take(data_parallel_rank)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, and the host tier's, unless a running sequence holds a cached prefix;
        returns whether it did."""
        with self._entered:
            done: bool = self._core.reset()
            if done and self._tiers is not None:
                self._tiers.clear()
            return done

    def evict_blocks(self, block_ids: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int32]:
        """Drop the given cached blocks (invalid KV) and everything cached after them, never demoting;
        blocks on a running sequence's path stay. Returns the ids that left the cache."""
        with self._entered:
            try:
                return self._core.evict_blocks(block_ids)
            except InvalidId as error:
                raise_if_wrong_type(error, "evict_blocks", {"block_ids": block_ids})
                raise

    def num_common_prefix_blocks(self, seqs: Sequence[SequenceState]) -> int:
        """How many leading blocks all of ``seqs`` share (cascade attention's common prefix)."""
        try:
            handles = [self._core.handle_of(seq) for seq in seqs]
        except TypeError:
            raise InvalidId(
                f"num_common_prefix_blocks: seqs must be a sequence of SequenceStates, got {seqs!r}"
            ) from None
        return int(self._core.num_common_prefix_blocks(handles))

    def write_block_table(self, seq: SequenceState, out: object, *, pad: int | None = None) -> int:
        """Write the sequence's block ids into ``out``, a writable 1-D int32 buffer (padded with ``pad``
        if given); returns the ids written."""
        try:
            return int(self._core.write_table(self._core.handle_of(seq), out, pad))
        except InvalidId as error:
            raise_if_wrong_type(error, "write_block_table", {}, {"out": out})
            raise

    def write_block_tables(
        self,
        seqs: Sequence[SequenceState],
        table: object,
        *,
        rows: Sequence[int] | npt.NDArray[np.integer] | None = None,
        pad: int | None = None,
    ) -> None:
        """Write each sequence's block ids into row ``rows[i]`` (default ``i``) of ``table``, a 2-D int32
        block table in host or CUDA memory (:mod:`lifecycle.block_tables`); everything is checked first."""
        seqs = list(seqs)
        handle_of = self._core.handle_of
        handles = [handle_of(seq) for seq in seqs]
        with self._entered, self._clock:
            write_block_tables(self._core, self._device, self._memory.tables, seqs, handles, table, rows, pad)

    def flush_store(self, timeout_s: float = 10.0) -> bool:
        """Wait until the blocks queued for the shared store are written (False: ``timeout_s`` passed first)."""
        with self._entered:
            return self._tiers.flush(timeout_s) if self._tiers is not None else True

    def stats(self, *, reset: bool = False) -> Stats:
        """The counters (the core's, the model's own, the tiers') since the model was built, or with
        ``reset=True`` since the last such call."""
        with self._entered:
            tiers = self._tiers.stats() if self._tiers is not None else {}
            total = Stats.of_model(self._core.counters(), self._counters, tiers)
            since = total.minus(self._stats_base) if self._stats_base is not None else total
            if reset:
                self._stats_base = total
            return since

    @property
    def config(self) -> ModelConfig:
        return self._config

    @property
    def device(self) -> Device:
        return self._device

    @property
    def core(self) -> KVCacheCore:
        """The KV cache core: every request's state, the prefix trie, the block pool."""
        return self._core

    @property
    def pool(self) -> BlockPool:
        """The block pool (refcounts; the core keeps every reference in it)."""
        return self._pool

    @property
    def slots(self) -> SlotPool:
        """The SSM slot pool (each slot owned through a guard that records its sequence)."""
        return self._slots

    @property
    def kv_pool(self) -> KVPool | None:
        """The paged KV memory (addresses, strides and array views for kernels)."""
        return self._kv

    @property
    def ssm_pool(self) -> SSMPool | None:
        return self._ssm

    @property
    def null_block(self) -> int:
        """The block held for padding tables (0), -1 without one."""
        return int(self._core.null_block)

    @property
    def host_tier(self) -> HostTier | None:
        """The host tier under the KV pool (None without one)."""
        return self._tiers.host if self._tiers is not None else None

    @property
    def num_live_sequences(self) -> int:
        with self._entered:
            return int(self._core.num_live_sequences)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Recount every reference from scratch (blocks, pins, chunks and snapshots in the core;
        slots; adapters) and raise ``InvariantViolation`` on any mismatch."""
        with self._entered:
            self._core.check_invariants()
            self._slots.check_invariants()
            self._lora.check_invariants()
            if self._tiers is not None:
                self._tiers.check_invariants()
