"""The event log of a KV cache core and the logs drained from it (compiled from pyx/evlog.pyx)."""

from typing import final

import numpy as np
import numpy.typing as npt

#: The layout of one entry of ``RawEvents.entries``.
EVENT_DTYPE: np.dtype[np.void]
STORED: int
REMOVED: int
CLEARED: int

@final
class EventLog:
    """A KV cache core's event log; the core makes its own and writes to it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        """Not for callers: a ``KVCacheCore`` makes its own."""
    @property
    def events(self) -> bool: ...
    @property
    def demote(self) -> bool: ...
    @property
    def max_pending_tokens(self) -> int: ...
    @property
    def demote_min(self) -> int: ...

@final
class RawEvents:
    """What ``KVCacheCore.take_events`` drained (read-only views over the log's memory)."""

    def __init__(self, *args: object, **kwargs: object) -> None: ...
    def __len__(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def dropped(self) -> int: ...
    @property
    def entries(self) -> npt.NDArray[np.void]: ...
    @property
    def hashes(self) -> npt.NDArray[np.uint64]: ...
    @property
    def tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def ids(self) -> npt.NDArray[np.int32]: ...
