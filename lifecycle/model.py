"""``HybridModel``: the seventeen ``ModelLifecycle`` methods and their companions, a composition of
the parts of one model (:mod:`lifecycle.parts`), keeping no copy of what they own. Bookkeeping calls
on a pure-attention model go straight to the KV cache core (which has its own lock); calls that touch
device memory or the adapter table take the model's lock, so teardown never frees memory under them.
Bad input raises a :class:`~lifecycle.errors.LifecycleError` before anything changes.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from lifecycle._modelcalls import ModelCalls
from lifecycle.block_tables import host_table, raise_if_wrong_type, write_block_tables
from lifecycle.cache_keys import MMKey
from lifecycle.compaction import SlotMoves
from lifecycle.config import ModelConfig, ModelDims
from lifecycle.device import Device, open_device
from lifecycle.errors import ConfigError, InvalidId, TornDown, Unsupported
from lifecycle.events.types import KVEventBatch
from lifecycle.lora import AdapterInfo
from lifecycle.parts import Gate, ModelParts, ModelViews
from lifecycle.protocol import LifecycleDefaults, PrefixReclaim
from lifecycle.retention import RetentionCalls
from lifecycle.sequence import NO_ADAPTER, SequenceState
from lifecycle.snapshots import cache_sequence, snapshot_point
from lifecycle.stats import DeviceClock, ModelCounters, Stats, TeardownReport
from lifecycle.stepping import Stepper, handles_of, step_refused
from lifecycle.swap.sequences import restore_sequence, save_sequence

__all__ = ["HybridModel", "TeardownReport"]

_log = logging.getLogger("lifecycle.model")
_Ints = Sequence[int] | npt.NDArray[np.integer]
_AnyInts = _Ints | Any  # also a CPU tensor or anything with the buffer protocol


class HybridModel(ModelCalls, ModelViews, RetentionCalls, LifecycleDefaults):
    """The memory lifecycle of one hybrid (attention + SSM) model, or a pure-attention or pure-SSM one.
    ``device``: a :class:`~lifecycle.device.Device` or a kind for :func:`~lifecycle.device.open_device`
    (a device opened here is closed by ``teardown``). ``events``: log KV events (``take_events``).
    ``host_tier_blocks``: keep up to that many evicted prefix-cache blocks in host memory and promote
    them back at admission; ``store``: a Redis / Valkey URL shared by engines, written behind the host
    tier (:mod:`lifecycle.tiers.promote`); a hybrid model's host tier keeps SSM snapshots beside its
    blocks, and it takes no store. ``null_block``: block 0 is held for good, for engines that pad their
    block tables with it (vLLM's null block). ``weights_fingerprint``, ``tier_secret``: what the tiers
    key blocks under besides the configuration (:mod:`lifecycle.tiers.keys`); ``store_options``: the
    store's keywords (:class:`~lifecycle.tiers.store.StoreTier`: ``admit``, ``ttl_s``, ...)."""

    __slots__ = (  # attributes as slots: the hot paths read several per call (ModelCalls: the per-request ones)
        "_adapters", "_addrs_by_slot", "_attach", "_block_size", "_cache_by_default", "_clock", "_config", "_core",
        "_counters", "_demoting", "_device", "_drop_queue", "_entered", "_innerq_hook", "_lock", "_memory", "_moves",
        "_on_release", "_parts", "_pool", "_slots", "_snapshots", "_ssm", "_stepper", "_tiers", "teardown_report",
    )

    def __init__(
        self, config: ModelConfig, device: Device | str = "auto", *, ordinal: int = 0, events: bool = False,
        host_tier_blocks: int = 0, store: str | None = None, null_block: bool = False,
        weights_fingerprint: bytes | str | None = None, tier_secret: bytes | str | None = None,
        store_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"config must be a ModelConfig, got {type(config).__name__}")
        self._config, self._block_size = config, config.block_size
        self._lock = threading.RLock()
        self._entered = Gate(self._lock, self._enter)
        self._torn_down = False
        self.teardown_report: TeardownReport | None = None
        self._counters = ModelCounters()
        opened = isinstance(device, str)  # a kind other than open_device's three is refused there (ConfigError)
        if isinstance(device, str):
            device = open_device(device, ordinal)  # type: ignore[arg-type]
        self._parts = parts = ModelParts(config, device, owns_device=opened, events=events,
                                         host_tier_blocks=host_tier_blocks, store=store, null_block=null_block,
                                         weights_fingerprint=weights_fingerprint, tier_secret=tier_secret,
                                         store_options=store_options)
        self._device: Device = parts.device
        self._memory, self._pool, self._core, self._slots = parts.memory, parts.pool, parts.core, parts.slots
        self._ssm, self._snapshots, self._adapters = parts.memory.ssm, parts.memory.snapshots, parts.adapters
        self._addrs_by_slot, self._tiers, self._attach = parts.memory.addrs_by_slot, parts.tiers, parts.attach
        self._clock = DeviceClock(self._counters, self._core.time_ns)
        self._moves = SlotMoves(self._core, self._slots, self._ssm, self._device, self._counters, self._clock)
        self._stepper = Stepper(self._core, self._device, self._memory.tables, self._entered, self._clock,
                                self._drained, self.step)
        self._drop_queue = parts.drop_queue
        self._innerq_hook: Callable[[], None] | None = None
        per_seq = config.max_blocks_per_seq_resolved * config.block_size
        self._demoting = self._tiers is not None and self._tiers.host is not None
        self._on_release = self._release_adapter  # bound once: the core calls it back as it releases a record
        # which per-request calls are one core call on this model (the rest take the composed paths below)
        self._bind_calls(parts, self._on_release, sys.maxsize if parts.memory.kv is None else per_seq,
                         self._ssm is None, self._ssm is None and not self._demoting,
                         self._snapshots is None and not self._demoting)
        # what a step caches by default
        self._cache_by_default = self._ssm is None and config.enable_prefix_cache

    def _enter(self) -> None:
        """Start of a call (under the lock): refuse after teardown, reap dropped sequences."""
        if self._torn_down:
            raise TornDown(f"model {self._config.name!r} was torn down; only teardown() may be called again")
        if self._drop_queue:
            with self._lock:  # (reentrant) the tiers learn what a dropped sequence held under it
                self._parts.reap(self._on_release)

    def _release_adapter(self, adapter_slot: int) -> None:
        """What the core calls back as it releases a record bound to an adapter."""
        with self._lock:
            self._adapters.release_ref(adapter_slot)

    def _drained(self) -> None:
        """After a core call that may have evicted: demote what it evicted (host tier)."""
        if self._demoting and self._tiers is not None:
            with self._lock:
                self._tiers.drain()

    def bind_gpu_to_thread(self) -> None:
        """Make the device context current on the calling thread (every thread calls it first)."""
        with self._entered:
            self._device.bind_to_thread()

    def alloc_sequence(self) -> SequenceState:
        """A new sequence owning a zeroed SSM slot. Raises ``OutOfSlots`` when none is free."""
        return self.alloc_sequence_for(0)

    def _zero_slot(self, seq: SequenceState) -> SequenceState:
        """(``alloc_sequence_for`` with SSM layers) the new sequence's slot zeroed, or it is released."""
        assert self._ssm is not None
        try:
            with self._entered, self._clock:
                self._ssm.zero_slot(seq.slot_idx)
                self._device.synchronize()  # the engine's kernels may run on another stream
        except BaseException:
            self._core.release(seq, False)
            raise
        return seq

    def cache_sequence(self, seq: SequenceState) -> None:
        """Insert the sequence's full blocks into the prefix cache under its adapter (an existing node
        keeps its own block), pinned while it lives. A failed or freed sequence is never cached."""
        self._core.handle_of(seq)
        with self._entered, self._clock:
            if seq.is_open:
                if self._demoting:
                    self._parts.tier_record(seq.handle, seq)
                cache_sequence(self._core, self._snapshots, seq, self._block_size)

    def _finish_composed(self, seq: SequenceState) -> None:
        """``finish_sequence`` with SSM snapshots or a host tier."""
        if self._snapshots is not None:
            self._core.handle_of(seq)
            with self._entered, self._clock:
                if seq.is_open:
                    try:
                        if self._demoting:
                            self._parts.tier_record(seq.handle, seq)
                        cache_sequence(self._core, self._snapshots, seq, self._block_size)
                    finally:
                        self._core.release(seq, False, self._on_release)
            return
        if self._torn_down or self._drop_queue:
            self._enter()
        if self._demoting:
            self._tier_record(seq, True)
        self._core.release(seq, True, self._on_release)  # the slot, then the record: one C call

    def free_sequence(self, seq: SequenceState) -> None:
        """Release the slot (unless detached), the adapter reference, the pins and the blocks; once."""
        if self._torn_down or self._drop_queue:
            self._enter()
        if self._demoting:
            self._tier_record(seq, False)  # not cached: no SSM snapshot either
        self._core.release(seq, False, self._on_release)

    def _tier_record(self, seq: SequenceState, cached: bool) -> None:
        with self._lock:
            self._parts.tier_record(seq.handle, seq if cached else None)

    def compact_sequence(self, seq: SequenceState, new_slot: int) -> None:
        """Move the sequence's SSM state into ``new_slot`` (:meth:`lifecycle.compaction.SlotMoves.compact`)."""
        handle = self._core.handle_of(seq)
        with self._entered:
            self._moves.compact(seq, handle, new_slot)

    def detach_slot_for_reuse(self, seq: SequenceState) -> None:
        """Give up the sequence's slot without releasing it: ``slot_idx`` becomes ``DETACHED_SLOT``."""
        self._core.handle_of(seq)
        with self._entered:
            self._moves.detach(seq)

    def kv_block_bytes(self) -> int:
        """Bytes one block index holds across every attention layer, K and V (0 without any)."""
        with self._entered:
            return self._config.kv_block_bytes()

    def teardown(self) -> None:
        """Release every pool, exactly once; what callers still held is released all the same and
        reported in ``teardown_report`` (and logged). Every later call but this one raises ``TornDown``."""
        with self._lock:
            if self._torn_down:
                return
            self._parts.reap(self._on_release)
            report = self._parts.close()
            self._torn_down, self.teardown_report = True, report
            self._parts.release()
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
            return self._config.dims()

    def save_sequence_state(self, seq: SequenceState, writer: BinaryIO) -> None:
        """Write the sequence to ``writer`` as a swap record (:func:`lifecycle.swap.sequences.save_sequence`)."""
        self._core.handle_of(seq)
        with self._entered:
            save_sequence(self._parts.swap, seq, writer, self._counters, self._clock)

    def restore_sequence_state(self, seq: SequenceState, num_blocks: int, reader: BinaryIO) -> None:
        """Restore a fresh sequence from a swap record (:func:`lifecycle.swap.sequences.restore_sequence`)."""
        self._core.handle_of(seq)
        with self._entered:
            restore_sequence(self._parts.swap, self._core, seq, num_blocks, reader, self._counters, self._clock)

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
        """Evict up to ``num_blocks`` unheld cached blocks, least recently used first; returns how many."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidId(f"reclaim_prefix_blocks: num_blocks={num_blocks!r} must be an int >= 0")
        with self._entered:
            try:
                return int(self._core.evict(min(num_blocks, self._pool.num_total)))
            finally:
                self._drained()

    def prefetch_prefix(
        self, prompt: _Ints, adapter_slot: int = NO_ADAPTER, *, cache_salt: bytes | str | int | None = None,
        mm_keys: Sequence[MMKey] | None = None,
    ) -> int:
        """When a request is queued: ask the store for the blocks of its prompt the host tier lacks, so its
        admission promotes what has arrived (:meth:`lifecycle.attach.PrefixAttach.prefetch`)."""
        with self._entered:
            return self._attach.prefetch(prompt, self._parts.lora.root_of(adapter_slot), cache_salt, mm_keys)

    def reclaim_prefix_blocks_for(self, prompt: _Ints, adapter_slot: int, blocks_needed: int) -> PrefixReclaim:
        """Evict until the free blocks cover a prefill of ``prompt`` (see ``PrefixAttach.reclaim_for``)."""
        if isinstance(blocks_needed, bool) or not isinstance(blocks_needed, int) or blocks_needed < 0:
            raise InvalidId(f"reclaim_prefix_blocks_for: blocks_needed={blocks_needed!r} must be an int >= 0")
        with self._entered:
            return self._attach.reclaim_for(prompt, self._parts.lora.root_of(adapter_slot), blocks_needed)

    def retire_sequence(self, seq: SequenceState) -> None:
        """Mark a finished sequence retired: it no longer grows, and may be compacted over (detaching it)."""
        self._core.retire(self._core.handle_of(seq))

    def _attach_composed(
        self, seq: SequenceState, prompt: _Ints, grow_to: int | None, cache_salt: bytes | str | int | None,
        mm_keys: Sequence[MMKey] | None,
    ) -> int:
        """``attach_prefix`` past one core call: keyed (salt, multimodal keys), with tiers, or hybrid."""
        if cache_salt is not None or mm_keys:
            return self._attach.keyed_attach(self.attach_prefix, seq, prompt, grow_to, cache_salt, mm_keys)
        if self._ssm is None:
            with self._entered, self._clock:
                return self._attach.tiered(seq, prompt, grow_to)
        self._core.handle_of(seq)
        with self._entered, self._clock:
            return self._attach.hybrid(seq, prompt, grow_to)

    def grow(self, seq: SequenceState, num_tokens: int) -> int:
        """Grow the block table to cover ``num_tokens`` tokens, all or nothing, evicting cached blocks
        when short; returns the blocks added. A freed or retired sequence raises ``SequenceStateError``."""
        if self._torn_down or self._drop_queue:
            self._enter()
        try:
            return self._core.grow_seq(seq, num_tokens)
        finally:
            if self._demoting:
                self._drained()

    def step(
        self, seqs: Sequence[SequenceState] | _AnyInts, tokens: _AnyInts, *, counts: _AnyInts | None = None,
        table: npt.NDArray[np.int32] | Any | None = None, rows: _AnyInts | None = None, cache: bool | None = None,
        pad: int | None = None,
        group_tables: Sequence[npt.NDArray[np.int32]] | None = None,
    ) -> npt.NDArray[np.int32]:
        """One decode step in one core call with the GIL released: append one token per sequence (or
        ``counts[i]`` of ``tokens``), grow the tables whose last block filled (evicting when short), write
        the new ids into row ``rows[i]`` (default ``i``) of ``table``, cache the blocks that filled
        (``cache``; default: pure attention with the prefix cache on). All or nothing per sequence:
        returns the positions of those that could not grow, unchanged. Argument forms: :mod:`lifecycle.stepping`.
        Several KV cache groups: ``group_tables`` (host tables shaped as ``table``, one per group past 0)
        get each group's new ids; blocks that left a window are released in the same call."""
        handles: Any = seqs if isinstance(seqs, np.ndarray) else handles_of(seqs)
        if cache is None:
            cache = self._cache_by_default
        if self._torn_down or self._drop_queue:
            self._enter()
        if table is not None and not isinstance(table, np.ndarray):
            host = host_table(table, "step")
            if host is None or not host.flags.c_contiguous:
                if group_tables is not None:
                    raise Unsupported("step: group_tables need a C-contiguous host table; write each group's "
                                      "table with write_block_tables(..., group=)")
                return self._stepper.into(handles, tokens, counts, table, host, rows, cache, pad)
            table = host
        try:
            return self._core.step(handles, tokens, counts, table, rows, cache, group_tables)
        except InvalidId as error:
            step_refused(error, handles, tokens, counts, rows, table)
            raise
        finally:
            if self._demoting:
                self._drained()

    def save_snapshot(self, seq: SequenceState, num_tokens: int, *, rolling: bool = False) -> bool:
        """Cache the sequence's first ``num_tokens`` tokens (whole blocks its SSM state consumed exactly)
        with an SSM snapshot there; False, changing nothing, when it cannot (:mod:`lifecycle.snapshots`).
        ``rolling=True`` replaces its previous rolling snapshot (one per block boundary while decoding)."""
        self._core.handle_of(seq)
        with self._entered:
            if self._snapshots is None or not self._core.enabled or not seq.is_open or seq.failed:
                return False
            blocks = snapshot_point(seq, num_tokens, self._block_size)
            with self._clock:
                return self._snapshots.snapshot(self._core, seq, blocks, rolling=rolling)

    def load_adapter(self, name: str) -> int:
        """Load (or reload, as a new generation) a LoRA adapter; returns its slot. With KV events, a
        reload publishes the removal of every block cached under the previous generation."""
        with self._entered:
            slot, retired = self._parts.lora.load(name)
            self._parts.retire(retired)
            return slot

    def unload_adapter(self, name: str) -> None:
        """Unload an adapter; its slot is reused once no sequence references it."""
        with self._entered:
            self._adapters.unload(name)

    def adapter_info(self, adapter_slot: int) -> AdapterInfo:
        with self._entered:
            return self._adapters.info(adapter_slot)

    def bind_adapter(self, seq: SequenceState, adapter_slot: int) -> None:
        """Serve the sequence with the adapter in ``adapter_slot`` (one reference on that slot index,
        released by ``free_sequence`` even after a reload). Bind before ``attach_prefix``."""
        handle = self._core.handle_of(seq)
        with self._entered:
            self._parts.lora.bind(seq, handle, adapter_slot)

    def block_table(self, seq: SequenceState, group: int = 0) -> npt.NDArray[np.int32]:
        """The sequence's block ids in KV cache group ``group`` (int32, a copy; -1 where a windowed
        group holds none)."""
        return self._core.block_table(self._core.handle_of(seq), group)

    def wait_stream(self, stream: object) -> None:
        """Order later device work after the engine\'s work on ``stream``, without blocking (``Device.wait_stream``)."""
        with self._entered:
            self._device.wait_stream(stream)

    def use_stream(self, stream: object) -> AbstractContextManager[None]:
        """Within the block, the library's copies on this thread run on the engine's ``stream``."""
        return self._device.use_stream(stream)

    def record_event(self, event: object) -> None:
        """Record ``event`` (a CUDA event or an object carrying one) after the library's copies so far."""
        with self._entered:
            self._device.record_event(event)

    def wait_event(self, event: object) -> None:
        """Order the library's later copies after ``event`` (recorded by the engine)."""
        with self._entered:
            self._device.wait_event(event)

    def take_events(self, data_parallel_rank: int | None = None) -> KVEventBatch:
        """The KV events since the last call, in vLLM's layout (:mod:`lifecycle.events`)."""
        with self._entered:
            return self._parts.take_events(data_parallel_rank)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (and the tiers') unless a running sequence holds a cached prefix."""
        with self._entered:
            return self._parts.reset()

    def evict_blocks(self, block_ids: _Ints) -> npt.NDArray[np.int32]:
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
            raise InvalidId(f"num_common_prefix_blocks: seqs must be SequenceStates, got {seqs!r}") from None
        return int(self._core.num_common_prefix_blocks(handles))

    def write_block_table(self, seq: SequenceState, out: object, *, pad: int | None = None, group: int = 0) -> int:
        """Write the sequence's block ids (in KV cache group ``group``) into ``out``, a writable 1-D int32
        buffer (padded with ``pad``)."""
        try:
            return int(self._core.write_table(self._core.handle_of(seq), out, pad, group))
        except InvalidId as error:
            raise_if_wrong_type(error, "write_block_table", {}, {"out": out})
            raise

    def write_block_tables(
        self, seqs: Sequence[SequenceState], table: object, *, rows: _Ints | None = None, pad: int | None = None,
        group: int = 0,
    ) -> None:
        """Write each sequence's block ids (in KV cache group ``group``: one engine table per group) into row
        ``rows[i]`` (default ``i``) of ``table``, a 2-D int32 table in host or CUDA memory
        (:mod:`lifecycle.block_tables`); everything is checked first."""
        seqs = list(seqs)
        handle_of = self._core.handle_of
        handles = [handle_of(seq) for seq in seqs]
        with self._entered, self._clock:
            write_block_tables(self._core, self._device, self._memory.tables, seqs, handles, table, rows, pad, group)

    def flush_store(self, timeout_s: float = 10.0) -> bool:
        """Wait until the blocks queued for the shared store are written (False: ``timeout_s`` passed)."""
        with self._entered:
            return self._tiers.flush(timeout_s) if self._tiers is not None else True

    def stats(self, *, reset: bool = False) -> Stats:
        """The counters since the model was built, or with ``reset=True`` since the last such call."""
        with self._entered:
            return self._parts.counters(self._counters, reset)

    def check_invariants(self) -> None:
        """Recount every reference from scratch; ``InvariantViolation`` on any mismatch."""
        with self._entered:
            self._parts.check_invariants()
