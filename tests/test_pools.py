"""KVPool and SSMPool: layout in device memory, addresses, views, slot copies, release.

Data tests run on the ``device`` fixture (host, host-deferred, or CUDA over the emulated driver);
the order and failure tests use a host device that records or fails calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, assert_type

import numpy as np
import numpy.typing as npt
import pytest
from devices import Emulator, device, emu, live_allocations, read_device, write_device  # noqa: F401

from lifecycle.config import AttentionLayer, ModelConfig, SSMLayer, StorageScalar
from lifecycle.device.base import Copy, Device
from lifecycle.device.host import HostDevice
from lifecycle.errors import BlockIdOutOfRange, CudaError, DeviceError, InvalidId, SlotOutOfRange, TornDown
from lifecycle.pools import KVPool, PoolView, SSMPool

BLOCK_SIZE = 4
NUM_BLOCKS = 6
MAX_SEQS = 4


def hybrid_config(**overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "layers": (
            AttentionLayer(num_kv_heads=2, head_dim=8),
            SSMLayer(h_state_bytes=256, conv_state_bytes=96),
            AttentionLayer(num_kv_heads=1, head_dim=16, dtype="bfloat16", v_aliases_k=True),
            SSMLayer(h_state_bytes=128, conv_state_bytes=32, h_dtype="bfloat16", conv_dtype="float32"),
            AttentionLayer(num_kv_heads=4, head_dim=4, dtype="float32"),
        ),
        "block_size": BLOCK_SIZE,
        "num_blocks": NUM_BLOCKS,
        "max_seqs": MAX_SEQS,
    }
    fields.update(overrides)
    return ModelConfig(**fields)


CONFIG = hybrid_config()


class RecordingDevice(HostDevice):
    """A host device that records allocations, frees and batched copies, and can fail the N-th
    allocation (0-based) or the N-th free."""

    def __init__(self, fail_alloc_at: int = -1, fail_free_at: int = -1) -> None:
        super().__init__()
        self.allocs: list[tuple[int, int]] = []
        self.frees: list[int] = []
        self.batches: list[list[Copy]] = []
        self.memsets: list[tuple[int, int, int]] = []
        self._fail_alloc_at = fail_alloc_at
        self._fail_free_at = fail_free_at
        self._free_calls = 0

    def alloc(self, nbytes: int) -> int:
        if len(self.allocs) == self._fail_alloc_at:
            raise DeviceError(f"injected: allocation {self._fail_alloc_at} of {nbytes} bytes fails")
        ptr = super().alloc(nbytes)
        self.allocs.append((ptr, nbytes))
        return ptr

    def free(self, ptr: int) -> None:
        call = self._free_calls
        self._free_calls += 1
        if call == self._fail_free_at:
            raise DeviceError(f"injected: free {call} fails")
        super().free(ptr)
        self.frees.append(ptr)

    def copy_batch(self, copies: Sequence[Copy] | npt.NDArray[np.int64]) -> None:
        self.batches.append([(int(dst), int(src), int(nbytes)) for dst, src, nbytes in copies])
        super().copy_batch(copies)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self.memsets.append((ptr, value, nbytes))
        super().memset(ptr, value, nbytes)


def view_layout(view: Any) -> tuple[int, tuple[int, ...], np.dtype[Any]]:
    """(address, shape, dtype) of a numpy view or a ``__cuda_array_interface__`` object."""
    if isinstance(view, np.ndarray):
        assert view.flags.c_contiguous
        return view.ctypes.data, view.shape, view.dtype
    interface = view.__cuda_array_interface__
    assert interface["strides"] is None  # C-contiguous
    return interface["data"][0], tuple(interface["shape"]), np.dtype(interface["typestr"])


def host_kv_view(kv: KVPool, layer: int) -> npt.NDArray[StorageScalar]:
    """``kv.kv_view(layer)`` on the host device, where it is a numpy array."""
    view = kv.kv_view(layer)
    assert isinstance(view, np.ndarray)
    return view


def random_bytes(rng: np.random.Generator, nbytes: int) -> npt.NDArray[np.uint8]:
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def assert_disjoint(ranges: list[tuple[int, int]]) -> None:
    ordered = sorted(ranges)
    for (start, nbytes), (next_start, _) in zip(ordered, ordered[1:]):
        assert start + nbytes <= next_start, f"range at {start:#x} (+{nbytes}) overlaps {next_start:#x}"


# === KVPool: layout ======================================================================================


def test_kv_pool_allocates_one_range_per_attention_layer() -> None:
    dev = RecordingDevice()
    kv = KVPool(dev, CONFIG)
    sizes = [nbytes for _, nbytes in dev.allocs]
    assert sizes == [NUM_BLOCKS * layer.block_bytes(BLOCK_SIZE) for layer in CONFIG.attention_layers]
    assert kv.layer_ptrs == tuple(ptr for ptr, _ in dev.allocs)
    kv.release()


def test_kv_pool_size_is_blocks_times_kv_block_bytes(device: Device) -> None:
    kv = KVPool(device, CONFIG)
    assert kv.total_bytes == CONFIG.num_blocks_resolved * CONFIG.kv_block_bytes()
    assert (kv.num_layers, kv.num_blocks, kv.block_size) == (3, NUM_BLOCKS, BLOCK_SIZE)
    kv.release()


def test_kv_layer_block_bytes_follow_the_layer_spec(device: Device) -> None:
    kv = KVPool(device, CONFIG)
    assert [kv.layer_block_bytes(i) for i in range(3)] == [2 * 4 * 2 * 8 * 2, 1 * 4 * 1 * 16 * 2, 2 * 4 * 4 * 4 * 4]
    assert [kv.block_stride_bytes(i) for i in range(3)] == [kv.layer_block_bytes(i) for i in range(3)]
    kv.release()


def test_each_layer_block_is_one_contiguous_range_without_overlap(device: Device) -> None:
    kv = KVPool(device, CONFIG)
    ranges = kv.block_ranges(range(NUM_BLOCKS))
    assert len(ranges) == kv.num_layers * NUM_BLOCKS
    assert sum(nbytes for _, nbytes in ranges) == kv.total_bytes
    assert_disjoint(ranges)
    for layer in range(kv.num_layers):
        for block in range(NUM_BLOCKS):
            assert ranges[layer * NUM_BLOCKS + block] == (kv.block_addr(layer, block), kv.layer_block_bytes(layer))
    kv.release()


def test_blocks_of_a_layer_are_packed_from_the_layer_base(device: Device) -> None:
    kv = KVPool(device, CONFIG)
    for layer, base in enumerate(kv.layer_ptrs):
        assert [kv.block_addr(layer, b) for b in range(NUM_BLOCKS)] == [
            base + b * kv.block_stride_bytes(layer) for b in range(NUM_BLOCKS)
        ]
    kv.release()


def test_layer_shape_puts_k_and_v_inside_the_block(device: Device) -> None:
    kv = KVPool(device, CONFIG)
    assert kv.layer_shape(0) == (NUM_BLOCKS, 2, BLOCK_SIZE, 2, 8)
    assert kv.layer_shape(1) == (NUM_BLOCKS, 1, BLOCK_SIZE, 1, 16)  # V aliases K
    assert kv.layer_strides(0) == (256, 128, 32, 16, 2)
    kv.release()


def test_kv_view_covers_the_layer_with_its_shape_and_dtype(device: Device) -> None:
    kv = KVPool(device, CONFIG)
    expected_dtypes = [np.dtype(np.float16), np.dtype(np.uint16), np.dtype(np.float32)]  # bf16 as uint16
    for layer in range(kv.num_layers):
        ptr, shape, dtype = view_layout(kv.kv_view(layer))
        assert (ptr, shape, dtype) == (kv.layer_ptrs[layer], kv.layer_shape(layer), expected_dtypes[layer])
    kv.release()


def test_kv_view_is_typed_as_a_pool_view_and_is_numpy_on_host() -> None:
    kv = KVPool(HostDevice(), CONFIG)
    view = assert_type(kv.kv_view(1), PoolView)  # checked statically by mypy --strict (test_static.py)
    assert isinstance(view, np.ndarray) and view.dtype == np.uint16  # bfloat16's storage
    kv.release()


def test_kv_view_strides_match_layer_strides_on_host() -> None:
    kv = KVPool(HostDevice(), CONFIG)
    for layer in range(kv.num_layers):
        assert host_kv_view(kv, layer).strides == kv.layer_strides(layer)
    kv.release()


def test_data_written_at_a_block_address_reads_back_through_the_view() -> None:
    dev = HostDevice()
    kv = KVPool(dev, CONFIG)
    rng = np.random.default_rng(1)
    data = random_bytes(rng, kv.layer_block_bytes(0))
    write_device(dev, kv.block_addr(0, 3), data)
    view = host_kv_view(kv, 0)
    assert np.array_equal(view[3].view(np.uint8).reshape(-1), data)
    v_plane = data[kv.layer_strides(0)[1] :].view(np.float16).reshape(BLOCK_SIZE, 2, 8)
    assert np.array_equal(view[3, 1], v_plane, equal_nan=True)
    kv.release()


def test_data_written_through_the_view_reads_back_at_the_block_address() -> None:
    dev = HostDevice()
    kv = KVPool(dev, CONFIG)
    view = host_kv_view(kv, 2)
    view[4] = np.arange(view[4].size, dtype=np.float32).reshape(view[4].shape)
    back = read_device(dev, kv.block_addr(2, 4), kv.layer_block_bytes(2)).view(np.float32)
    assert np.array_equal(back, np.arange(view[4].size, dtype=np.float32))
    kv.release()


def test_block_data_round_trips_through_addresses_on_every_device(device: Device) -> None:
    kv = KVPool(device, CONFIG)
    rng = np.random.default_rng(2)
    written = {}
    for layer in range(kv.num_layers):
        for block in range(NUM_BLOCKS):
            written[layer, block] = random_bytes(rng, kv.layer_block_bytes(layer))
            write_device(device, kv.block_addr(layer, block), written[layer, block])
    for (layer, block), data in written.items():
        assert np.array_equal(read_device(device, kv.block_addr(layer, block), data.nbytes), data)
    kv.release()


def test_copy_blocks_copies_every_layer_in_one_batch() -> None:
    dev = RecordingDevice()
    kv = KVPool(dev, CONFIG)
    rng = np.random.default_rng(3)
    for ptr, nbytes in dev.allocs:
        write_device(dev, ptr, random_bytes(rng, nbytes))
    before = [read_device(dev, ptr, nbytes) for ptr, nbytes in dev.allocs]
    kv.copy_blocks([(1, 4), (2, 2), (5, 0)])
    dev.synchronize()
    assert len(dev.batches) == 1 and len(dev.batches[0]) == 2 * kv.num_layers  # (2, 2) is skipped
    for layer in range(kv.num_layers):
        size = kv.layer_block_bytes(layer)
        after = read_device(dev, kv.layer_ptrs[layer], NUM_BLOCKS * size).reshape(NUM_BLOCKS, size)
        expected = before[layer].reshape(NUM_BLOCKS, size).copy()
        expected[4], expected[0] = expected[1], expected[5]
        assert np.array_equal(after, expected)
    kv.release()


def test_copy_blocks_checks_every_id_before_copying() -> None:
    dev = RecordingDevice()
    kv = KVPool(dev, CONFIG)
    with pytest.raises(BlockIdOutOfRange, match=rf"block id {NUM_BLOCKS} is out of range"):
        kv.copy_blocks([(0, 1), (2, NUM_BLOCKS)])
    assert dev.batches == []
    kv.release()


@pytest.mark.parametrize(
    "pairs, message",
    [
        ([(0, 3), (1, 3)], "block 3 is the destination of pairs 0 and 1"),
        ([(0, 1), (1, 2)], "block 1 is read by pair 1 and written by pair 0"),
        ([(1, 2), (0, 1)], "block 1 is read by pair 0 and written by pair 1"),
        ([(0, 1), (1, 0)], "block 0 is read by pair 0 and written by pair 1"),
    ],
    ids=["two pairs write one block", "chained pairs", "chained pairs listed backwards", "a swap"],
)
def test_copy_blocks_refuses_pairs_whose_order_would_matter(pairs: list[tuple[int, int]], message: str) -> None:
    dev = RecordingDevice()
    kv = KVPool(dev, CONFIG)
    with pytest.raises(InvalidId, match=message):
        kv.copy_blocks(pairs)
    assert dev.batches == []
    kv.release()


def test_copy_blocks_may_copy_one_block_to_several(device: Device) -> None:
    kv = KVPool(device, CONFIG)
    size = kv.layer_block_bytes(0)
    data = random_bytes(np.random.default_rng(4), size)
    write_device(device, kv.block_addr(0, 2), data)
    kv.copy_blocks([(2, 4), (2, 5)])
    device.synchronize()
    for block in (4, 5):
        assert np.array_equal(read_device(device, kv.block_addr(0, block), size), data)
    kv.release()


# === KVPool: validation =================================================================================


@pytest.mark.parametrize("block_id", [-1, NUM_BLOCKS, 2**40])
def test_block_addr_out_of_range_names_id_and_limit(device: Device, block_id: int) -> None:
    kv = KVPool(device, CONFIG)
    message = rf"block id {block_id} is out of range: valid values are 0\.\.{NUM_BLOCKS - 1}"
    with pytest.raises(BlockIdOutOfRange, match=message):
        kv.block_addr(0, block_id)
    kv.release()


@pytest.mark.parametrize("layer", [-1, 3])
def test_layer_out_of_range_names_layer_and_limit(device: Device, layer: int) -> None:
    kv = KVPool(device, CONFIG)
    with pytest.raises(InvalidId, match=rf"attention layer {layer} is out of range: valid values are 0\.\.2"):
        kv.kv_view(layer)
    kv.release()


@pytest.mark.parametrize("bad", [True, 1.0, "1", None])
def test_non_integer_block_id_is_refused(device: Device, bad: object) -> None:
    kv = KVPool(device, CONFIG)
    with pytest.raises(BlockIdOutOfRange, match="block id must be an int"):
        kv.block_addr(0, bad)  # type: ignore[arg-type]
    kv.release()


def test_numpy_integer_ids_are_accepted(device: Device) -> None:
    kv = KVPool(device, CONFIG)
    assert kv.block_addr(np.int64(1), np.int32(2)) == kv.block_addr(1, 2)  # type: ignore[arg-type]
    assert kv.block_ranges(np.array([3, 1], dtype=np.int32)) == kv.block_ranges([3, 1])
    kv.release()


def test_block_ranges_checks_every_id_first(device: Device) -> None:
    kv = KVPool(device, CONFIG)
    with pytest.raises(BlockIdOutOfRange, match="block id -3"):
        kv.block_ranges([0, 1, -3])
    kv.release()


def test_model_without_attention_has_an_empty_kv_pool() -> None:
    dev = RecordingDevice()
    kv = KVPool(dev, hybrid_config(layers=(SSMLayer(64, 64),), num_blocks=None))
    assert (kv.num_layers, kv.total_bytes, kv.layer_ptrs) == (0, 0, ())
    assert dev.allocs == []
    with pytest.raises(InvalidId, match="attention layer 0 is out of range: the pool has none"):
        kv.block_addr(0, 0)
    kv.release()


# === KVPool: release ===================================================================================


def test_kv_release_frees_newest_first() -> None:
    dev = RecordingDevice()
    kv = KVPool(dev, CONFIG)
    kv.release()
    assert dev.frees == [ptr for ptr, _ in reversed(dev.allocs)]
    assert dev.live_allocations == 0 and kv.released


def test_kv_release_twice_frees_once() -> None:
    dev = RecordingDevice()
    kv = KVPool(dev, CONFIG)
    kv.release()
    kv.release()
    assert len(dev.frees) == len(dev.allocs)


@pytest.mark.parametrize(
    "call", ["layer_ptrs", "block_addr", "block_ranges", "kv_view", "copy_blocks", "layer_block_bytes"]
)
def test_kv_calls_after_release_raise_torn_down(device: Device, call: str) -> None:
    kv = KVPool(device, CONFIG)
    kv.release()
    actions: dict[str, Callable[[], object]] = {
        "layer_ptrs": lambda: kv.layer_ptrs,
        "block_addr": lambda: kv.block_addr(0, 0),
        "block_ranges": lambda: kv.block_ranges([0]),
        "kv_view": lambda: kv.kv_view(0),
        "copy_blocks": lambda: kv.copy_blocks([(0, 1)]),
        "layer_block_bytes": lambda: kv.layer_block_bytes(0),
    }
    with pytest.raises(TornDown, match="KVPool was released"):
        actions[call]()


@pytest.mark.parametrize("fail_at", range(3))
def test_kv_constructor_failure_frees_what_it_allocated(fail_at: int) -> None:
    dev = RecordingDevice(fail_alloc_at=fail_at)
    with pytest.raises(DeviceError, match=f"allocation {fail_at}"):
        KVPool(dev, CONFIG)
    assert len(dev.allocs) == fail_at
    assert dev.frees == [ptr for ptr, _ in reversed(dev.allocs)]
    assert dev.live_allocations == 0


def test_kv_release_keeps_freeing_after_a_failed_free() -> None:
    dev = RecordingDevice(fail_free_at=0)
    kv = KVPool(dev, CONFIG)
    with pytest.raises(DeviceError, match="free 0 fails"):
        kv.release()
    assert dev.frees == [ptr for ptr, _ in reversed(dev.allocs)][1:]
    kv.release()  # exactly once: nothing is retried
    assert len(dev.frees) == len(dev.allocs) - 1


def test_kv_pool_on_a_device_too_small_leaks_nothing() -> None:
    dev = HostDevice(capacity=CONFIG.kv_pool_bytes() - 1)
    with pytest.raises(DeviceError):
        KVPool(dev, CONFIG)
    assert dev.live_allocations == 0


# === SSMPool: layout ====================================================================================


def test_ssm_pool_allocates_h_then_conv_per_layer_with_a_padding_slot() -> None:
    dev = RecordingDevice()
    ssm = SSMPool(dev, CONFIG)
    slots = MAX_SEQS + 1
    assert [nbytes for _, nbytes in dev.allocs] == [slots * 256, slots * 96, slots * 128, slots * 32]
    assert ssm.h_ptrs == (dev.allocs[0][0], dev.allocs[2][0])
    assert ssm.conv_ptrs == (dev.allocs[1][0], dev.allocs[3][0])
    ssm.release()


def test_ssm_pool_sizes(device: Device) -> None:
    ssm = SSMPool(device, CONFIG)
    assert (ssm.num_layers, ssm.num_slots, ssm.padding_slot) == (2, MAX_SEQS + 1, MAX_SEQS)
    assert ssm.slot_bytes == CONFIG.ssm_slot_bytes() == 256 + 96 + 128 + 32
    assert ssm.total_bytes == CONFIG.ssm_pool_bytes()
    ssm.release()


def test_slot_addresses_step_by_the_state_size(device: Device) -> None:
    ssm = SSMPool(device, CONFIG)
    for layer, (h_bytes, conv_bytes) in enumerate([(256, 96), (128, 32)]):
        for slot in range(ssm.num_slots):
            assert ssm.h_addr(layer, slot) == ssm.h_ptrs[layer] + slot * h_bytes
            assert ssm.conv_addr(layer, slot) == ssm.conv_ptrs[layer] + slot * conv_bytes
    ssm.release()


def test_slot_ranges_list_every_layer_h_then_conv(device: Device) -> None:
    ssm = SSMPool(device, CONFIG)
    assert ssm.slot_ranges(2) == [
        (ssm.h_addr(0, 2), 256),
        (ssm.conv_addr(0, 2), 96),
        (ssm.h_addr(1, 2), 128),
        (ssm.conv_addr(1, 2), 32),
    ]
    ssm.release()


def test_slot_ranges_of_all_slots_are_disjoint_and_cover_the_pool(device: Device) -> None:
    ssm = SSMPool(device, CONFIG)
    ranges = [r for slot in range(ssm.num_slots) for r in ssm.slot_ranges(slot)]
    assert_disjoint(ranges)
    assert sum(nbytes for _, nbytes in ranges) == ssm.total_bytes
    ssm.release()


def test_ssm_views_cover_every_slot_with_the_state_dtype(device: Device) -> None:
    ssm = SSMPool(device, CONFIG)
    slots = MAX_SEQS + 1
    assert view_layout(ssm.h_view(0)) == (ssm.h_ptrs[0], (slots, 64), np.dtype(np.float32))
    assert view_layout(ssm.conv_view(0)) == (ssm.conv_ptrs[0], (slots, 48), np.dtype(np.float16))
    assert view_layout(ssm.h_view(1)) == (ssm.h_ptrs[1], (slots, 64), np.dtype(np.uint16))  # bfloat16
    assert view_layout(ssm.conv_view(1)) == (ssm.conv_ptrs[1], (slots, 8), np.dtype(np.float32))
    ssm.release()


def test_h_view_row_is_the_slot_state_at_h_addr() -> None:
    dev = HostDevice()
    ssm = SSMPool(dev, CONFIG)
    state = np.linspace(-1, 1, 64, dtype=np.float32)
    write_device(dev, ssm.h_addr(0, 3), state)
    assert np.array_equal(ssm.h_view(0)[3], state)
    ssm.release()


# === SSMPool: zero and copy ============================================================================


def fill_pool(dev: Device, ssm: SSMPool, seed: int) -> dict[tuple[int, int], npt.NDArray[np.uint8]]:
    """Random bytes in every range of every slot; returns them by (slot, range index)."""
    rng = np.random.default_rng(seed)
    data = {}
    for slot in range(ssm.num_slots):
        for index, (addr, nbytes) in enumerate(ssm.slot_ranges(slot)):
            data[slot, index] = random_bytes(rng, nbytes)
            write_device(dev, addr, data[slot, index])
    return data


def read_pool(dev: Device, ssm: SSMPool) -> dict[tuple[int, int], npt.NDArray[np.uint8]]:
    return {
        (slot, index): read_device(dev, addr, nbytes)
        for slot in range(ssm.num_slots)
        for index, (addr, nbytes) in enumerate(ssm.slot_ranges(slot))
    }


def test_zero_slot_zeroes_only_that_slot(device: Device) -> None:
    ssm = SSMPool(device, CONFIG)
    before = fill_pool(device, ssm, seed=4)
    ssm.zero_slot(2)
    device.synchronize()
    after = read_pool(device, ssm)
    for (slot, index), data in before.items():
        expected = np.zeros_like(data) if slot == 2 else data
        assert np.array_equal(after[slot, index], expected), (slot, index)
    ssm.release()


def test_zero_slot_of_the_padding_slot_is_allowed(device: Device) -> None:
    ssm = SSMPool(device, CONFIG)
    fill_pool(device, ssm, seed=5)
    ssm.zero_slot(ssm.padding_slot)
    device.synchronize()
    assert all(not read_device(device, addr, n).any() for addr, n in ssm.slot_ranges(ssm.padding_slot))
    ssm.release()


def test_copy_slot_copies_every_layer_bit_exactly(device: Device) -> None:
    ssm = SSMPool(device, CONFIG)
    before = fill_pool(device, ssm, seed=6)
    ssm.copy_slot(1, 3)
    device.synchronize()
    after = read_pool(device, ssm)
    for (slot, index), data in before.items():
        expected = before[1, index] if slot == 3 else data
        assert np.array_equal(after[slot, index], expected), (slot, index)
    ssm.release()


def test_copy_slot_is_one_batched_copy_of_every_range() -> None:
    dev = RecordingDevice()
    ssm = SSMPool(dev, CONFIG)
    ssm.copy_slot(0, 4)
    assert dev.batches == [
        [(dst, src, nbytes) for (dst, nbytes), (src, _) in zip(ssm.slot_ranges(4), ssm.slot_ranges(0))]
    ]
    ssm.release()


def test_copy_slot_onto_itself_issues_nothing() -> None:
    dev = RecordingDevice()
    ssm = SSMPool(dev, CONFIG)
    ssm.copy_slot(2, 2)
    assert dev.batches == []
    ssm.release()


def test_zero_slot_memsets_every_range_of_the_slot() -> None:
    dev = RecordingDevice()
    ssm = SSMPool(dev, CONFIG)
    ssm.zero_slot(1)
    assert dev.memsets == [(addr, 0, nbytes) for addr, nbytes in ssm.slot_ranges(1)]
    ssm.release()


# === SSMPool: validation and release ===================================================================


@pytest.mark.parametrize("slot", [-1, MAX_SEQS + 1])
@pytest.mark.parametrize("call", ["h_addr", "conv_addr", "slot_ranges", "zero_slot", "copy_src", "copy_dst"])
def test_slot_out_of_range_names_slot_and_limit(slot: int, call: str) -> None:
    dev = RecordingDevice()
    ssm = SSMPool(dev, CONFIG)
    actions: dict[str, Callable[[], object]] = {
        "h_addr": lambda: ssm.h_addr(0, slot),
        "conv_addr": lambda: ssm.conv_addr(0, slot),
        "slot_ranges": lambda: ssm.slot_ranges(slot),
        "zero_slot": lambda: ssm.zero_slot(slot),
        "copy_src": lambda: ssm.copy_slot(slot, 0),
        "copy_dst": lambda: ssm.copy_slot(0, slot),
    }
    with pytest.raises(SlotOutOfRange, match=rf"slot {slot} is out of range: valid values are 0\.\.{MAX_SEQS}"):
        actions[call]()
    assert dev.batches == [] and dev.memsets == []
    ssm.release()


def test_ssm_layer_out_of_range_is_refused(device: Device) -> None:
    ssm = SSMPool(device, CONFIG)
    with pytest.raises(InvalidId, match=r"SSM layer 2 is out of range: valid values are 0\.\.1"):
        ssm.h_view(2)
    ssm.release()


def test_model_without_ssm_layers_has_an_empty_ssm_pool() -> None:
    dev = RecordingDevice()
    ssm = SSMPool(dev, hybrid_config(layers=(AttentionLayer(2, 8),)))
    assert (ssm.num_layers, ssm.total_bytes, ssm.slot_ranges(0)) == (0, 0, [])
    ssm.copy_slot(0, 1)
    assert dev.allocs == [] and dev.batches == []
    ssm.release()


def test_ssm_release_frees_newest_first_exactly_once() -> None:
    dev = RecordingDevice()
    ssm = SSMPool(dev, CONFIG)
    ssm.release()
    ssm.release()
    assert dev.frees == [ptr for ptr, _ in reversed(dev.allocs)]
    assert dev.live_allocations == 0 and ssm.released


@pytest.mark.parametrize("call", ["h_ptrs", "h_addr", "slot_ranges", "zero_slot", "copy_slot", "conv_view"])
def test_ssm_calls_after_release_raise_torn_down(device: Device, call: str) -> None:
    ssm = SSMPool(device, CONFIG)
    ssm.release()
    actions: dict[str, Callable[[], object]] = {
        "h_ptrs": lambda: ssm.h_ptrs,
        "h_addr": lambda: ssm.h_addr(0, 0),
        "slot_ranges": lambda: ssm.slot_ranges(0),
        "zero_slot": lambda: ssm.zero_slot(0),
        "copy_slot": lambda: ssm.copy_slot(0, 1),
        "conv_view": lambda: ssm.conv_view(0),
    }
    with pytest.raises(TornDown, match="SSMPool was released"):
        actions[call]()


@pytest.mark.parametrize("fail_at", range(4))
def test_ssm_constructor_failure_frees_what_it_allocated(fail_at: int) -> None:
    dev = RecordingDevice(fail_alloc_at=fail_at)
    with pytest.raises(DeviceError, match=f"allocation {fail_at}"):
        SSMPool(dev, CONFIG)
    assert len(dev.allocs) == fail_at
    assert dev.frees == [ptr for ptr, _ in reversed(dev.allocs)]
    assert dev.live_allocations == 0


def test_constructor_failure_keeps_the_allocation_error_when_a_free_also_fails() -> None:
    dev = RecordingDevice(fail_alloc_at=2, fail_free_at=0)
    with pytest.raises(DeviceError, match="allocation 2") as info:
        SSMPool(dev, CONFIG)
    assert any("free 0 fails" in note for note in info.value.__notes__)
    assert dev.live_allocations == 1  # the one whose free failed; the other was still freed


@pytest.mark.parametrize("pool_type", [KVPool, SSMPool])
def test_pool_failing_on_the_emulated_driver_leaks_nothing(device: Device, emu: Emulator, pool_type: type) -> None:
    """An out-of-memory from the driver half-way through the constructor: a clean CudaError and
    nothing left allocated."""
    pool_bytes = CONFIG.kv_pool_bytes() if pool_type is KVPool else CONFIG.ssm_pool_bytes()
    emu.set_alloc_budget(emu.live_bytes + pool_bytes // 2)  # the first allocations fit, a later one fails
    before = live_allocations(device)
    with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        pool_type(device, CONFIG)
    assert live_allocations(device) == before
