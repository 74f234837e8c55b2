"""lifecycle: the memory of an LLM being served.

Paged KV blocks with refcounts, a refcounted prefix cache over them, SSM state slots for hybrid
models, LoRA adapter slot references, compaction, and swap of a sequence's state to host memory or
files and back. Start with :class:`HybridModel` (the ``ModelLifecycle`` implementation) and a
:class:`ModelConfig` or a :func:`preset`.
"""

from __future__ import annotations

import logging as _logging
from importlib import import_module as _import_module
from importlib.util import find_spec as _find_spec
from typing import TYPE_CHECKING

# A library logs; the application decides where to (no "No handlers could be found" fallback).
_logging.getLogger("lifecycle").addHandler(_logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "DETACHED_SLOT",
    "NO_ADAPTER",
    "AdapterError",
    "AdapterInfo",
    "AttentionLayer",
    "BlockIdOutOfRange",
    "BlockPool",
    "ChunkedLocalLayer",
    "ConfigError",
    "CudaError",
    "Device",
    "DeviceError",
    "DoubleFree",
    "DriverNotFound",
    "ForeignSequence",
    "ForkedAfterCudaInit",
    "HostDevice",
    "HybridModel",
    "IndexerLayer",
    "InvalidId",
    "InvalidType",
    "InvariantViolation",
    "KVCacheCore",
    "KVGroupSpec",
    "KVPool",
    "LifecycleDefaults",
    "LifecycleError",
    "MLALayer",
    "MalformedEvent",
    "MemoryPlan",
    "ModelConfig",
    "ModelDims",
    "ModelLifecycle",
    "OutOfBlocks",
    "OutOfSlots",
    "PoolExhausted",
    "PrefixReclaim",
    "RadixTrie",
    "RetentionError",
    "SSMLayer",
    "SSMPool",
    "SeqStatus",
    "SequenceState",
    "SequenceStateError",
    "SlidingWindowLayer",
    "SlotGuard",
    "SlotInUse",
    "SlotOutOfRange",
    "SlotPool",
    "Stats",
    "SwapChecksumError",
    "SwapError",
    "SwapFormatError",
    "SwapHandle",
    "SwapModelMismatch",
    "SwapStreamError",
    "SwapTier",
    "TeardownReport",
    "TornDown",
    "Unsupported",
    "__version__",
    "open_device",
    "preset",
    "preset_names",
]

# The public names are loaded on first use (PEP 562), so that importing one light module, such as
# lifecycle.protocol, does not load the compiled core and everything above it.
_MODULE_OF_NAMES: dict[str, tuple[str, ...]] = {
    "lifecycle._blockpool": ("BlockPool",),
    "lifecycle._kvcache": ("KVCacheCore",),
    "lifecycle._radix": ("RadixTrie",),
    "lifecycle._slots": ("SlotGuard", "SlotPool"),
    "lifecycle.lora": ("AdapterInfo",),
    "lifecycle.config": (
        "AttentionLayer", "ChunkedLocalLayer", "IndexerLayer", "KVGroupSpec", "MLALayer", "MemoryPlan", "ModelConfig",
        "ModelDims", "SSMLayer", "SlidingWindowLayer",
    ),
    "lifecycle.device": ("Device", "HostDevice", "open_device"),
    "lifecycle.errors": (
        "AdapterError", "BlockIdOutOfRange", "ConfigError", "CudaError", "DeviceError", "DoubleFree",
        "DriverNotFound", "ForeignSequence", "ForkedAfterCudaInit", "InvalidId", "InvalidType", "InvariantViolation",
        "LifecycleError", "MalformedEvent", "OutOfBlocks", "OutOfSlots", "PoolExhausted", "RetentionError",
        "SequenceStateError", "SlotInUse", "SlotOutOfRange", "SwapChecksumError", "SwapError", "SwapFormatError",
        "SwapModelMismatch", "SwapStreamError", "TornDown", "Unsupported",
    ),
    "lifecycle.model": ("HybridModel", "TeardownReport"),
    "lifecycle.pools": ("KVPool", "SSMPool"),
    "lifecycle.presets": ("preset", "preset_names"),
    "lifecycle.protocol": ("LifecycleDefaults", "ModelLifecycle", "PrefixReclaim"),
    "lifecycle.sequence": ("DETACHED_SLOT", "NO_ADAPTER", "SeqStatus", "SequenceState"),
    "lifecycle.stats": ("Stats",),
    "lifecycle.swap.tier": ("SwapHandle", "SwapTier"),
}
_MODULE_OF = {name: module for module, names in _MODULE_OF_NAMES.items() for name in names}

if TYPE_CHECKING:
    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore
    from lifecycle._radix import RadixTrie
    from lifecycle._slots import SlotGuard, SlotPool
    from lifecycle.lora import AdapterInfo
    from lifecycle.config import (
        AttentionLayer,
        ChunkedLocalLayer,
        IndexerLayer,
        KVGroupSpec,
        MemoryPlan,
        MLALayer,
        ModelConfig,
        ModelDims,
        SlidingWindowLayer,
        SSMLayer,
    )
    from lifecycle.device import Device, HostDevice, open_device
    from lifecycle.errors import (
        AdapterError,
        BlockIdOutOfRange,
        ConfigError,
        CudaError,
        DeviceError,
        DoubleFree,
        DriverNotFound,
        ForeignSequence,
        ForkedAfterCudaInit,
        InvalidId,
        InvalidType,
        InvariantViolation,
        LifecycleError,
        MalformedEvent,
        OutOfBlocks,
        OutOfSlots,
        PoolExhausted,
        RetentionError,
        SequenceStateError,
        SlotInUse,
        SlotOutOfRange,
        SwapChecksumError,
        SwapError,
        SwapFormatError,
        SwapModelMismatch,
        SwapStreamError,
        TornDown,
        Unsupported,
    )
    from lifecycle.model import HybridModel, TeardownReport
    from lifecycle.pools import KVPool, SSMPool
    from lifecycle.presets import preset, preset_names
    from lifecycle.protocol import LifecycleDefaults, ModelLifecycle, PrefixReclaim
    from lifecycle.sequence import DETACHED_SLOT, NO_ADAPTER, SequenceState, SeqStatus
    from lifecycle.stats import Stats
    from lifecycle.swap.tier import SwapHandle, SwapTier
else:

    def __getattr__(name: str) -> object:
        module = _MODULE_OF.get(name)
        if module is not None:
            value = getattr(_import_module(module), name)
            globals()[name] = value  # later lookups find it without coming here
            return value
        # A submodule read as an attribute before anything imported it (``lifecycle.config.X``
        # right after ``import lifecycle``).
        if not name.startswith("_") and _find_spec(f"lifecycle.{name}") is not None:
            return _import_module(f"lifecycle.{name}")
        raise AttributeError(f"module 'lifecycle' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
