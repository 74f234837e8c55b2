"""Retention hints and pinned prefixes of a KV cache core (compiled from pyx/retention.pyx)."""

from collections.abc import Iterable, Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt

DEFAULT_RETENTION: int
TTL_PRIORITY: int

def block_spans(
    ranges: Iterable[tuple[int, int, int] | tuple[int, int, int, float | None]],
    prompt_len: int,
    block_size: int,
    decode_priority: int | None = None,
    decode_duration_s: float | None = None,
    ttl_s: float | None = None,
) -> list[tuple[int, int, float]]:
    """Where each priority starts over a request's blocks: ``(first block, priority, duration or -1.0)``."""

@final
class Retention:
    """A KV cache core's retention hints and pinned prefixes (``KVCacheCore.retention``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        """Not for callers: a ``KVCacheCore`` makes its own."""
    @property
    def num_hinted(self) -> int: ...
    @property
    def hinted(self) -> bool: ...
    @property
    def pin_budget(self) -> int: ...
    @property
    def pinned_blocks(self) -> int: ...
    def set(
        self,
        handle: int,
        ranges: Iterable[tuple[int, int, int] | tuple[int, int, int, float | None]] = (),
        decode_priority: int | None = None,
        decode_duration_s: float | None = None,
        ttl_s: float | None = None,
    ) -> list[tuple[int, int, float]]: ...
    def prioritize(
        self, tokens: npt.NDArray[np.integer[Any]] | Sequence[int], key: int, priority: int,
        duration_s: float | None = None,
    ) -> int: ...
    def set_pin_budget(self, blocks: int | np.integer[Any]) -> None: ...
    def pin(self, tokens: npt.NDArray[np.integer[Any]] | Sequence[int], key: int) -> int: ...
    def unpin(self, tokens: npt.NDArray[np.integer[Any]] | Sequence[int], key: int) -> int: ...
    def set_time(self, seconds: float) -> None: ...
    def time(self) -> float: ...
