"""The ``ModelLifecycle`` protocol: the seventeen methods an engine's scheduler calls.

Seven are required of every model; :class:`LifecycleDefaults` supplies the other ten with the
behaviour a model without pooled memory wants (nothing to tear down, no swap, no blocks).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Protocol, runtime_checkable

from lifecycle.errors import Unsupported

__all__ = ["LifecycleDefaults", "ModelLifecycle", "PrefixReclaim"]

if TYPE_CHECKING:
    from lifecycle.config import ModelDims
    from lifecycle.sequence import SequenceState


@dataclass(frozen=True, slots=True)
class PrefixReclaim:
    """Outcome of ``reclaim_prefix_blocks_for``.

    ``target`` is how many new blocks the prefill still has to allocate once it reuses the cached
    prefix (``blocks_needed`` minus the reusable blocks, never below 0); ``free`` is the pool's
    free block count after reclaiming. ``free >= target`` means the prefill fits. ``host_blocks``:
    of the blocks still to allocate, the leading ones a host tier holds (copied in at attach
    rather than computed; 0 without a tier).
    """

    target: int
    free: int
    host_blocks: int = 0

    @property
    def fits(self) -> bool:
        """True when the pool now has enough free blocks for the prefill."""
        return self.free >= self.target


@runtime_checkable
class ModelLifecycle(Protocol):
    """The memory lifecycle of one served model, as the scheduler sees it."""

    # Required of every model.
    def bind_gpu_to_thread(self) -> None: ...
    def alloc_sequence(self) -> SequenceState: ...
    def cache_sequence(self, seq: SequenceState) -> None: ...
    def free_sequence(self, seq: SequenceState) -> None: ...
    def compact_sequence(self, seq: SequenceState, new_slot: int) -> None: ...
    def detach_slot_for_reuse(self, seq: SequenceState) -> None: ...
    def kv_block_bytes(self) -> int: ...

    # Provided by LifecycleDefaults.
    def teardown(self) -> None: ...
    def poll_innerq(self) -> None: ...
    def high_speed_swap_dims(self) -> ModelDims | None: ...
    def alloc_sequence_for(self, budget_tokens: int) -> SequenceState: ...
    def save_sequence_state(self, seq: SequenceState, writer: BinaryIO) -> None: ...
    def restore_sequence_state(self, seq: SequenceState, num_blocks: int, reader: BinaryIO) -> None: ...
    def num_free_blocks(self) -> int: ...
    def num_total_blocks(self) -> int: ...
    def reclaim_prefix_blocks(self, num_blocks: int) -> int: ...
    def reclaim_prefix_blocks_for(
        self, prompt: Sequence[int], adapter_slot: int, blocks_needed: int
    ) -> PrefixReclaim: ...


class LifecycleDefaults(ABC):
    """The ten provided methods, for models that own no pooled device memory.

    Subclasses implement the seven required methods. A model that owns pools must override
    ``teardown`` (the default releases nothing, so such a model would leak), and usually the rest.
    """

    @abstractmethod
    def bind_gpu_to_thread(self) -> None: ...
    @abstractmethod
    def alloc_sequence(self) -> SequenceState: ...
    @abstractmethod
    def cache_sequence(self, seq: SequenceState) -> None: ...
    @abstractmethod
    def free_sequence(self, seq: SequenceState) -> None: ...
    @abstractmethod
    def compact_sequence(self, seq: SequenceState, new_slot: int) -> None: ...
    @abstractmethod
    def detach_slot_for_reuse(self, seq: SequenceState) -> None: ...
    @abstractmethod
    def kv_block_bytes(self) -> int: ...

    def reclaim_prefix_blocks(self, num_blocks: int) -> int:
        """Evicts nothing: a model without a prefix cache has nothing to give back."""
        return 0

    def teardown(self) -> None:  # noqa: B027  (a no-op default, deliberately not abstract)
        """Nothing to release."""

    def poll_innerq(self) -> None:  # noqa: B027  (a no-op default, deliberately not abstract)
        """No KV-quantization calibration driver is registered."""

    def high_speed_swap_dims(self) -> ModelDims | None:
        """This model does not take part in high-speed swap."""
        return None

    def alloc_sequence_for(self, budget_tokens: int) -> SequenceState:
        """The budget only sizes per-sequence proposer state; without any, same as alloc_sequence."""
        return self.alloc_sequence()

    def save_sequence_state(self, seq: SequenceState, writer: BinaryIO) -> None:
        raise Unsupported(f"{type(self).__name__} cannot save sequence state (no swap support)")

    def restore_sequence_state(self, seq: SequenceState, num_blocks: int, reader: BinaryIO) -> None:
        raise Unsupported(f"{type(self).__name__} cannot restore sequence state (no swap support)")

    def num_free_blocks(self) -> int:
        return 0

    def num_total_blocks(self) -> int:
        return 0

    def reclaim_prefix_blocks_for(
        self, prompt: Sequence[int], adapter_slot: int, blocks_needed: int
    ) -> PrefixReclaim:
        """No prefix is reused: reclaim until ``blocks_needed`` blocks are free or nothing gives."""
        while self.num_free_blocks() < blocks_needed:
            if self.reclaim_prefix_blocks(blocks_needed - self.num_free_blocks()) == 0:
                break
        return PrefixReclaim(target=blocks_needed, free=self.num_free_blocks())
