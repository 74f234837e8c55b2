"""W2 (SPEC §7) through the ``HybridModel`` API, to compare with the trie + pool replay of w2.py.

The same trace and rules, but every step is a public model call a scheduler would make:
``alloc_sequence_for`` (prompt + generated tokens) + ``attach_prefix(prompt, grow_to=...)`` at admission (the
cached prefix, then the rest of the blocks, evicting when short: the same as ``attach_prefix`` + ``grow``),
``append_tokens`` for the generated tokens, ``cache_sequence`` + ``free_sequence`` at finish.
The model is pure attention (one small layer: the replay measures bookkeeping, not bandwidth).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from w2 import LIFECYCLE_REPEATS, REFERENCE_HIT_TOKENS, REFERENCE_PROMPT_TOKENS, W2Trace, load_w2, no_gc, result

from lifecycle import AttentionLayer, HybridModel, ModelConfig, SequenceState


def replay_model(trace: W2Trace, separate_calls: bool = False) -> tuple[float, int, int]:
    """One timed replay on a fresh model; returns (seconds, hit tokens, blocks evicted). A request
    finishes with ``finish_sequence``, or ``separate_calls`` of ``cache_sequence`` then
    ``free_sequence`` (whose cached path is pinned in between)."""
    config = ModelConfig(
        layers=(AttentionLayer(num_kv_heads=1, head_dim=8),),
        block_size=trace.block_size,
        num_blocks=trace.num_blocks,
        max_seqs=trace.max_live,
        name="w2",
    )
    model = HybridModel(config, "host")
    requests = [
        (
            trace.tokens[i][: trace.prompt_lens[i]],
            trace.tokens[i][trace.prompt_lens[i] :],
            trace.prompt_lens[i] + trace.gen_len,
        )
        for i in range(trace.num_requests)
    ]
    live: deque[SequenceState] = deque()
    max_live = trace.max_live
    alloc, attach = model.alloc_sequence_for, model.attach_prefix
    cache, free, finish_sequence = model.cache_sequence, model.free_sequence, model.finish_sequence

    def finish() -> None:
        seq = live.popleft()
        if separate_calls:
            cache(seq)
            free(seq)
        else:
            finish_sequence(seq)

    with no_gc():  # the same timing rules as the trie-level replay in w2.py
        start = time.perf_counter()
        for prompt, generated, total in requests:
            if len(live) == max_live:
                finish()
            seq = alloc(total)
            attach(seq, prompt, grow_to=total)
            seq.append_tokens(generated)
            live.append(seq)
        while live:
            finish()
        seconds = time.perf_counter() - start
    model.check_invariants()
    stats = model.stats()
    model.teardown()
    report = model.teardown_report
    if report is None or report.leaked:
        raise AssertionError(f"W2 through the model leaked: {report}")
    return seconds, stats.prefix_hit_tokens, stats.blocks_evicted


def run(trace_path: Path, repeats: int = LIFECYCLE_REPEATS) -> list[dict[str, Any]]:
    """Best of ``repeats`` replays, as w2.py reports the trie-level figure (the median is given
    beside it); asserts the hit tokens equal the peers' to the token."""
    trace = load_w2(trace_path)
    prompt_tokens = sum(trace.prompt_lens)
    runs = [replay_model(trace) for _ in range(repeats)]
    seconds = min(r[0] for r in runs)
    median_us = statistics.median(r[0] for r in runs) / trace.num_requests * 1e6
    _, hit_tokens, blocks_evicted = runs[0]
    if prompt_tokens != REFERENCE_PROMPT_TOKENS or hit_tokens != REFERENCE_HIT_TOKENS:
        raise AssertionError(
            f"W2 (model API) hit {hit_tokens} of {prompt_tokens} prompt tokens; the peers hit "
            f"{REFERENCE_HIT_TOKENS} of {REFERENCE_PROMPT_TOKENS}"
        )
    record = result("lifecycle-model", seconds, hit_tokens, prompt_tokens, blocks_evicted, trace.num_requests)
    record["workload"] = "W2-model"
    record["median_us_per_request"] = round(median_us, 3)
    return [record]
