"""KV cache groups of a KV cache core (compiled from pyx/groups.pyx).

A core made with ``KVCacheCore(pool, block_size, groups=[(kind, window, sink_tokens, pool), ...])``
owns one ``KVGroups``: group 0 is the core's own pool (full attention), each entry of ``groups``
one more group with its rule and its own ``BlockPool`` (same block size).
"""

from typing import Literal, TypeAlias, final

from lifecycle._blockpool import BlockPool

#: The attention rules a group follows.
GroupKind: TypeAlias = Literal["full", "sliding_window", "chunked_local"]
#: One group past group 0 as ``KVCacheCore(groups=...)`` takes it: ``(kind, window, sink_tokens,
#: pool)``, ``kind`` a ``GroupKind``, ``window`` in tokens (the sliding window, or the chunk; 0 for
#: full), ``sink_tokens`` for a sliding window only (else 0). Another kind raises ``ConfigError``.
GroupSpec: TypeAlias = tuple[str, int, int, BlockPool]

KINDS: tuple[str, str, str]
#: Checkpoints (windows kept for later hits) every this many tokens unless told otherwise.
DEFAULT_RETENTION_TOKENS: int

@final
class KVGroups:
    """The KV cache groups of a ``KVCacheCore`` (made by the core; read ``KVCacheCore.group_stats``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        """Not for callers: a ``KVCacheCore`` given ``groups=`` makes its own."""
    @property
    def specs(self) -> tuple[tuple[str, int, int], ...]:
        """``(kind, window, sink_tokens)`` of every group, group 0 first."""
    @property
    def pools(self) -> tuple[BlockPool, ...]:
        """The ``BlockPool`` of every group, group 0 (the core's) first."""
    @property
    def retention_blocks(self) -> int:
        """Blocks between checkpoints (0: none)."""
    @property
    def windowed(self) -> bool:
        """Whether some group releases blocks (sliding window or chunked local)."""
    @property
    def shared(self) -> bool:
        """Whether every group takes its ids from group 0's pool (one id space)."""
