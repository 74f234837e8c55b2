"""Counters a scheduler reads to see what the library did (``HybridModel.stats()``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from time import perf_counter_ns
from typing import final


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


@dataclass(slots=True)
class ModelCounters:
    """What the model itself does around the core: moves of SSM state and swap records."""

    compactions: int = 0
    detaches: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    swap_failures: int = 0
    bytes_swapped_out: int = 0
    bytes_swapped_in: int = 0
    device_ns: int = 0  # time in calls that move device memory, the core's own time excluded


@dataclass(slots=True)
class Stats:
    """Monotonic counters since the model was built (or since the last ``stats(reset=True)``).
    ``time_in_library_ns`` sums the wall time spent inside the public methods that mutate state.
    ``snapshots_evicted`` counts every snapshot dropped: with its node, reused by the pool's LRU,
    or replaced by a rolling save. The tier counters (``tier_lookups``: admissions that looked
    past the device; ``host_hit_blocks``, ``store_hit_blocks``; ``blocks_demoted``,
    ``blocks_promoted``) stay 0 without a host tier: ``prefix_hit_tokens`` counts the device's hits
    only, and ``blocks_promoted * block_size`` more tokens came from the tiers."""

    sequences_allocated: int = 0
    sequences_freed: int = 0
    blocks_allocated: int = 0
    blocks_freed: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_hit_tokens: int = 0
    prefix_lookup_tokens: int = 0
    blocks_cached: int = 0
    blocks_evicted: int = 0
    cache_read_tokens: int = 0  # prompt tokens served from the cache, as API providers bill them
    cache_write_tokens: int = 0  # tokens of the blocks written into the cache
    compactions: int = 0
    detaches: int = 0
    snapshots_saved: int = 0
    snapshot_hits: int = 0
    snapshot_hits_cut_short: int = 0
    snapshots_evicted: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    swap_failures: int = 0
    bytes_swapped_out: int = 0
    bytes_swapped_in: int = 0
    tier_lookups: int = 0
    host_hit_blocks: int = 0
    store_hit_blocks: int = 0
    blocks_demoted: int = 0
    blocks_promoted: int = 0
    tier_ns: int = 0  # time in the tiers (inside time_in_library_ns), of which:
    tier_copy_ns: int = 0  # batched copies between the device and the host tier
    tier_store_ns: int = 0  # store reads at admission (the rest is bookkeeping)
    time_in_library_ns: int = 0

    @property
    def hit_rate(self) -> float:
        """Prefix hit tokens over looked-up prompt tokens (0.0 before any lookup)."""
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = dict(asdict(self))
        out["hit_rate"] = self.hit_rate
        return out

    def copy(self) -> Stats:
        return Stats(**asdict(self))

    @classmethod
    def of_model(cls, core: dict[str, int], model: ModelCounters, tiers: dict[str, int]) -> Stats:
        """A model's counters: the core's, the model's own and the tiers' (``tier_ns``, and the
        model's ``device_ns``, count as time in the library)."""
        own = asdict(model)
        tiers = dict(tiers)
        time_ns = core["time_in_library_ns"] + own.pop("device_ns") + tiers.get("tier_ns", 0)
        return cls(**{**core, "time_in_library_ns": time_ns}, **own, **tiers)

    def minus(self, earlier: Stats) -> Stats:
        """The counts since ``earlier`` (a snapshot of the same model)."""
        before = asdict(earlier)
        return Stats(**{name: value - before[name] for name, value in asdict(self).items()})


def human_bytes(nbytes: int) -> str:
    """``nbytes`` for a person: 512 B, 1.5 KiB, ... up to TiB."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@final
class DeviceClock:
    """``with clock:`` around a call that moves device memory adds its time, less what the core
    counted of it (``core_ns``, the core's own clock), to ``counters.device_ns``. Used under the
    model's lock; nested uses each count their own span, as separate calls would."""

    __slots__ = ("_core_ns", "_counters", "_started")

    def __init__(self, counters: ModelCounters, core_ns: Callable[[], int]) -> None:
        self._counters = counters
        self._core_ns = core_ns
        self._started: list[tuple[int, int]] = []

    def __enter__(self) -> None:
        self._started.append((perf_counter_ns(), self._core_ns()))

    def __exit__(self, *_: object) -> None:
        started, core_before = self._started.pop()
        spent = perf_counter_ns() - started - (self._core_ns() - core_before)
        self._counters.device_ns += max(spent, 0)
