"""The SSM snapshot ids of a KV cache core (compiled from pyx/snapids.pyx)."""

from typing import final

@final
class SnapshotIds:
    """A KV cache core's SSM snapshot ids; the core makes its own."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        """Not for callers: a ``KVCacheCore`` makes its own."""
    @property
    def num(self) -> int: ...
    @property
    def used(self) -> int: ...
    @property
    def evicted(self) -> int: ...
