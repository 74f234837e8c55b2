"""Engine-owned block tables (``HybridModel.write_block_tables``): a host table is written in place;
a CUDA table gets the rows from the model's pinned staging in one host-to-device copy per call, on
the calling thread's copy stream, and the staging is refilled only once that copy ran.

The CUDA tests need ``LIFECYCLE_TEST_DEVICE=cuda`` (the emulated driver in CI, through
tests/test_device_emulated.py): the engine's table is allocated through the driver itself, not
through the model's device, and handed over by ``__cuda_array_interface__``, as a torch or CuPy
tensor is. The ``gpu`` test does the same with a torch tensor on a real GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from devices import (  # noqa: F401  (fixtures)
    EngineStream,
    Emulator,
    device,
    emu,
    engine,
    live_allocations,
    loaded_emulator,
)
from lifecycle import AttentionLayer, HybridModel, ModelConfig, SequenceState
from lifecycle.device.base import Device
from lifecycle.device.host import HostDevice
from lifecycle.errors import ForeignSequence, InvalidId, SequenceStateError

BS = 4
WIDTH = 6
CONFIG = ModelConfig(
    layers=(AttentionLayer(num_kv_heads=1, head_dim=8),),
    block_size=BS,
    num_blocks=48,
    max_seqs=8,
    max_blocks_per_seq=WIDTH + 2,
    name="tables",
)
UNTOUCHED = 99  # what the engine's table holds where nothing was written


@pytest.fixture
def model(device: Device) -> Iterator[HybridModel]:
    """A model on the device under test; after the test it must tear down leaving no allocation
    and no event of the device's behind."""
    m = HybridModel(CONFIG, device)
    yield m
    if m.teardown_report is None:
        m.check_invariants()
        m.teardown()
    assert m.teardown_report is not None and m.teardown_report.leaked == 0, m.teardown_report
    assert live_allocations(device) == 0
    assert getattr(device, "live_events") == 0


@pytest.fixture
def cuda_model(model: HybridModel) -> HybridModel:
    if model.device.kind != "cuda":
        pytest.skip("needs LIFECYCLE_TEST_DEVICE=cuda (the emulated driver in CI)")
    return model


def serve(model: HybridModel, *num_tokens: int) -> list[SequenceState]:
    """One sequence per count, each holding that many tokens of its own (no shared prefix)."""
    seqs = []
    for i, n in enumerate(num_tokens):
        seq = model.alloc_sequence_for(n)
        model.attach_prefix(seq, [1000 * (i + 1) + t for t in range(n)], grow_to=n)
        seqs.append(seq)
    model.check_invariants()
    return seqs


def free(model: HybridModel, seqs: list[SequenceState]) -> None:
    for seq in seqs:
        model.free_sequence(seq)
    model.check_invariants()


def expected_row(seq: SequenceState, pad: int | None, row: npt.NDArray[np.int32]) -> list[int]:
    ids: list[int] = seq.block_table.tolist()
    tail = [pad] * (len(row) - len(ids)) if pad is not None else row[len(ids):].tolist()
    return ids + tail


def host_table(num_rows: int = 5, width: int = WIDTH) -> npt.NDArray[np.int32]:
    return np.full((num_rows, width), UNTOUCHED, dtype=np.int32)


class CpuTensor:
    """A CPU tensor reachable through DLPack only (no buffer protocol), as torch's is."""

    def __init__(self, array: npt.NDArray[np.int32]) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


# -- host tables -------------------------------------------------------------------------------


def test_rows_get_each_sequences_block_ids_padded_and_other_rows_stay(model: HybridModel) -> None:
    seqs = serve(model, 5, 9, 13)
    table = host_table()
    model.write_block_tables(seqs, table, pad=0)
    for row, seq in enumerate(seqs):
        assert table[row].tolist() == expected_row(seq, 0, table[row])
    assert (table[3:] == UNTOUCHED).all()
    free(model, seqs)


def test_rows_place_each_sequence_and_without_pad_the_tail_is_left_alone(model: HybridModel) -> None:
    seqs = serve(model, 5, 9)
    table = host_table()
    model.write_block_tables(seqs, table, rows=[4, 1])
    assert table[4].tolist() == seqs[0].block_table.tolist() + [UNTOUCHED] * (WIDTH - 2)
    assert table[1].tolist() == seqs[1].block_table.tolist() + [UNTOUCHED] * (WIDTH - 3)
    assert (table[[0, 2, 3]] == UNTOUCHED).all()
    free(model, seqs)


def test_a_cpu_tensor_through_dlpack_is_written_in_place(model: HybridModel) -> None:
    seqs = serve(model, 9)
    table = host_table(2)
    model.write_block_tables(seqs, CpuTensor(table), rows=[1], pad=3)
    assert table[1].tolist() == expected_row(seqs[0], 3, table[1])
    assert (table[0] == UNTOUCHED).all()
    free(model, seqs)


def test_an_empty_batch_writes_nothing(model: HybridModel) -> None:
    table = host_table()
    model.write_block_tables([], table, pad=0)
    assert (table == UNTOUCHED).all()


def _read_only(table: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    view = table.view()
    view.flags.writeable = False
    return view


def _same(table: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    return table


Table = npt.NDArray[np.int32]
HOST_REFUSALS: dict[str, tuple[Callable[[Table], Any], dict[str, Any], str]] = {
    "wrong dtype": (lambda t: t.astype(np.int64), {}, "the table holds int64, expected int32"),
    "1-D": (lambda t: t[0], {}, r"the table is 1-D, expected 2-D \(rows, blocks\)"),
    "rows not contiguous": (lambda t: t[:, ::2], {}, "rows are not contiguous"),
    "read-only": (_read_only, {}, "read-only"),
    "row out of range": (_same, {"rows": [0, 5]}, r"row 5 \(sequence 1\) out of range \[0, 5\)"),
    "a row twice": (_same, {"rows": [2, 2]}, "row 2 is given to more than one sequence"),
    "rows of another length": (_same, {"rows": [0]}, "rows must be 2 ints"),
    "too narrow": (lambda t: t[:, :2], {}, "holds 3 blocks, the table has 2 columns"),
    "pad out of range": (_same, {"pad": 48}, "pad"),
}


@pytest.mark.parametrize("case", sorted(HOST_REFUSALS))
def test_a_bad_host_table_is_refused_and_nothing_is_written(model: HybridModel, case: str) -> None:
    seqs = serve(model, 1, 9)  # the first fits any table: a late refusal would have written it
    reshape, options, message = HOST_REFUSALS[case]
    table = host_table()
    with pytest.raises(InvalidId, match=message):
        model.write_block_tables(seqs, reshape(table), **options)
    assert (table == UNTOUCHED).all()
    free(model, seqs)


def test_a_sequence_of_another_model_is_refused_and_nothing_is_written(model: HybridModel) -> None:
    other = HybridModel(CONFIG, "host")
    seqs = serve(model, 5)
    stranger = serve(other, 5)
    table = host_table()
    with pytest.raises(ForeignSequence, match="another model"):
        model.write_block_tables([seqs[0], stranger[0]], table, pad=0)
    assert (table == UNTOUCHED).all()
    free(model, seqs)
    free(other, stranger)
    other.teardown()


def test_a_freed_sequence_is_refused_by_id_and_nothing_is_written(model: HybridModel) -> None:
    seqs = serve(model, 5, 9, 3)
    model.free_sequence(seqs[1])
    table = host_table()
    with pytest.raises(SequenceStateError, match=f"sequence {seqs[1].seq_id} was freed"):
        model.write_block_tables(seqs, table, pad=0)
    assert (table == UNTOUCHED).all()
    free(model, [seqs[0], seqs[2]])


def test_a_cuda_table_on_a_host_model_is_refused() -> None:
    host_model = HybridModel(CONFIG, HostDevice())
    seqs = serve(host_model, 5)
    with pytest.raises(InvalidId, match="needs a model on a CUDA device"):
        host_model.write_block_tables(seqs, CudaTableView(0x1000, (2, WIDTH)), pad=0)
    free(host_model, seqs)
    host_model.teardown()


def test_a_cuda_tensor_without_the_cuda_array_interface_is_refused(model: HybridModel) -> None:
    seqs = serve(model, 5)

    class CudaDLPackOnly:
        def __dlpack__(self, **kwargs: Any) -> Any:
            raise AssertionError("never exported")

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

    with pytest.raises(InvalidId, match="device type 2: a CUDA tensor is taken through __cuda_array_interface__"):
        model.write_block_tables(seqs, CudaDLPackOnly(), pad=0)
    free(model, seqs)


# -- CUDA tables ---------------------------------------------------------------------------------


class CudaTableView:
    """What torch, CuPy or Numba hand over for a device tensor: ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, shape: tuple[int, ...], *, typestr: str = "<i4",
                 strides: tuple[int, ...] | None = None, read_only: bool = False, version: int = 3,
                 stream: int | None = None) -> None:
        self.interface: dict[str, Any] = {"version": version, "shape": shape, "typestr": typestr,
                                          "data": (ptr, read_only), "strides": strides}
        if stream is not None:
            self.interface["stream"] = stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.interface


class EngineTable:
    """An engine's int32 table in device memory, allocated through the driver directly (as torch's
    allocator does), filled with ``UNTOUCHED``; :meth:`read` copies it back."""

    def __init__(self, num_rows: int = 5, width: int = WIDTH) -> None:
        from cuda.bindings import driver

        self._driver = driver
        self.shape = (num_rows, width)
        self.nbytes = num_rows * width * 4
        err, ptr = driver.cuMemAlloc(self.nbytes)
        assert not err, f"cuMemAlloc failed: {err}"
        self.ptr = int(ptr)
        self.write(self.ptr, np.full(num_rows * width, UNTOUCHED, dtype=np.int32))

    def view(self, **interface: Any) -> CudaTableView:
        return CudaTableView(self.ptr, self.shape, **interface)

    def write(self, ptr: int, values: npt.NDArray[np.int32]) -> None:
        (err,) = self._driver.cuMemcpyHtoDAsync(ptr, values.ctypes.data, values.nbytes, 0)
        assert not err, f"cuMemcpyHtoDAsync failed: {err}"
        (err,) = self._driver.cuStreamSynchronize(0)
        assert not err, f"cuStreamSynchronize failed: {err}"

    def read(self) -> npt.NDArray[np.int32]:
        """The table as it is in device memory now (the model's copies are not waited for)."""
        out = np.empty(self.shape, dtype=np.int32)
        (err,) = self._driver.cuMemcpyDtoHAsync(out.ctypes.data, self.ptr, self.nbytes, 0)
        assert not err, f"cuMemcpyDtoHAsync failed: {err}"
        (err,) = self._driver.cuStreamSynchronize(0)
        assert not err, f"cuStreamSynchronize failed: {err}"
        return out

    def close(self) -> None:
        (err,) = self._driver.cuMemFree(self.ptr)
        assert not err, f"cuMemFree failed: {err}"


@pytest.fixture
def engine_table(cuda_model: HybridModel) -> Iterator[EngineTable]:
    table = EngineTable()
    yield table
    table.close()


def count_copies(emulator: Emulator | None) -> None:
    if emulator is not None:
        emulator.count_calls("cuMemcpyHtoDAsync")


def test_a_cuda_table_gets_the_rows_written_and_nothing_else(cuda_model: HybridModel,
                                                            engine_table: EngineTable) -> None:
    seqs = serve(cuda_model, 5, 9, 13)
    cuda_model.write_block_tables(seqs, engine_table.view(), rows=[3, 1, 2], pad=0)
    cuda_model.device.synchronize()
    table = engine_table.read()
    for row, seq in zip([3, 1, 2], seqs):
        assert table[row].tolist() == expected_row(seq, 0, table[row])
    assert (table[[0, 4]] == UNTOUCHED).all()
    free(cuda_model, seqs)


def test_each_call_is_one_host_to_device_copy(cuda_model: HybridModel, engine_table: EngineTable,
                                              emu: Emulator) -> None:
    seqs = serve(cuda_model, 5, 9, 13, 2)
    for rows in ([0, 1, 2, 3], [4, 3], [1]):
        emu.count_calls("cuMemcpyHtoDAsync")
        cuda_model.write_block_tables(seqs[: len(rows)], engine_table.view(), rows=rows, pad=0)
        assert emu.counted_calls == 1, rows
    free(cuda_model, seqs)


def test_the_staging_is_refilled_only_after_the_previous_copy_from_it_ran(
    cuda_model: HybridModel, engine_table: EngineTable, emu: Emulator
) -> None:
    seqs = serve(cuda_model, 5, 9, 13, 17)
    cuda_model.write_block_tables(seqs[:2], engine_table.view(), pad=0)
    assert emu.pending_ops > 0  # the first copy has not run: refilling its staging now would change what it copies
    cuda_model.write_block_tables(seqs[2:], engine_table.view(), rows=[2, 3], pad=0)
    cuda_model.device.synchronize()
    table = engine_table.read()
    for row, seq in enumerate(seqs):
        assert table[row].tolist() == expected_row(seq, 0, table[row]), row
    free(cuda_model, seqs)


def test_under_use_stream_the_copy_follows_the_engines_kernels_and_the_next_call_waits_for_the_copy_only(
    cuda_model: HybridModel, engine_table: EngineTable, engine: EngineStream, emu: Emulator
) -> None:
    seqs = serve(cuda_model, 5, 9)
    scratch = EngineTable(1, 4)
    later_kernel = np.arange(4, dtype=np.int32)
    engine.write(engine_table.ptr, np.full(WIDTH, -7, dtype=np.int32).view(np.uint8))  # a kernel writing row 0
    with cuda_model.use_stream(engine.cuda_stream):
        cuda_model.write_block_tables(seqs[:1], engine_table.view(), pad=0)
        engine.write(scratch.ptr, later_kernel.view(np.uint8))  # the step's kernels, queued after the copy
        cuda_model.write_block_tables(seqs[1:], engine_table.view(), rows=[1], pad=0)
        assert (scratch.read() == UNTOUCHED).all()  # the second call waited for the first copy, not the kernels
    engine.synchronize()
    cuda_model.device.synchronize()
    table = engine_table.read()
    assert table[0].tolist() == expected_row(seqs[0], 0, table[0])  # the copy landed after the kernel's write
    assert table[1].tolist() == expected_row(seqs[1], 0, table[1])
    assert scratch.read()[0].tolist() == later_kernel.tolist()
    scratch.close()
    free(cuda_model, seqs)


@pytest.mark.parametrize("names_stream", [False, True], ids=["no stream", "interface stream"])
def test_the_stream_the_interface_names_is_waited_for(cuda_model: HybridModel, engine_table: EngineTable,
                                                     engine: EngineStream, names_stream: bool) -> None:
    seqs = serve(cuda_model, 9)
    engine.write(engine_table.ptr, np.full(WIDTH, -7, dtype=np.int32).view(np.uint8))  # still in flight
    view = engine_table.view(stream=engine.cuda_stream) if names_stream else engine_table.view()
    cuda_model.write_block_tables(seqs, view, pad=0)
    cuda_model.device.synchronize()
    engine.synchronize()
    row = engine_table.read()[0]
    assert (row.tolist() == expected_row(seqs[0], 0, row)) == names_stream
    free(cuda_model, seqs)


CUDA_REFUSALS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "int64": ({"typestr": "<i8"}, {}, "expected '<i4'"),
    "1-D": ({"shape": (5 * WIDTH,)}, {}, "expected 2-D"),
    "not contiguous": ({"strides": (2 * WIDTH * 4, 4), "shape": (2, WIDTH)}, {}, "expected C-contiguous"),
    "read-only": ({"read_only": True}, {}, "read-only"),
    "version 1": ({"version": 1}, {}, "version 1"),
    "row out of range": ({}, {"rows": [4, 5]}, r"row 5 \(sequence 1\) out of range \[0, 5\)"),
    "too narrow": ({"shape": (10, 2)}, {}, "holds 3 blocks, the table has 2 columns"),
    "rows with a gap": ({}, {"rows": [0, 2]}, r"rows \[1\] of them are not given"),
    "no pad": ({}, {"pad": None}, "give pad="),
    "past the allocation": ({"shape": (5, 100_000)}, {}, "runs past the end of its allocation"),
}


@pytest.mark.parametrize("case", sorted(CUDA_REFUSALS))
def test_a_bad_cuda_table_is_refused_and_nothing_is_copied(cuda_model: HybridModel, engine_table: EngineTable,
                                                           case: str) -> None:
    interface, options, message = CUDA_REFUSALS[case]
    seqs = serve(cuda_model, 1, 9)
    shape = interface.pop("shape", engine_table.shape)
    view = CudaTableView(engine_table.ptr, shape, **interface)
    emulator = loaded_emulator()
    count_copies(emulator)
    with pytest.raises(InvalidId, match=message):
        cuda_model.write_block_tables(seqs, view, **{"pad": 0, **options})
    cuda_model.device.synchronize()
    assert (engine_table.read() == UNTOUCHED).all()
    if emulator is not None:
        assert emulator.counted_calls == 0
    free(cuda_model, seqs)


def test_host_memory_behind_a_cuda_interface_is_refused(cuda_model: HybridModel) -> None:
    seqs = serve(cuda_model, 5)
    table = host_table(1)
    with pytest.raises(InvalidId, match="not device memory"):
        cuda_model.write_block_tables(seqs, CudaTableView(table.ctypes.data, table.shape), pad=0)
    assert (table == UNTOUCHED).all()
    free(cuda_model, seqs)


def test_the_staging_grows_as_needed_and_is_released_at_teardown(cuda_model: HybridModel) -> None:
    device = cuda_model.device
    seqs = serve(cuda_model, 5, 9)
    small, large = EngineTable(2, WIDTH), EngineTable(2, 1100)
    before = live_allocations(device)
    cuda_model.write_block_tables(seqs, small.view(), pad=0)
    assert live_allocations(device) == before + 1
    cuda_model.write_block_tables(seqs, large.view(), pad=0)  # 8800 bytes: past the first buffer
    assert live_allocations(device) == before + 1
    device.synchronize()
    for table in (small, large):
        rows = table.read()
        assert [rows[i].tolist() for i in range(2)] == [expected_row(s, 0, rows[i]) for i, s in enumerate(seqs)]
        table.close()
    free(cuda_model, seqs)
    cuda_model.teardown()
    assert live_allocations(device) == 0


# -- the device layer's part ---------------------------------------------------------------------


def test_copy_htod_to_writes_memory_the_device_did_not_allocate(device: Device) -> None:
    values = np.arange(8, dtype=np.int32)
    if device.kind == "cuda":
        target = EngineTable(1, 8)
        device.copy_htod_to(target.ptr, values.ctypes.data, values.nbytes)
        device.synchronize()
        assert target.read()[0].tolist() == values.tolist()
        target.close()
    else:
        out = np.zeros(8, dtype=np.int32)
        device.copy_htod_to(out.ctypes.data, values.ctypes.data, values.nbytes)
        device.synchronize()
        assert out.tolist() == values.tolist()


def test_copy_htod_to_refuses_what_cannot_be_its_destination(device: Device) -> None:
    values = np.arange(8, dtype=np.int32)
    with pytest.raises(InvalidId, match="nbytes=-1"):
        device.copy_htod_to(0x1000, values.ctypes.data, -1)
    host = np.zeros(8, dtype=np.int32)
    if device.kind == "cuda":
        with pytest.raises(InvalidId, match="not device memory"):
            device.copy_htod_to(host.ctypes.data, values.ctypes.data, values.nbytes)
    else:
        with pytest.raises(InvalidId, match="null address"):
            device.copy_htod_to(0, values.ctypes.data, values.nbytes)
    device.synchronize()
    assert (host == 0).all()


def test_an_event_of_the_device_is_recorded_waited_for_and_destroyed_once(device: Device) -> None:
    event = device.create_event()
    assert getattr(device, "live_events") == 1
    device.synchronize_event(event)  # never recorded: returns at once
    device.record_event(event)
    device.synchronize_event(event)
    device.destroy_event(event)
    assert getattr(device, "live_events") == 0
    with pytest.raises(InvalidId, match="not a live event"):
        device.destroy_event(event)
    with pytest.raises(InvalidId, match="not a live event"):
        device.synchronize_event(event)


def test_synchronize_event_runs_the_copies_recorded_before_it(device: Device) -> None:
    ptr = device.alloc(64)
    staging = device.alloc_pinned(64)
    device.host_array(staging, 64)[:] = 5
    event = device.create_event()
    device.copy_htod(ptr, staging, 64)
    device.record_event(event)
    device.synchronize_event(event)
    device.host_array(staging, 64)[:] = 0  # the copy ran: changing its source changes nothing
    device.copy_dtoh(staging, ptr, 64)
    device.synchronize()
    assert (device.host_array(staging, 64) == 5).all()
    device.destroy_event(event)
    device.free_pinned(staging)
    device.free(ptr)


# -- a real GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_torch_table_on_the_gpu_is_written_on_the_engines_stream() -> None:
    torch = pytest.importorskip("torch")
    if loaded_emulator() is not None or not torch.cuda.is_available():
        pytest.skip("needs torch with a real GPU")
    gpu_model = HybridModel(CONFIG, "cuda")
    seqs = serve(gpu_model, 5, 9, 13)
    table = torch.full((4, WIDTH), UNTOUCHED, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream()
    with gpu_model.use_stream(stream):
        gpu_model.write_block_tables(seqs, table, rows=[1, 2, 3], pad=0)
    rows = table.cpu().numpy()  # on the same stream: after the copy
    assert (rows[0] == UNTOUCHED).all()
    for row, seq in zip([1, 2, 3], seqs):
        assert rows[row].tolist() == expected_row(seq, 0, rows[row])
    free(gpu_model, seqs)
    gpu_model.teardown()
    report = gpu_model.teardown_report
    assert report is not None and report.leaked == 0


# -- HybridModel.step into a CUDA table ------------------------------------------------------------


def test_step_writes_the_batchs_rows_of_a_cuda_table_whole_in_one_copy(
    cuda_model: HybridModel, engine_table: EngineTable, emu: Emulator
) -> None:
    seqs = serve(cuda_model, 4, 8)  # each last block full: the step grows both
    emu.count_calls("cuMemcpyHtoDAsync")
    refused = cuda_model.step(seqs, [7, 8], table=engine_table.view(), rows=[2, 1], pad=0)
    assert refused.size == 0 and emu.counted_calls == 1
    cuda_model.device.synchronize()
    table = engine_table.read()
    assert [seq.num_blocks for seq in seqs] == [2, 3]
    for row, seq in zip([2, 1], seqs):
        assert table[row].tolist() == expected_row(seq, 0, table[row])
    assert (table[[0, 3, 4]] == UNTOUCHED).all()
    cuda_model.check_invariants()
    free(cuda_model, seqs)


def test_step_pads_a_cuda_table_with_the_null_block_by_default(device: Device) -> None:
    if device.kind != "cuda":
        pytest.skip("needs LIFECYCLE_TEST_DEVICE=cuda (the emulated driver in CI)")
    model = HybridModel(CONFIG, device, null_block=True)
    table = EngineTable()
    try:
        seqs = serve(model, 4)
        assert model.step(seqs, [7], table=table.view()).size == 0
        model.device.synchronize()
        row = table.read()[0]
        assert row.tolist() == expected_row(seqs[0], model.null_block, row)
        free(model, seqs)
    finally:
        table.close()
        model.teardown()
    assert model.teardown_report is not None and model.teardown_report.leaked == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "give pad="),
        ({"pad": 0, "rows": [0, 2]}, r"rows \[1\] of them are not given"),
        ({"pad": 0, "shape": (5, 1)}, "the sequence holds 2 blocks, the buffer takes 1"),
        ({"pad": 0, "shape": (5, 2)}, "request 1 would hold 3 blocks"),
    ],
    ids=["no pad", "a gap in the rows", "narrower than a table", "narrower than the grown table"],
)
def test_step_into_a_bad_cuda_table_changes_nothing_and_copies_nothing(
    cuda_model: HybridModel, engine_table: EngineTable, emu: Emulator, options: dict[str, Any], message: str
) -> None:
    seqs = serve(cuda_model, 1, 8)
    shape = options.pop("shape", engine_table.shape)
    before = [(seq.num_tokens, seq.block_table.tolist()) for seq in seqs]
    emu.count_calls("cuMemcpyHtoDAsync")
    with pytest.raises(InvalidId, match=message):
        cuda_model.step(seqs, [7, 8], table=CudaTableView(engine_table.ptr, shape), **options)
    assert [(seq.num_tokens, seq.block_table.tolist()) for seq in seqs] == before and emu.counted_calls == 0
    cuda_model.device.synchronize()
    assert (engine_table.read() == UNTOUCHED).all()
    free(cuda_model, seqs)


def test_step_into_a_cuda_table_on_a_host_model_is_refused() -> None:
    model = HybridModel(CONFIG, HostDevice())
    seqs = serve(model, 4)
    with pytest.raises(InvalidId, match="step: a CUDA table needs a model on a CUDA device"):
        model.step(seqs, [7], table=CudaTableView(0x1000, (1, WIDTH)), pad=0)
    assert seqs[0].num_tokens == 4
    free(model, seqs)
    model.teardown()
