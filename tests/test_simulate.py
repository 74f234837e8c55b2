"""lifecycle.simulate: the multi-turn trace generator and the scheduler loop over the public API.

The loop runs with ``check_every=1``, so every scheduler step is followed by ``check_invariants()``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lifecycle.config import AttentionLayer, ModelConfig
from lifecycle.errors import ConfigError, LifecycleError, TornDown
from lifecycle.model import HybridModel
from lifecycle.presets import preset
from lifecycle.simulate import (
    COPY_CAUSES,
    CopyTimingDevice,
    Request,
    SimulationOptions,
    SimulationResult,
    figure,
    multi_turn_trace,
    plot,
    simulate,
    simulation_model,
    summary_rows,
    trace_for_model,
)

def short_trace(seed: int, num_chats: int, turns: int, **kwargs: Any) -> list[Request]:
    """A trace of short chats (system prompts of 16..48 tokens)."""
    lengths: dict[str, Any] = dict(system_prompt_tokens=(16, 48), user_tokens=(4, 12), response_tokens=(4, 16))
    return multi_turn_trace(seed, num_chats, turns, **{**lengths, **kwargs})


def by_chat(trace: list[Request]) -> dict[int, list[Request]]:
    chats: dict[int, list[Request]] = {}
    for request in trace:
        chats.setdefault(request.chat_id, []).append(request)
    return chats


# ---------------------------------------------------------------------------------------- trace


def test_trace_is_deterministic_for_a_seed() -> None:
    first = short_trace(7, 20, 3)
    second = short_trace(7, 20, 3)
    assert len(first) == len(second) == 60
    for a, b in zip(first, second):
        assert (a.chat_id, a.turn, a.adapter) == (b.chat_id, b.turn, b.adapter)
        assert np.array_equal(a.prompt, b.prompt) and np.array_equal(a.response, b.response)


def test_another_seed_gives_another_trace() -> None:
    first = short_trace(1, 5, 2)
    second = short_trace(2, 5, 2)
    assert any(not np.array_equal(a.prompt, b.prompt) for a, b in zip(first, second))


def test_each_turn_extends_the_previous_prompt_and_response() -> None:
    trace = short_trace(3, 12, 4)
    for turns in by_chat(trace).values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for before, after in zip(turns, turns[1:]):
            context = np.concatenate((before.prompt, before.response))
            assert np.array_equal(after.prompt[: context.shape[0]], context)
            assert after.prompt.shape[0] > context.shape[0]  # a new user message follows


def test_request_ids_follow_arrival_order() -> None:
    trace = short_trace(3, 12, 4)
    assert [r.request_id for r in trace] == list(range(len(trace)))


def test_chats_share_system_prompts_with_skewed_popularity() -> None:
    trace = multi_turn_trace(5, 200, 1, num_system_prompts=6, system_prompt_tokens=(32, 32),
                             user_tokens=(4, 8), response_tokens=(4, 8))
    heads = [r.prompt[:32].tobytes() for r in trace]
    counts = sorted((heads.count(h) for h in set(heads)), reverse=True)
    assert 1 < len(counts) <= 6
    assert counts[0] > 2 * counts[-1]


def test_a_chat_keeps_its_adapter_and_some_chats_use_none() -> None:
    trace = short_trace(4, 80, 3, adapters=("a", "b"), no_adapter_fraction=0.3)
    chats = by_chat(trace)
    for turns in chats.values():
        assert len({r.adapter for r in turns}) == 1
    adapters = {turns[0].adapter for turns in chats.values()}
    assert adapters == {None, "a", "b"}


def test_min_turns_varies_chat_length() -> None:
    trace = short_trace(4, 60, 5, min_turns=1)
    lengths = {len(turns) for turns in by_chat(trace).values()}
    assert min(lengths) >= 1 and max(lengths) <= 5 and len(lengths) > 1


def test_max_requests_cuts_chats_from_their_end() -> None:
    trace = short_trace(4, 50, 4, max_requests=37)
    assert len(trace) == 37
    for turns in by_chat(trace).values():
        assert [r.turn for r in turns] == list(range(len(turns)))


def test_token_ids_lie_in_the_vocabulary() -> None:
    trace = short_trace(4, 10, 2, vocab_size=50)
    tokens = np.concatenate([np.concatenate((r.prompt, r.response)) for r in trace])
    assert tokens.dtype == np.int32 and tokens.min() >= 1 and tokens.max() < 50


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_chats=-1),
        dict(turns=0),
        dict(min_turns=3, turns=2),
        dict(user_tokens=(0, 5)),
        dict(response_tokens=(9, 3)),
        dict(no_adapter_fraction=1.5),
        dict(adapters=("a", "a")),
        dict(adapters=(), no_adapter_fraction=0.5),
        dict(concurrent_chats=0),
        dict(max_requests=-2),
    ],
)
def test_trace_refuses_bad_arguments(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = dict(seed=0, num_chats=4, turns=2)
    args.update(kwargs)
    with pytest.raises(ConfigError):
        multi_turn_trace(**args)


def test_trace_for_model_fits_the_pool_and_the_adapter_slots() -> None:
    config = preset("tiny-hybrid")
    trace = trace_for_model(config, seed=0, num_requests=50, turns=3)
    assert len(trace) == 50
    quarter = config.num_blocks_resolved // 4 * config.block_size
    assert max(r.total_tokens for r in trace) <= quarter
    assert len({r.adapter for r in trace if r.adapter}) <= config.num_adapter_slots


def test_trace_for_model_without_adapter_slots_serves_the_base_model() -> None:
    trace = trace_for_model(preset("llama-like"), seed=0, num_requests=20, turns=2)
    assert all(r.adapter is None for r in trace)


def test_trace_for_model_refuses_a_pool_too_small_for_any_chat() -> None:
    with pytest.raises(ConfigError, match="too small"):
        trace_for_model(preset("tiny-hybrid", num_blocks=4), seed=0, num_requests=5, turns=8)


# ---------------------------------------------------------------------------------------- loop


def run(config: ModelConfig, trace: list[Request], **options: Any) -> tuple[HybridModel, SimulationResult]:
    model = HybridModel(config, "host")
    result = simulate(model, trace, SimulationOptions(check_every=1, **options))
    return model, result


def pressured_tiny() -> tuple[ModelConfig, list[Request]]:
    """A tiny hybrid model and long responses: a full batch outgrows the pool while decoding, so
    decode growth must preempt."""
    config = preset("tiny-hybrid", num_blocks=40, num_snapshots=16)
    trace = multi_turn_trace(1, 30, 2, adapters=("a", "b"), system_prompt_tokens=(8, 24), user_tokens=(2, 6),
                             response_tokens=(12, 24))
    return config, trace


def test_simulate_serves_every_request_and_leaks_nothing() -> None:
    config = preset("tiny-hybrid")
    trace = trace_for_model(config, seed=0, num_requests=40, turns=3)
    model, result = run(config, trace)
    summary = result.summary
    assert summary.requests == 40
    assert summary.leaked == 0 and result.teardown.live_sequences == 0
    assert summary.prompt_tokens == sum(r.prompt.shape[0] for r in trace)
    assert summary.generated_tokens == sum(r.max_new_tokens for r in trace)
    assert result.stats.sequences_allocated == result.stats.sequences_freed


def test_simulate_tears_the_model_down() -> None:
    config = preset("tiny-hybrid")
    model, _ = run(config, trace_for_model(config, seed=0, num_requests=5, turns=2))
    with pytest.raises(TornDown):
        model.num_free_blocks()


def test_later_turns_reuse_the_cached_conversation() -> None:
    config = preset("small-hybrid", num_blocks=512)
    trace = trace_for_model(config, seed=2, num_requests=30, turns=3)
    _, result = run(config, trace, max_live=4)
    assert result.summary.prefix_hit_rate > 0.2
    assert result.summary.snapshot_hits > 0


def test_an_attention_only_model_reuses_prefixes_without_snapshots() -> None:
    config = preset("llama-like")
    trace = trace_for_model(config, seed=2, num_requests=20, turns=3)
    _, result = run(config, trace, max_live=4)
    assert result.summary.prefix_hit_rate > 0
    assert result.summary.snapshots_saved == 0
    assert result.summary.leaked == 0


def test_memory_pressure_preempts_by_swap_and_swaps_back_in() -> None:
    config, trace = pressured_tiny()
    _, result = run(config, trace)
    summary = result.summary
    assert summary.swaps_out > 0
    assert summary.swaps_out == summary.swaps_in == summary.preemptions - summary.recomputes
    assert summary.swap_bytes == result.stats.bytes_swapped_out + result.stats.bytes_swapped_in
    assert summary.requests == len(trace) and summary.leaked == 0


def test_without_swap_preemption_recomputes() -> None:
    config, trace = pressured_tiny()
    _, result = run(config, trace, swap=False)
    summary = result.summary
    assert summary.preemptions > 0 and summary.recomputes == summary.preemptions
    assert summary.swaps_out == 0 and summary.recomputed_tokens > 0
    assert summary.requests == len(trace) and summary.leaked == 0


def test_a_spill_directory_takes_what_host_swap_cannot_and_is_left_empty(tmp_path: Any) -> None:
    config, trace = pressured_tiny()
    _, result = run(config, trace, swap_host_bytes=0, spill_dir=tmp_path)
    assert result.summary.swaps_out > 0
    assert list(tmp_path.iterdir()) == []


def test_retiring_sequences_compact_the_last_running_one_into_their_slot() -> None:
    config, trace = pressured_tiny()
    _, result = run(config, trace)
    assert 0 < result.summary.compactions < len(trace)


def test_invariants_are_checked_at_the_requested_interval() -> None:
    config = preset("tiny-hybrid")
    trace = trace_for_model(config, seed=0, num_requests=20, turns=2)
    model = HybridModel(config, "host")
    result = simulate(model, trace, SimulationOptions(check_every=3))
    assert result.summary.invariant_checks == result.summary.steps // 3 + 1


def test_the_time_series_has_one_sample_per_step() -> None:
    config = preset("tiny-hybrid")
    _, result = run(config, trace_for_model(config, seed=0, num_requests=20, turns=2))
    series = result.series
    assert len(series.step) == len(series.used_blocks) == len(series.running) == result.summary.steps
    assert all(0 <= used <= series.total_blocks for used in series.used_blocks)
    rates = series.hit_rate()
    assert rates[-1] == pytest.approx(result.summary.prefix_hit_rate)
    assert all(0.0 <= r <= 1.0 for r in series.hit_rate(window=5))


def test_on_request_done_counts_every_finished_request() -> None:
    config = preset("tiny-hybrid")
    trace = trace_for_model(config, seed=0, num_requests=15, turns=2)
    seen: list[int] = []
    simulate(HybridModel(config, "host"), trace, on_request_done=seen.append)
    assert seen == list(range(1, 16))


def test_a_request_longer_than_the_pool_is_refused_before_anything_runs() -> None:
    config = ModelConfig(layers=(AttentionLayer(num_kv_heads=1, head_dim=8),), block_size=4, num_blocks=8)
    trace = multi_turn_trace(0, 1, 1, adapters=(), no_adapter_fraction=1.0, system_prompt_tokens=(40, 40),
                             user_tokens=(4, 4), response_tokens=(4, 4))
    model = HybridModel(config, "host")
    with pytest.raises(ConfigError, match="request 0 reaches 48 tokens"):
        simulate(model, trace)
    assert model.teardown_report is not None and model.teardown_report.leaked == 0


@pytest.mark.parametrize(
    "kwargs", [dict(max_live=0), dict(check_every=-1), dict(snapshot_interval_blocks=-1), dict(watermark=1.0),
               dict(swap_host_bytes=-1)]
)
def test_options_refuse_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        SimulationOptions(**kwargs)


# ---------------------------------------------------------------------------------------- pool split and events


def test_the_pool_splits_into_live_cached_and_free_blocks_at_every_step() -> None:
    config, trace = pressured_tiny()
    _, result = run(config, trace)
    series = result.series
    assert len(series.live_blocks) == len(series.cached_blocks) == len(series.free_blocks) == result.summary.steps
    for live, cached, free, used in zip(series.live_blocks, series.cached_blocks, series.free_blocks,
                                        series.used_blocks):
        assert live + cached + free == series.total_blocks
        assert live + cached == used and min(live, cached, free) >= 0
    assert max(series.cached_blocks) > 0 and max(series.live_blocks) > 0


def test_the_series_marks_every_preemption_and_swap_in_at_its_step() -> None:
    config, trace = pressured_tiny()
    _, result = run(config, trace)
    series, summary = result.series, result.summary
    assert sum(series.swaps_out) == summary.swaps_out > 0
    assert sum(series.swaps_in) == summary.swaps_in
    assert sum(series.recomputes) == summary.recomputes
    assert len(series.swaps_out) == len(series.swaps_in) == len(series.recomputes) == summary.steps


def test_preemptions_by_recompute_are_marked_too() -> None:
    config, trace = pressured_tiny()
    _, result = run(config, trace, swap=False)
    assert sum(result.series.recomputes) == result.summary.recomputes > 0
    assert sum(result.series.swaps_out) == 0


# ---------------------------------------------------------------------------------------- time split


def test_library_time_is_device_copies_plus_bookkeeping_on_a_timing_device() -> None:
    config, trace = pressured_tiny()
    result = simulate(simulation_model(config), trace, SimulationOptions(check_every=1))
    summary = result.summary
    assert summary.copy_ns is not None and summary.bookkeeping_ns is not None
    assert summary.copy_ns + summary.bookkeeping_ns == summary.time_in_library_ns
    assert sorted(summary.copy_ns_by_cause) == sorted(COPY_CAUSES)
    assert sum(summary.copy_ns_by_cause.values()) == summary.copy_ns
    assert summary.dominant in ("device copies", "bookkeeping")


def test_snapshot_compaction_and_swap_copies_are_told_apart_on_a_hybrid_model() -> None:
    config, trace = pressured_tiny()
    by_cause = simulate(simulation_model(config), trace).summary.copy_ns_by_cause
    assert by_cause["snapshots"] > 0 and by_cause["compaction"] > 0 and by_cause["swap"] > 0


def test_an_attention_only_model_makes_no_snapshot_copies() -> None:
    config = preset("llama-like")
    trace = trace_for_model(config, seed=2, num_requests=10, turns=2)
    by_cause = simulate(simulation_model(config), trace).summary.copy_ns_by_cause
    assert by_cause["snapshots"] == 0 and by_cause["compaction"] == 0


def test_without_a_timing_device_the_split_is_not_reported() -> None:
    config = preset("tiny-hybrid")
    _, result = run(config, trace_for_model(config, seed=0, num_requests=5, turns=2))
    summary = result.summary
    assert (summary.copy_ns, summary.bookkeeping_ns, summary.dominant) == (None, None, None)
    assert summary.copy_ns_by_cause == {}


def test_simulation_model_runs_on_a_timing_device_that_simulate_closes() -> None:
    config = preset("tiny-hybrid")
    model = simulation_model(config)
    device = model.device
    assert isinstance(device, CopyTimingDevice) and device.kind == "host"
    simulate(model, trace_for_model(config, seed=0, num_requests=3, turns=1))
    with pytest.raises(LifecycleError):
        device.inner.alloc(64)


def test_simulation_model_refuses_an_unknown_device() -> None:
    with pytest.raises(ConfigError, match="device='tpu'"):
        simulation_model(preset("tiny-hybrid"), "tpu")


# ---------------------------------------------------------------------------------------- output


def test_the_json_carries_the_seed_and_the_pool_sizes() -> None:
    config = preset("tiny-hybrid", num_blocks=96)
    trace = trace_for_model(config, seed=5, num_requests=5, turns=2)
    out = simulate(HybridModel(config, "host"), trace, SimulationOptions(max_live=3), seed=5).to_json()
    assert out["seed"] == 5
    pools = out["pools"]
    assert (pools["kv_blocks"], pools["block_size"], pools["max_live"]) == (96, config.block_size, 3)
    assert pools["ssm_slots"] == config.max_seqs and pools["snapshots"] == config.num_snapshots
    assert pools["kv_block_bytes"] == config.kv_block_bytes() and pools["ssm_slot_bytes"] == config.ssm_slot_bytes()


def test_the_summary_rows_split_library_time_and_name_what_dominates() -> None:
    config, trace = pressured_tiny()
    rows = dict(summary_rows(simulate(simulation_model(config), trace, seed=1)))
    assert rows["trace seed"] == "1"
    assert "copies" in rows["library time per request"] and "bookkeeping" in rows["library time per request"]
    assert "SSM snapshots" in rows["  device copies by cause (µs/request)"]
    assert rows["  dominated by"].startswith(("device copies", "bookkeeping"))


def test_the_figure_stacks_the_pool_split_and_marks_swaps() -> None:
    pytest.importorskip("matplotlib")
    config, trace = pressured_tiny()
    result = simulate(HybridModel(config, "host"), trace)
    legend = figure(result).axes[0].get_legend()
    assert legend is not None
    labels = [text.get_text() for text in legend.get_texts()]
    assert labels[:3] == ["live: held by running sequences", "cached, evictable", "free"]
    assert f"swapped out ({result.summary.swaps_out})" in labels
    assert f"swapped in ({result.summary.swaps_in})" in labels


def test_plot_writes_the_figure_in_the_format_of_the_suffix(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    config = preset("tiny-hybrid")
    result = simulate(HybridModel(config, "host"), trace_for_model(config, seed=0, num_requests=5, turns=2))
    plot(result, tmp_path / "run.svg")
    assert (tmp_path / "run.svg").read_text().lstrip().startswith("<?xml")
