"""pytest-benchmark suite of swap (``python -m pytest bench/test_bench_swap.py``).

Save and restore of a 4k-token sequence of a 4-layer llama-like model on the host device, beside a
numpy copy of the same bytes, tracked over time with ``python bench/regress.py save`` / ``check``.
The fraction table comes from ``swap_bench.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, cast

import numpy as np
import numpy.typing as npt
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

sys.path.insert(0, str(Path(__file__).resolve().parent))

from swap_bench import fill_random, layer_ranges, llama_like, prefaulted  # noqa: E402
from lifecycle import swap  # noqa: E402
from lifecycle.device import open_device  # noqa: E402
from lifecycle.model import HybridModel  # noqa: E402
from lifecycle.sequence import SequenceState  # noqa: E402
from lifecycle.swap.tier import _ViewReader, _ViewWriter  # noqa: E402

TOKENS = 4096

Setup = tuple[HybridModel, SequenceState, npt.NDArray[np.uint8]]


@pytest.fixture(scope="module")
def saved() -> Iterator[Setup]:
    model = HybridModel(llama_like(4, TOKENS), open_device("host"))
    seq = model.alloc_sequence()
    fill_random(model, seq, TOKENS, np.random.default_rng(0))
    record = prefaulted(swap.record_nbytes(model.config, seq.num_blocks, seq.num_tokens))
    model.save_sequence_state(seq, cast(BinaryIO, _ViewWriter(record.data)))
    yield model, seq, record
    model.teardown()


def test_memcpy_of_the_same_bytes(benchmark: BenchmarkFixture, saved: Setup) -> None:
    model, seq, record = saved
    views = [model.device.device_array(a, (n,), np.uint8) for a, n in layer_ranges(model, seq)]
    out = prefaulted(record.nbytes)

    def copy() -> None:
        start = 0
        for view in views:
            np.copyto(out[start : start + view.nbytes], view)
            start += view.nbytes

    benchmark(copy)


def test_save(benchmark: BenchmarkFixture, saved: Setup) -> None:
    model, seq, record = saved
    benchmark(lambda: model.save_sequence_state(seq, cast(BinaryIO, _ViewWriter(record.data))))


def test_restore(benchmark: BenchmarkFixture, saved: Setup) -> None:
    model, seq, record = saved

    def restore() -> None:
        target = model.alloc_sequence()
        model.restore_sequence_state(target, seq.num_blocks, cast(BinaryIO, _ViewReader(record.data)))
        model.free_sequence(target)

    benchmark(restore)
    target = model.alloc_sequence()
    model.restore_sequence_state(target, seq.num_blocks, cast(BinaryIO, _ViewReader(record.data)))
    assert target.tokens.tolist() == seq.tokens.tolist()
    model.free_sequence(target)
