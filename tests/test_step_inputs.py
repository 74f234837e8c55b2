"""What the hot-path calls take: numpy arrays, sequences, CPU tensors (torch, or anything with
DLPack or ``__array__``), each read or written in place where its layout allows; and an argument
of a type they cannot take refused with ``InvalidType`` (a ``LifecycleError`` and a ``TypeError``),
nothing changed.

The torch tests skip without torch (CI does not install it); the DLPack and ``__array__`` stand-ins
below run everywhere. Tables in CUDA memory are tested in tests/test_device_tables.py, over the
emulated driver.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from lifecycle.config import AttentionLayer, ModelConfig
from lifecycle.errors import InvalidId, InvalidType, LifecycleError
from lifecycle.model import HybridModel
from lifecycle.sequence import SequenceState

BS = 4
WIDTH = 8


@pytest.fixture
def model() -> Iterator[HybridModel]:
    config = ModelConfig(layers=(AttentionLayer(num_kv_heads=1, head_dim=8),), block_size=BS, num_blocks=32,
                         max_seqs=4, max_blocks_per_seq=WIDTH)
    m = HybridModel(config, "host")
    yield m
    m.check_invariants()
    m.teardown()
    assert m.teardown_report is not None


def admitted(model: HybridModel, count: int = 2) -> list[SequenceState]:
    """Sequences whose last block is full: the next step grows each by one block."""
    seqs = []
    for i in range(count):
        seq = model.alloc_sequence_for(WIDTH * BS)
        model.attach_prefix(seq, [100 * (i + 1) + t for t in range(BS)], grow_to=BS)
        seqs.append(seq)
    return seqs


class DLPackOnly:
    """A CPU tensor reachable through DLPack alone (no buffer protocol), as torch's is."""

    def __init__(self, array: npt.NDArray[Any]) -> None:
        self.array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class ArrayLike:
    """An object numpy reads through ``__array__`` (as it reads a CPU tensor)."""

    def __init__(self, array: npt.NDArray[Any]) -> None:
        self.array = array

    def __array__(self, dtype: Any = None, copy: Any = None) -> npt.NDArray[Any]:
        return self.array if dtype is None else self.array.astype(dtype)

    def __len__(self) -> int:
        return len(self.array)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.array.tolist())


def expected_rows(seqs: list[SequenceState]) -> list[list[int]]:
    return [seq.block_table.tolist() for seq in seqs]


HANDLE_FORMS: dict[str, Callable[[list[int]], Any]] = {
    "int64 array": lambda h: np.array(h, dtype=np.int64),
    "list": list,
    "tuple": tuple,
    "__array__": lambda h: ArrayLike(np.array(h, dtype=np.int64)),
}


@pytest.mark.parametrize("form", sorted(HANDLE_FORMS))
def test_step_takes_handles_in_any_integer_form(model: HybridModel, form: str) -> None:
    seqs = admitted(model)
    refused = model.step(HANDLE_FORMS[form]([s.handle for s in seqs]), [7, 8])
    assert refused.size == 0
    assert [s.num_tokens for s in seqs] == [BS + 1, BS + 1] and [s.num_blocks for s in seqs] == [2, 2]


@pytest.mark.parametrize("form", ["list", "tuple", "int64 array", "__array__"])
def test_step_takes_tokens_counts_and_rows_in_any_integer_form(model: HybridModel, form: str) -> None:
    seqs = admitted(model)
    make = HANDLE_FORMS[form]
    table = np.full((4, WIDTH), -1, dtype=np.int32)
    refused = model.step(seqs, make([7, 8, 9]), counts=make([1, 2]), table=table, rows=make([3, 1]))
    assert refused.size == 0 and [s.num_tokens for s in seqs] == [BS + 1, BS + 2]
    assert table[3, 1] == seqs[0].block_table[1] and table[1, 1] == seqs[1].block_table[1]
    assert (table[[0, 2]] == -1).all()


def test_step_writes_a_dlpack_table_in_place(model: HybridModel) -> None:
    seqs = admitted(model)
    table = np.zeros((2, WIDTH), dtype=np.int32)
    assert model.step(seqs, [7, 8], table=DLPackOnly(table)).size == 0
    assert [row[:2] for row in table.tolist()] == [[0, s.block_table[1]] for s in seqs]  # the new block ids


def test_step_writes_a_buffer_protocol_table_in_place(model: HybridModel) -> None:
    seqs = admitted(model)
    table = np.zeros((2, WIDTH), dtype=np.int32)
    assert model.step(seqs, [7, 8], table=table.data).size == 0
    assert table[:, 1].tolist() == [s.block_table[1] for s in seqs]


WRONG_TYPES: dict[str, tuple[dict[str, Any], str]] = {
    "seqs as a str": ({"seqs": "abc"}, "seqs must be SequenceStates, or their handles as ints"),
    "seqs as floats": ({"seqs": [1.5, 2.5]}, "seqs must be SequenceStates"),
    "seqs mixing sequences and others": ({"seqs": "mixed"}, "seqs must be SequenceStates"),
    "seqs not sized": ({"seqs": 5}, "seqs must be SequenceStates"),
    "tokens as None": ({"tokens": None}, "tokens must be ints"),
    "tokens as floats": ({"tokens": np.array([1.0, 2.0])}, "tokens must be ints"),
    "tokens as an object": ({"tokens": object()}, "tokens must be ints"),
    "counts as strs": ({"counts": ["1", "1"]}, "counts must be ints"),
    "rows as floats": ({"rows": [0.0, 1.0]}, "rows must be ints"),
    "a float table": ({"table": np.zeros((2, WIDTH))}, "table must be int32 in host memory, got ndarray of float64"),
    "an int64 table": ({"table": np.zeros((2, WIDTH), dtype=np.int64)}, "int64"),
    "a table of another kind": ({"table": "table"}, "str has neither the buffer protocol"),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_a_wrong_type_is_a_type_error_and_changes_nothing(model: HybridModel, case: str) -> None:
    seqs = admitted(model)
    options, message = WRONG_TYPES[case]
    arguments: dict[str, Any] = {"seqs": seqs, "tokens": [7, 8], **options}
    if arguments["seqs"] == "mixed":
        arguments["seqs"] = [seqs[0], seqs[1].handle]
    if "rows" in options and "table" not in options:
        arguments["table"] = np.zeros((2, WIDTH), dtype=np.int32)
    before = [(s.num_tokens, s.block_table.tolist()) for s in seqs], model.num_free_blocks()
    with pytest.raises(InvalidType, match=message) as raised:
        model.step(arguments.pop("seqs"), arguments.pop("tokens"), **arguments)
    assert isinstance(raised.value, TypeError) and isinstance(raised.value, LifecycleError)
    assert isinstance(raised.value, InvalidId)  # what callers already catch
    assert ([(s.num_tokens, s.block_table.tolist()) for s in seqs], model.num_free_blocks()) == before


def test_a_wrong_value_of_a_right_type_stays_a_value_error(model: HybridModel) -> None:
    seqs = admitted(model)
    with pytest.raises(InvalidId, match="3 tokens for 2 requests") as raised:
        model.step(seqs, [7, 8, 9])
    assert not isinstance(raised.value, TypeError)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, s: m.attach_prefix(s, "not tokens"), "attach_prefix: prompt must be ints"),
        (lambda m, s: m.attach_prefix(s, [1.5, 2.5]), "attach_prefix: prompt must be ints"),
        (lambda m, s: m.reclaim_prefix_blocks_for(object(), -1, 1), "reclaim_prefix_blocks_for: prompt must be ints"),
        (lambda m, s: m.evict_blocks(["1"]), "evict_blocks: block_ids must be ints"),
        (lambda m, s: m.write_block_table(s, object()), "write_block_table: out must be int32"),
        (lambda m, s: m.write_block_table(s, np.zeros(WIDTH)), "write_block_table: out must be int32"),
        (lambda m, s: m.write_block_tables([s], object()), "write_block_tables: object has neither"),
    ],
    ids=["attach str", "attach floats", "reclaim object", "evict strs", "write object", "write floats",
         "write tables object"],
)
def test_the_other_hot_path_calls_refuse_a_wrong_type_as_a_type_error(
    model: HybridModel, call: Callable[[HybridModel, SequenceState], Any], message: str
) -> None:
    seq = model.alloc_sequence_for(WIDTH * BS)
    free = model.num_free_blocks()
    with pytest.raises(InvalidType, match=message) as raised:
        call(model, seq)
    assert isinstance(raised.value, TypeError)
    assert model.num_free_blocks() == free and seq.num_tokens == 0
    model.free_sequence(seq)


# -- torch, where installed ------------------------------------------------------------------------


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


def test_step_takes_torch_handles_tokens_and_table_and_writes_the_table_in_place(
    model: HybridModel, torch: Any
) -> None:
    seqs = admitted(model)
    table = torch.zeros((2, WIDTH), dtype=torch.int32)
    handles = torch.tensor([s.handle for s in seqs], dtype=torch.int64)
    refused = model.step(handles, torch.tensor([7, 8], dtype=torch.int32), table=table)
    assert refused.size == 0
    assert table[:, 1].tolist() == [s.block_table[1] for s in seqs]  # the tensor's own memory was written


def test_a_strided_torch_table_with_contiguous_rows_is_written_in_place(model: HybridModel, torch: Any) -> None:
    seqs = admitted(model)
    wide = torch.zeros((4, WIDTH), dtype=torch.int32)
    assert model.step(seqs, [7, 8], table=wide[::2]).size == 0  # every other row: rows stay contiguous
    assert wide[[0, 2], 1].tolist() == [s.block_table[1] for s in seqs] and wide[[1, 3]].eq(0).all()


def test_torch_prompts_and_ids_are_taken_by_the_other_calls(model: HybridModel, torch: Any) -> None:
    seq = model.alloc_sequence_for(WIDTH * BS)
    prompt = torch.arange(1, 3 * BS + 2, dtype=torch.int32)
    assert model.reclaim_prefix_blocks_for(prompt, -1, 4).target >= 0
    model.attach_prefix(seq, prompt, grow_to=len(prompt))
    row = torch.full((WIDTH,), -1, dtype=torch.int32)
    assert model.write_block_table(seq, row, pad=0) == seq.num_blocks
    assert row[: seq.num_blocks].tolist() == seq.block_table.tolist()
    model.finish_sequence(seq)
    assert model.evict_blocks(torch.tensor(seq.block_table[:1].tolist())).size >= 0


def test_a_torch_float_table_is_a_type_error(model: HybridModel, torch: Any) -> None:
    seqs = admitted(model)
    with pytest.raises(InvalidType, match="float32, expected int32"):
        model.step(seqs, [7, 8], table=torch.zeros((2, WIDTH), dtype=torch.float32))
    assert [s.num_tokens for s in seqs] == [BS, BS]
