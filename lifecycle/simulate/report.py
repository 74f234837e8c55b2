"""What a simulation returns and how it is shown: the summary, the time series, the rows
``lifecycle simulate`` prints and the figure.

The library's time is reported in two parts. *Device copies* are the time spent in the device's
copies, memsets and synchronizes (SSM snapshots saved and restored, compaction, the zeroing of a new
sequence's SSM slot) plus the whole of every swap (its copies and checksums); they are measured when
the model runs on a :class:`~lifecycle.device.timing.CopyTimingDevice`, as
:func:`~lifecycle.simulate.simulation_model` builds it. *Bookkeeping* is the rest: block tables,
the prefix trie, refcounts, slots, snapshot and adapter tables. On hybrid models the snapshot copies
usually dominate; :func:`summary_rows` and the JSON say which does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from lifecycle.model import TeardownReport
from lifecycle.stats import Stats, human_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["SimulationResult", "Summary", "TimeSeries", "figure", "plot", "summary_rows"]

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
    #: Time in the host / store tiers (inside ``time_in_library_ns``): batched copies, store
    #: reads at admission, and the rest (tier keys, indexes, checks) as bookkeeping.
    tier_ns: int = 0
    tier_copy_ns: int = 0
    tier_store_ns: int = 0
    #: Per KV cache group at the end (``HybridModel.group_stats``: rule, blocks, free, cached,
    #: released from windows, kept at checkpoints, evicted, layers, bytes), group 0 first.
    kv_groups: list[dict[str, Any]] = field(default_factory=list)


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


def _tier_rows(s: Summary) -> list[tuple[str, str]]:
    """The tiers' hits and time per request: copies, store reads, bookkeeping."""
    def us(ns: int) -> float:
        return ns / 1e3 / s.requests if s.requests else 0.0

    bookkeeping = s.tier_ns - s.tier_copy_ns - s.tier_store_ns
    return [(
        "  tier time per request",
        f"{us(s.tier_ns):,.1f} µs = copies {us(s.tier_copy_ns):,.1f} + store reads {us(s.tier_store_ns):,.1f} + "
        f"bookkeeping {us(bookkeeping):,.1f}",
    )]


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
        *(_tier_rows(s) if "host_tier_blocks" in pools and pools["host_tier_blocks"] else []),
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
