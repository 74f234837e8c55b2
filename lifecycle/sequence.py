"""``SequenceState``: one request's handle on the memory the model lent it.

A sequence owns an SSM slot (through a slot guard, so that dropping the object releases the slot
exactly once), one reference on every block of its block table, pins on the cached prefix it
reuses, and optionally a LoRA adapter slot reference. Only the model that created it changes those;
the engine reads them (``block_table``, ``slot_idx``, ``ssm_addrs``) and appends the tokens it
computed (``append_tokens``).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, final

import numpy as np
import numpy.typing as npt

from lifecycle._hostcopy import put_int32 as _put_int32
from lifecycle.errors import SequenceStateError

if TYPE_CHECKING:
    from lifecycle._slots import SlotGuard

#: ``slot_idx`` of a sequence whose slot was given up with ``detach_slot_for_reuse``. It equals the
#: padding slot's index from the end, so a stale kernel index lands on padding, never on a live slot.
DETACHED_SLOT: Final[int] = -1

#: Sentinel of ``adapter_slot`` for a sequence served without a LoRA adapter.
NO_ADAPTER: Final[int] = -1

_EMPTY_I32: Final = np.empty(0, dtype=np.int32)
_INT32: Final = np.dtype(np.int32)


class SeqStatus(enum.Enum):
    """Where a sequence is in its life. Transitions: ACTIVE -> RETIRED -> FREED, ACTIVE -> FREED."""

    ACTIVE = "active"
    RETIRED = "retired"
    FREED = "freed"


# Module globals read faster than the enum's class attributes (every sequence sets or tests them).
_ACTIVE: Final = SeqStatus.ACTIVE
_FREED: Final = SeqStatus.FREED


@final
class Holdings:
    """The references a sequence holds, kept by the model too, so that a sequence dropped without
    ``free_sequence`` can still be reaped (its blocks, pins and adapter reference released)."""

    __slots__ = (
        "seq_id",
        "blocks",
        "num_blocks",
        "pinned_nodes",
        "cache_pins",
        "pinned_depth",
        "rolling_snapshot",
        "adapter_slot",
        "adapter_uid",
        "status",
    )

    def __init__(self, seq_id: int, block_capacity: int) -> None:
        self.seq_id = seq_id
        self.blocks: npt.NDArray[np.int32] = np.empty(block_capacity, _INT32)  # positional: parses faster
        self.num_blocks = 0
        #: Pins on the cached prefix attached at admission (its blocks head the block table).
        self.pinned_nodes: npt.NDArray[np.int32] = _EMPTY_I32
        #: Pins on the nodes the sequence's own ``cache_sequence`` calls added after that prefix
        #: (a tuple, replaced when it grows: most sequences never add any, and share the empty one).
        self.cache_pins: tuple[npt.NDArray[np.int32], ...] = ()
        #: How many leading nodes of the sequence's cached path are pinned by it.
        self.pinned_depth = 0
        #: (trie node, snapshot id, its generation) of the last ``save_snapshot(..., rolling=True)``.
        self.rolling_snapshot: tuple[int, int, int] | None = None
        self.adapter_slot = NO_ADAPTER
        self.adapter_uid = 0
        self.status = _ACTIVE

    def block_ids(self) -> npt.NDArray[np.int32]:
        return self.blocks[: self.num_blocks]

    def ensure_capacity(self, num_blocks: int) -> None:
        if num_blocks > self.blocks.shape[0]:
            grown = np.empty(max(num_blocks, 2 * self.blocks.shape[0]), dtype=np.int32)
            grown[: self.num_blocks] = self.blocks[: self.num_blocks]
            self.blocks = grown


@final
class SequenceState:
    """One sequence's memory, as handed out by ``alloc_sequence``. Not constructed directly."""

    __slots__ = (
        "_seq_id",
        "_model_id",
        "_holdings",
        "_guard",
        "_slot_idx",
        "_ssm_addrs",
        "_tokens",
        "_num_tokens",
        "prompt_len",
        "num_cached_tokens",
        "ssm_tokens",
        "budget_tokens",
        "_draft_tokens",
        "_failed",
        "_drop_queue",
        "__weakref__",
    )

    def __init__(
        self,
        seq_id: int,
        model_id: int,
        holdings: Holdings,
        guard: SlotGuard,
        ssm_addrs: tuple[tuple[int, int], ...],
        budget_tokens: int,
        drop_queue: deque[int],
    ) -> None:
        self._seq_id = seq_id
        self._model_id = model_id
        self._holdings = holdings
        self._guard: SlotGuard | None = guard
        self._slot_idx = guard.slot
        self._ssm_addrs = ssm_addrs
        self._tokens: npt.NDArray[np.int32] = np.empty(max(budget_tokens, 16), _INT32)
        self._num_tokens = 0
        #: Tokens of the prompt (the rest of ``tokens`` was generated).
        self.prompt_len = 0
        #: Prompt tokens whose KV came from the prefix cache.
        self.num_cached_tokens = 0
        #: How many tokens the SSM state in the slot has consumed (set by the engine; defaults to
        #: ``num_tokens``). A snapshot is only taken where this falls on a block boundary.
        self.ssm_tokens: int | None = None
        #: The most tokens this request can reach (prompt + max new tokens).
        self.budget_tokens = budget_tokens
        self._draft_tokens: npt.NDArray[np.int32] | None = None
        self._failed = False
        self._drop_queue = drop_queue

    def __del__(self) -> None:
        # Dropped without free_sequence (an exception path): the slot guard releases the slot by
        # itself; the model reaps the other references at its next call.
        if self._holdings.status is not _FREED:
            self._drop_queue.append(self._seq_id)

    def __repr__(self) -> str:
        return (
            f"SequenceState(seq_id={self._seq_id}, slot_idx={self._slot_idx}, "
            f"blocks={self._holdings.num_blocks}, tokens={self._num_tokens}, "
            f"status={self._holdings.status.value}{', failed' if self._failed else ''})"
        )

    # --- read side -------------------------------------------------------------------------------

    @property
    def seq_id(self) -> int:
        return self._seq_id

    @property
    def slot_idx(self) -> int:
        """The SSM pool slot holding this sequence's state, or ``DETACHED_SLOT``."""
        return self._slot_idx

    @property
    def ssm_addrs(self) -> tuple[tuple[int, int], ...]:
        """Per SSM layer, the (h_state, conv_state) device addresses of this sequence's slot."""
        return self._ssm_addrs

    @property
    def draft_tokens(self) -> npt.NDArray[np.int32]:
        """Per-sequence proposer state for speculative decoding: draft token ids, sized to the
        budget (allocated on first use, so sequences that never draft pay nothing)."""
        if self._draft_tokens is None:
            self._draft_tokens = np.zeros(self.budget_tokens, dtype=np.int32)
        return self._draft_tokens

    @property
    def block_table(self) -> npt.NDArray[np.int32]:
        """The sequence's block ids in order, int32 (a view: valid until the next growth)."""
        return self._holdings.block_ids()

    @property
    def num_blocks(self) -> int:
        return self._holdings.num_blocks

    @property
    def tokens(self) -> npt.NDArray[np.int32]:
        """Prompt and generated tokens so far (a view)."""
        return self._tokens[: self._num_tokens]

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def adapter_slot(self) -> int:
        """The LoRA adapter slot this sequence holds a reference on, or ``NO_ADAPTER``."""
        return self._holdings.adapter_slot

    @property
    def status(self) -> SeqStatus:
        return self._holdings.status

    @property
    def is_detached(self) -> bool:
        return self._slot_idx == DETACHED_SLOT

    @property
    def is_freed(self) -> bool:
        return self._holdings.status is SeqStatus.FREED

    @property
    def failed(self) -> bool:
        return self._failed

    # --- engine side -----------------------------------------------------------------------------

    def mark_failed(self) -> None:
        """Mark the sequence failed: its KV is not trusted, so it is never inserted in the cache."""
        self._failed = True

    def append_tokens(self, tokens: Iterable[int] | npt.NDArray[np.integer]) -> None:
        """Record tokens whose KV the engine has computed (prompt first, then generated ones)."""
        if self._holdings.status is _FREED:
            raise SequenceStateError(f"sequence {self._seq_id} was freed; cannot append tokens")
        start = self._num_tokens
        if _put_int32(self._tokens, start, tokens):  # int32 tokens that fit: one memcpy
            self._num_tokens = start + len(tokens)  # type: ignore[arg-type]
            return
        if isinstance(tokens, np.ndarray) and tokens.ndim == 1 and (
            tokens.dtype is _INT32
            or (tokens.dtype.itemsize <= 4 and (tokens.dtype == np.int32 or tokens.dtype.kind == "u"))
        ):
            new = tokens  # every value fits the int32 token buffer: nothing to check
        else:
            new = _checked_tokens(tokens)
        end = start + len(new)
        if end > len(self._tokens):
            self._grow_tokens(end)
        self._tokens[start:end] = new
        self._num_tokens = end

    def _grow_tokens(self, needed: int) -> None:
        grown = np.empty(max(needed, 2 * len(self._tokens)), dtype=np.int32)
        grown[: self._num_tokens] = self._tokens[: self._num_tokens]
        self._tokens = grown


def _checked_tokens(tokens: Iterable[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """``tokens`` as a 1-D int64 array, every id checked to fit the int32 token buffer."""
    try:
        new = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), dtype=np.int64)
    except OverflowError:
        raise SequenceStateError("token ids must lie in [0, 2147483647]; one does not fit 64 bits") from None
    if new.ndim != 1:
        raise SequenceStateError(f"tokens must be one-dimensional, got shape {new.shape}")
    if new.size and (int(new.min()) < 0 or int(new.max()) > 0x7FFFFFFF):
        bad = int(new.min()) if int(new.min()) < 0 else int(new.max())
        raise SequenceStateError(f"token id {bad} out of range [0, 2147483647]")
    return new
