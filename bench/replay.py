"""W2 and W3 (SPEC §7) replayed through lifecycle, at the core and through ``HybridModel``.

Both workloads follow the same rules (``../shared/bench/README.md``): requests in order, a FIFO
window of ``max_live`` live requests; a finishing request caches every full block of its prompt and
generated tokens, then releases its references; admission reuses the longest cached prefix in
whole blocks, never the block holding the prompt's last token, and allocates the rest of the
blocks it will hold, evicting least recently used unpinned cached blocks when short.

- ``replay_core``: the KV cache core's own calls, one C call each: ``admit`` (a new record with
  its cached prefix and the rest of its blocks) and ``finish`` (cache, unpin, release). This is
  the trie-level figure the peers' pool/tree replays compare with.
- ``replay_model``: every step a public ``HybridModel`` call a scheduler makes:
  ``alloc_sequence_for``, ``attach_prefix(prompt, grow_to=...)``, ``append_tokens`` of the generated
  tokens, ``finish_sequence``.

Trace preparation (the per-request arguments) happens before the clock, as for the peers; the
cyclic GC is off during a replay.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray
from w2 import no_gc

Replay = Callable[["PrefixTrace"], tuple[float, int, int]]


class PrefixTrace(Protocol):
    """What a prefix-cache replay reads of a trace (``w2.W2Trace`` and ``w3.W3Trace`` both are)."""

    @property
    def tokens(self) -> list[NDArray[np.int32]]: ...
    @property
    def prompt_lens(self) -> list[int]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def max_live(self) -> int: ...
    @property
    def num_requests(self) -> int: ...
    def blocks_needed(self, i: int) -> int: ...
    def reusable_blocks(self, i: int) -> int: ...


def replay_core(trace: PrefixTrace, *, events: bool = False, core: Any = None) -> tuple[float, int, int]:
    """One timed replay through ``KVCacheCore.admit`` / ``finish`` on a fresh pool (or on ``core``,
    a fresh core the caller built, e.g. with KV cache groups); returns (seconds, hit tokens, blocks
    evicted). ``events``: the core logs KV events and the replay drains them after every request,
    as an engine publishing them each step would."""
    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore

    if core is None:
        core = KVCacheCore(BlockPool(trace.num_blocks), trace.block_size, events=events)
    requests = core_requests(trace)
    max_live = trace.max_live
    stored = 0
    with no_gc():
        start = time.perf_counter()
        if events:
            stored = drive_core_events(core, requests, max_live)
        else:
            drive_core(core, requests, max_live)
        seconds = time.perf_counter() - start
    if events and stored != core.counters()["blocks_cached"] + core.counters()["blocks_evicted"]:
        raise AssertionError(f"{stored} hashes in the events, but the core cached and evicted a different count")
    core.check_invariants()
    check_no_leak(core)
    counters = core.counters()
    return seconds, counters["prefix_hit_tokens"], counters["blocks_evicted"]


def check_no_leak(core: Any) -> None:
    """After a replay: every block of every KV cache group's pool is free or cached."""
    for group in core.group_stats():
        if group["num_free"] + group["num_cached"] != group["num_blocks"]:
            raise AssertionError(
                f"leaked blocks in group {group['group']}: {group['num_free']} free + {group['num_cached']} cached "
                f"!= {group['num_blocks']}"
            )


def replay_model(trace: PrefixTrace, *, host_tier_blocks: int = 0) -> tuple[float, int, int]:
    """One timed replay through the public ``HybridModel`` API on a fresh pure-attention model
    (one small layer: the replay measures bookkeeping, not bandwidth); returns (seconds, hit
    tokens, blocks evicted). With ``host_tier_blocks``, evicted blocks go to a host tier of that
    many blocks and come back at admission: hit tokens count the device's and the tier's."""
    model = new_model(trace, host_tier_blocks)
    requests = model_requests(trace)
    with no_gc():
        start = time.perf_counter()
        drive_model(model, requests, trace.max_live)
        seconds = time.perf_counter() - start
    model.check_invariants()
    stats = model.stats()
    model.teardown()
    report = model.teardown_report
    if report is None or report.leaked:
        raise AssertionError(f"the model replay leaked: {report}")
    return seconds, stats.prefix_hit_tokens + stats.blocks_promoted * trace.block_size, stats.blocks_evicted


def core_requests(trace: PrefixTrace) -> list[tuple[NDArray[np.int32], int, int]]:
    """The arguments of each request's ``admit``: its tokens, blocks held, most blocks reused."""
    return [(trace.tokens[i], trace.blocks_needed(i), trace.reusable_blocks(i)) for i in range(trace.num_requests)]


def drive_core(core: Any, requests: list[tuple[NDArray[np.int32], int, int]], max_live: int) -> None:
    """The core-level replay loop (untimed here: ``replay_core`` and bench/callgrind.py time or count it)."""
    live: deque[int] = deque()
    admit, finish = core.admit, core.finish
    for tokens, needed, reusable in requests:
        if len(live) == max_live:
            finish(live.popleft())
        live.append(admit(tokens, needed, reusable))
    while live:
        finish(live.popleft())


def drive_core_events(core: Any, requests: list[tuple[NDArray[np.int32], int, int]], max_live: int) -> int:
    """:func:`drive_core` on a core with events on, draining them after every request as an engine
    publishing them each step would; returns the hashes the drained events carried."""
    live: deque[int] = deque()
    admit, finish, take = core.admit, core.finish, core.take_events
    stored = 0
    for tokens, needed, reusable in requests:
        if len(live) == max_live:
            finish(live.popleft())
        live.append(admit(tokens, needed, reusable))
        stored += len(take().hashes)
    while live:
        finish(live.popleft())
    stored += len(take().hashes)
    return stored


def new_model(trace: PrefixTrace, host_tier_blocks: int = 0) -> Any:
    """The pure-attention model a model replay runs on (one small layer, on the host device)."""
    from lifecycle import AttentionLayer, HybridModel, ModelConfig

    config = ModelConfig(
        layers=(AttentionLayer(num_kv_heads=1, head_dim=8),),
        block_size=trace.block_size,
        num_blocks=trace.num_blocks,
        max_seqs=trace.max_live,
        name="replay",
    )
    return HybridModel(config, "host", host_tier_blocks=host_tier_blocks)


def model_requests(trace: PrefixTrace) -> list[tuple[NDArray[np.int32], NDArray[np.int32], int]]:
    """Per request: its prompt, its generated tokens and their total count."""
    requests = []
    for i in range(trace.num_requests):
        tokens, prompt_len = trace.tokens[i], trace.prompt_lens[i]
        requests.append((tokens[:prompt_len], tokens[prompt_len:], len(tokens)))
    return requests


def drive_model(model: Any, requests: list[tuple[NDArray[np.int32], NDArray[np.int32], int]], max_live: int) -> None:
    """The model replay loop: the public calls a scheduler makes per request."""
    live: deque[Any] = deque()
    alloc, attach, finish = model.alloc_sequence_for, model.attach_prefix, model.finish_sequence
    for prompt, generated, total in requests:
        if len(live) == max_live:
            finish(live.popleft())
        seq = alloc(total)
        attach(seq, prompt, grow_to=total)
        seq.append_tokens(generated)
        live.append(seq)
    while live:
        finish(live.popleft())


def record(workload: str, library: str, runs: list[tuple[float, int, int]], trace: PrefixTrace) -> dict[str, Any]:
    """The JSON record of ``runs`` (best of them, the median beside it) in the shape every library
    reports; replays that disagree on their hits are a bug."""
    hits = {r[1] for r in runs}
    if len(hits) != 1:
        raise AssertionError(f"{workload} {library}: replays of one trace hit {sorted(hits)} tokens")
    prompt_tokens = sum(trace.prompt_lens)
    seconds = min(r[0] for r in runs)
    return {
        "workload": workload,
        "library": library,
        "us_per_request": round(seconds / trace.num_requests * 1e6, 3),
        "median_us_per_request": round(statistics.median(r[0] for r in runs) / trace.num_requests * 1e6, 3),
        "hit_rate": round(runs[0][1] / prompt_tokens, 6),
        "hit_tokens": runs[0][1],
        "prompt_tokens": prompt_tokens,
        "blocks_evicted": runs[0][2],
        "replays": len(runs),
    }


def run_events(workload: str, trace: PrefixTrace, repeats: int) -> list[dict[str, Any]]:
    """The core with events off and on (drained after every request), replays interleaved so
    that drift of a noisy machine hits both alike; the second record carries the ratio of the
    best times and of the medians."""
    off: list[tuple[float, int, int]] = []
    on: list[tuple[float, int, int]] = []
    for _ in range(repeats):
        off.append(replay_core(trace))
        on.append(replay_core(trace, events=True))
    plain = record(workload, "lifecycle", off, trace)
    logged = record(workload, "lifecycle-events", on, trace)
    logged["overhead_best"] = round(logged["us_per_request"] / plain["us_per_request"] - 1, 4)
    logged["overhead_median"] = round(logged["median_us_per_request"] / plain["median_us_per_request"] - 1, 4)
    return [plain, logged]


def run_tiers(workload: str, trace: PrefixTrace, multiples: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    """The model with a host tier of each multiple of the device pool (0: none): hit rate and
    time per request."""
    records = []
    for multiple in multiples:
        blocks = multiple * trace.num_blocks
        runs = [replay_model(trace, host_tier_blocks=blocks) for _ in range(repeats)]
        name = f"lifecycle-model host tier {multiple}x" if multiple else "lifecycle-model"
        entry = record(workload, name, runs, trace)
        entry["host_tier_blocks"] = blocks
        records.append(entry)
    return records


def run(workload: str, trace: PrefixTrace, repeats: int, *, model: bool) -> dict[str, Any]:
    """``repeats`` replays of ``trace`` at the core (``model=False``) or through the model."""
    replay: Replay = replay_model if model else replay_core
    runs = [replay(trace) for _ in range(repeats)]
    return record(workload, "lifecycle-model" if model else "lifecycle", runs, trace)
