"""pytest-benchmark suite of the ``HybridModel`` methods (``python -m pytest bench/test_bench_model.py``).

One benchmark per method of the protocol and per companion, on a small hybrid model on the host
device (the bookkeeping, not bandwidth, is what these track). A method that changes state is paired
with the call that undoes it (alloc with free, compact there with compact back), so every round
starts from the same state. Track it with ``python bench/regress.py save`` / ``check`` (see there).
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from lifecycle import NO_ADAPTER, AttentionLayer, HybridModel, ModelConfig, SequenceState, SSMLayer

BS = 16
PROMPT = np.arange(1, 1 + 64 * BS + 7, dtype=np.int32)  # 64 whole blocks and a tail


@pytest.fixture
def model() -> Iterator[HybridModel]:
    config = ModelConfig(
        layers=(
            AttentionLayer(num_kv_heads=2, head_dim=64),
            SSMLayer(h_state_bytes=16 << 10, conv_state_bytes=2 << 10),
        ),
        block_size=BS,
        num_blocks=4096,
        max_seqs=64,
        num_adapter_slots=2,
        num_snapshots=64,
    )
    m = HybridModel(config, "host")
    yield m
    m.teardown()


def cached(m: HybridModel) -> None:
    """Cache PROMPT (with an SSM snapshot at its 64 whole blocks) so lookups hit."""
    seq = m.alloc_sequence()
    m.attach_prefix(seq, PROMPT)
    m.grow(seq, len(PROMPT))
    m.save_snapshot(seq, 64 * BS)
    m.finish_sequence(seq)


def test_alloc_and_free_sequence(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    benchmark(lambda: model.free_sequence(model.alloc_sequence()))


def test_alloc_sequence_for_and_free(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    benchmark(lambda: model.free_sequence(model.alloc_sequence_for(2048)))


def test_attach_prefix_hit(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    cached(model)

    def attach() -> None:
        seq = model.alloc_sequence()
        model.attach_prefix(seq, PROMPT)
        model.free_sequence(seq)

    benchmark(attach)


def test_grow_64_blocks(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    def grow() -> None:
        seq = model.alloc_sequence()
        model.grow(seq, 64 * BS)
        model.free_sequence(seq)

    benchmark(grow)


def test_cache_and_free_sequence(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    def cache() -> None:
        seq = model.alloc_sequence()
        model.attach_prefix(seq, PROMPT)
        model.grow(seq, len(PROMPT))
        model.cache_sequence(seq)
        model.free_sequence(seq)

    benchmark(cache)


def test_finish_sequence(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    def finish() -> None:
        seq = model.alloc_sequence()
        model.attach_prefix(seq, PROMPT)
        model.grow(seq, len(PROMPT))
        model.finish_sequence(seq)

    benchmark(finish)


def test_compact_sequence_there_and_back(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    seq = model.alloc_sequence()
    home, away = seq.slot_idx, model.config.max_seqs - 1

    def compact() -> None:
        model.compact_sequence(seq, away)
        model.compact_sequence(seq, home)

    benchmark(compact)
    model.free_sequence(seq)


def test_retire_compact_detach_free(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    def retire() -> None:
        done, survivor = model.alloc_sequence(), model.alloc_sequence()
        model.retire_sequence(done)
        model.compact_sequence(survivor, done.slot_idx)
        model.detach_slot_for_reuse(done)
        model.free_sequence(done)
        model.free_sequence(survivor)

    benchmark(retire)


def test_reclaim_prefix_blocks(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    def reclaim() -> None:
        cached(model)
        model.reclaim_prefix_blocks(1 << 20)

    benchmark(reclaim)


def test_reclaim_prefix_blocks_for(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    cached(model)
    benchmark(lambda: model.reclaim_prefix_blocks_for(PROMPT, NO_ADAPTER, 80))


def test_save_sequence_state(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    seq = model.alloc_sequence()
    model.attach_prefix(seq, PROMPT)
    model.grow(seq, len(PROMPT))
    sink = io.BytesIO()

    def save() -> None:
        sink.seek(0)
        model.save_sequence_state(seq, sink)

    benchmark(save)
    model.free_sequence(seq)


def test_restore_sequence_state(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    seq = model.alloc_sequence()
    model.attach_prefix(seq, PROMPT)
    model.grow(seq, len(PROMPT))
    record = io.BytesIO()
    model.save_sequence_state(seq, record)
    num_blocks = seq.num_blocks
    model.free_sequence(seq)

    def restore() -> None:
        target: SequenceState = model.alloc_sequence()
        record.seek(0)
        model.restore_sequence_state(target, num_blocks, record)
        model.free_sequence(target)

    benchmark(restore)


@pytest.mark.parametrize(
    "method",
    [
        "kv_block_bytes", "num_free_blocks", "num_total_blocks", "high_speed_swap_dims", "poll_innerq",
        "bind_gpu_to_thread",
    ],
)
def test_cheap_queries(benchmark: BenchmarkFixture, model: HybridModel, method: str) -> None:
    benchmark(getattr(model, method))


def test_check_invariants(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    cached(model)
    live = [model.alloc_sequence() for _ in range(16)]
    for seq in live:
        model.attach_prefix(seq, PROMPT)
        model.grow(seq, len(PROMPT))
    benchmark(model.check_invariants)
    for seq in live:
        model.free_sequence(seq)


def test_build_and_teardown(benchmark: BenchmarkFixture, model: HybridModel) -> None:
    benchmark(lambda: HybridModel(model.config, "host").teardown())
