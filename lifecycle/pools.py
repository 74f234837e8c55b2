"""The KV pools and the SSM pool: the model's state in device memory, and its addresses for kernels.

KV pools: one per KV cache group (``config.kv_groups``; one for a model of one group), each with
its own block ids ``0 .. num_blocks - 1`` (the group's own ``BlockPool`` in the core) and one
allocation per layer of the group. An attention layer (full, sliding window, chunked local) is
shaped ``[num_blocks, planes, block_size, num_kv_heads, head_dim]`` (``planes`` = 2 for K and V,
1 where V aliases K); an MLA layer ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``;
a sparse-attention indexer ``[num_blocks, block_size, bytes_per_token]`` (bytes). The K/V axis
sits inside the block, so one ``(layer, block)`` is one contiguous range of
``layer_block_bytes(layer)`` bytes: a block moves with one copy per layer, and paged-attention
kernels (FlashInfer's NHD layout with K and V in one tensor) index it as ``cache[block_table[i]]``.
Groups share no memory, so a block of one group is exactly its layers' pages (no padding to a
common page size); :func:`kv_group_pools` builds them all.

SSM pool: per SSM layer, one allocation of ``h`` state and one of conv state, each
``max_seqs + 1`` slots (the last, ``padding_slot``, is never handed out; kernels point padded batch
entries at it).

Layer indices count a KV group's layers (its KV pool; for a one-group model of attention layers,
every attention layer) and SSM layers (SSM pool) separately, in model order.
Copies and memsets are asynchronous on the device's stream; ``device.synchronize()`` makes them
visible. Both pools free their memory newest allocation first, exactly once; any call but
``release`` afterwards raises :class:`~lifecycle.errors.TornDown`, and views taken before are invalid.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import index as _as_index
from typing import TYPE_CHECKING, Any, ClassVar, Generic, SupportsIndex, TypeAlias, TypeVar, cast

from numpy.typing import NDArray

from lifecycle.config import (
    DTYPE_SIZES,
    DType,
    IndexerLayer,
    KVLayer,
    ModelConfig,
    SSMLayer,
    StorageScalar,
)
from lifecycle.device.base import Copy, Device
from lifecycle.errors import BlockIdOutOfRange, InvalidId, SlotOutOfRange, TornDown

if TYPE_CHECKING:
    from lifecycle.device.cuda import CudaArrayView

#: An array view of pool memory: a numpy array of the layer's storage dtype on the host device, a
#: ``__cuda_array_interface__`` object on CUDA (narrow with ``isinstance(view, numpy.ndarray)``);
#: both export DLPack with the layer's true dtype.
PoolView: TypeAlias = "NDArray[StorageScalar] | CudaArrayView"


def _int_arg(what: str, value: object, limit: int, error: type[InvalidId]) -> int:
    """``value`` as an int in ``0 .. limit-1`` (numpy integers accepted, bool refused)."""
    if type(value) is int:
        number = value
    elif isinstance(value, SupportsIndex) and not isinstance(value, bool):
        number = _as_index(value)
    else:
        raise error(f"{what} must be an int, got {value!r}")
    if not 0 <= number < limit:
        valid = f"valid values are 0..{limit - 1}" if limit else "the pool has none"
        raise error(f"{what} {number} is out of range: {valid}")
    return number


class _Allocations:
    """Device allocations of one pool, freed newest first, exactly once."""

    __slots__ = ("_device", "_ptrs", "_released")

    def __init__(self, device: Device) -> None:
        self._device = device
        self._ptrs: list[int] = []
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def alloc(self, nbytes: int) -> int:
        ptr = self._device.alloc(nbytes)
        self._ptrs.append(ptr)
        return ptr

    def free_all(self) -> list[Exception]:
        """Free every allocation, newest first, even if some frees fail; returns the failures."""
        self._released = True
        failures: list[Exception] = []
        while self._ptrs:
            ptr = self._ptrs.pop()
            try:
                self._device.free(ptr)
            except Exception as failure:  # keep freeing the rest: one bad free must not leak them
                failures.append(failure)
        return failures

    def release(self) -> None:
        if self._released:
            return
        failures = self.free_all()
        if failures:
            raise failures[0]

    def check_live(self, pool: str) -> None:
        if self._released:
            raise TornDown(f"{pool} was released; its memory is gone")

    def undo_construction(self, error: BaseException) -> None:
        """Free what a failed constructor allocated, keeping ``error`` as the one raised."""
        for failure in self.free_all():
            error.add_note(f"while freeing after the failure: {failure!r}")


LayerT = TypeVar("LayerT", bound=KVLayer | SSMLayer)


class LayerPool(Generic[LayerT]):
    """What both pools keep the same way: the device, their layers (attention layers in the KV
    pool, SSM layers in the SSM pool) and the allocations behind them, freed newest first, exactly
    once."""

    _name: ClassVar[str]  # the pool's name in errors
    _layer_name: ClassVar[str]  # what a layer index counts, in errors

    def __init__(self, device: Device, layers: tuple[LayerT, ...]) -> None:
        self._device = device
        self._layers: tuple[LayerT, ...] = layers
        self._allocations = _Allocations(device)

    def _allocate(self, sizes: Iterable[int]) -> tuple[int, ...]:
        """One allocation of each size, in order; on failure those made are freed and the error
        raised."""
        ptrs: list[int] = []
        try:
            for nbytes in sizes:
                ptrs.append(self._allocations.alloc(nbytes))
        except BaseException as error:
            self._allocations.undo_construction(error)
            raise
        return tuple(ptrs)

    @property
    def device(self) -> Device:
        """The device the pool lives on."""
        return self._device

    @property
    def num_layers(self) -> int:
        """Layers in the pool (attention layers in the KV pool, SSM layers in the SSM pool)."""
        return len(self._layers)

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran."""
        return self._allocations.released

    def _check_live(self) -> None:
        self._allocations.check_live(self._name)

    def _layer(self, layer: int) -> int:
        self._allocations.check_live(self._name)
        return _int_arg(self._layer_name, layer, len(self._layers), InvalidId)

    def release(self) -> None:
        """Free every layer's memory, newest allocation first; a second call does nothing."""
        self._allocations.release()


def _element(layer: KVLayer) -> tuple[DType, int]:
    """The dtype of a layer's array view and its size (an indexer's blocks are viewed as bytes:
    its key and scale share a token's row)."""
    dtype: DType = "uint8" if isinstance(layer, IndexerLayer) else layer.dtype
    return dtype, DTYPE_SIZES[dtype]


class KVPool(LayerPool[KVLayer]):
    """The layers of KV cache group ``group`` of ``config`` for that group's ``num_blocks`` blocks
    (group 0: every attention layer of a one-group model, for ``config.num_blocks_resolved``)."""

    _name = "KVPool"
    _layer_name = "attention layer"

    def __init__(self, device: Device, config: ModelConfig, group: int = 0) -> None:
        groups = config.kv_groups
        if not 0 <= group < max(len(groups), 1):
            raise InvalidId(f"KVPool: group {group!r} is out of range: {config.name!r} has {len(groups)} KV groups")
        layers: list[KVLayer] = []
        for index in groups[group].layer_indices if groups else ():  # no KV layer: an empty pool
            layer = config.layers[index]
            assert not isinstance(layer, SSMLayer)
            layers.append(layer)
        super().__init__(device, tuple(layers))
        self._group = group
        self._kind = groups[group].kind if groups else "full"
        self._num_blocks = groups[group].num_blocks if groups else 0
        self._block_size = config.block_size
        self._block_bytes = tuple(layer.block_bytes(config.block_size) for layer in self._layers)
        blocks = self._num_blocks
        self._ptrs = self._allocate(blocks * block_bytes for block_bytes in self._block_bytes) if blocks else ()

    @property
    def group(self) -> int:
        """The KV cache group this pool holds (its index in ``config.kv_groups``)."""
        return self._group

    @property
    def kind(self) -> str:
        """The group's attention rule: ``"full"``, ``"sliding_window"`` or ``"chunked_local"``."""
        return self._kind

    # --- sizes and addresses ---------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks per layer."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool: ``num_blocks * config.kv_block_bytes()``."""
        return self._num_blocks * sum(self._block_bytes)

    @property
    def layer_ptrs(self) -> tuple[int, ...]:
        """Base address of each attention layer's allocation (block 0)."""
        self._check_live()
        return self._ptrs

    def _block(self, block_id: object) -> int:
        return _int_arg("block id", block_id, self._num_blocks, BlockIdOutOfRange)

    def layer_block_bytes(self, layer: int) -> int:
        """Bytes of one block of ``layer`` (K and V, or K alone)."""
        return self._block_bytes[self._layer(layer)]

    def block_stride_bytes(self, layer: int) -> int:
        """Bytes from one block of ``layer`` to the next (blocks are packed: the block's size)."""
        return self.layer_block_bytes(layer)

    def layer_shape(self, layer: int) -> tuple[int, ...]:
        """``(num_blocks, *block_shape)`` of ``layer``: ``(num_blocks, planes, block_size,
        num_kv_heads, head_dim)`` for attention, ``(num_blocks, block_size, width)`` for MLA (width
        elements) and the indexer (width bytes)."""
        return (self._num_blocks, *self._layers[self._layer(layer)].block_shape(self._block_size))

    def layer_strides(self, layer: int) -> tuple[int, ...]:
        """Byte strides of :meth:`layer_shape` (C order)."""
        shape = self.layer_shape(layer)
        strides = [_element(self._layers[layer])[1]]
        for extent in reversed(shape[1:]):
            strides.append(strides[-1] * extent)
        return tuple(reversed(strides))

    def block_addr(self, layer: int, block_id: int) -> int:
        """Address of block ``block_id`` of ``layer``: ``layer_block_bytes(layer)`` contiguous bytes,
        K then V. Raises :class:`BlockIdOutOfRange` / :class:`InvalidId`."""
        index = self._layer(layer)
        return self._ptrs[index] + self._block(block_id) * self._block_bytes[index]

    def block_ranges(self, block_ids: Iterable[int]) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every given block in every layer, layer-major (all blocks of
        layer 0, then layer 1, ...). Every id is checked before anything is returned."""
        self._check_live()
        blocks = [self._block(block_id) for block_id in block_ids]
        return [
            (ptr + block * block_bytes, block_bytes)
            for ptr, block_bytes in zip(self._ptrs, self._block_bytes)
            for block in blocks
        ]

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy blocks ``src -> dst`` for each ``(src, dst)`` pair, in every layer, as one batched
        device copy (asynchronous). The copies of a batch run in no particular order, so a block
        may be written by one pair only, and not also be read by another (chained pairs such as
        ``(a, b), (b, c)`` take two calls); a ``(b, b)`` pair is a no-op. Every id and pair is
        checked before anything is issued."""
        self._check_live()
        checked = [(self._block(src), self._block(dst)) for src, dst in pairs]
        writer: dict[int, int] = {}  # block -> the pair that writes it
        for index, (src, dst) in enumerate(checked):
            if src != dst:
                if dst in writer:
                    raise InvalidId(
                        f"copy_blocks: block {dst} is the destination of pairs {writer[dst]} and {index}; "
                        "one batch writes a block at most once"
                    )
                writer[dst] = index
        for index, (src, dst) in enumerate(checked):
            if src != dst and src in writer:
                raise InvalidId(
                    f"copy_blocks: block {src} is read by pair {index} and written by pair {writer[src]} of the "
                    "same batch; copies in a batch run in no particular order, so chained pairs take two calls"
                )
        copies: list[Copy] = [
            (ptr + dst * block_bytes, ptr + src * block_bytes, block_bytes)
            for ptr, block_bytes in zip(self._ptrs, self._block_bytes)
            for src, dst in checked
            if src != dst
        ]
        if copies:
            self._device.copy_batch(copies)

    def kv_view(self, layer: int) -> PoolView:
        """Zero-copy array of ``layer`` shaped :meth:`layer_shape`: numpy on host, an object with
        ``__cuda_array_interface__`` on CUDA; both export DLPack with the layer's true dtype
        (``torch.from_dlpack(pool.kv_view(0))`` is a bfloat16 / float8 tensor over the pool). numpy
        and the array interface see bfloat16 / float8 as unsigned integers of the same width."""
        index = self._layer(layer)
        dtype = _element(self._layers[index])[0]
        view = self._device.device_array(self._ptrs[index], self.layer_shape(index), dtype)
        return cast(PoolView, view)

    def __repr__(self) -> str:
        return (
            f"KVPool(group={self._group}, kind={self._kind!r}, layers={len(self._layers)}, "
            f"num_blocks={self._num_blocks}, total_bytes={self.total_bytes}, released={self.released})"
        )


class SSMPool(LayerPool[SSMLayer]):
    """h and conv state of every SSM layer for ``config.max_seqs + 1`` slots."""

    _name = "SSMPool"
    _layer_name = "SSM layer"

    def __init__(self, device: Device, config: ModelConfig) -> None:
        super().__init__(device, config.ssm_layers)
        self._num_slots = config.max_seqs + 1
        ptrs = self._allocate(
            self._num_slots * nbytes
            for layer in self._layers
            for nbytes in (layer.h_state_bytes, layer.conv_state_bytes)
        )
        self._h_ptrs, self._conv_ptrs = ptrs[0::2], ptrs[1::2]
        # (base, bytes per slot) of every per-slot range, in slot_ranges order.
        self._regions = tuple(
            region
            for layer, h_ptr, conv_ptr in zip(self._layers, self._h_ptrs, self._conv_ptrs)
            for region in ((h_ptr, layer.h_state_bytes), (conv_ptr, layer.conv_state_bytes))
        )

    # --- sizes and addresses ---------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        """Slots per layer, padding slot included (``max_seqs + 1``)."""
        return self._num_slots

    @property
    def padding_slot(self) -> int:
        """The last slot: addressable, never handed out to a sequence."""
        return self._num_slots - 1

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot across every layer (h and conv)."""
        return sum(layer.slot_bytes for layer in self._layers)

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self._num_slots * self.slot_bytes

    @property
    def h_ptrs(self) -> tuple[int, ...]:
        """Base address (slot 0) of each layer's h state; slot ``s`` is ``s * h_state_bytes`` further."""
        self._check_live()
        return self._h_ptrs

    @property
    def conv_ptrs(self) -> tuple[int, ...]:
        """Base address (slot 0) of each layer's conv state."""
        self._check_live()
        return self._conv_ptrs

    def _slot(self, slot: int) -> int:
        self._check_live()
        return _int_arg("slot", slot, self._num_slots, SlotOutOfRange)

    def h_addr(self, layer: int, slot: int) -> int:
        """Address of ``slot``'s h state in ``layer`` (``h_state_bytes`` contiguous bytes)."""
        index = self._layer(layer)
        return self._h_ptrs[index] + self._slot(slot) * self._layers[index].h_state_bytes

    def conv_addr(self, layer: int, slot: int) -> int:
        """Address of ``slot``'s conv state in ``layer`` (``conv_state_bytes`` contiguous bytes)."""
        index = self._layer(layer)
        return self._conv_ptrs[index] + self._slot(slot) * self._layers[index].conv_state_bytes

    def slot_ranges(self, slot: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every per-slot range of ``slot``: layer 0's h, layer 0's conv,
        layer 1's h, ... (always in this order)."""
        index = self._slot(slot)
        return [(base + index * nbytes, nbytes) for base, nbytes in self._regions]

    def zero_slot(self, slot: int) -> None:
        """Set every byte of ``slot``'s state, in every layer, to 0 (asynchronous)."""
        for addr, nbytes in self.slot_ranges(slot):
            self._device.memset(addr, 0, nbytes)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy ``src``'s h and conv state of every layer to ``dst`` as ONE batched device copy
        (asynchronous: synchronize before ``src`` is reused). Same slot: nothing to do."""
        source, target = self._slot(src), self._slot(dst)
        if source == target or not self._regions:
            return
        self._device.copy_batch(
            [(base + target * nbytes, base + source * nbytes, nbytes) for base, nbytes in self._regions]
        )

    def h_view(self, layer: int) -> Any:
        """Zero-copy ``[num_slots, elements]`` array of ``layer``'s h state (numpy on host,
        ``__cuda_array_interface__`` on CUDA; DLPack with the true dtype on both, as
        :meth:`KVPool.kv_view`)."""
        index = self._layer(layer)
        spec = self._layers[index]
        return self._view(self._h_ptrs[index], spec.h_state_bytes, spec.h_dtype)

    def conv_view(self, layer: int) -> Any:
        """Zero-copy ``[num_slots, elements]`` array of ``layer``'s conv state."""
        index = self._layer(layer)
        spec = self._layers[index]
        return self._view(self._conv_ptrs[index], spec.conv_state_bytes, spec.conv_dtype)

    def _view(self, ptr: int, slot_bytes: int, dtype: DType) -> Any:
        return self._device.device_array(ptr, (self._num_slots, slot_bytes // DTYPE_SIZES[dtype]), dtype)

    def __repr__(self) -> str:
        return (
            f"SSMPool(layers={len(self._layers)}, num_slots={self._num_slots}, "
            f"total_bytes={self.total_bytes}, released={self.released})"
        )


def kv_group_pools(device: Device, config: ModelConfig) -> tuple[KVPool, ...]:
    """One :class:`KVPool` per KV cache group of ``config``, group 0 first (none without KV
    layers); if one cannot be allocated, those before it are released and the error raised."""
    pools: list[KVPool] = []
    try:
        for group in range(len(config.kv_groups)):
            pools.append(KVPool(device, config, group))
    except BaseException:
        for pool in reversed(pools):
            pool.release()
        raise
    return tuple(pools)
