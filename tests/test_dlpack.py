"""DLPack views of the pools: ``torch.from_dlpack(pool.kv_view(layer))`` is a zero-copy tensor of the
layer's true dtype (bfloat16, float8 ...) where numpy and ``__cuda_array_interface__`` see unsigned
integers of the same width.

The capsules are read here with ctypes against dlpack.h's layout, so the checks run without torch
(which CI does not install); the torch tests run where torch is installed (CPU tensors only). On
the emulated driver, the ordering of the consumer's stream after the device's copies is shown both
ways.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from devices import Emulator, EngineStream, device, emu, engine, read_device, write_device  # noqa: F401  (fixtures)
from lifecycle.config import AttentionLayer, DType, ModelConfig, SSMLayer
from lifecycle.device.base import Device
from lifecycle.device.dlpack import DLPACK_DTYPES, KDL_CPU, KDL_CUDA
from lifecycle.device.host import HostDevice
from lifecycle.pools import KVPool, SSMPool

DTYPES: list[DType] = ["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"]
BLOCK_SIZE = 4
CONFIG = ModelConfig(
    layers=(
        *(AttentionLayer(num_kv_heads=2, head_dim=8, dtype=dtype) for dtype in DTYPES),
        SSMLayer(h_state_bytes=64, conv_state_bytes=32, h_dtype="float32", conv_dtype="bfloat16"),
    ),
    block_size=BLOCK_SIZE,
    num_blocks=6,
    max_seqs=3,
)
LAYER_OF = {dtype: index for index, dtype in enumerate(DTYPES)}


# --- reading a capsule as a consumer does (dlpack.h) -------------------------------------------------


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor),
    ]


_api = ctypes.pythonapi
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Exported:
    """What a capsule says: its name, version and flags (versioned only) and the tensor."""

    def __init__(self, capsule: Any) -> None:
        self.name: bytes = _api.PyCapsule_GetName(capsule)
        pointer = _api.PyCapsule_GetPointer(capsule, self.name)
        self.version: tuple[int, int] | None = None
        self.flags = 0
        if self.name == b"dltensor_versioned":
            versioned = DLManagedTensorVersioned.from_address(pointer)
            self.version, self.flags, tensor = (versioned.major, versioned.minor), versioned.flags, versioned.dl_tensor
        else:
            tensor = DLManagedTensor.from_address(pointer).dl_tensor
        self.data: int = tensor.data or 0
        self.device = (tensor.device.device_type, tensor.device.device_id)
        self.dtype = (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes)
        self.shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
        self.strides = tuple(tensor.strides[i] for i in range(tensor.ndim))
        self.byte_offset = tensor.byte_offset


def consume(capsule: Any) -> None:
    """Take the tensor as a consumer does (rename the capsule "used_..."), then delete it."""
    name: bytes = _api.PyCapsule_GetName(capsule)
    pointer = _api.PyCapsule_GetPointer(capsule, name)
    _api.PyCapsule_SetName(capsule, b"used_" + name)
    struct = DLManagedTensorVersioned if name == b"dltensor_versioned" else DLManagedTensor
    DELETER(struct.from_address(pointer).deleter)(pointer)


@pytest.fixture
def pools(device: Device) -> Iterator[tuple[KVPool, SSMPool]]:
    kv, ssm = KVPool(device, CONFIG), SSMPool(device, CONFIG)
    yield kv, ssm
    ssm.release()
    kv.release()


def own_device(dev: Device) -> tuple[int, int]:
    return (KDL_CPU, 0) if dev.kind == "host" else (KDL_CUDA, 0)


# === what a capsule describes, on every device ==========================================================


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_kv_view_exports_its_layers_true_dtype(pools: tuple[KVPool, SSMPool], dtype: DType) -> None:
    kv, _ = pools
    exported = Exported(kv.kv_view(LAYER_OF[dtype]).__dlpack__(max_version=(1, 0)))
    assert exported.dtype == (*DLPACK_DTYPES[dtype], 1)


def test_dlpack_codes_are_dlpack_h_codes() -> None:
    # kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLFloat8_e4m3fn 10, kDLFloat8_e5m2 12
    assert DLPACK_DTYPES == {"float16": (2, 16), "bfloat16": (4, 16), "float32": (2, 32), "float8_e4m3fn": (10, 8),
                             "float8_e5m2": (12, 8), "int8": (0, 8), "uint8": (1, 8)}


def test_a_kv_view_capsule_describes_the_layers_memory_in_place(device: Device,
                                                               pools: tuple[KVPool, SSMPool]) -> None:
    kv, _ = pools
    layer = LAYER_OF["bfloat16"]
    exported = Exported(kv.kv_view(layer).__dlpack__(max_version=(1, 0)))
    assert (exported.data, exported.byte_offset, exported.device) == (kv.layer_ptrs[layer], 0, own_device(device))
    assert exported.shape == kv.layer_shape(layer)
    assert exported.strides == tuple(stride // 2 for stride in kv.layer_strides(layer))


def test_ssm_views_export_the_h_and_conv_dtypes(pools: tuple[KVPool, SSMPool]) -> None:
    _, ssm = pools
    h, conv = Exported(ssm.h_view(0).__dlpack__()), Exported(ssm.conv_view(0).__dlpack__())
    assert (h.dtype, h.shape, h.data) == ((2, 32, 1), (ssm.num_slots, 16), ssm.h_ptrs[0])
    assert (conv.dtype, conv.shape, conv.data) == ((4, 16, 1), (ssm.num_slots, 16), ssm.conv_ptrs[0])


def test_dlpack_device_names_the_views_device(device: Device, pools: tuple[KVPool, SSMPool]) -> None:
    kv, ssm = pools
    assert kv.kv_view(0).__dlpack_device__() == ssm.h_view(0).__dlpack_device__() == own_device(device)


@pytest.mark.parametrize(("max_version", "name", "version"), [
    (None, b"dltensor", None),
    ((0, 8), b"dltensor", None),
    ((1, 0), b"dltensor_versioned", (1, 1)),
    ((1, 3), b"dltensor_versioned", (1, 1)),
])
def test_max_version_picks_the_capsule_kind(pools: tuple[KVPool, SSMPool], max_version: tuple[int, int] | None,
                                            name: bytes, version: tuple[int, int] | None) -> None:
    kv, _ = pools
    exported = Exported(kv.kv_view(0).__dlpack__(max_version=max_version))
    assert (exported.name, exported.version, exported.flags) == (name, version, 0)


@pytest.mark.parametrize("versioned", [False, True], ids=["dltensor", "dltensor_versioned"])
def test_an_unconsumed_capsule_holds_the_view_until_it_is_dropped(pools: tuple[KVPool, SSMPool],
                                                                   versioned: bool) -> None:
    kv, _ = pools
    view = kv.kv_view(0)
    before = sys.getrefcount(view)
    capsule = view.__dlpack__(max_version=(1, 0) if versioned else None)
    assert sys.getrefcount(view) == before + 1
    del capsule
    assert sys.getrefcount(view) == before


@pytest.mark.parametrize("versioned", [False, True], ids=["dltensor", "dltensor_versioned"])
def test_a_consumed_capsule_releases_the_view_through_its_deleter_once(pools: tuple[KVPool, SSMPool],
                                                                       versioned: bool) -> None:
    kv, _ = pools
    view = kv.kv_view(0)
    before = sys.getrefcount(view)
    capsule = view.__dlpack__(max_version=(1, 0) if versioned else None)
    consume(capsule)
    assert sys.getrefcount(view) == before
    del capsule  # renamed "used_...": the destructor leaves the tensor alone
    assert sys.getrefcount(view) == before


def test_a_view_outside_its_device_is_refused(pools: tuple[KVPool, SSMPool]) -> None:
    kv, _ = pools
    with pytest.raises(BufferError, match="dl_device=.*copy it instead"):
        kv.kv_view(0).__dlpack__(dl_device=(KDL_CUDA + 11, 3))


# === host views ==========================================================================================


@pytest.fixture
def host() -> Iterator[tuple[KVPool, SSMPool]]:
    """The pools on a host device, whatever device the suite runs on."""
    dev = HostDevice()
    kv, ssm = KVPool(dev, CONFIG), SSMPool(dev, CONFIG)
    yield kv, ssm
    ssm.release()
    kv.release()
    dev.close()


def host_view(host: tuple[KVPool, SSMPool], dtype: DType) -> npt.NDArray[Any]:
    view = host[0].kv_view(LAYER_OF[dtype])
    assert isinstance(view, np.ndarray)
    return view


def test_a_host_view_is_still_numpy_of_the_storage_dtype(host: tuple[KVPool, SSMPool]) -> None:
    view = host_view(host, "bfloat16")
    assert isinstance(view, np.ndarray) and view.dtype == np.uint16


def test_numpy_takes_a_host_view_through_dlpack_without_a_copy(host: tuple[KVPool, SSMPool]) -> None:
    view = host_view(host, "float16")
    array = np.from_dlpack(view)
    array[1, 0, 0, 0, 0] = 2.5
    assert array.ctypes.data == view.ctypes.data and view[1, 0, 0, 0, 0] == 2.5


def test_a_slice_of_a_host_view_exports_its_own_window_and_dtype(host: tuple[KVPool, SSMPool]) -> None:
    view = host_view(host, "bfloat16")
    exported = Exported(view[2:4, :, ::2].__dlpack__())
    assert exported.dtype == (4, 16, 1)
    assert exported.data == view[2].ctypes.data and exported.shape == (2, 2, 2, 2, 8)
    assert exported.strides == (128, 64, 32, 8, 1)


def test_a_host_view_as_another_numpy_dtype_exports_that_dtype(host: tuple[KVPool, SSMPool]) -> None:
    assert Exported(host_view(host, "bfloat16").view(np.int16).__dlpack__()).dtype == (0, 16, 1)


def test_a_host_view_refuses_a_stream(host: tuple[KVPool, SSMPool]) -> None:
    with pytest.raises(BufferError, match="stream=1.*no stream"):
        host_view(host, "bfloat16").__dlpack__(stream=1)


def test_copy_true_exports_a_copy_flagged_as_copied(host: tuple[KVPool, SSMPool]) -> None:
    view = host_view(host, "bfloat16")
    exported = Exported(view.__dlpack__(max_version=(1, 0), copy=True))
    assert exported.data != view.ctypes.data and exported.dtype == (4, 16, 1)
    assert exported.flags == 2  # DLPACK_FLAG_BITMASK_IS_COPIED


def test_a_read_only_view_is_flagged_and_needs_a_versioned_capsule(host: tuple[KVPool, SSMPool]) -> None:
    view = host_view(host, "bfloat16")[1:3]
    view.flags.writeable = False
    assert Exported(view.__dlpack__(max_version=(1, 0))).flags == 1  # DLPACK_FLAG_BITMASK_READ_ONLY
    with pytest.raises(BufferError, match="read-only"):
        view.__dlpack__()


# === torch, where it is installed =========================================================================

TORCH_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float8_e4m3fn": "float8_e4m3fn",
                "float8_e5m2": "float8_e5m2", "int8": "int8", "uint8": "uint8"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_from_dlpack_is_a_zero_copy_tensor_of_the_true_dtype(host: tuple[KVPool, SSMPool], dtype: DType) -> None:
    torch = pytest.importorskip("torch")
    view = host_view(host, dtype)
    tensor = torch.from_dlpack(view)
    assert tensor.dtype == getattr(torch, TORCH_DTYPES[dtype])
    assert (tensor.data_ptr(), tuple(tensor.shape)) == (view.ctypes.data, view.shape)


def test_a_torch_write_lands_in_the_pool(host: tuple[KVPool, SSMPool]) -> None:
    torch = pytest.importorskip("torch")
    kv, _ = host
    layer = LAYER_OF["bfloat16"]
    torch.from_dlpack(kv.kv_view(layer))[3, 1, 0, 0, 0] = 1.5
    block = kv.device.host_array(kv.block_addr(layer, 3), kv.layer_block_bytes(layer)).view(np.uint16)
    assert block[kv.layer_strides(layer)[1] // 2] == 0x3FC0  # 1.5 in bfloat16


def test_torch_reads_an_ssm_slot_as_its_dtype(host: tuple[KVPool, SSMPool]) -> None:
    torch = pytest.importorskip("torch")
    _, ssm = host
    write_device(ssm.device, ssm.h_addr(0, 1), np.arange(16, dtype=np.float32))
    assert torch.from_dlpack(ssm.h_view(0))[1].tolist() == list(range(16))


# === the consumer's stream on CUDA (emulated driver) =======================================================

CONSUMERS = pytest.mark.parametrize("consumer", ["engine stream", "legacy default (None)", "no ordering (-1)"])


@CONSUMERS
def test_an_export_orders_the_consumers_stream_after_the_devices_copies(
    device: Device, emu: Emulator, engine: EngineStream, pools: tuple[KVPool, SSMPool], consumer: str
) -> None:
    from cuda.bindings import driver

    kv, _ = pools
    addr, nbytes = kv.block_addr(0, 2), kv.layer_block_bytes(0)
    ours = np.full(nbytes, 0x11, dtype=np.uint8)
    theirs = np.full(nbytes, 0x22, dtype=np.uint8)
    device.copy_htod(addr, ours.ctypes.data, nbytes)  # in flight on the device's stream
    view = kv.kv_view(0)
    if consumer == "engine stream":
        view.__dlpack__(stream=engine.cuda_stream)
        engine.write(addr, theirs)
        engine.synchronize()
    else:
        view.__dlpack__(stream=None if consumer == "legacy default (None)" else -1)
        emu.engine_write(0, addr, theirs)  # a kernel on the legacy default stream
        (err,) = driver.cuStreamSynchronize(0)
        assert not err
    device.synchronize()
    expected = ours if consumer == "no ordering (-1)" else theirs  # unordered: our late copy lands last
    assert np.array_equal(read_device(device, addr, nbytes), expected)


def test_a_cuda_view_refuses_copy_true(device: Device, pools: tuple[KVPool, SSMPool]) -> None:
    if device.kind != "cuda":
        pytest.skip("a CUDA view's refusal")
    kv, _ = pools
    with pytest.raises(BufferError, match="copy=True"):
        kv.kv_view(0).__dlpack__(copy=True)
