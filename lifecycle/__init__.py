"""lifecycle: the memory of an LLM being served.

Paged KV blocks with refcounts, a refcounted prefix cache over them, SSM state slots for hybrid
models, LoRA adapter slot references, compaction, and swap of a sequence's state to host memory or
files and back. Start with :class:`HybridModel` (the ``ModelLifecycle`` implementation) and a
:class:`ModelConfig` or a :func:`preset`.
"""

from __future__ import annotations

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore
from lifecycle._radix import RadixTrie
from lifecycle._slots import SlotGuard, SlotPool
from lifecycle.adapters import AdapterInfo
from lifecycle.config import AttentionLayer, ModelConfig, ModelDims, SSMLayer
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
    InvariantViolation,
    LifecycleError,
    MalformedEvent,
    OutOfBlocks,
    OutOfSlots,
    PoolExhausted,
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

__version__ = "0.1.0"

__all__ = [
    "DETACHED_SLOT",
    "NO_ADAPTER",
    "AdapterError",
    "AdapterInfo",
    "AttentionLayer",
    "BlockIdOutOfRange",
    "BlockPool",
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
    "InvalidId",
    "InvariantViolation",
    "KVCacheCore",
    "KVPool",
    "LifecycleDefaults",
    "LifecycleError",
    "MalformedEvent",
    "ModelConfig",
    "ModelDims",
    "ModelLifecycle",
    "OutOfBlocks",
    "OutOfSlots",
    "PoolExhausted",
    "PrefixReclaim",
    "RadixTrie",
    "SSMLayer",
    "SSMPool",
    "SeqStatus",
    "SequenceState",
    "SequenceStateError",
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
