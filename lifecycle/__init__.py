"""lifecycle: the memory of an LLM being served.

Paged KV blocks with refcounts, a refcounted prefix cache over them, SSM state slots for hybrid
models, LoRA adapter slot references, compaction, and swap of a sequence's state to host memory or
files and back.
"""

from __future__ import annotations

from lifecycle._blockpool import BlockPool
from lifecycle.errors import (
    AdapterError,
    BlockIdOutOfRange,
    ConfigError,
    CudaError,
    DeviceError,
    DoubleFree,
    DriverNotFound,
    ForeignSequence,
    InvalidId,
    InvariantViolation,
    LifecycleError,
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
    TornDown,
    Unsupported,
)

__version__ = "0.1.0"

__all__ = [
    "AdapterError",
    "BlockIdOutOfRange",
    "BlockPool",
    "ConfigError",
    "CudaError",
    "DeviceError",
    "DoubleFree",
    "DriverNotFound",
    "ForeignSequence",
    "InvalidId",
    "InvariantViolation",
    "LifecycleError",
    "OutOfBlocks",
    "OutOfSlots",
    "PoolExhausted",
    "SequenceStateError",
    "SlotInUse",
    "SlotOutOfRange",
    "SwapChecksumError",
    "SwapError",
    "SwapFormatError",
    "SwapModelMismatch",
    "TornDown",
    "Unsupported",
    "__version__",
]
