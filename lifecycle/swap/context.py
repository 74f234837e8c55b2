"""What save and restore work on: the model's configuration, device and pools, named by the parts
of them swap reads (so that swap imports neither the model nor the pools)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from lifecycle.swap.format import ConfigLike, _Layout

if TYPE_CHECKING:
    from lifecycle.lora import AdapterInfo
    from lifecycle.device.base import Device
    from lifecycle.swap.staging import StagingBuffer

__all__ = ["AdapterLookup", "GroupColumns", "KVLayout", "SSMLayout", "SwapContext"]


class KVLayout(Protocol):
    """The part of :class:`~lifecycle.pools.KVPool` swap reads: ``layer`` counts attention layers."""

    @property
    def num_layers(self) -> int: ...
    def layer_block_bytes(self, layer: int) -> int: ...
    def block_addr(self, layer: int, block_id: int) -> int: ...


class GroupColumns(Protocol):
    """The part of :class:`~lifecycle._kvcache.KVCacheCore` a record of several KV cache groups
    reads: a sequence's table in each group, and its window state."""

    def block_table(self, handle: int, group: int = 0) -> npt.NDArray[np.int32]: ...
    def kv_tokens(self, handle: int) -> int: ...


class SSMLayout(Protocol):
    """The part of :class:`~lifecycle.pools.SSMPool` swap reads."""

    def slot_ranges(self, slot: int) -> list[tuple[int, int]]: ...


class AdapterLookup(Protocol):
    """The part of :class:`~lifecycle.lora.AdapterTable` swap reads."""

    def info(self, slot: int) -> AdapterInfo: ...



@dataclass(slots=True)
class SwapContext:
    """What save and restore work on: the model's configuration, device and pools.

    ``staging``: the model's reusable staging buffer; None allocates one per call (and frees it).
    ``adapters``: resolves a sequence's ``adapter_slot`` to (name, generation) for the record;
    needed only for sequences bound to an adapter. ``zero_copy_host``: on the host device, hash and
    copy straight between the stream and the pools instead of through the staging buffer.
    ``grouped``: the model's KV layers are not one group of attention layers, so its records are
    2.x ones over ``kv_groups`` (a KV pool per group, group 0 first) and ``core`` (each group's
    table)."""

    config: ConfigLike
    device: Device
    kv: KVLayout | None
    ssm: SSMLayout | None
    staging: StagingBuffer | None = None
    adapters: AdapterLookup | None = None
    zero_copy_host: bool = True
    kv_groups: tuple[KVLayout, ...] = ()
    core: GroupColumns | None = None
    grouped: bool = False
    _layout: _Layout | None = field(default=None, repr=False)

    def layout(self) -> _Layout:
        if self._layout is None:
            self._layout = _Layout.of(self)
        return self._layout
