"""Synthetic serving traces, driven through the public lifecycle API the way a continuous-batching
scheduler drives it.

:func:`multi_turn_trace` builds a seeded, deterministic trace of multi-turn chats: a few system
prompts shared with Zipf-like popularity, several LoRA adapters (and requests without one), and
turns whose prompt is the previous turn's prompt, its response and a new user message.

:func:`simulate` replays a trace on a :class:`~lifecycle.model.HybridModel`: admission with
``reclaim_prefix_blocks_for`` then ``alloc_sequence_for``, ``bind_adapter``, ``attach_prefix`` and
``grow``; decode steps one token at a time (with SSM snapshots at block boundaries on hybrid
models); preemption under memory pressure by swap-out to a :class:`~lifecycle.swap.tier.SwapTier`
and swap-in later (recompute when the tier refuses); retirement with compaction; caching and
freeing; invariant checks; teardown. It returns a :class:`SimulationResult` (summary and time
series). No kernel runs: the token ids of every response are part of the trace.

The library's time is reported in two parts. *Device copies* are the time spent in the device's
copies, memsets and synchronizes (SSM snapshots saved and restored, compaction, the zeroing of a new
sequence's SSM slot) plus the whole of every swap (its copies and checksums); they are measured when
the model runs on a :class:`~lifecycle.device.timing.CopyTimingDevice`, as :func:`simulation_model`
builds it. *Bookkeeping* is the rest: block tables, the prefix trie, refcounts, slots, snapshot and
adapter tables. On hybrid models the snapshot copies usually dominate; :func:`summary_rows` and the
JSON say which does.

The rooms: :mod:`~lifecycle.simulate.traces` (the traces), :mod:`~lifecycle.simulate.scheduler`
(the loop), :mod:`~lifecycle.simulate.report` (the result, its rows and its figure); every name is
importable from here.
"""

from __future__ import annotations

from lifecycle.device.timing import CopyTimingDevice
from lifecycle.simulate.report import SimulationResult, Summary, TimeSeries, figure, plot, summary_rows
from lifecycle.simulate.scheduler import COPY_CAUSES, SimulationOptions, simulate, simulation_model
from lifecycle.simulate.traces import (
    DEFAULT_ADAPTERS,
    MAX_TURN_SHRINK,
    Request,
    max_turns,
    multi_turn_trace,
    trace_for_model,
    trace_nbytes,
)

__all__ = [
    "COPY_CAUSES",
    "DEFAULT_ADAPTERS",
    "CopyTimingDevice",
    "MAX_TURN_SHRINK",
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
