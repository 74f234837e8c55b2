"""The scheduler loop: a trace replayed on a model the way a continuous-batching scheduler drives it.

:func:`simulate` replays a trace on a :class:`~lifecycle.model.HybridModel`: admission with
``reclaim_prefix_blocks_for`` then ``alloc_sequence_for``, ``bind_adapter``, ``attach_prefix`` and
``grow``; decode steps one token at a time (with SSM snapshots at block boundaries on hybrid
models); preemption under memory pressure by swap-out to a :class:`~lifecycle.swap.tier.SwapTier`
and swap-in later (recompute when the tier refuses); retirement with compaction; caching and
freeing; invariant checks; teardown. It returns a :class:`~lifecycle.simulate.report.SimulationResult`.
:func:`simulation_model` builds a model on a :class:`~lifecycle.device.timing.CopyTimingDevice`, so
that the result can tell the device copies from the bookkeeping.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final, Literal, cast

import numpy as np
import numpy.typing as npt

from lifecycle.config import ModelConfig
from lifecycle.device import open_device
from lifecycle.device.base import Device
from lifecycle.device.timing import CopyTimingDevice
from lifecycle.errors import ConfigError, LifecycleError, OutOfBlocks, PoolExhausted
from lifecycle.model import HybridModel
from lifecycle.sequence import NO_ADAPTER, SequenceState
from lifecycle.simulate.report import SimulationResult, Summary, TimeSeries
from lifecycle.simulate.traces import Request, _check_count
from lifecycle.swap.tier import SwapHandle, SwapTier

__all__ = ["COPY_CAUSES", "SimulationOptions", "simulate", "simulation_model"]

#: What the scheduler was doing when the device copied (the keys of ``Summary.copy_ns_by_cause``):
#: saving SSM snapshots, compacting a survivor into a retired slot, admitting (a new slot zeroed, a
#: snapshot restored), decoding, finishing (caching, freeing), swapping out or in.
COPY_CAUSES: Final[tuple[str, ...]] = ("snapshots", "compaction", "admission", "decode", "finish", "swap")



def simulation_model(
    config: ModelConfig, device: Device | str = "host", *, host_tier_blocks: int = 0, store: str | None = None
) -> HybridModel:
    """A model for :func:`simulate` on a :class:`CopyTimingDevice` over ``device`` (or over
    ``open_device(device)`` for a kind, which :func:`simulate` then closes after its teardown), so
    that the summary can tell device copies from bookkeeping; with a host tier of
    ``host_tier_blocks`` blocks and a ``store`` URL under it if given."""
    tiers = {"host_tier_blocks": host_tier_blocks, "store": store}
    if not isinstance(device, str):
        return HybridModel(config, CopyTimingDevice(device), **tiers)  # type: ignore[arg-type]
    if device not in ("auto", "host", "cuda"):
        raise ConfigError(f"device={device!r} must be 'auto', 'host' or 'cuda'")
    timed = CopyTimingDevice(open_device(cast(Literal["auto", "host", "cuda"], device)), close_with_simulation=True)
    try:
        return HybridModel(config, timed, **tiers)  # type: ignore[arg-type]
    except BaseException:
        timed.close()
        raise



@dataclass(frozen=True, slots=True)
class SimulationOptions:
    """How the simulated scheduler behaves.

    ``max_live``: most sequences decoding at once. ``check_every``: run ``check_invariants`` every
    that many steps (0: only at the end). ``snapshot_interval_blocks``: on hybrid models, besides the
    snapshot at the end of each prompt's last whole block, take one every that many blocks of the
    sequence (prefill chunk ends, then while decoding; 0: prompt ends only). ``watermark``: fraction
    of the pool admission keeps free for decode growth. ``swap``: preempt by swap-out (False: always
    recompute). ``swap_host_bytes`` and ``spill_dir`` size the swap tier.
    """

    max_live: int = 32
    check_every: int = 100
    snapshot_interval_blocks: int = 16
    watermark: float = 0.01
    swap: bool = True
    swap_host_bytes: int = 256 << 20
    spill_dir: Path | None = None

    def __post_init__(self) -> None:
        _check_count("max_live", self.max_live, 1)
        _check_count("check_every", self.check_every, 0)
        _check_count("snapshot_interval_blocks", self.snapshot_interval_blocks, 0)
        _check_count("swap_host_bytes", self.swap_host_bytes, 0)
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark={self.watermark!r} must lie in [0, 1)")


# ---------------------------------------------------------------------------------------- loop


@dataclass(slots=True, eq=False)
class _Live:
    """A request being served: its sequence and how many response tokens it has generated."""

    request: Request
    seq: SequenceState
    generated: int


@dataclass(slots=True, eq=False)
class _Swapped:
    request: Request
    handle: SwapHandle
    generated: int


class _Simulation:
    """The scheduler loop. One instance per run."""

    def __init__(
        self,
        model: HybridModel,
        trace: Sequence[Request],
        options: SimulationOptions,
        on_request_done: Callable[[int], None] | None,
    ) -> None:
        self.model = model
        self.options = options
        self.on_request_done = on_request_done
        self.block_size = model.config.block_size
        self.hybrid = model.ssm_pool is not None
        # Several KV cache groups: prefill in chunks and append through the core, whose windowed
        # groups release what left their window (their pools hold windows, not whole prompts).
        self.grouped = model.core.num_groups > 1
        self.chunk_blocks = _prefill_chunk_blocks(model.config) if self.grouped else 0
        self.tiered = model.host_tier is not None
        self.total_blocks = model.num_total_blocks()
        self.watermark_blocks = int(options.watermark * self.total_blocks)
        self.max_live = min(options.max_live, model.config.max_seqs)
        self._check_fits(trace)
        adapters = sorted({r.adapter for r in trace if r.adapter})
        self.adapter_slots = {name: model.load_adapter(name) for name in adapters}
        # A chat's next turn becomes ready when the turn before it has finished.
        self.successor: dict[int, Request] = {}
        last_turn: dict[int, Request] = {}
        self.ready: list[tuple[int, Request]] = []
        for request in trace:
            before = last_turn.get(request.chat_id)
            if before is None:
                self.ready.append((request.request_id, request))
            else:
                self.successor[before.request_id] = request
            last_turn[request.chat_id] = request
        heapq.heapify(self.ready)
        self.running: list[_Live] = []
        self.swapped: deque[_Swapped] = deque()
        self.restart: deque[tuple[Request, int]] = deque()  # preempted by recompute
        self.tier: SwapTier | None = None
        self.timer = model.device if isinstance(model.device, CopyTimingDevice) else None
        self.swap_library_ns = 0
        self.series = TimeSeries(total_blocks=self.total_blocks)
        self.held = np.zeros(self.total_blocks, dtype=bool)  # scratch of _live_blocks
        self.step_events = {"swaps_out": 0, "recomputes": 0, "swaps_in": 0}
        self.done = 0
        self.steps = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.preemptions = 0
        self.recomputes = 0
        self.recomputed_tokens = 0
        self.swap_seconds = 0.0
        self.invariant_checks = 0

    def _check_fits(self, trace: Sequence[Request]) -> None:
        """Refuse a trace with a request no scheduling could ever serve (before touching the model)."""
        if not trace:
            return
        longest = max(trace, key=lambda r: r.total_tokens)
        per_seq = self.model.config.dims().max_blocks_per_layer * self.block_size
        usable = (self.total_blocks - self.watermark_blocks) * self.block_size
        limit = min(per_seq, usable)
        if longest.total_tokens > limit:
            raise ConfigError(
                f"request {longest.request_id} reaches {longest.total_tokens} tokens, over the "
                f"{limit} tokens one sequence can hold ({self.total_blocks} blocks of {self.block_size}); "
                "use more blocks or shorter chats"
            )
        adapters = {r.adapter for r in trace if r.adapter}
        if len(adapters) > self.model.config.num_adapter_slots:
            raise ConfigError(
                f"the trace uses {len(adapters)} adapters but the model has "
                f"num_adapter_slots={self.model.config.num_adapter_slots}"
            )

    # ---------------------------------------------------------------- run

    @contextmanager
    def _cause(self, cause: str) -> Iterator[None]:
        """Device copies made inside the block count for ``cause``."""
        timer = self.timer
        if timer is None:
            yield
            return
        previous, timer.cause = timer.cause, cause
        try:
            yield
        finally:
            timer.cause = previous

    @contextmanager
    def _swapping(self) -> Iterator[None]:
        """A swap's library time counts whole as copies (its copies and checksums)."""
        library_before = self.model.stats().time_in_library_ns
        started = time.perf_counter()
        try:
            with self._cause("swap"):
                yield
        finally:
            self.swap_seconds += time.perf_counter() - started
            self.swap_library_ns += self.model.stats().time_in_library_ns - library_before

    def run(self) -> None:
        options = self.options
        if options.swap and not self.grouped:  # a swap record holds one group (save_sequence_state refuses more)
            self.tier = SwapTier(self.model, host_bytes=options.swap_host_bytes, spill_dir=options.spill_dir)
        try:
            while self.ready or self.restart or self.swapped or self.running:
                self.steps += 1
                with self._cause("admission"):
                    self._admit()
                if not self.running:
                    self._stuck()
                with self._cause("decode"):
                    self._decode_step()
                self._sample()
                if self.options.check_every and self.steps % self.options.check_every == 0:
                    self._check()
        finally:
            if self.tier is not None:
                self.tier.close()
        self._check()

    def _stuck(self) -> None:
        waiting = self.swapped[0].request if self.swapped else self.restart[0][0] if self.restart else self.ready[0][1]
        raise OutOfBlocks(
            f"request {waiting.request_id} ({waiting.total_tokens} tokens) cannot be admitted with no "
            f"sequence running: {self.model.num_free_blocks()} of {self.total_blocks} blocks free"
        )

    def _check(self) -> None:
        self.model.check_invariants()
        self.invariant_checks += 1

    def _sample(self) -> None:
        series = self.series
        free = self.model.num_free_blocks()
        live = self._live_blocks()
        series.step.append(self.steps)
        series.used_blocks.append(self.total_blocks - free)
        series.live_blocks.append(live)
        series.cached_blocks.append(self.total_blocks - free - live)
        series.free_blocks.append(free)
        series.running.append(len(self.running))
        series.lookup_tokens.append(self.lookup_tokens)
        series.hit_tokens.append(self.hit_tokens)
        if self.tiered:
            stats = self.model.stats()
            series.tier_hit_tokens.append((stats.host_hit_blocks + stats.store_hit_blocks) * self.block_size)
        events = self.step_events
        series.swaps_out.append(events["swaps_out"])
        series.recomputes.append(events["recomputes"])
        series.swaps_in.append(events["swaps_in"])
        for name in events:
            events[name] = 0

    def _live_blocks(self) -> int:
        """Distinct blocks the running sequences hold (a shared cached prefix counts once)."""
        held = self.held
        held[:] = False
        for live in self.running:
            held[live.seq.block_table] = True
        return int(np.count_nonzero(held))

    # ---------------------------------------------------------------- admission

    def _admit(self) -> None:
        """Fill free batch places: swapped-out sequences first, then recomputes, then new requests,
        each queue in order (a head that does not fit blocks the ones behind it)."""
        prefilled = False
        while len(self.running) < self.max_live:
            if self.swapped:
                if not self._swap_in(self.swapped[0]):
                    break
                self.swapped.popleft()
            elif self.restart:
                request, generated = self.restart[0]
                if not self._prefill(request, generated):
                    break
                self.restart.popleft()
                self.recomputed_tokens += request.prompt.shape[0] + generated
                prefilled = True
            elif self.ready:
                request = self.ready[0][1]
                if not self._prefill(request, 0):
                    break
                heapq.heappop(self.ready)
                self.prompt_tokens += request.prompt.shape[0]
                prefilled = True
            else:
                break
        if prefilled:
            self.model.poll_innerq()

    def _prefill(self, request: Request, generated: int) -> bool:
        """Admit ``request`` (resuming after ``generated`` tokens when recomputing); False when it
        does not fit now, with nothing held."""
        model = self.model
        prompt = request.prompt if not generated else np.concatenate((request.prompt, request.response[:generated]))
        adapter_slot = self.adapter_slots[request.adapter] if request.adapter else NO_ADAPTER
        prompt_len = int(prompt.shape[0])
        blocks = -(-prompt_len // self.block_size)
        # The model takes token arrays as attach_prefix does; its annotation says Sequence[int].
        tokens = cast("Sequence[int]", prompt)
        reclaim = model.reclaim_prefix_blocks_for(tokens, adapter_slot, blocks + self.watermark_blocks)
        if reclaim.free < reclaim.target:
            return False
        seq = model.alloc_sequence_for(request.total_tokens)
        try:
            if adapter_slot != NO_ADAPTER:
                model.bind_adapter(seq, adapter_slot)
            if self.grouped:
                reused = self._prefill_chunked(seq, prompt)
            else:
                reused = model.attach_prefix(seq, prompt)
                model.grow(seq, prompt_len)
        except PoolExhausted:
            model.free_sequence(seq)
            return False
        self.lookup_tokens += prompt_len
        self.hit_tokens += reused
        if self.hybrid:
            self._prefill_snapshots(seq, reused, prompt_len)
        self.running.append(_Live(request, seq, generated))
        return True

    def _prefill_chunked(self, seq: SequenceState, prompt: npt.NDArray[np.int32]) -> int:
        """Prefill ``prompt`` in chunks of ``chunk_blocks`` blocks after its cached prefix: a
        lookup (a core record admitted without growth and closed uncached) finds the cut every
        group serves; the prompt up to it and one chunk is attached, then each chunk grown and
        appended, then an empty append (the last chunk is computed). Returns the reused tokens."""
        model, core, bs = self.model, self.model.core, self.block_size
        step = self.chunk_blocks * bs
        total = int(prompt.shape[0])
        probe = core.admit(prompt, 0, max(total - 1, 0) // bs, core.cache_key(seq.handle))
        cut = core.num_blocks(probe)
        core.finish(probe, False)
        end = min(total, cut * bs + step)
        reused = model.attach_prefix(seq, prompt[:end], grow_to=end)
        while end < total:
            stop = min(total, end + step)
            model.grow(seq, stop)
            seq.append_tokens(prompt[end:stop])
            end = stop
        seq.append_tokens(prompt[:0])
        return reused

    def _prefill_snapshots(self, seq: SequenceState, reused: int, prompt_len: int) -> None:
        """The prefill runs in chunks of ``snapshot_interval_blocks`` blocks (at fixed positions,
        so requests sharing a system prompt share chunk ends) and stops at the prompt's last whole
        block; the SSM state is snapshotted at each stop. Later requests reuse up to the deepest
        stop they share: a shared system prompt, or the whole previous turn of a chat."""
        last = prompt_len - prompt_len % self.block_size
        interval = self.options.snapshot_interval_blocks * self.block_size
        stops = list(range(reused - reused % interval + interval, last, interval)) if interval else []
        stops.append(last)
        with self._cause("snapshots"):
            for stop in stops:
                if stop > reused:
                    seq.ssm_tokens = stop
                    self.model.save_snapshot(seq, stop)
        seq.ssm_tokens = prompt_len

    def _swap_in(self, swapped: _Swapped) -> bool:
        """Bring a swapped-out sequence back (False: not enough free blocks yet). The tier consumes
        the handle even when the restore fails, so room is made first; a failed swap-in falls back
        to recompute."""
        model = self.model
        handle = swapped.handle
        needed = handle.num_blocks + self.watermark_blocks
        while model.num_free_blocks() < needed:
            if model.reclaim_prefix_blocks(needed - model.num_free_blocks()) == 0:
                return False
        assert self.tier is not None
        try:
            with self._swapping():
                seq = self.tier.swap_in(handle)
        except LifecycleError:
            self.restart.append((swapped.request, swapped.generated))
            self.recomputes += 1
            self.step_events["recomputes"] += 1
            return True
        self.step_events["swaps_in"] += 1
        if self.hybrid:
            seq.ssm_tokens = seq.num_tokens - 1
        self.running.append(_Live(swapped.request, seq, swapped.generated))
        return True

    # ---------------------------------------------------------------- decode

    def _decode_step(self) -> None:
        """One token for every running sequence, in admission order; a sequence that needs a block
        when none can be had preempts the most recently admitted one (possibly itself)."""
        running = self.running
        index = 0
        while index < len(running):
            live = running[index]
            if not self._reserve_next_token(live):
                break  # it preempted itself: it was the last one
            seq = live.seq
            token = live.request.response[live.generated : live.generated + 1]
            seq.append_tokens(token)
            live.generated += 1
            self.generated_tokens += 1
            if self.hybrid:
                self._after_decode(seq)
            if live.generated == live.request.max_new_tokens:
                running.pop(index)
                self._finish(live)
            else:
                index += 1

    def _reserve_next_token(self, live: _Live) -> bool:
        seq = live.seq
        if seq.num_tokens < seq.num_blocks * self.block_size:
            return True
        while True:
            try:
                self.model.grow(seq, seq.num_tokens + 1)
                return True
            except OutOfBlocks as error:
                if len(self.running) == 1:  # alone and still short: preempting it would loop for ever
                    raise OutOfBlocks(
                        f"request {live.request.request_id} cannot grow to {seq.num_tokens + 1} tokens with no other "
                        f"sequence running: {error}"
                    ) from error
                victim = self.running[-1]
                self._preempt(victim)
                if victim is live:
                    return False

    def _after_decode(self, seq: SequenceState) -> None:
        # The newest token is sampled, not yet fed through the SSM layers.
        consumed = seq.num_tokens - 1
        seq.ssm_tokens = consumed
        if consumed % self.block_size or consumed <= seq.prompt_len:
            return
        # Every block boundary gets a rolling snapshot (the last one is where the chat's next turn
        # resumes); every interval a snapshot that stays.
        interval = self.options.snapshot_interval_blocks * self.block_size
        with self._cause("snapshots"):
            self.model.save_snapshot(seq, consumed, rolling=not (interval and consumed % interval == 0))

    def _preempt(self, live: _Live) -> None:
        """Take ``live`` off the batch: swap it out, or (tier missing or refusing) cache and free it
        to recompute later."""
        self.running.remove(live)
        self.preemptions += 1
        if self.tier is not None:
            try:
                with self._swapping():
                    handle = self.tier.swap_out(live.seq)
            except LifecycleError:
                pass  # a failed swap-out has released the sequence; recompute it
            else:
                self.swapped.append(_Swapped(live.request, handle, live.generated))
                self.step_events["swaps_out"] += 1
                return
        if not live.seq.is_freed:
            with self._cause("finish"):
                self._cache_and_free(live.seq)
        self.recomputes += 1
        self.step_events["recomputes"] += 1
        self.restart.append((live.request, live.generated))

    # ---------------------------------------------------------------- finish

    def _cache_and_free(self, seq: SequenceState) -> None:
        """Cache the sequence's blocks and free it; with several KV groups in one core call (the
        core caches a grouped sequence when it finishes)."""
        if self.grouped:
            self.model.finish_sequence(seq)
        else:
            self.model.cache_sequence(seq)
            self.model.free_sequence(seq)

    def _finish(self, live: _Live) -> None:
        """Retire, move the last running sequence into the freed slot, cache, free."""
        model = self.model
        seq = live.seq
        with self._cause("compaction"):
            model.retire_sequence(seq)
            survivor = max(self.running, key=lambda other: other.seq.slot_idx, default=None)
            if survivor is not None and survivor.seq.slot_idx > seq.slot_idx:
                model.compact_sequence(survivor.seq, seq.slot_idx)
                # Compaction detached the retired sequence already; the engine's detach step is idempotent.
                model.detach_slot_for_reuse(seq)
        with self._cause("finish"):
            self._cache_and_free(seq)
        self.done += 1
        if self.on_request_done is not None:
            self.on_request_done(self.done)
        successor = self.successor.pop(live.request.request_id, None)
        if successor is not None:
            heapq.heappush(self.ready, (successor.request_id, successor))


def _prefill_chunk_blocks(config: ModelConfig) -> int:
    """Blocks per prefill chunk of a model with several KV groups: half of what the smallest
    windowed pool has left past one sequence's window (at least 1, at most 128)."""
    spare = [
        (group.num_blocks - group.blocks_per_sequence(config.max_model_len, config.block_size)) // 2
        for group in config.kv_groups
        if group.kind != "full"
    ]
    return max(1, min([128, *spare]))


def _fault_in_kv_pool(model: HybridModel) -> None:
    """Write the host KV pool once. An engine's prefills write every block they get; this loop
    runs no kernel, so without it a swap-in would be the first write to its blocks and would be
    billed for the operating system's page faults (milliseconds per page on some machines)."""
    kv = model.kv_pool
    if kv is None or model.device.kind != "host":
        return
    for layer, ptr in enumerate(kv.layer_ptrs):
        model.device.memset(ptr, 0, kv.num_blocks * kv.block_stride_bytes(layer))
    model.device.synchronize()


def _pools(model: HybridModel, options: SimulationOptions) -> dict[str, int]:
    config = model.config
    return {
        "kv_blocks": model.num_total_blocks(),
        "block_size": config.block_size,
        "kv_block_bytes": config.kv_block_bytes(),
        "ssm_slots": config.max_seqs,
        "ssm_slot_bytes": config.ssm_slot_bytes(),
        "snapshots": config.num_snapshots,
        "adapter_slots": config.num_adapter_slots,
        "max_live": min(options.max_live, config.max_seqs),
        "swap_host_bytes": options.swap_host_bytes if options.swap else 0,
        "host_tier_blocks": model.host_tier.capacity_blocks if model.host_tier is not None else 0,
    }


def _split_time(library_ns: int, copy_ns: int | None) -> tuple[int | None, str | None]:
    """(bookkeeping ns, which part dominates) given the copies' share of the library's time."""
    if copy_ns is None:
        return None, None
    bookkeeping = max(library_ns - copy_ns, 0)
    return bookkeeping, "device copies" if copy_ns > bookkeeping else "bookkeeping"


def simulate(
    model: HybridModel,
    trace: Sequence[Request],
    options: SimulationOptions | None = None,
    *,
    seed: int | None = None,
    on_request_done: Callable[[int], None] | None = None,
) -> SimulationResult:
    """Serve every request of ``trace`` on ``model``, then tear the model down (also on error).

    ``seed`` (the trace's, if known) is recorded in the summary. ``on_request_done(n)`` is called
    after each finished request with the count so far. Build the model with
    :func:`simulation_model` for the split of the library's time into device copies and
    bookkeeping. Raises :class:`~lifecycle.errors.ConfigError` before anything runs when a request
    can never fit, and whatever the library raises (``InvariantViolation`` included) otherwise.
    """
    options = options or SimulationOptions()
    started = time.perf_counter()
    pools = _pools(model, options)
    timer = model.device if isinstance(model.device, CopyTimingDevice) else None
    try:
        sim = _Simulation(model, trace, options, on_request_done)
        _fault_in_kv_pool(model)
        sim.run()
        stats = model.stats()
        kv_groups = model.group_stats()
    finally:
        model.teardown()
        if timer is not None and timer.close_with_simulation:
            timer.close()
    wall = time.perf_counter() - started
    report = model.teardown_report
    assert report is not None
    swap_bytes = stats.bytes_swapped_out + stats.bytes_swapped_in
    by_cause: dict[str, int] = {}
    copy_ns: int | None = None
    if timer is not None:
        by_cause = {cause: timer.copy_ns.get(cause, 0) for cause in COPY_CAUSES}
        by_cause["swap"] = sim.swap_library_ns  # the whole swap, checksums included
        copy_ns = sum(by_cause.values())
    bookkeeping_ns, dominant = _split_time(stats.time_in_library_ns, copy_ns)

    def per_request(ns: int | None) -> float | None:
        return None if ns is None else ns / 1e3 / sim.done if sim.done else 0.0

    summary = Summary(
        model=model.config.name,
        device=model.device.name,
        seed=seed,
        pools=pools,
        requests=sim.done,
        prompt_tokens=sim.prompt_tokens,
        generated_tokens=sim.generated_tokens,
        # A grouped model's prefill looks its prompt up twice in the core (the cut, then the
        # attach): the scheduler's own count is the one lookup per prefill.
        prefix_hit_rate=sim.hit_tokens / sim.lookup_tokens if sim.grouped and sim.lookup_tokens else stats.hit_rate,
        prefix_hit_tokens=sim.hit_tokens if sim.grouped else stats.prefix_hit_tokens,
        host_hit_tokens=stats.host_hit_blocks * model.config.block_size,
        store_hit_tokens=stats.store_hit_blocks * model.config.block_size,
        hit_rate_with_tiers=(
            stats.prefix_hit_tokens + stats.blocks_promoted * model.config.block_size
        ) / stats.prefix_lookup_tokens if stats.prefix_lookup_tokens else 0.0,
        evicted_blocks=stats.blocks_evicted,
        preemptions=sim.preemptions,
        swaps_out=stats.swaps_out,
        swaps_in=stats.swaps_in,
        swap_bytes=swap_bytes,
        swap_seconds=sim.swap_seconds,
        swap_gb_per_s=swap_bytes / sim.swap_seconds / 1e9 if sim.swap_seconds else 0.0,
        swap_failures=stats.swap_failures,
        recomputes=sim.recomputes,
        recomputed_tokens=sim.recomputed_tokens,
        compactions=stats.compactions,
        snapshots_saved=stats.snapshots_saved,
        snapshot_hits=stats.snapshot_hits,
        steps=sim.steps,
        invariant_checks=sim.invariant_checks,
        time_in_library_ns=stats.time_in_library_ns,
        library_us_per_request=stats.time_in_library_ns / 1e3 / sim.done if sim.done else 0.0,
        copy_ns=copy_ns,
        copy_ns_by_cause=by_cause,
        bookkeeping_ns=bookkeeping_ns,
        copy_us_per_request=per_request(copy_ns),
        bookkeeping_us_per_request=per_request(bookkeeping_ns),
        dominant=dominant,
        wall_seconds=wall,
        leaked=report.leaked,
        teardown=asdict(report),
        tier_ns=stats.tier_ns,
        tier_copy_ns=stats.tier_copy_ns,
        tier_store_ns=stats.tier_store_ns,
        kv_groups=kv_groups,
    )
    return SimulationResult(summary=summary, series=sim.series, stats=stats, teardown=report)

