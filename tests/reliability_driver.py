"""A seeded random operation driver over the whole ``HybridModel`` API, shared by the reliability
suites (``tests/test_model_stateful.py``, ``tests/test_faults.py``, ``tests/test_threads.py``) and
by the long mode (``bench/reliability.py``).

The driver plays an engine's scheduler, good and bad: it admits requests (alloc, adapter binding,
prefix attach, growth), decodes, caches, snapshots, retires, compacts (into free, retired and
detached slots), detaches, frees or drops sequences without freeing them, reclaims cached blocks,
swaps sequences out and back in, loads and reloads adapters, and throws bad input of every kind at
the model. After every operation it calls ``check_invariants()`` and checks what the model's own
recount cannot see (no slot held twice, a refused call changed nothing); at the end of an episode
it frees everything and requires every block, slot and adapter reference back (a leak is counted,
and the suites require 0).

Every random choice goes through a :class:`Chooser`, so the same operations run from a seeded
``random.Random`` (:class:`RandomChooser`) or from hypothesis draws (the stateful test), which then
shrinks a failure to a short program.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import random
import struct
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Final, Protocol, cast

import numpy as np
import numpy.typing as npt

from lifecycle.config import AttentionLayer, ModelConfig, SSMLayer
from lifecycle.device.base import Device
from lifecycle.device.host import HostDevice
from lifecycle.errors import (
    AdapterError,
    CudaError,
    ForeignSequence,
    InvalidId,
    InvariantViolation,
    LifecycleError,
    OutOfBlocks,
    OutOfSlots,
    PoolExhausted,
    SequenceStateError,
    SlotInUse,
    SlotOutOfRange,
    SwapError,
    SwapFormatError,
    SwapModelMismatch,
    SwapStreamError,
    TornDown,
)
from lifecycle.model import HybridModel
from lifecycle.sequence import DETACHED_SLOT, NO_ADAPTER, SeqStatus, SequenceState
from lifecycle.swap import HEADER_BYTES, parse_header
from lifecycle.swap.tier import SwapHandle, SwapTier

__all__ = [
    "CONFIGS",
    "OPERATIONS",
    "BrokenReader",
    "BrokenWriter",
    "Chooser",
    "Counts",
    "Driver",
    "DriverFailure",
    "RandomChooser",
    "forged_header",
    "run_random",
]

BS: Final = 4
ADAPTER_NAMES: Final = ("alpha", "beta", "gamma", "delta")
#: Shared "system prompts": requests start with one of them, so prefixes are reused and evicted.
SYSTEM_PROMPTS: Final = tuple(
    np.arange(1 + 100 * k, 1 + 100 * k + n, dtype=np.int32) for k, n in enumerate((9, 12, 5, 16))
)


def _hybrid(**overrides: Any) -> ModelConfig:
    fields_: dict[str, Any] = dict(
        layers=(
            AttentionLayer(num_kv_heads=2, head_dim=4),
            SSMLayer(h_state_bytes=64, conv_state_bytes=16),
            AttentionLayer(num_kv_heads=1, head_dim=4, dtype="float32"),
            SSMLayer(h_state_bytes=32, conv_state_bytes=8),
        ),
        block_size=BS,
        num_blocks=40,
        max_seqs=6,
        num_adapter_slots=3,
        num_snapshots=6,
        max_blocks_per_seq=16,
        name="reliability-hybrid",
    )
    fields_.update(overrides)
    return ModelConfig(**fields_)


#: The models the driver exercises: a hybrid with SSM snapshots, pure attention, the prefix cache
#: disabled, and a pure SSM model (no KV pool at all).
CONFIGS: Final[dict[str, ModelConfig]] = {
    "hybrid": _hybrid(),
    "attention": _hybrid(
        layers=(
            AttentionLayer(num_kv_heads=2, head_dim=4),
            AttentionLayer(num_kv_heads=2, head_dim=4, v_aliases_k=True),
        ),
        num_snapshots=0,
        name="reliability-attention",
    ),
    "no-cache": _hybrid(enable_prefix_cache=False, name="reliability-no-cache"),
    "ssm-only": ModelConfig(
        layers=(SSMLayer(h_state_bytes=64, conv_state_bytes=16),),
        block_size=BS,
        num_blocks=0,
        max_seqs=5,
        num_adapter_slots=2,
        name="reliability-ssm",
    ),
}


class DriverFailure(AssertionError):
    """The model broke a property the driver checks (the message says which, and the op)."""


class Chooser(Protocol):
    """Where the driver's random choices come from."""

    def integer(self, lo: int, hi: int) -> int:
        """An int in ``[lo, hi]`` (both included)."""
        ...


class RandomChooser:
    """Choices from a seeded ``random.Random``."""

    __slots__ = ("rng",)

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


@dataclass
class Counts:
    """What a run did. ``leaks`` must stay 0."""

    operations: int = 0
    invariant_checks: int = 0
    bad_inputs: int = 0
    refusals_under_pressure: int = 0
    round_trips: int = 0
    bad_records: int = 0
    faults_injected: int = 0
    faults_survived: int = 0
    episodes: int = 0
    leak_checks: int = 0
    leaks: int = 0
    by_op: Counter[str] = field(default_factory=Counter)
    bad_by_kind: Counter[str] = field(default_factory=Counter)
    faults_by_call: Counter[str] = field(default_factory=Counter)

    def merge(self, other: Counts) -> None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, Counter):
                mine.update(theirs)
            else:
                setattr(self, f.name, mine + theirs)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = dict(sorted(value.items())) if isinstance(value, Counter) else value
        return out


Digest = tuple[object, ...]


def model_digest(model: HybridModel) -> Digest:
    """Every count a refused call must leave alone: block refcounts, slot states, adapter
    references, cached blocks and snapshots. Reaps dropped sequences first (their release is a
    legitimate change that the next call would make anyway)."""
    model.num_live_sequences  # noqa: B018  (reaps the drop queue)
    return (
        model.pool.refcounts().tobytes(),
        model.slots.num_free,
        model.slots.num_guarded,
        model.slots.num_detached,
        tuple(model._adapters.refcounts()),
        model.core.num_cached_blocks,
        model.core.num_snapshots_used,
    )


def seq_digest(seq: SequenceState) -> Digest:
    return (
        seq.status,
        seq.slot_idx,
        seq.ssm_addrs,
        seq.block_table.tobytes(),
        seq.tokens.tobytes(),
        seq.prompt_len,
        seq.adapter_slot,
        seq.failed,
    )


@dataclass
class _Track:
    """What the driver remembers of a live sequence it created."""

    seq: SequenceState
    adapter_name: str | None = None


OPERATIONS: Final[tuple[str, ...]] = (
    "alloc",
    "alloc_for",
    "bind_adapter",
    "attach_prefix",
    "grow",
    "decode",
    "cache",
    "save_snapshot",
    "retire",
    "compact_free",
    "compact_retired",
    "compact_detached",
    "detach",
    "free",
    "drop",
    "reclaim",
    "reclaim_for",
    "round_trip",
    "load_adapter",
    "unload_adapter",
    "mark_failed",
    "bind_thread",
    "bad_input",
)

#: Relative weights of the random driver: admission and decode dominate, as in serving.
WEIGHTS: Final[dict[str, int]] = {
    "alloc": 10,
    "alloc_for": 3,
    "bind_adapter": 3,
    "attach_prefix": 10,
    "grow": 6,
    "decode": 14,
    "cache": 7,
    "save_snapshot": 3,
    "retire": 4,
    "compact_free": 4,
    "compact_retired": 3,
    "compact_detached": 2,
    "detach": 2,
    "free": 10,
    "drop": 3,
    "reclaim": 3,
    "reclaim_for": 3,
    "round_trip": 2,
    "load_adapter": 2,
    "unload_adapter": 1,
    "mark_failed": 1,
    "bind_thread": 1,
    "bad_input": 10,
}


class Driver:
    """Drives one model through random operations (see the module docstring).

    ``expect_faults``: a ``CudaError`` (injected by the caller, e.g. through the emulated driver)
    may surface from any operation that touches the device; the driver then does what an engine
    does (a failed prefill or swap-in frees its sequence), requires the invariants to hold and
    counts the fault as survived. ``on_op`` runs before every operation (fault injection hooks).
    """

    def __init__(
        self,
        config: ModelConfig,
        device: Device,
        chooser: Chooser,
        *,
        expect_faults: bool = False,
        on_op: Callable[[Driver], None] | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.choose = chooser
        self.expect_faults = expect_faults
        self.on_op = on_op
        self.counts = Counts()
        self.model = HybridModel(config, device)
        self.has_kv = config.kv_block_bytes() > 0
        self.has_ssm = bool(config.ssm_layers)
        self.snapshots = self.has_ssm and config.num_snapshots > 0 and config.enable_prefix_cache
        self.max_tokens = config.max_blocks_per_seq_resolved * BS if self.has_kv else 64
        self.seqs: list[_Track] = []
        self.freed: deque[SequenceState] = deque(maxlen=4)
        self._foreign: HybridModel | None = None
        self._foreign_seq: SequenceState | None = None
        self._tier: SwapTier | None = None
        self._last_op = ""

    # ------------------------------------------------------------------ helpers

    def _fail(self, message: str) -> DriverFailure:
        return DriverFailure(f"[{self.config.name}, op #{self.counts.operations} {self._last_op}] {message}")

    def _pick(self, tracks: list[_Track]) -> _Track | None:
        if not tracks:
            return None
        return tracks[self.choose.integer(0, len(tracks) - 1)]

    def _active(self, *, guarded: bool = False, unbound: bool = False) -> list[_Track]:
        out = []
        for t in self.seqs:
            s = t.seq
            if s.status is not SeqStatus.ACTIVE:
                continue
            if guarded and s.is_detached:
                continue
            if unbound and (s.adapter_slot != NO_ADAPTER or s.num_blocks):
                continue
            out.append(t)
        return out

    def _tokens(self, length: int) -> npt.NDArray[np.int32]:
        """A prompt: one of the system prompts, cut or extended by a short random suffix."""
        base = SYSTEM_PROMPTS[self.choose.integer(0, len(SYSTEM_PROMPTS) - 1)]
        if length <= base.shape[0]:
            return base[: max(length, 1)].copy()
        suffix = np.array([self.choose.integer(1000, 1010) for _ in range(length - base.shape[0])], dtype=np.int32)
        return np.concatenate((base, suffix))

    def _remove(self, track: _Track) -> None:
        self.seqs.remove(track)

    def _device_fault(self, exc: CudaError) -> None:
        """An injected device error surfaced: count it; re-raise when none was expected."""
        if not self.expect_faults:
            raise exc
        self.counts.faults_injected += 1
        self.counts.faults_by_call[exc.call.split("(", 1)[0]] += 1

    def check(self) -> None:
        """The model's recount, plus what it cannot see: no slot is held by two sequences, and
        every live sequence's slot addresses are those of its slot."""
        model = self.model
        model.check_invariants()
        self.counts.invariant_checks += 1
        slots: set[int] = set()
        ssm = model.ssm_pool
        for t in self.seqs:
            s = t.seq
            if s.is_freed or s.slot_idx == DETACHED_SLOT:
                continue
            if s.slot_idx in slots:
                raise self._fail(f"slot {s.slot_idx} is held by two live sequences")
            slots.add(s.slot_idx)
            if self.model.slots.owner_of(s.slot_idx) != s.handle:
                raise self._fail(
                    f"sequence {s.seq_id} reports slot {s.slot_idx}, "
                    f"whose guard records owner {self.model.slots.owner_of(s.slot_idx)}"
                )
            if ssm is not None and s.ssm_addrs != tuple(
                (ssm.h_addr(i, s.slot_idx), ssm.conv_addr(i, s.slot_idx)) for i in range(ssm.num_layers)
            ):
                raise self._fail(f"sequence {s.seq_id}: ssm_addrs do not point at slot {s.slot_idx}")

    def _pressure(self, what: str, before: Digest, seq: SequenceState | None = None, seq_before: Digest = ()) -> None:
        """A ``PoolExhausted`` refusal took nothing: slots, adapter references and the sequence are
        as before, and no block gained a reference. (Cached blocks it evicted while trying to make
        room stay evicted: allocation under pressure evicts until enough is free or nothing is
        evictable, SPEC scenario 13.)"""
        after = model_digest(self.model)
        refs_before = np.frombuffer(cast(bytes, before[0]), dtype=np.int32)
        refs_after = np.frombuffer(cast(bytes, after[0]), dtype=np.int32)
        if (
            after[1:5] != before[1:5]
            or bool((refs_after > refs_before).any())
            or after[5] > before[5]  # type: ignore[operator]
            or after[6] > before[6]  # type: ignore[operator]
            or (seq is not None and seq_digest(seq) != seq_before)
        ):
            raise self._fail(f"{what} was refused (pool exhausted) but took something: {before[1:]} -> {after[1:]}")
        self.counts.refusals_under_pressure += 1

    # ------------------------------------------------------------------ the loop

    def step(self, op: str | None = None) -> str:
        """Run one operation (random unless named) and check the invariants; returns its name."""
        if op is None:
            op = self._random_op()
        self._last_op = op
        if self.on_op is not None:
            self.on_op(self)
        getattr(self, "op_" + op)()
        self.counts.operations += 1
        self.counts.by_op[op] += 1
        self.check()
        return op

    def _random_op(self) -> str:
        total = sum(WEIGHTS.values())
        roll = self.choose.integer(1, total)
        for name, weight in WEIGHTS.items():
            roll -= weight
            if roll <= 0:
                return name
        raise AssertionError("unreachable")

    def run(self, num_ops: int) -> Counts:
        for _ in range(num_ops):
            self.step()
        return self.counts

    # ------------------------------------------------------------------ admission

    def op_alloc(self) -> None:
        before = model_digest(self.model)
        try:
            seq = self.model.alloc_sequence()
        except OutOfSlots:
            self._pressure("alloc_sequence", before)
            return
        except CudaError as exc:  # zeroing the slot failed: the slot went back
            self._device_fault(exc)
            if model_digest(self.model) != before:
                raise self._fail("alloc_sequence failed on the device but changed state") from exc
            return
        if self.has_ssm and seq.slot_idx < 0:
            raise self._fail(f"alloc_sequence gave slot {seq.slot_idx}")
        self.seqs.append(_Track(seq))

    def op_alloc_for(self) -> None:
        budget = self.choose.integer(0, self.max_tokens)
        before = model_digest(self.model)
        try:
            seq = self.model.alloc_sequence_for(budget)
        except OutOfSlots:
            self._pressure("alloc_sequence_for", before)
            return
        except CudaError as exc:
            self._device_fault(exc)
            return
        if seq.draft_tokens.shape[0] != budget or seq.budget_tokens != budget:
            raise self._fail(f"alloc_sequence_for({budget}) sized draft state to {seq.draft_tokens.shape[0]}")
        self.seqs.append(_Track(seq))

    def op_bind_adapter(self) -> None:
        track = self._pick(self._active(unbound=True))
        loaded = [n for n in ADAPTER_NAMES if n in self.model._adapters._by_name]
        if track is None or not loaded or track.seq.num_tokens:
            return self.op_load_adapter()
        name = loaded[self.choose.integer(0, len(loaded) - 1)]
        slot = self.model._adapters.slot_of(name)
        refs = self.model.adapter_info(slot).refcount
        self.model.bind_adapter(track.seq, slot)
        track.adapter_name = name
        if self.model.adapter_info(slot).refcount != refs + 1 or track.seq.adapter_slot != slot:
            raise self._fail(f"bind_adapter({slot}) did not take exactly one reference")

    def op_attach_prefix(self) -> None:
        fresh = [t for t in self._active() if not t.seq.num_tokens and not t.seq.num_blocks]
        track = self._pick(fresh)
        if track is None:
            return self.op_alloc()
        seq = track.seq
        if self.has_ssm and seq.is_detached:
            return
        tokens = self._tokens(self.choose.integer(1, min(24, self.max_tokens)))
        # Half the time the growth comes in the same call (attach_prefix(..., grow_to=...)).
        grow_to = (
            min(tokens.shape[0] + self.choose.integer(0, 8), self.max_tokens)
            if self.has_kv and self.choose.integer(0, 1)
            else None
        )
        try:
            reused = self.model.attach_prefix(seq, tokens, grow_to=grow_to)
        except CudaError as exc:  # restoring the snapshot failed: a failed prefill
            self._device_fault(exc)
            seq.mark_failed()
            self._free(track)
            return
        except PoolExhausted:  # only the growth can run short: the prefix stays attached
            if (
                grow_to is None
                or seq.num_blocks * BS != seq.num_cached_tokens
                or not np.array_equal(seq.tokens, tokens)
            ):
                raise self._fail(f"attach_prefix(grow_to={grow_to}) ran short and left {seq!r}") from None
            self.counts.refusals_under_pressure += 1
            return
        blocks = seq.num_blocks if grow_to is None else reused // BS
        if grow_to is not None and seq.num_blocks != max(-(-grow_to // BS), reused // BS):
            raise self._fail(f"attach_prefix(grow_to={grow_to}) left {seq.num_blocks} blocks")
        if reused % BS or reused >= tokens.shape[0] or reused != blocks * BS or reused != seq.num_cached_tokens:
            raise self._fail(f"attach_prefix reused {reused} of {tokens.shape[0]} tokens with {seq.num_blocks} blocks")
        if not np.array_equal(seq.tokens, tokens) or seq.prompt_len != tokens.shape[0]:
            raise self._fail("attach_prefix did not record the prompt")
        if grow_to is None and self.choose.integer(0, 3) == 0:  # a retried lookup takes no second set of references
            refs = self.model.pool.refcounts()
            try:
                again = self.model.attach_prefix(seq, tokens)
            except CudaError as exc:
                self._device_fault(exc)
                seq.mark_failed()
                self._free(track)
                return
            if not np.array_equal(refs, self.model.pool.refcounts()) or again != reused:
                raise self._fail("a retried attach_prefix took references twice")
        self._grow_to(track, seq.num_tokens)

    def _grow_to(self, track: _Track, num_tokens: int) -> bool:
        """Grow ``track``'s table to ``num_tokens`` tokens (True), or see it refused cleanly."""
        seq = track.seq
        if not self.has_kv:
            return True
        num_tokens = min(num_tokens, self.max_tokens)
        before, seq_before = model_digest(self.model), seq_digest(seq)
        try:
            added = self.model.grow(seq, num_tokens)
        except PoolExhausted:
            self._pressure("grow", before, seq, seq_before)
            return False
        if seq.num_blocks < -(-num_tokens // BS) or added < 0:
            raise self._fail(f"grow({num_tokens}) left {seq.num_blocks} blocks")
        return True

    def op_grow(self) -> None:
        track = self._pick(self._active())
        if track is None:
            return self.op_alloc()
        if track.seq.num_tokens == 0:
            return self.op_attach_prefix()
        self._grow_to(track, track.seq.num_tokens + self.choose.integer(0, 8))

    def op_decode(self) -> None:
        """Generate 1-4 tokens: grow to cover them, then record them."""
        track = self._pick([t for t in self._active() if t.seq.num_tokens])
        if track is None:
            return self.op_attach_prefix()
        seq = track.seq
        n = self.choose.integer(1, 4)
        if seq.num_tokens + n > self.max_tokens:
            return self.op_retire()
        if self._grow_to(track, seq.num_tokens + n):
            seq.append_tokens([2000 + self.choose.integer(0, 3) for _ in range(n)])

    # ------------------------------------------------------------------ cache and snapshots

    def op_cache(self) -> None:
        track = self._pick([t for t in self.seqs if t.seq.num_tokens])
        if track is None:
            return self.op_attach_prefix()
        cached = self.model.core.num_cached_blocks
        try:
            self.model.cache_sequence(track.seq)
        except CudaError as exc:  # the snapshot copy failed; the KV insert stands
            self._device_fault(exc)
            return
        if self.model.core.num_cached_blocks < cached:
            raise self._fail("cache_sequence dropped cached blocks")

    def op_save_snapshot(self) -> None:
        candidates = [
            t
            for t in self.seqs
            if t.seq.num_tokens >= BS and not t.seq.is_freed and not t.seq.is_detached and t.seq.num_blocks
        ]
        track = self._pick(candidates)
        if track is None or not self.snapshots:
            return self.op_cache()
        seq = track.seq
        full = min(seq.num_tokens // BS, seq.num_blocks)
        num_tokens = BS * self.choose.integer(1, full)
        try:
            saved = self.model.save_snapshot(seq, num_tokens)
        except CudaError as exc:
            self._device_fault(exc)
            return
        if saved is not (not seq.failed):
            raise self._fail(f"save_snapshot returned {saved} for a {'failed' if seq.failed else 'healthy'} sequence")

    # ------------------------------------------------------------------ retirement, compaction

    def op_retire(self) -> None:
        track = self._pick(self._active())
        if track is None:
            return self.op_alloc()
        self.model.retire_sequence(track.seq)
        if track.seq.status is not SeqStatus.RETIRED:
            raise self._fail("retire_sequence did not retire")

    def _compact(self, track: _Track, target: int) -> bool:
        seq = track.seq
        old = seq.slot_idx
        before, seq_before = model_digest(self.model), seq_digest(seq)
        try:
            self.model.compact_sequence(seq, target)
        except CudaError as exc:  # the copy or its wait failed: nothing moved
            self._device_fault(exc)
            if model_digest(self.model) != before or seq_digest(seq) != seq_before:
                raise self._fail(f"compact_sequence({old} -> {target}) failed on the device but changed state") from exc
            return False
        if seq.slot_idx != target or self.model.slots.is_free(target):
            raise self._fail(f"compact_sequence({old} -> {target}) left the sequence at {seq.slot_idx}")
        if old != target and not self.model.slots.is_free(old):
            raise self._fail(f"compact_sequence({old} -> {target}) did not release slot {old}")
        return True

    def op_compact_free(self) -> None:
        track = self._pick(self._active(guarded=True))
        free = [s for s in range(self.config.max_seqs) if self.model.slots.is_free(s)]
        if track is None or not free:
            return self.op_alloc()
        self._compact(track, free[self.choose.integer(0, len(free) - 1)])

    def op_compact_retired(self) -> None:
        """Scenario 1: a survivor moves into a retired sequence's slot, which detaches it."""
        survivor = self._pick(self._active(guarded=True))
        retired = self._pick([t for t in self.seqs if t.seq.status is SeqStatus.RETIRED and not t.seq.is_detached])
        if survivor is None or retired is None:
            return self.op_retire()
        target = retired.seq.slot_idx
        if self._compact(survivor, target) and not retired.seq.is_detached:
            raise self._fail(f"compacting into retired sequence {retired.seq.seq_id}'s slot did not detach it")

    def op_compact_detached(self) -> None:
        detached = [s for s in range(self.config.max_seqs) if self.model.slots.is_detached(s)]
        track = self._pick(self._active(guarded=True))
        if not detached or track is None:
            return self.op_detach()
        self._compact(track, detached[self.choose.integer(0, len(detached) - 1)])

    def op_detach(self) -> None:
        """Detach a retired sequence (its slot is meant for a survivor); at most half the slots
        are left detached, as an engine compacts a survivor in soon after."""
        track = self._pick([t for t in self.seqs if t.seq.status is SeqStatus.RETIRED and not t.seq.is_detached])
        if track is None or self.model.slots.num_detached >= self.config.max_seqs // 2:
            return self.op_retire()
        slot = track.seq.slot_idx
        self.model.detach_slot_for_reuse(track.seq)
        if not track.seq.is_detached or not self.model.slots.is_detached(slot) or track.seq.ssm_addrs:
            raise self._fail(f"detach_slot_for_reuse left slot {slot} {track.seq!r}")
        self.model.detach_slot_for_reuse(track.seq)  # a second call is a no-op

    # ------------------------------------------------------------------ release

    def _free(self, track: _Track) -> None:
        seq = track.seq
        slot, detached = seq.slot_idx, seq.is_detached
        self.model.free_sequence(seq)
        if not seq.is_freed or seq.num_blocks:
            raise self._fail(f"free_sequence left {seq!r}")
        if not detached and not self.model.slots.is_free(slot):
            raise self._fail(f"free_sequence did not release slot {slot}")
        if detached and self.model.slots.num_detached == 0 and self.has_ssm:
            pass  # the survivor owns it now; nothing to check here
        self.model.free_sequence(seq)  # a second call is a no-op
        self._remove(track)
        self.freed.append(seq)

    def op_free(self) -> None:
        track = self._pick(self.seqs)
        if track is None:
            return self.op_alloc()
        if self.choose.integer(0, 1) and not track.seq.failed:
            try:
                self.model.cache_sequence(track.seq)
            except CudaError as exc:  # the snapshot copy failed; freeing goes on
                self._device_fault(exc)
        self._free(track)

    def op_drop(self) -> None:
        """Lose a sequence without freeing it (an exception path): its guard releases the slot,
        the model reaps the rest at its next call."""
        track = self._pick(self.seqs)
        if track is None:
            return self.op_alloc()
        slot, detached = track.seq.slot_idx, track.seq.is_detached
        self._remove(track)
        del track
        if self.choose.integer(0, 7) == 0:
            gc.collect()
        if not detached and not self.model.slots.is_free(slot):
            raise self._fail(f"a dropped sequence did not release slot {slot}")

    def op_reclaim(self) -> None:
        n = self.choose.integer(0, 8)
        free = self.model.num_free_blocks()
        got = self.model.reclaim_prefix_blocks(n)
        if not 0 <= got <= n or self.model.num_free_blocks() != free + got:
            raise self._fail(
                f"reclaim_prefix_blocks({n}) returned {got}, free {free} -> {self.model.num_free_blocks()}"
            )

    def op_reclaim_for(self) -> None:
        tokens = self._tokens(self.choose.integer(0, 24)) if self.choose.integer(0, 5) else np.empty(0, np.int32)
        loaded = [self.model._adapters._by_name[n] for n in ADAPTER_NAMES if n in self.model._adapters._by_name]
        adapter = (
            NO_ADAPTER if not loaded or self.choose.integer(0, 1) else loaded[self.choose.integer(0, len(loaded) - 1)]
        )
        needed = self.choose.integer(0, self.config.num_blocks_resolved + 2)
        result = self.model.reclaim_prefix_blocks_for(tokens, adapter, needed)
        if result.free != self.model.num_free_blocks() or result.target > needed:
            raise self._fail(f"reclaim_prefix_blocks_for -> {result}, free {self.model.num_free_blocks()}")

    # ------------------------------------------------------------------ swap

    def op_round_trip(self) -> None:
        """Swap a sequence out and back into a new one bound to the same adapter; tokens, prompt
        length and block count come back. Also restores a corrupted copy (refused, nothing
        changed) and, now and then, into too few blocks."""
        candidates = [t for t in self.seqs if not t.seq.is_freed and not (self.has_ssm and t.seq.is_detached)]
        track = self._pick(candidates)
        if track is None:
            return self.op_alloc()
        seq = track.seq
        out = io.BytesIO()
        try:
            self.model.save_sequence_state(seq, out)
        except CudaError as exc:
            self._device_fault(exc)
            return
        record = out.getvalue()
        before = model_digest(self.model)
        try:
            target = self.model.alloc_sequence()
        except OutOfSlots:
            self._pressure("alloc_sequence (swap-in)", before)
            return
        except CudaError as exc:
            self._device_fault(exc)
            return
        new = _Track(target, track.adapter_name)
        self.seqs.append(new)
        if track.adapter_name is not None:
            slot = self.model._adapters._by_name.get(track.adapter_name)
            if slot is None or self.model.adapter_info(slot).uid != self.model.adapter_info(seq.adapter_slot).uid:
                self._free(new)  # reloaded or unloaded meanwhile: the record must be refused
                return self._bad_restore(record, seq.num_blocks, "stale adapter", SwapModelMismatch)
            self.model.bind_adapter(target, slot)
        room = self.model.num_free_blocks() >= seq.num_blocks  # else the refusal would evict to make room
        if room and self.choose.integer(0, 2) == 0:
            corrupt = bytearray(record)
            corrupt[self.choose.integer(0, len(corrupt) - 1)] ^= 1 << self.choose.integer(0, 7)
            self._refused(
                "restore a corrupted record",
                lambda: self.model.restore_sequence_state(target, seq.num_blocks, io.BytesIO(bytes(corrupt))),
                SwapError,
                target,
                kind="corrupted record",
            )
            self.counts.bad_records += 1
        before, seq_before = model_digest(self.model), seq_digest(target)
        try:
            self.model.restore_sequence_state(target, seq.num_blocks, io.BytesIO(record))
        except PoolExhausted:
            self._pressure("restore_sequence_state", before, target, seq_before)
            self._free(new)
            return
        except CudaError as exc:  # a failed swap-in frees the sequence (scenario 15)
            self._device_fault(exc)
            if target.num_blocks or target.num_tokens:
                raise self._fail("a failed restore left blocks or tokens in the sequence") from exc
            self._free(new)
            return
        if not np.array_equal(target.tokens, seq.tokens) or target.prompt_len != seq.prompt_len:
            raise self._fail("restore did not bring back the tokens")
        if target.num_blocks != seq.num_blocks or target.failed != seq.failed:
            raise self._fail(f"restore gave {target.num_blocks} blocks, failed={target.failed}")
        self.counts.round_trips += 1
        if self.choose.integer(0, 1):  # the swapped-out original is freed, as after preemption
            self._free(track)

    def _bad_restore(self, record: bytes, num_blocks: int, kind: str, expected: type[LifecycleError]) -> None:
        if self.model.num_free_blocks() < num_blocks:
            return  # restore allocates (evicting if short) before it reads the record
        try:
            target = self.model.alloc_sequence()
        except OutOfSlots:
            return
        except CudaError as exc:
            self._device_fault(exc)
            return
        track = _Track(target)
        self.seqs.append(track)
        self._refused(
            kind,
            lambda: self.model.restore_sequence_state(target, num_blocks, io.BytesIO(record)),
            expected,
            target,
            kind=kind,
        )
        self._free(track)

    # ------------------------------------------------------------------ adapters

    def op_load_adapter(self) -> None:
        if not self.config.num_adapter_slots:
            return
        name = ADAPTER_NAMES[self.choose.integer(0, len(ADAPTER_NAMES) - 1)]
        table = self.model._adapters
        old = table._by_name.get(name)
        old_refs = self.model.adapter_info(old).refcount if old is not None else 0
        before = model_digest(self.model)
        try:
            slot = self.model.load_adapter(name)
        except OutOfSlots:
            self._pressure(f"load_adapter({name!r})", before)
            return
        info = self.model.adapter_info(slot)
        if info.name != name or not info.loaded:
            raise self._fail(f"load_adapter({name!r}) -> {info}")
        if old is not None and old != slot and self.model.adapter_info(old).refcount != old_refs:
            raise self._fail("reloading an adapter moved the old generation's references")

    def op_unload_adapter(self) -> None:
        loaded = [n for n in ADAPTER_NAMES if n in self.model._adapters._by_name]
        if not loaded:
            return self.op_load_adapter()
        self.model.unload_adapter(loaded[self.choose.integer(0, len(loaded) - 1)])

    def op_mark_failed(self) -> None:
        track = self._pick([t for t in self.seqs if not t.seq.is_freed])
        if track is None:
            return
        track.seq.mark_failed()
        cached = self.model.core.num_cached_blocks
        self.model.cache_sequence(track.seq)
        if self.model.core.num_cached_blocks != cached:
            raise self._fail("a failed sequence was cached")

    def op_bind_thread(self) -> None:
        try:
            self.model.bind_gpu_to_thread()
        except CudaError as exc:
            self._device_fault(exc)

    # ------------------------------------------------------------------ bad input

    def _refused(
        self,
        what: str,
        call: Callable[[], object],
        expected: type[LifecycleError] | tuple[type[LifecycleError], ...],
        seq: SequenceState | None = None,
        *,
        kind: str | None = None,
    ) -> None:
        """``call`` must raise ``expected`` and change nothing."""
        before = model_digest(self.model)
        seq_before = seq_digest(seq) if seq is not None else ()
        try:
            call()
        except expected:
            pass
        except LifecycleError as exc:
            raise self._fail(f"{what}: raised {type(exc).__name__} ({exc}), expected {expected}") from exc
        else:
            raise self._fail(f"{what}: accepted, expected {expected}")
        if model_digest(self.model) != before:
            raise self._fail(f"{what}: refused, but the pools changed")
        if seq is not None and seq_digest(seq) != seq_before:
            raise self._fail(f"{what}: refused, but the sequence changed")
        self.counts.bad_inputs += 1
        self.counts.bad_by_kind[kind or what] += 1

    def _foreign_sequence(self) -> SequenceState:
        if self._foreign is None:
            self._foreign = HybridModel(CONFIGS["attention"], HostDevice())
            self._foreign_seq = self._foreign.alloc_sequence()
        assert self._foreign_seq is not None
        return self._foreign_seq

    def swap_tier(self) -> SwapTier:
        """The driver's swap tier (bad inputs only: every swap-out it is given is refused)."""
        if self._tier is None:
            self._tier = SwapTier(self.model, host_bytes=1 << 20)
        return self._tier

    def op_bad_input(self) -> None:
        kinds = _BAD_INPUTS
        kinds[self.choose.integer(0, len(kinds) - 1)](self)

    # ------------------------------------------------------------------ end of an episode

    def finish(self) -> int:
        """Free everything (some sequences dropped instead), bring detached slots back, evict the
        whole cache, tear down; returns the leaks found (references not back) and adds them to
        ``counts.leaks``. Calls after teardown must raise ``TornDown``."""
        model = self.model
        leaks = 0
        if self._tier is not None:
            leaks += self._tier.num_swapped_out  # every swap-out was a refusal: nothing may be held
            self._tier.close()
            self._tier = None
        for i, track in enumerate(list(self.seqs)):
            if i % 3 == 2:
                self._remove(track)
            else:
                self._free(track)
            del track
        gc.collect()
        self.check()
        for slot in range(self.config.max_seqs):
            if model.slots.is_detached(slot):  # a survivor moves in, then leaves
                survivor = model.alloc_sequence()
                model.compact_sequence(survivor, slot)
                model.free_sequence(survivor)
        while model.reclaim_prefix_blocks(model.num_total_blocks() + 1):
            pass
        self.check()
        leaks += model.num_total_blocks() - model.num_free_blocks()
        leaks += self.config.max_seqs - model.slots.num_free
        leaks += sum(model._adapters.refcounts())
        leaks += model.num_live_sequences
        leaks += model.core.num_cached_blocks
        model.teardown()
        report = model.teardown_report
        assert report is not None
        leaks += report.leaked
        model.teardown()  # a second teardown is a no-op
        for call in (model.alloc_sequence, model.check_invariants, lambda: model.reclaim_prefix_blocks(1)):
            try:
                call()
            except TornDown:
                self.counts.bad_inputs += 1
                self.counts.bad_by_kind["call after teardown"] += 1
            else:
                raise self._fail("a call after teardown was accepted")
        if self._foreign is not None:
            self._foreign_seq = None
            self._foreign.teardown()
        self.counts.leak_checks += 1
        self.counts.episodes += 1
        self.counts.leaks += leaks
        return leaks


# ---------------------------------------------------------------------------- bad inputs


def _bad_foreign(d: Driver) -> None:
    other = d._foreign_sequence()
    m = d.model
    calls: list[tuple[str, Callable[[], object]]] = [
        ("free", lambda: m.free_sequence(other)),
        ("grow", lambda: m.grow(other, 4)),
        ("cache", lambda: m.cache_sequence(other)),
        ("compact", lambda: m.compact_sequence(other, 0)),
        ("attach", lambda: m.attach_prefix(other, [1, 2, 3])),
        ("bind", lambda: m.bind_adapter(other, 0)),
        ("save", lambda: m.save_sequence_state(other, io.BytesIO())),
        ("detach", lambda: m.detach_slot_for_reuse(other)),
        ("retire", lambda: m.retire_sequence(other)),
        ("table", lambda: m.block_table(other)),
        ("not a sequence", lambda: m.free_sequence("seq-1")),  # type: ignore[arg-type]
    ]
    name, call = calls[d.choose.integer(0, len(calls) - 1)]
    d._refused(f"{name} of a foreign sequence", call, ForeignSequence, other, kind="foreign sequence")


def _bad_freed(d: Driver) -> None:
    if not d.freed:
        return _bad_grow(d)
    seq = d.freed[d.choose.integer(0, len(d.freed) - 1)]
    m = d.model
    calls: list[tuple[str, Callable[[], object]]] = [
        ("grow", lambda: m.grow(seq, 8)),
        ("attach", lambda: m.attach_prefix(seq, [1, 2, 3])),
        ("compact", lambda: m.compact_sequence(seq, 0)),
        ("bind", lambda: m.bind_adapter(seq, 0)),
        ("retire", lambda: m.retire_sequence(seq)),
        ("save", lambda: m.save_sequence_state(seq, io.BytesIO())),
        ("restore", lambda: m.restore_sequence_state(seq, 0, io.BytesIO())),
        ("append", lambda: seq.append_tokens([1])),
    ]
    name, call = calls[d.choose.integer(0, len(calls) - 1)]
    d._refused(f"{name} of a freed sequence", call, SequenceStateError, seq, kind="freed sequence")


def _bad_grow(d: Driver) -> None:
    track = d._pick(d._active())
    if track is None:
        return _bad_budget(d)
    seq = track.seq
    limit = d.config.max_blocks_per_seq_resolved * BS
    value: object = (-1, -(2**40), limit + 1, 2**63, 3.5, "8", None)[d.choose.integer(0, 6)]
    d._refused(f"grow({value!r})", lambda: d.model.grow(seq, value), InvalidId, seq, kind="grow: bad token count")  # type: ignore[arg-type]


def _bad_compact_slot(d: Driver) -> None:
    track = d._pick(d._active(guarded=True))
    if track is None:
        return _bad_budget(d)
    seq = track.seq
    value: object = (-1, d.config.max_seqs, 2**31, -(2**40), 1.0, "0", None)[d.choose.integer(0, 6)]
    d._refused(
        f"compact_sequence(slot={value!r})",
        lambda: d.model.compact_sequence(seq, value),  # type: ignore[arg-type]
        SlotOutOfRange,
        seq,
        kind="compact: slot out of range",
    )


def _bad_compact_active(d: Driver) -> None:
    """Scenario: compacting into a slot an active sequence owns is refused, nothing changed."""
    guarded = d._active(guarded=True)
    if len(guarded) < 2:
        return _bad_compact_slot(d)
    a = guarded[d.choose.integer(0, len(guarded) - 1)]
    b = d._pick([t for t in guarded if t is not a])
    assert b is not None
    d._refused(
        "compact into an active sequence's slot",
        lambda: d.model.compact_sequence(a.seq, b.seq.slot_idx),
        SlotInUse,
        a.seq,
        kind="compact: active owner",
    )


def _bad_compact_detached(d: Driver) -> None:
    track = d._pick([t for t in d.seqs if t.seq.is_detached and not t.seq.is_freed])
    if track is None:
        return _bad_compact_active(d)
    d._refused(
        "compact a detached sequence",
        lambda: d.model.compact_sequence(track.seq, 0),
        SequenceStateError,
        track.seq,
        kind="compact: detached sequence",
    )


def _bad_tokens(d: Driver) -> None:
    fresh = [t for t in d._active() if not t.seq.num_tokens and not t.seq.num_blocks]
    track = d._pick(fresh)
    if track is None:
        return _bad_grow(d)
    bad: object = (
        [1, -2, 3],
        [1, 2**31],
        np.ones((2, 3), dtype=np.int32),
        [[1, 2]],
        np.array([-1], dtype=np.int64),
        [3, 2**70],
    )[d.choose.integer(0, 5)]
    d._refused(
        f"attach_prefix({bad!r})",
        lambda: d.model.attach_prefix(track.seq, bad),  # type: ignore[arg-type]
        InvalidId,
        track.seq,
        kind="attach: bad tokens",
    )


def _bad_attach_state(d: Driver) -> None:
    """attach_prefix after growth, or with tokens other than the ones the sequence holds."""
    track = d._pick([t for t in d._active() if t.seq.num_tokens and t.seq.num_blocks > 0])
    if track is None:
        return _bad_tokens(d)
    seq = track.seq
    other = np.concatenate((seq.tokens, np.array([7], np.int32)))
    d._refused(
        "attach_prefix after growth",
        lambda: d.model.attach_prefix(seq, other),
        SequenceStateError,
        seq,
        kind="attach: wrong state",
    )


def _bad_adapter(d: Driver) -> None:
    m = d.model
    track = d._pick(d._active(unbound=True))
    if track is None:
        return _bad_adapter_table(d)
    n = d.config.num_adapter_slots
    unloaded = [s for s in range(n) if not m.adapter_info(s).loaded]
    choices: list[tuple[int, type[LifecycleError]]] = [
        (-5, SlotOutOfRange),
        (n, SlotOutOfRange),
        (2**40, SlotOutOfRange),
    ]
    choices += [(s, AdapterError) for s in unloaded]
    slot, expected = choices[d.choose.integer(0, len(choices) - 1)]
    d._refused(
        f"bind_adapter({slot})",
        lambda: m.bind_adapter(track.seq, slot),
        expected,
        track.seq,
        kind="bind: bad adapter slot",
    )


def _bad_bind_state(d: Driver) -> None:
    m = d.model
    loaded = [m._adapters._by_name[x] for x in ADAPTER_NAMES if x in m._adapters._by_name]
    track = d._pick([t for t in d._active() if t.seq.adapter_slot != NO_ADAPTER or t.seq.num_blocks])
    if track is None or not loaded:
        return _bad_adapter(d)
    slot = loaded[0]
    d._refused(
        "bind_adapter on a bound or grown sequence",
        lambda: m.bind_adapter(track.seq, slot),
        SequenceStateError,
        track.seq,
        kind="bind: wrong state",
    )


def _bad_adapter_table(d: Driver) -> None:
    m = d.model
    n = d.config.num_adapter_slots
    calls: list[tuple[str, Callable[[], object], type[LifecycleError]]] = [
        ("load_adapter('')", lambda: m.load_adapter(""), AdapterError),
        ("unload_adapter('nobody')", lambda: m.unload_adapter("nobody"), AdapterError),
        (f"adapter_info({n})", lambda: m.adapter_info(n), SlotOutOfRange),
        ("adapter_info(-1)", lambda: m.adapter_info(-1), SlotOutOfRange),
    ]
    what, call, expected = calls[d.choose.integer(0, len(calls) - 1)]
    d._refused(what, call, expected, kind="adapter table")


def _bad_budget(d: Driver) -> None:
    limit = d.config.max_blocks_per_seq_resolved * BS
    values: list[object] = [-1, 1.5, "10", None]
    if d.has_kv:
        values.append(limit + 1)
    value = values[d.choose.integer(0, len(values) - 1)]
    d._refused(
        f"alloc_sequence_for({value!r})",
        lambda: d.model.alloc_sequence_for(value),  # type: ignore[arg-type]
        InvalidId,
        kind="alloc: bad budget",
    )


def _bad_reclaim(d: Driver) -> None:
    m = d.model
    n = d.config.num_adapter_slots
    calls: list[tuple[str, Callable[[], object], type[LifecycleError]]] = [
        ("reclaim_prefix_blocks(-1)", lambda: m.reclaim_prefix_blocks(-1), InvalidId),
        ("reclaim_prefix_blocks('3')", lambda: m.reclaim_prefix_blocks("3"), InvalidId),  # type: ignore[arg-type]
        (
            "reclaim_prefix_blocks_for(needed=-1)",
            lambda: m.reclaim_prefix_blocks_for([1, 2], NO_ADAPTER, -1),
            InvalidId,
        ),
        (
            "reclaim_prefix_blocks_for(bad tokens)",
            lambda: m.reclaim_prefix_blocks_for([1, -2], NO_ADAPTER, 1),
            InvalidId,
        ),
        (f"reclaim_prefix_blocks_for(adapter={n})", lambda: m.reclaim_prefix_blocks_for([1, 2], n, 1), SlotOutOfRange),
    ]
    unloaded = [s for s in range(n) if not m.adapter_info(s).loaded]
    if unloaded:
        calls.append(
            (
                "reclaim_prefix_blocks_for(unloaded adapter)",
                lambda: m.reclaim_prefix_blocks_for([1, 2], unloaded[0], 1),
                AdapterError,
            )
        )
    what, call, expected = calls[d.choose.integer(0, len(calls) - 1)]
    d._refused(what, call, expected, kind="reclaim: bad argument")


def _bad_snapshot(d: Driver) -> None:
    track = d._pick([t for t in d.seqs if not t.seq.is_freed and t.seq.num_tokens and not t.seq.failed])
    if track is None or not d.snapshots:
        return _bad_reclaim(d)
    seq = track.seq
    value = (0, -BS, BS + 1, (seq.num_tokens // BS + 1) * BS)[d.choose.integer(0, 3)]
    d._refused(
        f"save_snapshot({value})",
        lambda: d.model.save_snapshot(seq, value),
        InvalidId,
        seq,
        kind="snapshot: bad token count",
    )


def _bad_restore_state(d: Driver) -> None:
    """restore into a sequence that already holds tokens, with a negative count, or a record
    that is not one."""
    m = d.model
    busy = d._pick([t for t in d._active() if t.seq.num_tokens and not (d.has_ssm and t.seq.is_detached)])
    fresh = d._pick([t for t in d._active(guarded=True) if not t.seq.num_tokens and not t.seq.num_blocks])
    if busy is not None and d.choose.integer(0, 1):
        seq = busy.seq
        d._refused(
            "restore into a busy sequence",
            lambda: m.restore_sequence_state(seq, 0, io.BytesIO(b"")),
            SequenceStateError,
            seq,
            kind="restore: busy sequence",
        )
    elif fresh is not None:
        seq = fresh.seq
        junk = bytes(d.choose.integer(0, 255) for _ in range(d.choose.integer(0, 200)))
        calls: list[tuple[str, Callable[[], object], type[LifecycleError]]] = [
            ("restore(num_blocks=-1)", lambda: m.restore_sequence_state(seq, -1, io.BytesIO(b"")), InvalidId),
            ("restore(junk)", lambda: m.restore_sequence_state(seq, 0, io.BytesIO(junk)), SwapError),
        ]
        what, call, expected = calls[d.choose.integer(0, 1)]
        d._refused(what, call, expected, seq, kind="restore: bad argument")
    else:
        _bad_foreign(d)


def _bad_retire(d: Driver) -> None:
    track = d._pick([t for t in d.seqs if t.seq.status is SeqStatus.RETIRED])
    if track is None:
        return _bad_append(d)
    seq = track.seq
    calls: list[tuple[str, Callable[[], object]]] = [
        ("retire twice", lambda: d.model.retire_sequence(seq)),
        ("grow a retired sequence", lambda: d.model.grow(seq, seq.num_tokens + 8)),
    ]
    what, call = calls[d.choose.integer(0, 1)]
    d._refused(what, call, SequenceStateError, seq, kind="retired sequence")


def _bad_append(d: Driver) -> None:
    track = d._pick([t for t in d.seqs if not t.seq.is_freed])
    if track is None:
        return _bad_budget(d)
    bad: object = ([-1], [2**31], np.ones((2, 2), dtype=np.int64), np.array([2**40]), [2**70])[d.choose.integer(0, 4)]
    d._refused(
        f"append_tokens({bad!r})",
        lambda: track.seq.append_tokens(bad),  # type: ignore[arg-type]
        InvalidId,
        track.seq,
        kind="append: bad tokens",
    )


def _saveable(d: Driver) -> list[_Track]:
    return [t for t in d._active() if not (d.has_ssm and t.seq.is_detached)]


def _restore_pair(d: Driver) -> tuple[_Track | None, _Track | None]:
    """(a fresh sequence to restore into, another whose record it can take: both without an
    adapter, so the record's adapter matches)."""
    fresh = d._pick(
        [
            t
            for t in d._active(guarded=True)
            if not t.seq.num_tokens and not t.seq.num_blocks and t.seq.adapter_slot == NO_ADAPTER
        ]
    )
    source = d._pick([t for t in _saveable(d) if t is not fresh and t.seq.adapter_slot == NO_ADAPTER])
    return fresh, source


def _bad_swap_out(d: Driver) -> None:
    """A sequence whose record could not be restored (``prompt_len`` out of range) is refused by
    the swap tier, before anything: it stays live and nothing is reserved."""
    track = d._pick([t for t in _saveable(d) if t.seq.num_tokens])
    if track is None:
        return _bad_pool_count(d)
    seq, good = track.seq, track.seq.prompt_len
    bad: object = (seq.num_tokens + 1, -1, 2**64, "3", 2.5)[d.choose.integer(0, 4)]
    kind = "swap_out: unrestorable record"
    try:
        seq.prompt_len = bad  # type: ignore[assignment]
    except LifecycleError:  # refused on assignment (the core rewrite's setters): no record can hold it
        if seq.prompt_len != good:
            raise d._fail(f"prompt_len={bad!r} was refused, but prompt_len changed") from None
        d.counts.bad_inputs += 1
        d.counts.bad_by_kind[kind] += 1
        return
    try:
        d._refused(
            f"swap_out with prompt_len={bad!r}", lambda: d.swap_tier().swap_out(seq), SequenceStateError, seq, kind=kind
        )
    finally:
        seq.prompt_len = good


def _bad_handle(d: Driver) -> None:
    """Handles another tier issued, handles built by hand, things that are no handle."""
    tier = d.swap_tier()
    forged = SwapHandle(
        tier_id=0,
        handle_id=1,
        nbytes=HEADER_BYTES,
        num_blocks=0,
        num_tokens=0,
        budget_tokens=0,
        adapter=None,
        location="host",
        path=None,
    )
    handles: list[object] = [forged, dataclasses.replace(forged, tier_id=tier._tier_id), None, "handle-1"]
    handle = handles[d.choose.integer(0, len(handles) - 1)]
    call = tier.swap_in if d.choose.integer(0, 1) else tier.discard
    d._refused(
        f"{call.__name__}({handle!r})",
        lambda: call(handle),  # type: ignore[arg-type]
        SwapError,
        kind="swap: foreign or forged handle",
    )


class BrokenReader:
    """Reads ``data`` correctly, except that call ``bad_call`` of ``readinto`` answers
    ``answer(asked)``; refuses to be called forever (a loop on a broken answer fails, not hangs)."""

    CALL_BUDGET: Final = 10_000

    def __init__(self, data: bytes, bad_call: int, answer: Callable[[int], object]) -> None:
        self._inner = io.BytesIO(data)
        self._bad_call = bad_call
        self._answer = answer
        self.calls = 0

    def readinto(self, buffer: memoryview) -> object:
        self.calls += 1
        assert self.calls < self.CALL_BUDGET, "restore keeps calling a broken reader"
        if self.calls == self._bad_call:
            return self._answer(buffer.nbytes)
        return self._inner.readinto(buffer)


class BrokenWriter:
    """Takes every byte, except that call ``bad_call`` of ``write`` answers ``answer(offered)``."""

    CALL_BUDGET: Final = 10_000

    def __init__(self, bad_call: int, answer: Callable[[int], object]) -> None:
        self._inner = io.BytesIO()
        self._bad_call = bad_call
        self._answer = answer
        self.calls = 0

    def write(self, data: memoryview) -> object:
        self.calls += 1
        assert self.calls < self.CALL_BUDGET, "save keeps calling a broken writer"
        if self.calls == self._bad_call:
            return self._answer(memoryview(data).nbytes)
        return self._inner.write(data)


#: Broken answers of a stream asked for ``n`` bytes.
_BROKEN_ANSWERS: Final[tuple[Callable[[int], object], ...]] = (
    lambda n: -1,
    lambda n: n + 1,
    lambda n: 2**64,
    lambda n: 1.5,
    lambda n: "1",
    lambda n: True,
)


def _bad_stream(d: Driver) -> None:
    """Readers and writers answering nonsense (negative, more than asked, not an int): refused at
    once with ``SwapStreamError``, the restore undone."""
    fresh, source = _restore_pair(d)
    if d.expect_faults or source is None:  # the device copies of a save could meet an injected fault
        return _bad_pool_count(d)
    answer = _BROKEN_ANSWERS[d.choose.integer(0, len(_BROKEN_ANSWERS) - 1)]
    bad_call = d.choose.integer(1, 4)
    if fresh is None or d.choose.integer(0, 1):
        d._refused(
            "save to a broken writer",
            lambda: d.model.save_sequence_state(source.seq, cast(io.BytesIO, BrokenWriter(bad_call, answer))),
            SwapStreamError,
            source.seq,
            kind="swap: broken stream",
        )
        return
    out = io.BytesIO()
    d.model.save_sequence_state(source.seq, out)
    if d.model.num_free_blocks() < source.seq.num_blocks:
        return  # today's restore evicts to make room before it reads past the header
    reader = cast(io.BytesIO, BrokenReader(out.getvalue(), bad_call, answer))
    d._refused(
        "restore from a broken reader",
        lambda: d.model.restore_sequence_state(fresh.seq, source.seq.num_blocks, reader),
        SwapStreamError,
        fresh.seq,
        kind="swap: broken stream",
    )


def forged_header(record: bytes, num_tokens: int) -> bytes:
    """``record``'s header announcing ``num_tokens`` tokens, every size consistent with it and the
    header checksum recomputed: only the model's limits can refuse it."""
    header = parse_header(record[:HEADER_BYTES])
    growth = 4 * (num_tokens - header.num_tokens)
    return dataclasses.replace(
        header, num_tokens=num_tokens, meta_bytes=header.meta_bytes + growth, record_bytes=header.record_bytes + growth
    ).pack()


def _bad_forged_size(d: Driver) -> None:
    """A record announcing more tokens than the model's per-sequence limit is refused before a
    byte past its header is read."""
    fresh, source = _restore_pair(d)
    if d.expect_faults or fresh is None or source is None or not d.has_kv:
        return _bad_pool_count(d)
    out = io.BytesIO()
    d.model.save_sequence_state(source.seq, out)
    limit = d.config.max_blocks_per_seq_resolved * BS
    num_tokens = (limit + 1, 2**31 - 1, 2**32)[d.choose.integer(0, 2)]
    reader = io.BytesIO(forged_header(out.getvalue(), num_tokens) + b"\0" * 64)
    d._refused(
        f"restore a record announcing {num_tokens} tokens",
        lambda: d.model.restore_sequence_state(fresh.seq, source.seq.num_blocks, reader),
        SwapFormatError,
        fresh.seq,
        kind="swap: forged size",
    )
    if reader.tell() != HEADER_BYTES:
        raise d._fail(f"a forged size was refused after reading {reader.tell()} bytes, not just the header")


def _bad_pool_count(d: Driver) -> None:
    """Counts, starts and ids no C index holds, and batches holding None, at the block pool."""
    pool = d.model.pool
    table = np.zeros(4, np.int32)
    calls: list[tuple[str, Callable[[], object], type[LifecycleError]]] = [
        ("allocate(2**64)", lambda: pool.allocate(2**64), InvalidId),
        ("allocate(1.5)", lambda: pool.allocate(1.5), InvalidId),  # type: ignore[arg-type]
        ("allocate(more than the pool)", lambda: pool.allocate(pool.num_total + 1), OutOfBlocks),
        ("allocate_into(start=2**63)", lambda: pool.allocate_into(table, 2**63, 1), InvalidId),
        ("dec_ref_range(n=-2**70)", lambda: pool.dec_ref_range(table, 0, -(2**70)), InvalidId),
        ("refcount(2**70)", lambda: pool.refcount(2**70), InvalidId),
        ("dec_ref([0, None])", lambda: pool.dec_ref(np.array([0, None], dtype=object)), InvalidId),
    ]
    what, call, expected = calls[d.choose.integer(0, len(calls) - 1)]
    d._refused(what, call, expected, kind="pool: count or id of the wrong kind")


_BAD_INPUTS: Final[tuple[Callable[[Driver], None], ...]] = (
    _bad_foreign,
    _bad_freed,
    _bad_grow,
    _bad_compact_slot,
    _bad_compact_active,
    _bad_compact_detached,
    _bad_tokens,
    _bad_attach_state,
    _bad_adapter,
    _bad_bind_state,
    _bad_adapter_table,
    _bad_budget,
    _bad_reclaim,
    _bad_snapshot,
    _bad_restore_state,
    _bad_retire,
    _bad_append,
    _bad_swap_out,
    _bad_handle,
    _bad_stream,
    _bad_forged_size,
    _bad_pool_count,
)


def episodes(total_ops: int, ops_per_episode: int) -> Iterator[int]:
    """Split ``total_ops`` into episode lengths."""
    while total_ops > 0:
        n = min(ops_per_episode, total_ops)
        yield n
        total_ops -= n


def run_random(
    total_ops: int,
    *,
    seed: int = 0,
    ops_per_episode: int = 2000,
    configs: tuple[str, ...] = tuple(CONFIGS),
    device_factory: Callable[[], Device] = HostDevice,
    progress: Callable[[Counts], None] | None = None,
) -> Counts:
    """Run ``total_ops`` random operations in episodes of ``ops_per_episode``, cycling through
    ``configs``; every episode starts a fresh model and ends with :meth:`Driver.finish`."""
    counts = Counts()
    for i, n in enumerate(episodes(total_ops, ops_per_episode)):
        config = CONFIGS[configs[i % len(configs)]]
        device = device_factory()
        try:
            driver = Driver(config, device, RandomChooser(seed * 1_000_003 + i))
            driver.run(n)
            driver.finish()
            counts.merge(driver.counts)
        finally:
            device.close()
        if progress is not None:
            progress(counts)
    return counts


# ---------------------------------------------------------------------------- swap record fuzzing

#: Mutation kinds; a mutation is ``(kind, a, b, c)`` of plain ints, so hypothesis and a seeded
#: ``random.Random`` generate the same shapes (see :func:`mutate`).
MUTATIONS: Final[tuple[str, ...]] = (
    "flip",  # flip bit c % 8 of byte a
    "truncate",  # keep the first a bytes
    "splice",  # replace b bytes at a with the donor record's bytes at c
    "insert",  # insert b bytes of value c at a
    "delete",  # delete b bytes at a
    "header_field",  # set header field a % 20 to an interesting value b, header checksum recomputed
    "header_sizes",  # set num_tokens / adapter_name_bytes to b, sizes and checksum made consistent
    "resealed_flip",  # flip a payload bit, then recompute that section's checksum
)
_FIELD_VALUES: Final = (0, 1, 2, 3, 4, 7, 8, 16, 127, 128, 255, 4096, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1)
#: Token counts a consistent forged header may announce (up to the format's limit and past it).
MAX_FORGED_TOKENS: Final = 2**32


def _header_struct() -> struct.Struct:
    from lifecycle.swap.format import _HEADER

    return _HEADER


_FIELD_FORMATS: Final = "HHIQQIIQQIIQQIIQqII"  # the header's fields after the magic, in order
_FIELD_RANGES: Final = {"H": (0, 2**16 - 1), "I": (0, 2**32 - 1), "Q": (0, 2**64 - 1), "q": (-(2**63), 2**63 - 1)}


def _reseal_header(fields_: list[Any]) -> bytes:
    """Pack header fields (each clamped to its width) and append a valid header checksum."""
    import xxhash

    for i, fmt in enumerate(_FIELD_FORMATS, start=1):
        lo, hi = _FIELD_RANGES[fmt]
        fields_[i] = max(lo, min(int(fields_[i]), hi))
    body = _header_struct().pack(*fields_)
    return body + xxhash.xxh3_64_intdigest(body, 0).to_bytes(8, "little")


def section_spans(record: bytes) -> list[tuple[int, int]]:
    """(start, end) of every section payload of a valid ``record``; section k (1-based) is
    followed by the xxh3-64 of its payload seeded with k."""
    from lifecycle.swap import HEADER_BYTES, parse_header

    header = parse_header(record[:HEADER_BYTES])
    a, r = header.num_attention_layers, header.num_ssm_ranges
    table = np.frombuffer(record, dtype="<u8", count=a + r, offset=HEADER_BYTES).tolist()
    sizes = [header.meta_bytes] + [header.num_blocks * n for n in table[:a]] + table[a:]
    spans, offset = [], HEADER_BYTES
    for size in sizes:
        spans.append((offset, offset + size))
        offset += size + 8
    return spans


def mutate(record: bytes, mutations: list[tuple[int, int, int, int]], donor: bytes) -> bytes:
    """Apply ``mutations`` to ``record`` in order (positions wrap around the current length)."""
    import xxhash

    from lifecycle.swap import HEADER_BYTES

    data = bytearray(record)
    header = _header_struct()
    spans = section_spans(record)  # of the valid original: a resealed flip targets its sections
    for kind_index, a, b, c in mutations:
        kind = MUTATIONS[kind_index % len(MUTATIONS)]
        n = len(data)
        if kind == "flip" and n:
            data[a % n] ^= 1 << (c % 8)
        elif kind == "truncate":
            del data[a % (n + 1) :]
        elif kind == "splice" and donor:
            start, size = c % len(donor), b % 64 + 1
            chunk = donor[start : start + size]
            pos = a % (n + 1)
            data[pos : pos + len(chunk)] = chunk
        elif kind == "insert":
            pos = a % (n + 1)
            data[pos:pos] = bytes([c % 256]) * (b % 16 + 1)
        elif kind == "delete" and n:
            pos = a % n
            del data[pos : pos + b % 16 + 1]
        elif kind in ("header_field", "header_sizes") and len(data) >= HEADER_BYTES:
            fields_ = list(header.unpack_from(bytes(data)))
            if kind == "header_field":
                index = a % len(fields_)
                if index == 0:
                    fields_[0] = bytes((c + i) % 256 for i in range(8))
                else:
                    value = _FIELD_VALUES[b % len(_FIELD_VALUES)] if c % 3 else fields_[index] + (1 if c % 2 else -1)
                    fields_[index] = -value if _FIELD_FORMATS[index - 1] == "q" and c % 5 == 0 else value
            else:
                # 7: num_tokens, 14: adapter_name_bytes, 16: meta_bytes, 4: record_bytes (struct order)
                index = 7 if c % 2 else 14
                new = b % (MAX_FORGED_TOKENS if index == 7 else 8192)
                delta = (new - fields_[index]) * (4 if index == 7 else 1)
                fields_[index] = new
                fields_[16] += delta
                fields_[4] += delta
            data[:HEADER_BYTES] = _reseal_header(fields_)
        elif kind == "resealed_flip":
            k = a % len(spans)
            start, end = spans[k]
            if end <= start or end + 8 > len(data):
                continue
            data[start + b % (end - start)] ^= 1 << (c % 8)
            digest = xxhash.xxh3_64_intdigest(bytes(data[start:end]), k + 1)
            data[end : end + 8] = digest.to_bytes(8, "little")
    return bytes(data)


@dataclass
class FuzzCounts:
    """Restores of mutated records: ``rejected`` by a SwapError (by class), ``accepted`` (only
    possible where the mutation resealed checksums or touched nothing the reader uses)."""

    tried: int = 0
    rejected: int = 0
    accepted: int = 0
    by_error: Counter[str] = field(default_factory=Counter)


class FuzzFailure(AssertionError):
    """A mutated record crashed restore, was wrongly accepted, or changed the pools."""


def restore_mutated(
    model: HybridModel,
    record: bytes,
    num_blocks: int,
    mutated: bytes,
    *,
    resealed: bool,
    adapter_slot: int = NO_ADAPTER,
    counts: FuzzCounts | None = None,
    reader: Callable[[bytes], Any] = io.BytesIO,
) -> None:
    """Restore ``mutated`` into a fresh sequence: it must be rejected with a ``SwapError`` leaving
    the pools and the sequence exactly as before, or (only where that is legitimate) accepted
    whole. Frees the sequence; checks the invariants."""
    seq = model.alloc_sequence()
    try:
        if adapter_slot != NO_ADAPTER:
            model.bind_adapter(seq, adapter_slot)
        before, seq_before = model_digest(model), seq_digest(seq)
        try:
            model.restore_sequence_state(seq, num_blocks, reader(mutated))
        except SwapError as exc:
            if model_digest(model) != before or seq_digest(seq) != seq_before:
                raise FuzzFailure(f"a rejected record ({type(exc).__name__}: {exc}) changed state") from exc
            if counts is not None:
                counts.rejected += 1
                counts.by_error[type(exc).__name__] += 1
        except Exception as exc:  # anything else is a crash
            raise FuzzFailure(f"restore of a mutated record raised {type(exc).__name__}: {exc}") from exc
        else:
            intact = mutated[: len(record)] == record
            if not (intact or resealed):
                raise FuzzFailure("a corrupted record was accepted")
            if seq.num_blocks != num_blocks:
                raise FuzzFailure(f"an accepted record gave {seq.num_blocks} blocks, not {num_blocks}")
            if counts is not None:
                counts.accepted += 1
        if counts is not None:
            counts.tried += 1
    finally:
        model.free_sequence(seq)
    model.check_invariants()


def random_mutations(rng: random.Random) -> list[tuple[int, int, int, int]]:
    return [
        (rng.randrange(len(MUTATIONS)), rng.randrange(1 << 20), rng.randrange(1 << 20), rng.randrange(1 << 20))
        for _ in range(rng.randint(1, 3))
    ]


def fuzz_restore(num_records: int, *, seed: int = 0, device_factory: Callable[[], Device] = HostDevice) -> FuzzCounts:
    """Restore ``num_records`` randomly mutated records (from a hybrid sequence bound to an
    adapter and from a pure-attention one) and count how each was refused."""
    rng = random.Random(seed)
    counts = FuzzCounts()
    for name in ("hybrid", "attention"):
        device = device_factory()
        model = HybridModel(CONFIGS[name], device)
        try:
            adapter = model.load_adapter("alpha")
            source = model.alloc_sequence()
            model.bind_adapter(source, adapter)
            model.attach_prefix(source, SYSTEM_PROMPTS[1])
            model.grow(source, 20)
            source.append_tokens(range(30, 38))
            out = io.BytesIO()
            model.save_sequence_state(source, out)
            record = out.getvalue()
            donor_seq = model.alloc_sequence()
            model.attach_prefix(donor_seq, SYSTEM_PROMPTS[0])
            model.grow(donor_seq, 9)
            donor = io.BytesIO()
            model.save_sequence_state(donor_seq, donor)
            for _ in range(num_records // 2):
                mutations = random_mutations(rng)
                resealed = any(
                    MUTATIONS[k % len(MUTATIONS)] in ("header_field", "header_sizes", "resealed_flip")
                    for k, *_ in mutations
                )
                mutated = mutate(record, mutations, donor.getvalue())
                restore_mutated(
                    model, record, source.num_blocks, mutated, resealed=resealed, adapter_slot=adapter, counts=counts
                )
            model.free_sequence(source)
            model.free_sequence(donor_seq)
        finally:
            model.teardown()
            device.close()
    return counts


# ---------------------------------------------------------------------------- fault sweeps

#: A 14-token prompt: 3 full blocks of 4, so a second request reuses up to 3 with a snapshot.
FAULT_PROMPT: Final = np.arange(1, 15, dtype=np.int32)


class EmulatorControls(Protocol):
    """The part of ``tests/devices.py``'s ``Emulator`` a fault sweep uses."""

    def reset(self) -> None: ...
    def fail_from_call(self, n: int, code: int) -> None: ...
    @property
    def live_allocations(self) -> int: ...
    @property
    def call_count(self) -> int: ...


@dataclass
class Lifecycle:
    """One run of the representative lifecycle (:func:`run_lifecycle`); what a sweep inspects
    after a fault."""

    config: ModelConfig
    model: HybridModel | None = None
    held: list[SequenceState] = field(default_factory=list)
    step: str = "start"
    #: (step, driver calls it made), filled when an emulator is passed
    calls: list[tuple[str, int]] = field(default_factory=list)


def workload(life: Lifecycle, emulator: EmulatorControls | None = None) -> None:
    """Every model method that touches the device, in the order a serving engine calls them:
    bind, alloc (zeroes the slot), attach (miss, then a hit restoring a snapshot), cache (saves a
    snapshot), save_snapshot, compaction into a free and into a retired slot, swap out (staging
    allocated on first use), swap in, a second swap out (staging reused), free."""
    m = life.model
    assert m is not None
    last = emulator.call_count if emulator is not None else 0

    def at(step: str) -> None:
        nonlocal last
        if emulator is not None:
            now = emulator.call_count
            life.calls.append((life.step, now - last))
            last = now
        life.step = step

    at("bind_gpu_to_thread")
    m.bind_gpu_to_thread()
    at("alloc_sequence (zero slot)")
    a = m.alloc_sequence()
    life.held.append(a)
    at("attach_prefix (miss)")
    m.attach_prefix(a, FAULT_PROMPT)
    m.grow(a, 16)
    a.append_tokens([7, 7])
    at("cache_sequence (snapshot save)")
    m.cache_sequence(a)
    at("save_snapshot")
    m.save_snapshot(a, 8)
    at("alloc_sequence (zero slot) 2")
    b = m.alloc_sequence()
    life.held.append(b)
    at("attach_prefix (snapshot restore)")
    m.attach_prefix(b, FAULT_PROMPT)
    m.grow(b, 20)
    b.append_tokens(range(100, 106))
    at("compact_sequence (free slot)")
    free_slot = next(s for s in range(life.config.max_seqs) if m.slots.is_free(s))
    m.compact_sequence(b, free_slot)
    at("compact_sequence (retired slot)")
    m.retire_sequence(a)
    m.compact_sequence(b, a.slot_idx)
    at("save_sequence_state")
    record = io.BytesIO()
    m.save_sequence_state(b, record)
    at("alloc_sequence (zero slot) 3")
    c = m.alloc_sequence()
    life.held.append(c)
    at("restore_sequence_state")
    m.restore_sequence_state(c, b.num_blocks, io.BytesIO(record.getvalue()))
    at("save_sequence_state (staging reused)")
    m.save_sequence_state(c, io.BytesIO())
    at("free")
    for seq in life.held:
        m.free_sequence(seq)
    life.held.clear()
    at("done")


def run_lifecycle(life: Lifecycle, dev: Device, emulator: EmulatorControls | None = None) -> None:
    """Construct the model, run :func:`workload`, tear down."""
    life.step = "HybridModel() (pool allocations)"
    start = emulator.call_count if emulator is not None else 0
    life.model = HybridModel(life.config, dev)
    if emulator is not None:
        life.calls.append((life.step, emulator.call_count - start))
    workload(life, emulator)
    life.step = "teardown (frees)"
    start = emulator.call_count if emulator is not None else 0
    life.model.teardown()
    if emulator is not None:
        life.calls.append((life.step, emulator.call_count - start))
    life.step = "after teardown"


def release_everything(m: HybridModel, held: list[SequenceState]) -> None:
    """Free what is still held and require every block, slot and adapter reference back."""
    m.check_invariants()
    for seq in held:
        m.free_sequence(seq)
    held.clear()
    m.check_invariants()
    while m.reclaim_prefix_blocks(m.num_total_blocks()):
        pass
    problems = []
    if m.num_free_blocks() != m.num_total_blocks():
        problems.append(f"{m.num_total_blocks() - m.num_free_blocks()} blocks not back")
    if m.slots.num_free != m.config.max_seqs:
        problems.append(f"{m.config.max_seqs - m.slots.num_free} slots not back")
    if sum(m._adapters.refcounts()):
        problems.append(f"adapter references {m._adapters.refcounts()}")
    if m.num_live_sequences:
        problems.append(f"{m.num_live_sequences} live sequences")
    if problems:
        raise DriverFailure("; ".join(problems))


class one_shot_faults:
    """Context manager: the emulator's sticky fault is lifted the moment the device layer builds
    the ``CudaError`` for it (every failing call goes through ``lifecycle.device.cuda._error``),
    so exactly one driver call fails."""

    def __init__(self, emulator: EmulatorControls) -> None:
        self.emulator = emulator
        self._original: Any = None

    def __enter__(self) -> one_shot_faults:
        import lifecycle.device.cuda as cuda_module

        self._original = original = cuda_module._error
        emulator = self.emulator

        def lift_then_report(driver: Any, call: str, err: Any) -> CudaError:
            emulator.reset()
            return original(driver, call, err)

        cuda_module._error = lift_then_report
        return self

    def __exit__(self, *exc: object) -> None:
        import lifecycle.device.cuda as cuda_module

        cuda_module._error = self._original


@dataclass
class SweepResult:
    """A fault at every driver call of the lifecycle, one at a time."""

    calls: int = 0
    surfaced: int = 0
    survived: int = 0
    teardown_raised: int = 0
    leaks: int = 0
    sites: Counter[tuple[str, str]] = field(default_factory=Counter)
    broken: Counter[str] = field(default_factory=Counter)
    never_surfaced: list[int] = field(default_factory=list)


def count_lifecycle_calls(
    emulator: EmulatorControls, device_factory: Callable[[], Device], config: ModelConfig
) -> tuple[int, list[tuple[str, int]]]:
    """Driver calls of one fault-free lifecycle, in all and per step."""
    dev = device_factory()
    try:
        life = Lifecycle(config)
        before = emulator.call_count
        run_lifecycle(life, dev, emulator)
        return emulator.call_count - before, [(s, n) for s, n in life.calls if n]
    finally:
        dev.close()


def fault_sweep(
    emulator: EmulatorControls,
    device_factory: Callable[[], Device],
    *,
    sticky: bool,
    code: int = 719,
    config: ModelConfig | None = None,
) -> SweepResult:
    """For every driver call N of the lifecycle: a fresh device and model, call N fails (once,
    or from N on when ``sticky``), and then:

    - the fault must surface as a ``CudaError`` (else N is listed in ``never_surfaced``);
    - transient: every reference comes back, the whole workload runs again and teardown reports
      no leak; a failed teardown free leaves the allocation to ``device.close()``;
    - sticky: the host-side bookkeeping still frees everything; teardown finishes (raising the
      driver's error, counted in ``teardown_raised``); once the driver recovers, closing the
      device frees what the model could not.

    A recount that breaks after the fault is counted in ``broken`` by step; device allocations
    left after closing are counted in ``leaks``."""
    config = config or CONFIGS["hybrid"]
    result = SweepResult()
    result.calls, _ = count_lifecycle_calls(emulator, device_factory, config)
    for n in range(1, result.calls + 1):
        dev = device_factory()
        baseline = emulator.live_allocations
        life = Lifecycle(config)
        emulator.fail_from_call(n, code)
        try:
            run_lifecycle(life, dev)
        except CudaError as exc:
            result.surfaced += 1
            result.sites[(life.step, exc.call.split("(", 1)[0])] += 1
        else:
            result.never_surfaced.append(n)
        m = life.model
        try:
            if m is not None and life.step == "teardown (frees)":
                # one free failed: teardown went on with the rest and raised; nothing was held
                report = m.teardown_report
                if report is None or report.leaked:
                    result.leaks += 1
                try:
                    m.alloc_sequence()
                except TornDown:
                    pass
                else:
                    raise DriverFailure("a model whose teardown raised still accepts calls")
            elif m is not None:
                release_everything(m, life.held)
                if not sticky:
                    emulator.reset()
                    again = Lifecycle(config, model=m)
                    workload(again)
                    release_everything(m, again.held)
                try:
                    m.teardown()
                except CudaError:
                    result.teardown_raised += 1
                report = m.teardown_report
                if report is None or report.leaked:
                    result.leaks += 1
            result.survived += 1
        except (InvariantViolation, DriverFailure):
            result.broken[life.step] += 1
            if m is not None:
                emulator.reset()
                m.teardown()
        emulator.reset()
        dev.close()  # frees what a failed free left behind, now that the driver works
        result.leaks += emulator.live_allocations - baseline
    return result


def soak(dev: Device, emulator: EmulatorControls, config: ModelConfig, ops: int, seed: int, code: int = 719) -> Driver:
    """The random driver with a one-shot fault armed at a random upcoming driver call before
    about one operation in eight (use inside :class:`one_shot_faults`)."""
    rng = random.Random(seed)

    def arm(_: Driver) -> None:
        if rng.random() < 0.125:
            emulator.fail_from_call(rng.randint(1, 6), code)

    driver = Driver(config, dev, RandomChooser(seed), expect_faults=True, on_op=arm)
    driver.run(ops)
    emulator.reset()
    driver.finish()
    driver.counts.faults_survived = driver.counts.faults_injected
    return driver
