"""Synthetic serving traces, driven through the public lifecycle API the way a continuous-batching
scheduler drives it.

:func:`multi_turn_trace` builds a seeded, deterministic trace of multi-turn chats: a few system
prompts shared with Zipf-like popularity, several LoRA adapters (and requests without one), and
turns whose prompt is the previous turn's prompt, its response and a new user message.

:func:`simulate` replays a trace on a :class:`~lifecycle.model.HybridModel`: admission with
``reclaim_prefix_blocks_for`` then ``alloc_sequence_for``, ``bind_adapter``, ``attach_prefix`` and
``grow``; decode steps one token at a time (with SSM snapshots at block boundaries on hybrid
models); preemption under memory pressure by swap-out to a :class:`~lifecycle.swap_tier.SwapTier`
and swap-in later (recompute when the tier refuses); retirement with compaction; caching and
freeing; invariant checks; teardown. It returns a :class:`SimulationResult` (summary and time
series). No kernel runs: the token ids of every response are part of the trace.

The library's time is reported in two parts. *Device copies* are the time spent in the device's
copies, memsets and synchronizes (SSM snapshots saved and restored, compaction, the zeroing of a new
sequence's SSM slot) plus the whole of every swap (its copies and checksums); they are measured when
the model runs on a :class:`CopyTimingDevice`, as :func:`simulation_model` builds it. *Bookkeeping*
is the rest: block tables, the prefix trie, refcounts, slots, snapshot and adapter tables. On hybrid
models the snapshot copies usually dominate; :func:`summary_rows` and the JSON say which does.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, cast

import numpy as np
import numpy.typing as npt

from lifecycle.config import ModelConfig
from lifecycle.device import open_device
from lifecycle.device.base import Copy, Device, DeviceKind
from lifecycle.errors import ConfigError, LifecycleError, OutOfBlocks, PoolExhausted
from lifecycle.model import HybridModel, TeardownReport
from lifecycle.sequence import NO_ADAPTER, SequenceState
from lifecycle.stats import Stats, human_bytes
from lifecycle.swap_tier import SwapHandle, SwapTier

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "COPY_CAUSES",
    "DEFAULT_ADAPTERS",
    "CopyTimingDevice",
    "Request",
    "SimulationOptions",
    "SimulationResult",
    "Summary",
    "TimeSeries",
    "figure",
    "max_turns",
    "multi_turn_trace",
    "plot",
    "simulate",
    "simulation_model",
    "summary_rows",
    "trace_for_model",
    "trace_nbytes",
]

#: Adapter names the default trace serves (besides requests without an adapter).
DEFAULT_ADAPTERS: Final[tuple[str, ...]] = ("chat-lora", "code-lora", "support-lora")
#: ``trace_for_model`` shortens messages so that a whole chat fits the model. Shortened more than
#: this many times below what a one-turn chat needs, more turns would only make another trace.
MAX_TURN_SHRINK: Final = 8
#: Memory of one ``Request`` besides its token ids: the object, two array headers, a list slot.
_REQUEST_OVERHEAD_BYTES: Final = 512
_SYSTEM_TOKENS: Final = (256, 1024)
_USER_TOKENS: Final = (16, 128)
_RESPONSE_TOKENS: Final = (32, 384)


# ---------------------------------------------------------------------------------------- trace


@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One turn of one chat. ``response`` holds the tokens the simulated engine generates (so the
    next turn of the chat can include them); ``adapter`` is None for the base model."""

    request_id: int
    chat_id: int
    turn: int
    adapter: str | None
    prompt: npt.NDArray[np.int32]
    response: npt.NDArray[np.int32]

    @property
    def max_new_tokens(self) -> int:
        return int(self.response.shape[0])

    @property
    def total_tokens(self) -> int:
        """Tokens the sequence reaches: prompt and response."""
        return int(self.prompt.shape[0] + self.response.shape[0])


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}")


def _check_range(name: str, bounds: tuple[int, int], minimum: int) -> None:
    low, high = bounds
    if not (isinstance(low, int) and isinstance(high, int)) or low < minimum or high < low:
        raise ConfigError(f"{name}={bounds!r} must be (low, high) ints with {minimum} <= low <= high")


def _zipf_weights(n: int, exponent: float) -> npt.NDArray[np.float64]:
    weights = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    weights /= weights.sum()
    return weights


@dataclass(slots=True, eq=False)
class _Chat:
    """An open chat while a trace is generated: ``context`` is everything said so far."""

    chat_id: int
    turns_left: int
    adapter: str | None
    context: npt.NDArray[np.int32]
    turn: int = 0


def multi_turn_trace(
    seed: int,
    num_chats: int,
    turns: int,
    *,
    min_turns: int | None = None,
    num_system_prompts: int = 8,
    system_prompt_tokens: tuple[int, int] = (256, 1024),
    user_tokens: tuple[int, int] = (16, 128),
    response_tokens: tuple[int, int] = (32, 384),
    adapters: Sequence[str] = DEFAULT_ADAPTERS,
    no_adapter_fraction: float = 0.25,
    concurrent_chats: int = 16,
    zipf_exponent: float = 1.1,
    vocab_size: int = 32_000,
    max_requests: int | None = None,
) -> list[Request]:
    """A deterministic trace (same arguments, same tokens) of ``num_chats`` chats of ``turns``
    turns each (or uniformly ``min_turns..turns``), in arrival order.

    Each chat picks a system prompt and an adapter (none with probability ``no_adapter_fraction``),
    both Zipf-distributed; turn ``t``'s prompt is turn ``t-1``'s prompt + its response + a new user
    message. Arrivals interleave ``concurrent_chats`` open chats, so a chat's turns appear in order
    but far apart. ``max_requests`` cuts the trace (a chat's turns are cut from its end). Token ids
    lie in ``[1, vocab_size)``.
    """
    _check_count("num_chats", num_chats, 0)
    _check_count("turns", turns, 1)
    low_turns = turns if min_turns is None else min_turns
    _check_count("min_turns", low_turns, 1)
    if low_turns > turns:
        raise ConfigError(f"min_turns={low_turns} must be <= turns={turns}")
    _check_count("num_system_prompts", num_system_prompts, 1)
    _check_range("system_prompt_tokens", system_prompt_tokens, 0)
    _check_range("user_tokens", user_tokens, 1)
    _check_range("response_tokens", response_tokens, 1)
    _check_count("concurrent_chats", concurrent_chats, 1)
    _check_count("vocab_size", vocab_size, 2)
    if max_requests is not None:
        _check_count("max_requests", max_requests, 0)
    if not 0.0 <= no_adapter_fraction <= 1.0:
        raise ConfigError(f"no_adapter_fraction={no_adapter_fraction!r} must lie in [0, 1]")
    if not adapters and no_adapter_fraction < 1.0:
        raise ConfigError("adapters is empty, so no_adapter_fraction must be 1.0")
    if len(set(adapters)) != len(adapters) or not all(isinstance(a, str) and a for a in adapters):
        raise ConfigError(f"adapters={list(adapters)!r} must be distinct non-empty names")

    rng = np.random.default_rng(seed)

    def tokens(bounds: tuple[int, int]) -> npt.NDArray[np.int32]:
        length = int(rng.integers(bounds[0], bounds[1] + 1))
        return rng.integers(1, vocab_size, length, dtype=np.int32)

    system_prompts = [tokens(system_prompt_tokens) for _ in range(num_system_prompts)]
    prompt_weights = _zipf_weights(num_system_prompts, zipf_exponent)
    adapter_weights = _zipf_weights(len(adapters), zipf_exponent) if adapters else None

    def open_chat(chat_id: int) -> _Chat:
        context = system_prompts[int(rng.choice(num_system_prompts, p=prompt_weights))]
        turns_left = int(rng.integers(low_turns, turns + 1))
        use_base = adapter_weights is None or rng.random() < no_adapter_fraction
        adapter = None if use_base else adapters[int(rng.choice(len(adapters), p=adapter_weights))]
        return _Chat(chat_id, turns_left, adapter, context)

    limit = max_requests if max_requests is not None else num_chats * turns
    trace: list[Request] = []
    next_chat = min(concurrent_chats, num_chats)
    open_chats = [open_chat(chat_id) for chat_id in range(next_chat)]
    while open_chats and len(trace) < limit:
        index = int(rng.integers(len(open_chats)))
        chat = open_chats[index]
        prompt = np.concatenate((chat.context, tokens(user_tokens)))
        response = tokens(response_tokens)
        trace.append(Request(len(trace), chat.chat_id, chat.turn, chat.adapter, prompt, response))
        chat.context = np.concatenate((prompt, response))
        chat.turn += 1
        chat.turns_left -= 1
        if chat.turns_left == 0:
            if next_chat < num_chats:
                open_chats[index] = open_chat(next_chat)
                next_chat += 1
            else:
                open_chats.pop(index)
    return trace


@dataclass(frozen=True, slots=True)
class _ChatShape:
    """Message lengths ``trace_for_model`` uses for chats of some number of turns on a model."""

    budget: int  # tokens one chat may reach: a quarter of the pool, within the per-sequence limit
    scale: float
    system: tuple[int, int]
    user: tuple[int, int]
    response: tuple[int, int]

    @staticmethod
    def of(
        config: ModelConfig,
        turns: int,
        system_prompt_tokens: tuple[int, int],
        user_tokens: tuple[int, int],
        response_tokens: tuple[int, int],
    ) -> _ChatShape:
        budget = min(config.num_blocks_resolved // 4, config.max_blocks_per_seq_resolved) * config.block_size
        longest = system_prompt_tokens[1] + turns * (user_tokens[1] + response_tokens[1])
        scale = min(1.0, budget / longest) if longest else 1.0

        def scaled(bounds: tuple[int, int], minimum: int) -> tuple[int, int]:
            return (max(int(bounds[0] * scale), minimum), max(int(bounds[1] * scale), minimum))

        return _ChatShape(
            budget, scale, scaled(system_prompt_tokens, 0), scaled(user_tokens, 1), scaled(response_tokens, 1)
        )

    def fits(self, turns: int) -> bool:
        return self.system[1] + turns * (self.user[1] + self.response[1]) <= self.budget


def max_turns(
    config: ModelConfig,
    *,
    system_prompt_tokens: tuple[int, int] = _SYSTEM_TOKENS,
    user_tokens: tuple[int, int] = _USER_TOKENS,
    response_tokens: tuple[int, int] = _RESPONSE_TOKENS,
) -> int:
    """The most turns per chat :func:`trace_for_model` accepts for ``config``: chats that fit, with
    messages shortened at most ``MAX_TURN_SHRINK`` times more than a one-turn chat's (0: not even
    one turn fits)."""
    lengths = (system_prompt_tokens, user_tokens, response_tokens)
    floor = _ChatShape.of(config, 1, *lengths).scale / MAX_TURN_SHRINK

    def accepted(turns: int) -> bool:
        shape = _ChatShape.of(config, turns, *lengths)
        return shape.fits(turns) and shape.scale >= floor

    low, high = 0, max(config.num_blocks_resolved * config.block_size, 1)  # every turn takes >= 2 tokens
    while low < high:
        middle = (low + high + 1) // 2
        if accepted(middle):
            low = middle
        else:
            high = middle - 1
    return low


def trace_nbytes(
    config: ModelConfig,
    *,
    num_requests: int,
    turns: int,
    system_prompt_tokens: tuple[int, int] = _SYSTEM_TOKENS,
    user_tokens: tuple[int, int] = _USER_TOKENS,
    response_tokens: tuple[int, int] = _RESPONSE_TOKENS,
) -> int:
    """About how much memory a :func:`trace_for_model` trace takes (its mean, to size a run
    before generating it): every request holds its whole prompt and its response."""
    shape = _ChatShape.of(config, turns, system_prompt_tokens, user_tokens, response_tokens)

    def mean(bounds: tuple[int, int]) -> float:
        return (bounds[0] + bounds[1]) / 2

    # Chats have 1..turns turns, so a request is on average (turns - 1) / 3 turns deep.
    message = mean(shape.user) + mean(shape.response)
    tokens = mean(shape.system) + (turns - 1) / 3 * message + message
    return int(num_requests * (4 * tokens + _REQUEST_OVERHEAD_BYTES))


def trace_for_model(
    config: ModelConfig,
    *,
    seed: int,
    num_requests: int,
    turns: int,
    system_prompt_tokens: tuple[int, int] = _SYSTEM_TOKENS,
    user_tokens: tuple[int, int] = _USER_TOKENS,
    response_tokens: tuple[int, int] = _RESPONSE_TOKENS,
    **trace_options: Any,
) -> list[Request]:
    """:func:`multi_turn_trace` of ``num_requests`` requests from chats of ``1..turns`` turns, with
    every length scaled down (never up) so that a whole chat fits a quarter of ``config``'s KV pool
    and its per-sequence limit, and no more adapters than ``config`` has adapter slots. Raises
    ``ConfigError`` when even the shortest chat cannot fit, or for more turns than
    :func:`max_turns` (where only ever shorter messages would make room)."""
    _check_count("num_requests", num_requests, 0)
    _check_count("turns", turns, 1)
    shape = _ChatShape.of(config, turns, system_prompt_tokens, user_tokens, response_tokens)
    system, user, response = shape.system, shape.user, shape.response
    if not shape.fits(turns):
        raise ConfigError(
            f"a KV pool of {config.num_blocks_resolved} blocks of {config.block_size} tokens is too small for "
            f"chats of {turns} turns (each chat must fit a quarter of the pool); use more blocks or fewer turns"
        )
    limit = max_turns(
        config, system_prompt_tokens=system_prompt_tokens, user_tokens=user_tokens, response_tokens=response_tokens
    )
    if turns > limit:
        raise ConfigError(
            f"turns={turns} is more than the {limit} turns a chat may have on {config.num_blocks_resolved} blocks of "
            f"{config.block_size} tokens: its messages would be shortened more than {MAX_TURN_SHRINK} times below "
            "a one-turn chat's; use more blocks or fewer turns"
        )
    # One adapter per slot at most, so every adapter of the trace stays loaded.
    adapters = tuple(trace_options.pop("adapters", DEFAULT_ADAPTERS))[: config.num_adapter_slots]
    if not adapters:
        trace_options["no_adapter_fraction"] = 1.0
    return multi_turn_trace(
        seed,
        num_requests,
        turns,
        adapters=adapters,
        min_turns=1,
        system_prompt_tokens=system,
        user_tokens=user,
        response_tokens=response,
        max_requests=num_requests,
        **trace_options,
    )


# ---------------------------------------------------------------------------------------- device timing

#: What the scheduler was doing when the device copied (the keys of ``Summary.copy_ns_by_cause``):
#: saving SSM snapshots, compacting a survivor into a retired slot, admitting (a new slot zeroed, a
#: snapshot restored), decoding, finishing (caching, freeing), swapping out or in.
COPY_CAUSES: Final[tuple[str, ...]] = ("snapshots", "compaction", "admission", "decode", "finish", "swap")


class CopyTimingDevice:
    """A :class:`~lifecycle.device.base.Device` that forwards every call to ``inner`` and adds the
    wall time of each copy, memset and synchronize to ``copy_ns[cause]`` for the ``cause`` set at
    the time (None: not counted). Everything else, implementation-specific attributes included,
    is the inner device's."""

    def __init__(self, inner: Device, *, close_with_simulation: bool = False) -> None:
        self.inner = inner
        self.cause: str | None = None
        self.copy_ns: dict[str, int] = {}
        #: :func:`simulate` closes this device after tearing the model down (the model does not).
        self.close_with_simulation = close_with_simulation

    def _add(self, started: int) -> None:
        if self.cause is not None:
            self.copy_ns[self.cause] = self.copy_ns.get(self.cause, 0) + time.perf_counter_ns() - started

    @property
    def kind(self) -> DeviceKind:
        return self.inner.kind

    @property
    def name(self) -> str:
        return self.inner.name

    def bind_to_thread(self) -> None:
        self.inner.bind_to_thread()

    def alloc(self, nbytes: int) -> int:
        return self.inner.alloc(nbytes)

    def free(self, ptr: int) -> None:
        self.inner.free(ptr)

    def alloc_pinned(self, nbytes: int) -> int:
        return self.inner.alloc_pinned(nbytes)

    def free_pinned(self, ptr: int) -> None:
        self.inner.free_pinned(ptr)

    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        started = time.perf_counter_ns()
        try:
            self.inner.copy_dtod(dst, src, nbytes)
        finally:
            self._add(started)

    def copy_htod(self, dst: int, src_host: int, nbytes: int) -> None:
        started = time.perf_counter_ns()
        try:
            self.inner.copy_htod(dst, src_host, nbytes)
        finally:
            self._add(started)

    def copy_dtoh(self, dst_host: int, src: int, nbytes: int) -> None:
        started = time.perf_counter_ns()
        try:
            self.inner.copy_dtoh(dst_host, src, nbytes)
        finally:
            self._add(started)

    def copy_htod_to(self, dst: int, src_host: int, nbytes: int) -> None:
        started = time.perf_counter_ns()
        try:
            self.inner.copy_htod_to(dst, src_host, nbytes)
        finally:
            self._add(started)

    def copy_batch(self, copies: Sequence[Copy] | npt.NDArray[np.int64]) -> None:
        started = time.perf_counter_ns()
        try:
            self.inner.copy_batch(copies)
        finally:
            self._add(started)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        started = time.perf_counter_ns()
        try:
            self.inner.memset(ptr, value, nbytes)
        finally:
            self._add(started)

    def synchronize(self) -> None:
        started = time.perf_counter_ns()
        try:
            self.inner.synchronize()
        finally:
            self._add(started)

    def mem_info(self) -> tuple[int, int]:
        return self.inner.mem_info()

    def host_array(self, ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
        return self.inner.host_array(ptr, nbytes)

    def device_array(self, ptr: int, shape: tuple[int, ...], dtype: npt.DTypeLike) -> Any:
        return self.inner.device_array(ptr, shape, dtype)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"CopyTimingDevice({self.inner!r})"


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


# ---------------------------------------------------------------------------------------- results


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


@dataclass(frozen=True, slots=True)
class Summary:
    """What one simulation did. Hit rate = prompt tokens served from the prefix cache over prompt
    tokens looked up (recomputed prefills included).

    Time: ``time_in_library_ns`` (the model's own counter: every mutating public call) is
    ``copy_ns + bookkeeping_ns``. ``copy_ns`` is the device copies (``copy_ns_by_cause``: SSM
    snapshots saved, compaction, admission, which zeroes a new slot and restores a snapshot, and swap,
    counted whole with its checksums); it is None when the model's device is not a
    :class:`CopyTimingDevice`, and so are ``bookkeeping_ns`` and ``dominant``. ``seed`` is the trace's
    seed when the caller gave it; ``pools`` the sizes the run had."""

    model: str
    device: str
    seed: int | None
    pools: dict[str, int]
    requests: int
    prompt_tokens: int
    generated_tokens: int
    prefix_hit_rate: float
    prefix_hit_tokens: int
    host_hit_tokens: int
    store_hit_tokens: int
    hit_rate_with_tiers: float
    evicted_blocks: int
    preemptions: int
    swaps_out: int
    swaps_in: int
    swap_bytes: int
    swap_seconds: float
    swap_gb_per_s: float
    swap_failures: int
    recomputes: int
    recomputed_tokens: int
    compactions: int
    snapshots_saved: int
    snapshot_hits: int
    steps: int
    invariant_checks: int
    time_in_library_ns: int
    library_us_per_request: float
    copy_ns: int | None
    copy_ns_by_cause: dict[str, int]
    bookkeeping_ns: int | None
    copy_us_per_request: float | None
    bookkeeping_us_per_request: float | None
    dominant: str | None
    wall_seconds: float
    leaked: int
    teardown: dict[str, int]


@dataclass(slots=True)
class TimeSeries:
    """One sample per scheduler step, at its end. The KV pool's blocks split three ways:
    ``live_blocks`` held by running sequences (a cached prefix they share counts here),
    ``cached_blocks`` held by the prefix cache alone (evictable), ``free_blocks``; ``used_blocks``
    is live + cached. Then the sequences running, the cumulative prefix tokens looked up and hit,
    and the step's preemptions (by swap-out or by recompute) and swap-ins."""

    step: list[int] = field(default_factory=list)
    used_blocks: list[int] = field(default_factory=list)
    live_blocks: list[int] = field(default_factory=list)
    cached_blocks: list[int] = field(default_factory=list)
    free_blocks: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    lookup_tokens: list[int] = field(default_factory=list)
    hit_tokens: list[int] = field(default_factory=list)
    swaps_out: list[int] = field(default_factory=list)
    recomputes: list[int] = field(default_factory=list)
    swaps_in: list[int] = field(default_factory=list)
    tier_hit_tokens: list[int] = field(default_factory=list)  # of hit_tokens, from the host / store tiers
    total_blocks: int = 0

    def hit_rate(self, window: int = 0) -> list[float]:
        """Hit rate at each sample: cumulative, or over the last ``window`` samples."""
        rates: list[float] = []
        for i, (looked, hit) in enumerate(zip(self.lookup_tokens, self.hit_tokens)):
            if window and i >= window:
                looked -= self.lookup_tokens[i - window]
                hit -= self.hit_tokens[i - window]
            rates.append(hit / looked if looked else 0.0)
        return rates


@dataclass(frozen=True, slots=True)
class SimulationResult:
    summary: Summary
    series: TimeSeries
    stats: Stats
    teardown: TeardownReport

    def to_json(self) -> dict[str, Any]:
        """The summary and the raw counters as plain JSON types (no time series)."""
        out: dict[str, Any] = asdict(self.summary)
        out["stats"] = self.stats.as_dict()
        return out


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
        if options.swap:
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
            seq.append_tokens(live.request.response[live.generated : live.generated + 1])
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
            except OutOfBlocks:
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
                self.model.cache_sequence(live.seq)
                self.model.free_sequence(live.seq)
        self.recomputes += 1
        self.step_events["recomputes"] += 1
        self.restart.append((live.request, live.generated))

    # ---------------------------------------------------------------- finish

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
            model.cache_sequence(seq)
            model.free_sequence(seq)
        self.done += 1
        if self.on_request_done is not None:
            self.on_request_done(self.done)
        successor = self.successor.pop(live.request.request_id, None)
        if successor is not None:
            heapq.heappush(self.ready, (successor.request_id, successor))


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
        prefix_hit_rate=stats.hit_rate,
        prefix_hit_tokens=stats.prefix_hit_tokens,
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
    )
    return SimulationResult(summary=summary, series=sim.series, stats=stats, teardown=report)


# ---------------------------------------------------------------------------------------- output

_CAUSE_LABELS: Final[dict[str, str]] = {
    "snapshots": "SSM snapshots",
    "compaction": "compaction",
    "admission": "admission",
    "decode": "decode",
    "finish": "finish",
    "swap": "swap",
}


def _time_rows(s: Summary) -> list[tuple[str, str]]:
    library = s.library_us_per_request
    if s.copy_us_per_request is None or s.bookkeeping_us_per_request is None:
        return [("library time per request", f"{library:,.1f} µs (copies not told apart: see simulation_model)")]
    share = s.copy_ns / s.time_in_library_ns if s.copy_ns and s.time_in_library_ns else 0.0
    per_request = {cause: ns / 1e3 / s.requests for cause, ns in s.copy_ns_by_cause.items()} if s.requests else {}
    causes = ", ".join(
        f"{_CAUSE_LABELS[cause]} {us:,.1f}"
        for cause, us in sorted(per_request.items(), key=lambda item: -item[1])
        if us >= 0.05
    )
    top = max(per_request, key=lambda cause: per_request[cause], default=None)
    dominant = f"device copies ({share:.0%}" + (f", mostly {_CAUSE_LABELS[top]})" if top else ")")
    if s.dominant == "bookkeeping":
        dominant = f"bookkeeping ({1 - share:.0%})"
    return [
        (
            "library time per request",
            f"{library:,.1f} µs = copies {s.copy_us_per_request:,.1f} + "
            f"bookkeeping {s.bookkeeping_us_per_request:,.1f}",
        ),
        ("  device copies by cause (µs/request)", causes or "none"),
        ("  dominated by", dominant),
    ]


def summary_rows(result: SimulationResult) -> list[tuple[str, str]]:
    """The summary as (measure, value) rows, in the order ``lifecycle simulate`` prints them."""
    s = result.summary
    pools = s.pools
    failed = f", {s.swap_failures:,} failed" if s.swap_failures else ""
    swap_rate = f"{s.swap_gb_per_s:.2f} GB/s" if s.swap_bytes else "-"
    leaks = ", ".join(f"{k}={v}" for k, v in s.teardown.items() if v and k != "cached_blocks")
    pool_text = f"{pools['kv_blocks']:,} KV blocks of {pools['block_size']} tokens"
    if pools["ssm_slot_bytes"]:
        pool_text += f", {pools['ssm_slots']} SSM slots, {pools['snapshots']} snapshots"
    return [
        ("trace seed", "-" if s.seed is None else str(s.seed)),
        ("pools", pool_text),
        ("requests", f"{s.requests:,}"),
        ("prompt tokens", f"{s.prompt_tokens:,}"),
        ("generated tokens", f"{s.generated_tokens:,}"),
        ("prefix hit rate", f"{s.prefix_hit_rate:.1%} ({s.prefix_hit_tokens:,} tokens)"),
        *(
            [(
                "  with the host / store tiers",
                f"{s.hit_rate_with_tiers:.1%} (+{s.host_hit_tokens:,} host, +{s.store_hit_tokens:,} store tokens)",
            )]
            if "host_tier_blocks" in pools and pools["host_tier_blocks"]
            else []
        ),
        ("SSM snapshots (saved / hits)", f"{s.snapshots_saved:,} / {s.snapshot_hits:,}"),
        ("evicted blocks", f"{s.evicted_blocks:,}"),
        ("preemptions (swap / recompute)", f"{s.preemptions:,} ({s.swaps_out:,} / {s.recomputes:,})"),
        ("swaps (out / in)", f"{s.swaps_out:,} / {s.swaps_in:,}{failed}"),
        ("swap bytes", f"{human_bytes(s.swap_bytes)} ({swap_rate})"),
        ("compactions", f"{s.compactions:,}"),
        ("invariant checks", f"{s.invariant_checks:,} (all passed)"),
        *_time_rows(s),
        ("wall time", f"{s.wall_seconds:.1f} s ({s.steps:,} steps)"),
        ("leaked at teardown", f"{s.leaked}" + (f" ({leaks})" if leaks else "")),
    ]


def plot(result: SimulationResult, path: Path) -> None:
    """Draw :func:`figure` into ``path`` (.png, .svg or .pdf; needs matplotlib)."""
    figure(result).savefig(path)


def figure(result: SimulationResult) -> Figure:
    """The run per scheduler step (needs matplotlib): the KV pool split into live / cached
    (evictable) / free blocks with every preemption and swap-in marked, the sequences running, and
    the prefix hit rate."""
    from matplotlib.figure import Figure

    series = result.series
    total = max(series.total_blocks, 1)
    steps = series.step

    def percent(values: list[int]) -> list[float]:
        return [100.0 * value / total for value in values]

    drawing = Figure(figsize=(10, 8), layout="constrained")
    pool_axes, running_axes, hit_axes = drawing.subplots(3, 1, sharex=True, height_ratios=(3, 1, 2))
    pool_axes.stackplot(
        steps,
        percent(series.live_blocks),
        percent(series.cached_blocks),
        percent(series.free_blocks),
        labels=("live: held by running sequences", "cached, evictable", "free"),
        colors=("tab:blue", "tab:olive", "0.9"),
    )
    marks = (
        ("swaps_out", "swapped out", "v", "tab:red", 104.0),
        ("recomputes", "preempted to recompute", "x", "tab:purple", 104.0),
        ("swaps_in", "swapped in", "^", "tab:green", 109.0),
    )
    for name, label, marker, color, height in marks:
        counts: list[int] = getattr(series, name)
        at = [step for step, count in zip(steps, counts) if count]
        if at:
            counted = f"{label} ({sum(counts)})"
            pool_axes.scatter(at, [height] * len(at), marker=marker, color=color, s=14, label=counted)
    pool_axes.set_ylabel("KV pool (% of blocks)")
    pool_axes.set_ylim(0, 112)
    pool_axes.legend(loc="lower left", fontsize="small", ncols=2, framealpha=0.9)
    running_axes.plot(steps, series.running, color="tab:orange", linewidth=0.7)
    running_axes.set_ylabel("running")
    window = max(len(steps) // 50, 1)
    hit_axes.plot(steps, [100.0 * r for r in series.hit_rate()], color="tab:green", label="cumulative")
    hit_axes.plot(
        steps,
        [100.0 * r for r in series.hit_rate(window)],
        color="tab:green",
        alpha=0.35,
        linewidth=0.7,
        label=f"last {window} steps",
    )
    if series.tier_hit_tokens:
        looked_up = series.lookup_tokens
        tiers = [100.0 * t / looked if looked else 0.0 for t, looked in zip(series.tier_hit_tokens, looked_up)]
        hit_axes.plot(steps, tiers, color="tab:brown", label="of which from the host / store tiers")
    hit_axes.set_ylabel("prefix hit rate (%)")
    hit_axes.set_ylim(0, 100)
    hit_axes.set_xlabel("scheduler step")
    hit_axes.legend(loc="lower right")
    summary = result.summary
    seed = "" if summary.seed is None else f", seed {summary.seed}"
    drawing.suptitle(f"lifecycle simulate: {summary.model}, {summary.requests:,} requests on {summary.device}{seed}")
    return drawing
