"""W4 (bench/w4.py) replayed through lifecycle: one batched call per engine step.

Every step one call covers the 256 running sequences: it appends each one's token, grows the
sequences whose new token starts a block (evicting least recently used cached blocks when short),
writes the new block ids into the engine's int32 block table (row = lane) and caches the blocks
that filled (what vLLM's ``allocate_slots`` does per request).

- ``lifecycle-model``: ``HybridModel.step(handles, tokens, table=table)`` from Python, the
  handles an int64 array the replay keeps by lane (``SequenceState.handle``).
- ``lifecycle``: ``KVCacheCore.step(handles, tokens, None, table, None, True)`` on the model's core.
- ``lifecycle-core-time``: the same steps as the core's own clock counts them (``core.time_ns()``
  before and after each call: time under the core's lock, the C loop without argument conversion
  or the GIL's release), reported beside both rows.

Admission and finish go through the public model API in both rows: ``alloc_sequence_for(P + G)``,
``attach_prefix(seq, prompt, grow_to=P + 1)``, ``cache_sequence(seq)`` (the prompt's full blocks
published once prefilled, as vLLM's ``allocate_slots`` and SGLang's ``checkpoint`` do at admission:
otherwise the first step of every new sequence would cache its whole prompt, admission work inside
the step's figure) and the sequence's ``block_table`` written into its lane's row;
``finish_sequence`` (which caches its full blocks, then releases it). They are timed
apart (``us_per_turnover``): the per-step figure is the step's bookkeeping, as the issue asks, and
W2/W3 already measure admission and finish. Each step call is bracketed by ``perf_counter_ns``
(the brackets' own cost, ~0.1 us per step, is inside the figure). The trace's arrays (prompts,
generated tokens by step) are prepared before the clock; the cyclic GC is off during a replay.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
from numpy.typing import NDArray
from w2 import no_gc
from w4 import DecodeRun, W4Trace, record

#: Replays per figure: the best counts, the median is reported beside it.
REPEATS = 3


def make_model(trace: W4Trace) -> Any:
    """A pure-attention model of one small layer (the replay measures bookkeeping, not bandwidth)
    with the prefix cache on, one slot per lane and rows wide enough for the longest sequence."""
    from lifecycle import AttentionLayer, HybridModel, ModelConfig
    from w4 import GEN_MAX, PROMPT_MAX

    return HybridModel(
        ModelConfig(
            layers=(AttentionLayer(num_kv_heads=1, head_dim=8),),
            block_size=trace.block_size,
            num_blocks=trace.num_blocks,
            max_seqs=trace.running,
            max_blocks_per_seq=-(-(PROMPT_MAX + GEN_MAX) // trace.block_size),
            name="w4",
        ),
        "host",
    )


def replay(trace: W4Trace, *, through_model: bool, step_tokens: NDArray[np.int32] | None = None) -> DecodeRun:
    """One timed W4 replay on a fresh model; ``through_model`` steps with ``HybridModel.step``,
    otherwise with ``KVCacheCore.step``."""
    from lifecycle import SequenceState

    model = make_model(trace)
    core = model.core
    tokens_by_step = trace.step_tokens() if step_tokens is None else step_tokens
    prompts = {r: trace.prompt(r) for r in range(trace.num_sequences)}
    table = np.zeros((trace.running, model.config.max_blocks_per_seq), dtype=np.int32)
    handles = np.zeros(trace.running, dtype=np.int64)
    lanes: list[SequenceState | None] = [None] * trace.running
    step = model.step if through_model else core.step
    alloc, attach, publish, finish = (
        model.alloc_sequence_for, model.attach_prefix, model.cache_sequence, model.finish_sequence
    )
    perf, core_clock = time.perf_counter_ns, core.time_ns
    step_ns = core_ns = turnover_ns = refused = turnovers = 0
    with no_gc():
        for s in range(trace.steps):
            admitted = trace.admitted_before(s)
            if admitted:
                started = perf()
                for r in admitted:
                    lane = int(trace.lanes[r])
                    previous = lanes[lane]
                    if previous is not None:
                        finish(previous)
                    prompt = prompts[r]
                    seq = alloc(len(prompt) + int(trace.gen_lens[r]))
                    attach(seq, prompt, grow_to=len(prompt) + 1)
                    publish(seq)
                    blocks = seq.block_table
                    table[lane, : len(blocks)] = blocks
                    handles[lane] = seq.handle
                    lanes[lane] = seq
                turnover_ns += perf() - started
                turnovers += len(admitted)
            tokens = tokens_by_step[s]
            core_before = core_clock()
            started = perf()
            if through_model:
                out = step(handles, tokens, table=table)
            else:
                out = step(handles, tokens, None, table, None, True)
            step_ns += perf() - started
            core_ns += core_clock() - core_before
            refused += len(out)
    _check_tables(model, lanes, table)
    hit_tokens = model.stats().prefix_hit_tokens
    for seq in lanes:
        if seq is not None:
            model.finish_sequence(seq)
    model.check_invariants()
    model.teardown()
    report = model.teardown_report
    if report is None or report.leaked:
        raise AssertionError(f"the W4 replay leaked: {report}")
    return DecodeRun(step_ns, turnover_ns, turnovers, refused, hit_tokens, core_ns)


def _check_tables(model: Any, lanes: list[Any], table: NDArray[np.int32]) -> None:
    """The engine's table holds every running sequence's block table, and its tokens are whole."""
    model.check_invariants()
    for lane, seq in enumerate(lanes):
        blocks = seq.block_table
        if not np.array_equal(table[lane, : len(blocks)], blocks):
            raise AssertionError(f"lane {lane}: the engine's table row differs from the sequence's block table")
        if seq.num_blocks * model.config.block_size < seq.num_tokens:
            raise AssertionError(f"lane {lane}: {seq.num_tokens} tokens in {seq.num_blocks} blocks")


def run(trace: W4Trace, repeats: int = REPEATS) -> list[dict[str, Any]]:
    """W4 through ``HybridModel.step`` and ``KVCacheCore.step``, and the core's own time for the
    same steps, each best of ``repeats``. Each step row carries ``vs_core_time``: the median over
    its replays of the replay's step time over the core's own time in it (one replay's two clocks
    see the same machine, so the ratio holds on a busy one)."""
    step_tokens = trace.step_tokens()
    model_runs = [replay(trace, through_model=True, step_tokens=step_tokens) for _ in range(repeats)]
    core_runs = [replay(trace, through_model=False, step_tokens=step_tokens) for _ in range(repeats)]
    rows = [record("lifecycle-model", model_runs, trace), record("lifecycle", core_runs, trace)]
    for row, runs in zip(rows, (model_runs, core_runs)):
        row["vs_core_time"] = round(statistics.median(r.step_ns / r.core_ns for r in runs), 3)
    own = record("lifecycle-core-time", core_runs + model_runs, trace, clock="core_ns")
    del own["us_per_turnover"]  # the core's clock times the steps only
    return [*rows, own]
