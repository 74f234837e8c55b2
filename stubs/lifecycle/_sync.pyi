"""The KV cache core's lock (compiled from pyx/sync.pyx): its pool's mutex, timed."""

from typing import final

@final
class CoreLock:
    """A KV cache core's lock; the core makes its own (nothing to call from Python)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        """Not for callers: a ``KVCacheCore`` makes its own."""
