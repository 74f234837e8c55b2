"""The prefix cache's composite operations, each one C call (compiled from pyx/prefix_cache.pyx)."""

from collections.abc import Sequence
from typing import Any, final

import numpy as np
from numpy.typing import NDArray

from lifecycle._blockpool import BlockPool
from lifecycle._prefix_trie import PrefixTrie

_Int32s = NDArray[np.int32] | Sequence[int]
_AdapterKey = int | np.integer[Any]

@final
class PrefixCacheCore:
    """A prefix trie and the block pool whose references its nodes hold, with fused operations."""

    def __init__(self, pool: BlockPool, trie: PrefixTrie, *, enabled: bool = True) -> None: ...
    @property
    def pool(self) -> BlockPool: ...
    @property
    def trie(self) -> PrefixTrie: ...
    @property
    def enabled(self) -> bool: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_evictable_blocks(self) -> int: ...
    @property
    def blocks_evicted(self) -> int: ...
    def evict(self, n: int) -> int: ...
    def allocate(self, block_table: NDArray[np.int32], start: int, n: int) -> int: ...
    def acquire_prefix(
        self, tokens: _Int32s, block_table: NDArray[np.int32], adapter: _AdapterKey = 0, max_blocks: int = -1
    ) -> NDArray[np.int32]: ...
    def admit(
        self,
        tokens: _Int32s,
        num_blocks: int,
        adapter: _AdapterKey = 0,
        max_prefix: int = -1,
        block_table: NDArray[np.int32] | None = None,
    ) -> tuple[NDArray[np.int32], NDArray[np.int32], int]: ...
    def insert_path(
        self, tokens: _Int32s, block_ids: _Int32s, adapter: _AdapterKey = 0, *, known_prefix: _Int32s | None = None
    ) -> tuple[int, NDArray[np.int32], NDArray[np.int32]]: ...
    def cache_and_release(
        self,
        tokens: NDArray[np.int32],
        block_table: NDArray[np.int32],
        num_full: int,
        adapter: _AdapterKey,
        pinned: NDArray[np.int32],
    ) -> tuple[int, int]: ...
    def clear(self) -> int: ...
