"""The retention calls of ``HybridModel`` (:class:`RetentionCalls`, a base of it): what an engine
says about what to keep, passed to the core's hints (``lifecycle._retention``) under the model's
gate. The core keeps every hint; nothing here holds state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from lifecycle.sequence import NO_ADAPTER

if TYPE_CHECKING:
    from lifecycle._kvcache import KVCacheCore, SequenceState
    from lifecycle.parts import Gate, ModelParts

__all__ = ["RetentionCalls"]

_Ints = Sequence[int] | npt.NDArray[np.integer]


class RetentionCalls:
    """Retention hints, pinned prefixes and their budget (TensorRT-LLM's ``KvCacheRetentionConfig``
    semantics: priorities 0-100, the default 35, each decaying to the default after its duration)."""

    __slots__ = ()
    _core: KVCacheCore
    _entered: Gate
    _parts: ModelParts

    def set_retention(
        self,
        seq: SequenceState,
        ranges: Sequence[tuple[int, int, int] | tuple[int, int, int, float | None]] = (),
        *,
        decode_priority: int | None = None,
        decode_duration_s: float | None = None,
        ttl_s: float | None = None,
    ) -> list[tuple[int, int, float]]:
        """What to keep of the sequence's blocks once it finishes: token ``ranges`` of its prompt as
        ``(start, end, priority[, duration_s])`` (after ``duration_s`` a priority decays to the
        default), ``decode_priority`` (and ``decode_duration_s``) for its generated tokens, ``ttl_s``
        to keep its whole path (a conversation's tail) just above the default for that long.
        Eviction takes the lowest priority first. Call it after ``attach_prefix``; returns the spans
        kept, ``(first block, priority, duration or -1)``. Bad input raises ``RetentionError``; the
        old hint stands."""
        handle = self._core.handle_of(seq)
        with self._entered:
            return self._core.set_retention(
                handle, ranges, decode_priority=decode_priority, decode_duration_s=decode_duration_s, ttl_s=ttl_s
            )

    def pin_prefix(self, tokens: _Ints, *, adapter_slot: int = NO_ADAPTER) -> int:
        """Keep the cached whole blocks of ``tokens`` (a system prompt) until ``unpin_prefix``, within
        ``set_pin_budget``; returns how many blocks it pinned (0: none cached yet). Over the budget:
        ``RetentionError``, nothing pinned."""
        with self._entered:
            return int(self._core.retention.pin(tokens, self._parts.lora.root_of(adapter_slot)))

    def unpin_prefix(self, tokens: _Ints, *, adapter_slot: int = NO_ADAPTER) -> int:
        """Undo ``pin_prefix`` of the same prefix; returns the blocks it had pinned."""
        with self._entered:
            return int(self._core.retention.unpin(tokens, self._parts.lora.root_of(adapter_slot)))

    def set_tier_min_priority(self, priority: int) -> None:
        """Demote to the host tier only evicted blocks of retention priority ``priority`` or more
        (TensorRT-LLM's minimum priority for offload): a lower block leaves the device for good.
        0, the default: every evicted block goes down. Refused (``RetentionError``) outside 0-100."""
        with self._entered:
            self._core.set_demote_min_priority(priority)

    def set_pin_budget(self, num_blocks: int) -> None:
        """At most ``num_blocks`` blocks in pinned prefixes (0 until set)."""
        with self._entered:
            self._core.retention.set_pin_budget(num_blocks)
