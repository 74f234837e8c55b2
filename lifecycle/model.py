"""``HybridModel``: the seventeen ``ModelLifecycle`` methods and their companions for a model of
attention and SSM layers, composed of the layers below it:

- the KV cache core (``lifecycle._kvcache``): every request's tokens, block table, pinned prefix and
  content hashes, the prefix trie and the snapshot ids; one C call per scheduler step;
- the slot pool (``lifecycle._slots``): SSM state slots, each owned through a guard;
- the device pools (:mod:`lifecycle.pools`, :mod:`lifecycle.snapshots`) and the swap format
  (:mod:`lifecycle.swap`), which move bytes;
- the adapter table (:mod:`lifecycle.lora`).

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any, BinaryIO, Final

import numpy as np
import numpy.typing as npt

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore
from lifecycle._slots import SlotPool
from lifecycle.lora import AdapterInfo, AdapterTable, adapter_key
from lifecycle.block_tables import host_table, raise_if_wrong_type, step_cuda_table, write_block_tables
from lifecycle.config import ModelConfig, ModelDims
from lifecycle.device import Device, open_device
from lifecycle.errors import (
    ConfigError,
    InvalidId,
    InvariantViolation,
    LifecycleError,
    OutOfBlocks,
    SequenceStateError,
    SlotInUse,
    SlotOutOfRange,
    TornDown,
    Unsupported,
)
from lifecycle.kv_groups import core_groups, group_stats, refuse_grouped_swap, refuse_grouped_tiers
from lifecycle.memory import ModelMemory
from lifecycle.pools import KVPool, SSMPool
from lifecycle.protocol import LifecycleDefaults, PrefixReclaim
from lifecycle.sequence import NO_ADAPTER, SequenceState
from lifecycle.snapshots import cache_sequence, snapshot_point
from lifecycle.cache_keys import MMKey, identity_tokens, salted_key
from lifecycle.events.translate import KVEventLog
from lifecycle.events.types import KVEventBatch
from lifecycle.stats import ModelCounters, Stats, TeardownReport
from lifecycle.swap import SwapContext, restore as swap_restore, save as swap_save
from lifecycle.tiers.promote import ModelTiers, open_tiers
from lifecycle.tiers.host import HostTier

__all__ = ["HybridModel", "TeardownReport"]

_log = logging.getLogger("lifecycle.model")
_ACTIVE: Final = 1
_RETIRED: Final = 2


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
            groups=core_groups(config),
        )
        # A core of several KV cache groups caches a sequence at its finish, not in the step.
        self._step_caches = self._ssm is None and config.enable_prefix_cache and self._core.num_groups == 1
        self._slots = SlotPool(config.max_seqs)
        self._adapters = AdapterTable(config.num_adapter_slots)
        self._drop_queue: deque[int] = deque()
        self._innerq_hook: Callable[[], None] | None = None
        self._max_blocks_per_seq = config.max_blocks_per_seq_resolved
        self._max_budget_tokens = self._max_blocks_per_seq * self._block_size if self._kv is not None else None
        self._addrs_by_slot = self._memory.addrs_by_slot
        self._swap_ctx = SwapContext(
            config, self._device, self._kv, self._ssm, staging=self._memory.staging, adapters=self._adapters
        )
        # salted cache key -> (the key it was salted from, the salt)
        self._salted: dict[int, tuple[int, bytes | str | int]] = {}
        self._stats_base: Stats | None = None
        self._tiers: ModelTiers | None = None
        self._events = (
            KVEventLog(config.block_size, adapter_of=self._adapter_of, salt_of=self._salt_of) if events else None
        )
        if events or host_tier_blocks or store is not None:
            try:
                refuse_grouped_tiers(config, host_tier_blocks, store)
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

    # ------------------------------------------------------------------ plumbing

    def _enter(self) -> None:
        """Start of a call (under the lock): refuse after teardown, reap dropped sequences."""
        if self._torn_down:
            raise TornDown(f"model {self._config.name!r} was torn down; only teardown() may be called again")
        if self._drop_queue:
            self._reap_dropped()

    @contextmanager
    def _device_work(self) -> Iterator[None]:
        """Count the time of a call that moves device memory into ``time_in_library_ns`` (the
        core counts its own part)."""
        started, core_before = time.perf_counter_ns(), self._core.time_ns()
        try:
            yield
        finally:
            spent = time.perf_counter_ns() - started - (self._core.time_ns() - core_before)
            self._counters.device_ns += max(spent, 0)

    def _handle(self, seq: SequenceState) -> int:
        """The core handle of a sequence of this model."""
        return self._core.handle_of(seq)

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

    def _root_of(self, adapter_slot: int) -> int:
        if isinstance(adapter_slot, bool) or not isinstance(adapter_slot, int):
            raise InvalidId(f"adapter_slot={adapter_slot!r} must be an int (NO_ADAPTER = -1 for none)")
        return 0 if adapter_slot == NO_ADAPTER else self._adapters.uid_of_loaded(adapter_slot)

    def _release_adapter(self, adapter_slot: int) -> None:
        with self._lock:
            self._adapters.release_ref(adapter_slot)

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
                with self._lock, self._device_work():
                    self._enter()
                    self._ssm.zero_slot(seq.slot_idx)
                    self._device.synchronize()  # the engine's kernels may run on another stream
            except BaseException:
                self._core.release(seq, False)
                raise
        return seq

    def cache_sequence(self, seq: SequenceState) -> None:
        """Insert the sequence's full blocks (prompt and generated) into the prefix cache under its
        adapter; where a block's node already exists the node keeps its own block. The path stays
        pinned while the sequence lives. A failed or freed sequence is never cached."""
        self._handle(seq)
        with self._lock, self._device_work():
            self._enter()
            if seq.is_open:
                cache_sequence(self._core, self._snapshots, seq, self._block_size)

    def finish_sequence(self, seq: SequenceState) -> None:
        """``cache_sequence`` then ``free_sequence`` in one step (what a scheduler does when a
        request ends): one core call that caches, unpins and releases. A second call is a no-op
        while the model lives; after ``teardown`` (which released every sequence) it raises
        ``TornDown``, as every call but ``teardown`` does."""
        if self._snapshots is not None:
            self._handle(seq)
            with self._lock, self._device_work():
                self._enter()
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
        """Release the SSM slot first (unless detached), then the adapter reference, the prefix
        pins and one reference on every block. A second call is a no-op while the model lives;
        after ``teardown`` (which released every sequence) it raises ``TornDown``, as every call
        but ``teardown`` does."""
        if self._torn_down or self._drop_queue:
            self._enter()
        self._core.release(seq, False, self._release_adapter)

    def compact_sequence(self, seq: SequenceState, new_slot: int) -> None:
        """Move the sequence's SSM state to ``new_slot`` (one batched copy of every SSM layer,
        waited for before the old slot can be reused), claim ``new_slot``, release the old slot.

        ``new_slot`` may be free, detached, or owned by a *retired* sequence (whose slot is then
        detached in the same step). A slot owned by an active sequence raises ``SlotInUse``."""
        handle = self._handle(seq)
        with self._lock:
            self._enter()
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
                with self._device_work():
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
        """Give up the sequence's slot without releasing it (a survivor owns or will own it): the
        guard is emptied and ``slot_idx`` becomes ``DETACHED_SLOT``. A second call is a no-op."""
        self._handle(seq)
        with self._lock:
            self._enter()
            guard = seq.detach_guard()
            if guard is not None and guard.held:
                guard.take()
                self._counters.detaches += 1

    def kv_block_bytes(self) -> int:
        """Bytes one block index holds across every attention layer, K and V (0 without any)."""
        with self._lock:
            self._enter()
            return self._config.kv_block_bytes()

    # ------------------------------------------------------------------ provided methods

    def teardown(self) -> None:
        """Release every pool (device memory newest first), exactly once. What callers still held
        is released all the same and reported in ``teardown_report`` (and logged). A second call is
        a no-op; any other call afterwards raises ``TornDown``."""
        with self._lock:
            if self._torn_down:
                return
            self._reap_dropped()
            if self._tiers is not None:
                self._tiers.close()
            live, blocks, cached = self._core.close()
            report = TeardownReport(
                live_sequences=live,
                live_blocks=blocks,
                cached_blocks=cached,
                detached_slots=self._slots.num_detached,
                adapter_references=sum(self._adapters.refcounts()),
            )
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
        self._handle(seq)
        with self._lock:
            self._enter()
            if not seq.is_open:
                raise SequenceStateError(f"save_sequence_state: sequence {seq.seq_id} was freed")
            refuse_grouped_swap(self._config, "save_sequence_state")
            try:
                with self._device_work():
                    written = swap_save(self._swap_ctx, seq, writer)
            except BaseException:
                self._counters.swap_failures += 1
                raise
            self._counters.swaps_out += 1
            self._counters.bytes_swapped_out += written

    def restore_sequence_state(self, seq: SequenceState, num_blocks: int, reader: BinaryIO) -> None:
        """Take ``num_blocks`` free blocks for a freshly allocated sequence (all or nothing, before
        reading anything; a restore never evicts cached blocks, so a failure gives back exactly what
        it took) and stream a record written by ``save_sequence_state`` into them and the
        sequence's SSM slot, verifying everything. On any failure the blocks are freed and the
        sequence is unchanged."""
        handle = self._handle(seq)
        with self._lock:
            self._enter()
            refuse_grouped_swap(self._config, "restore_sequence_state")
            self._core.allocate(handle, num_blocks, "restore_sequence_state")
            try:
                with self._device_work():
                    read = swap_restore(self._swap_ctx, seq, num_blocks, reader)
            except BaseException:
                self._core.clear(handle)
                self._counters.swap_failures += 1
                raise
            self._counters.swaps_in += 1
            self._counters.bytes_swapped_in += read

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
        """Evict up to ``num_blocks`` blocks from the prefix cache (least recently used leaves no
        live sequence holds); returns how many blocks became free (0: nothing evictable)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidId(f"reclaim_prefix_blocks: num_blocks={num_blocks!r} must be an int >= 0")
        with self._lock:
            self._enter()
            try:
                return int(self._core.evict(min(num_blocks, self._pool.num_total)))
            finally:
                self._drained()

    def reclaim_prefix_blocks_for(
        self, prompt: Sequence[int] | npt.NDArray[np.integer], adapter_slot: int, blocks_needed: int
    ) -> PrefixReclaim:
        """Evict until the free blocks cover a prefill of ``prompt``: ``blocks_needed`` less the
        cached prefix it will reuse (which is pinned meanwhile, so never evicted). An empty prompt
        reuses nothing."""
        if isinstance(blocks_needed, bool) or not isinstance(blocks_needed, int) or blocks_needed < 0:
            raise InvalidId(f"reclaim_prefix_blocks_for: blocks_needed={blocks_needed!r} must be an int >= 0")
        with self._lock:
            self._enter()
            key = self._root_of(adapter_slot)
            try:
                target, free = self._core.reclaim_for(prompt, key, blocks_needed)
            except InvalidId as error:
                raise_if_wrong_type(error, "reclaim_prefix_blocks_for", {"prompt": prompt})
                raise
            finally:
                self._drained()
            host = self._tiers.host if self._tiers is not None else None
            if host is None or target == 0:
                return PrefixReclaim(target, free)
            # The host tier's leading run past the device match: promoted at attach, not prefilled.
            tokens = np.asarray(prompt, dtype=np.int32)
            limit = min((len(tokens) - 1) // self._block_size, blocks_needed)
            reused = blocks_needed - target
            hashes = self._core.content_hashes(tokens[: limit * self._block_size], key)[reused:]
            found = host.lookup(hashes, tokens[reused * self._block_size : limit * self._block_size])
            return PrefixReclaim(target, free, host_blocks=found)

    # ------------------------------------------------------------------ companions

    def retire_sequence(self, seq: SequenceState) -> None:
        """Mark a finished sequence retired: it no longer grows, and another sequence may be
        compacted into its slot (which detaches it). It can still be cached, saved and freed."""
        self._core.retire(self._handle(seq))

    def attach_prefix(
        self,
        seq: SequenceState,
        prompt: Sequence[int] | npt.NDArray[np.integer],
        *,
        grow_to: int | None = None,
        cache_salt: bytes | str | int | None = None,
        mm_keys: Sequence[MMKey] | None = None,
    ) -> int:
        """Record ``prompt`` as the sequence's tokens, find its longest cached prefix under the
        sequence's adapter (whole blocks, never the prompt's last token; for a hybrid model only up
        to a node with an SSM snapshot, which is restored into the slot), pin it and put its blocks
        at the head of the block table. Returns the reused token count. Calling it again for the
        same sequence and prompt (a retried lookup) takes no second set of references.

        ``grow_to``: then grow the block table to cover that many tokens, as ``grow(seq, grow_to)``
        would, in the same call. It ends as the two calls would: when the growth raises
        ``OutOfBlocks``, the prefix stays attached. A ``grow_to`` that ``grow`` would refuse is
        refused first, before anything is attached or recorded.

        ``cache_salt`` and ``mm_keys`` (multimodal inputs as ``(content_hash, start, end)``) are
        part of the blocks' identity (:mod:`lifecycle.cache_keys`): the same tokens under another
        salt or image never match. With a host tier, the lookup continues past the device match
        into the tiers, and blocks found there are copied into the table and count as reused."""
        if cache_salt is not None or mm_keys:
            keyed, unsalted = self._keyed(seq, prompt, cache_salt, mm_keys)
            try:
                return self.attach_prefix(seq, keyed, grow_to=grow_to)
            except BaseException:
                if unsalted is not None:
                    self._unsalt(seq, unsalted)
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
            return self._attach_tiered(seq, prompt, grow_to)
        self._handle(seq)
        with self._lock, self._device_work():
            self._enter()
            if seq.is_open and seq.is_detached:
                raise SequenceStateError(f"attach_prefix: sequence {seq.seq_id} is detached")
            try:
                reused: int = self._core.attach_seq(seq, prompt, grow_to)
            except OutOfBlocks:  # the growth failed; the prefix is attached: its state is restored all the same
                self._restore_prefix(seq)
                raise
            except InvalidId as error:
                raise_if_wrong_type(error, "attach_prefix", {"prompt": prompt})
                raise
            # (any other error refused the call before anything changed: the slot keeps its state)
            self._restore_prefix(seq)
            return reused

    def _restore_prefix(self, seq: SequenceState) -> None:
        if seq.is_open and self._snapshots is not None:
            self._snapshots.restore_prefix(self._core, seq)

    def _attach_tiered(
        self, seq: SequenceState, prompt: Sequence[int] | npt.NDArray[np.integer], grow_to: int | None
    ) -> int:
        assert self._tiers is not None
        with self._lock, self._device_work():
            self._enter()
            try:
                reused: int = self._core.attach_seq(seq, prompt, grow_to)
            except InvalidId as error:
                raise_if_wrong_type(error, "attach_prefix", {"prompt": prompt})
                raise
            finally:
                self._tiers.drain()  # what it evicted goes down before anything reuses the blocks
            tokens = np.asarray(prompt, dtype=np.int32)
            return reused + self._tiers.promote(seq.handle, tokens, reused // self._block_size) * self._block_size

    def _keyed(
        self,
        seq: SequenceState,
        prompt: Sequence[int] | npt.NDArray[np.integer],
        cache_salt: bytes | str | int | None,
        mm_keys: Sequence[MMKey] | None,
    ) -> tuple[npt.NDArray[np.int32] | Sequence[int] | npt.NDArray[np.integer], int | None]:
        """The prompt as matched (multimodal spans as identity tokens), with the record's cache
        key salted before its first attach (a retried attach must bring the same salt); and the
        key before, when this call salted it (put back if the attach is refused)."""
        handle = self._handle(seq)
        if mm_keys:
            prompt = identity_tokens(prompt, mm_keys)
        if cache_salt is None:
            return prompt, None
        key = self._core.cache_key(handle)
        base = self._salted[key][0] if key in self._salted else key
        salted = salted_key(base, cache_salt)
        if self._core.num_tokens(handle) != 0:
            if salted != key:
                raise SequenceStateError(f"attach_prefix: sequence {seq.seq_id} was attached with another cache salt")
            return prompt, None
        if salted == key:  # salted already by an attach that recorded nothing (an empty prompt)
            return prompt, None
        self._core.set_cache_key(handle, salted)
        self._salted[salted] = (base, cache_salt)
        if len(self._salted) > 65536:  # keys of long-gone salts name no adapter any more
            del self._salted[next(iter(self._salted))]
        return prompt, key

    def _unsalt(self, seq: SequenceState, key: int) -> None:
        """After a refused attach that salted the record's key: the key as it was, unless the
        attach recorded the prompt (a growth that failed after the prefix was attached)."""
        handle = seq.handle
        with suppress(LifecycleError):  # the refusal being raised is what the caller must see
            if self._core.is_live(handle) and self._core.num_tokens(handle) == 0:
                self._core.set_cache_key(handle, key)

    def _adapter_of(self, key: int) -> tuple[int, str] | None:
        """``(lora_id, lora_name)`` of a cache key, for KV events: the adapter's key and name."""
        base = self._salted[key][0] if key in self._salted else key
        named = self._adapters.named(base)
        return None if named is None else (base, named[0])

    def _salt_of(self, key: int) -> bytes | str | int | None:
        """The cache salt of a salted cache key, for KV events (None for another key)."""
        salted = self._salted.get(key)
        return None if salted is None else salted[1]

    def _read_events(self) -> None:
        """The core's pending log into the event log, through the tiers where there are some (what
        it evicted is demoted on the way)."""
        assert self._events is not None
        if self._tiers is not None:
            self._tiers.drain()
        else:
            self._events.read(self._core)

    def _drained(self) -> None:
        """After a core call that may have evicted: demote what it evicted (host tier)."""
        if self._demoting:
            assert self._tiers is not None
            with self._lock:
                self._tiers.drain()

    def grow(self, seq: SequenceState, num_tokens: int) -> int:
        """Grow the block table to cover ``num_tokens`` tokens, all or nothing, evicting cached
        prefix blocks when the free list runs short. Returns the number of blocks added. A freed
        or retired sequence raises ``SequenceStateError``; any sequence after ``teardown``,
        ``TornDown``."""
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
        group_tables: Sequence[npt.NDArray[np.int32]] | None = None,
    ) -> npt.NDArray[np.int32]:
        """One decode step for the running sequences in one core call with the GIL released:
        append one token per sequence (or ``counts[i]`` of the concatenated ``tokens``), grow the
        tables whose last block filled (evicting cached blocks when short), write the new block
        ids into row ``rows[i]`` (default ``i``) of the engine's int32 ``table``, and cache the
        blocks that filled (``cache``; by default on a pure-attention model with the prefix cache
        on). ``seqs`` are the sequences or, cheaper for a scheduler that keeps them, their
        ``handle`` values (an int64 numpy array or CPU tensor, read in place; a list).

        ``tokens``, ``counts`` and ``rows``: ints as numpy arrays, CPU tensors (int32 and
        contiguous ones are read in place, others converted) or lists. ``table``: a numpy array, a
        CPU tensor (DLPack) or anything with the buffer protocol, written in place; on a CUDA model
        also a table in GPU memory (``__cuda_array_interface__``: torch, CuPy), whose rows of the
        batch are then written whole, the columns past a sequence's blocks with ``pad`` (default:
        the null block), in one host-to-device copy from the model's pinned staging, as
        :meth:`write_block_tables` does. An argument of a type it cannot take is refused with
        :class:`~lifecycle.errors.InvalidType` (a ``TypeError``).

        All or nothing per sequence: returns the positions of those that could not grow even
        after eviction, left exactly as they were, for the scheduler to preempt.

        A model of several KV cache groups: ``group_tables`` (host tables shaped as ``table``, one
        per group past 0) get each group's new ids; blocks that left a window are released in the
        same call; ``cache`` defaults to off (the sequence is cached at its finish)."""
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
            cache = self._step_caches
        if self._torn_down or self._drop_queue:
            self._enter()
        if table is not None and not isinstance(table, np.ndarray):
            host = host_table(table, "step")
            if host is None:
                if group_tables is not None:
                    raise Unsupported("step: group_tables with a CUDA table; step into host tables, or write each "
                                      "group's table with write_block_tables(..., group=)")
                return self._step_cuda(handles, tokens, counts, table, rows, cache, pad)
            if not host.flags.c_contiguous:  # rows apart in memory (a slice of rows): stepped in a copy
                scratch = np.ascontiguousarray(host)
                refused = self.step(handles, tokens, counts=counts, table=scratch, rows=rows, cache=cache,
                                    group_tables=group_tables)
                host[...] = scratch
                return refused
            table = host
        try:
            if not self._demoting:
                return self._core.step(handles, tokens, counts, table, rows, cache, group_tables)
            try:
                return self._core.step(handles, tokens, counts, table, rows, cache, group_tables)
            finally:
                self._drained()
        except InvalidId as error:
            optional = {"counts": counts, "rows": rows}
            inputs = {"seqs": handles, "tokens": tokens, **{k: v for k, v in optional.items() if v is not None}}
            raise_if_wrong_type(error, "step", inputs, {"table": table})
            raise

    def _step_cuda(
        self, handles: object, tokens: object, counts: object, table: object, rows: object, cache: bool,
        pad: int | None,
    ) -> npt.NDArray[np.int32]:
        """:meth:`step` into a table in CUDA memory (:func:`lifecycle.block_tables.step_cuda_table`)."""
        try:
            wanted = np.asarray(handles, dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as error:
            raise_if_wrong_type(InvalidId(str(error)), "step", {"seqs": handles})
            raise InvalidId(f"step: handles must be ints, got {handles!r:.60}") from error
        if pad is None and self.null_block >= 0:
            pad = self.null_block
        with self._lock, self._device_work():
            self._enter()
            try:
                return step_cuda_table(
                    self._core, self._device, self._memory.tables, wanted, tokens, counts, table, rows, pad, cache
                )
            except InvalidId as error:
                optional = {"counts": counts, "rows": rows}
                inputs = {"tokens": tokens, **{k: v for k, v in optional.items() if v is not None}}
                raise_if_wrong_type(error, "step", inputs)
                raise
            finally:
                self._drained()

    def save_snapshot(self, seq: SequenceState, num_tokens: int, *, rolling: bool = False) -> bool:
        """Cache the sequence's first ``num_tokens`` tokens (a whole number of blocks, which the
        SSM state in its slot has consumed exactly) with an SSM snapshot at that point, so a later
        hybrid lookup can reuse them. Returns whether it did: False, changing nothing, when
        snapshots (or the prefix cache) are disabled or the sequence can no longer be cached (it
        was freed, or marked failed), as ``cache_sequence`` caches nothing then.

        ``rolling=True`` replaces the sequence's previous rolling snapshot: an engine can take one
        at every block boundary while decoding, so that the state at the last whole block of the
        finished sequence (where the next turn of a chat resumes) is cached, at the cost of one
        snapshot per live sequence and no growth of what the sequence holds."""
        self._handle(seq)
        with self._lock:
            self._enter()
            if self._snapshots is None or not self._core.enabled or not seq.is_open or seq.failed:
                return False
            blocks = snapshot_point(seq, num_tokens, self._block_size)
            with self._device_work():
                return self._snapshots.snapshot(self._core, seq, blocks, rolling=rolling)

    def load_adapter(self, name: str) -> int:
        """Load (or reload, as a new generation) a LoRA adapter; returns its slot. With KV events,
        a new generation of a name loaded before publishes the removal of every block cached under
        the previous generation (no request matches them again; a router names blocks by adapter
        name and tokens, and would count them as the new generation's), and nothing more of it."""
        with self._lock:
            self._enter()
            slot = self._adapters.load(name)
            generation = self._adapters.info(slot).generation
            if generation > 1 and self._events is not None:
                old = adapter_key(name, generation - 1)
                self._read_events()
                self._events.retire({old} | {key for key, (base, _) in self._salted.items() if base == old})
            return slot

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
        handle = self._handle(seq)
        with self._lock:
            self._enter()
            if not seq.is_open or self._core.status(handle) != _ACTIVE:
                raise SequenceStateError(f"bind_adapter: sequence {seq.seq_id} is {seq.status.value}, not active")
            uid = self._adapters.acquire(adapter_slot)
            try:
                self._core.bind_adapter(handle, adapter_slot, uid)
            except BaseException:
                self._adapters.release_ref(adapter_slot)
                raise

    def block_table(self, seq: SequenceState, group: int = 0) -> npt.NDArray[np.int32]:
        """The sequence's block ids in KV cache group ``group`` as an int32 array (a copy, safe to
        hand to a kernel); in a windowed group, -1 where the sequence holds no block."""
        return self._core.block_table(self._handle(seq), group)

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

    def use_stream(self, stream: object) -> AbstractContextManager[None]:
        """Within the block, the library's copies on this thread run on the engine's ``stream``
        (ordered with its kernels, no device-wide sync); see ``Device.use_stream``."""
        return self._device.use_stream(stream)

    def record_event(self, event: object) -> None:
        """Record ``event`` (a CUDA event handle or an object carrying one) after the library's
        copies issued so far, for the engine's stream to wait on."""
        with self._lock:
            self._enter()
            self._device.record_event(event)

    def wait_event(self, event: object) -> None:
        """Order the library's later copies after ``event`` (recorded by the engine)."""
        with self._lock:
            self._enter()
            self._device.wait_event(event)

    # ------------------------------------------------------------------ engine integration

    def take_events(self, data_parallel_rank: int | None = None) -> KVEventBatch:
        """The KV events since the last call (blocks the prefix cache stored and removed, a reset;
        the host tier's blocks), as a batch in vLLM's layout (:mod:`lifecycle.events`). Empty when
        the model was built without ``events=True``."""
        with self._lock:
            self._enter()
            if self._events is None:
                return KVEventBatch(ts=time.time(), events=(), data_parallel_rank=data_parallel_rank)
            self._read_events()
            return self._events.take(data_parallel_rank)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, and the host tier's, if no running sequence holds a cached
        prefix; returns whether it did (False leaves everything as it was), as vLLM's does."""
        with self._lock:
            self._enter()
            done: bool = self._core.reset()
            if done and self._tiers is not None:
                self._tiers.clear()
            return done

    def evict_blocks(self, block_ids: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int32]:
        """Drop the given cached blocks (their KV turned out invalid) and everything cached after
        them from the prefix cache, never demoting them; blocks on a running sequence's path stay.
        Returns the ids that left the cache."""
        with self._lock:
            self._enter()
            try:
                return self._core.evict_blocks(block_ids)
            except InvalidId as error:
                raise_if_wrong_type(error, "evict_blocks", {"block_ids": block_ids})
                raise

    def num_common_prefix_blocks(self, seqs: Sequence[SequenceState]) -> int:
        """How many leading blocks all of ``seqs`` share (cascade attention's common prefix)."""
        try:
            handles = [self._handle(seq) for seq in seqs]
        except TypeError:
            raise InvalidId(
                f"num_common_prefix_blocks: seqs must be a sequence of SequenceStates, got {seqs!r}"
            ) from None
        return int(self._core.num_common_prefix_blocks(handles))

    def write_block_table(self, seq: SequenceState, out: object, *, pad: int | None = None, group: int = 0) -> int:
        """Write the sequence's block ids into ``out``, a writable 1-D int32 buffer the engine
        owns (a numpy row, anything with the buffer protocol, a CPU tensor through DLPack), the
        rest padded with ``pad`` (the null block) if given; returns the ids written. ``group``: its
        table in that KV cache group."""
        try:
            return int(self._core.write_table(self._handle(seq), out, pad, group))
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
        group: int = 0,
    ) -> None:
        """Write each sequence's block ids into row ``rows[i]`` (default ``i``) of ``table``, a 2-D
        int32 block table the engine owns (its table in KV cache group ``group``: one engine table
        per group). Everything is checked before anything is written.

        A host table (a numpy array, anything with the buffer protocol, a CPU tensor through
        DLPack) is written in place; with ``pad``, each row's columns past its blocks get that id.
        A CUDA table (``__cuda_array_interface__``, C-contiguous; a model on a CUDA device) is
        written in whole rows, so ``pad`` is required and ``rows`` must cover one span of rows: the
        span goes in ONE host-to-device copy from the model's pinned staging, on the calling
        thread's copy stream (inside ``use_stream(engine_stream)``, in order with the engine's
        kernels; otherwise ``record_event`` orders them after it). The call does not wait for
        the copy; the next one waits for it before reusing the staging."""
        seqs = list(seqs)
        handles = [self._handle(seq) for seq in seqs]
        with self._lock, self._device_work():
            self._enter()
            write_block_tables(self._core, self._device, self._memory.tables, seqs, handles, table, rows, pad, group)

    def flush_store(self, timeout_s: float = 10.0) -> bool:
        """Wait until the blocks queued for the shared store are written (True; False when
        ``timeout_s`` passed first). Without a store: True."""
        with self._lock:
            self._enter()
            return self._tiers.flush(timeout_s) if self._tiers is not None else True

    def stats(self, *, reset: bool = False) -> Stats:
        """The counters: the core's (requests, blocks, prefix cache, snapshots), the model's own
        (compactions, detaches, swaps) and the tiers'. Since the model was built, or with
        ``reset=True`` since the last such call (what a metrics exporter reads)."""
        with self._lock:
            self._enter()
            tiers = self._tiers.stats() if self._tiers is not None else {}
            total = Stats.of_model(self._core.counters(), self._counters, tiers)
            since = total.minus(self._stats_base) if self._stats_base is not None else total
            if reset:
                self._stats_base = total
            return since

    def group_stats(self) -> list[dict[str, Any]]:
        """Per KV cache group, group 0 first: the core's counts (``kind``, ``window``,
        ``num_blocks``, ``num_free``, ``num_cached``, blocks allocated, freed, released from
        windows, kept at checkpoints, evicted) and the group's ``layers`` and pool ``bytes``."""
        with self._lock:
            self._enter()
            return group_stats(self._core, self._memory.kv_groups)

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
    def kv_pools(self) -> tuple[KVPool, ...]:
        """The paged KV memory of every KV cache group, group 0 (``kv_pool``) first."""
        return self._memory.kv_groups

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
        with self._lock:
            self._enter()
            return int(self._core.num_live_sequences)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Recount every reference from scratch (blocks, pins, chunks and snapshots in the core;
        slots; adapters) and raise ``InvariantViolation`` on any mismatch."""
        with self._lock:
            self._enter()
            self._core.check_invariants()
            self._slots.check_invariants()
            adapter_refs = [0] * self._adapters.num_slots
            for slot in self._core.adapter_slots().tolist():
                adapter_refs[slot] += 1
            if adapter_refs != self._adapters.refcounts():
                raise InvariantViolation(
                    f"adapter refcounts {self._adapters.refcounts()} but sequences hold {adapter_refs}"
                )
            if self._tiers is not None:
                self._tiers.check_invariants()
