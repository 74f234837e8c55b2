"""``SequenceState``: one request's handle on the memory the model lent it.

The request's state (tokens, block table, pinned prefix, content hashes, adapter reference, status)
lives in the model's KV cache core (``lifecycle._kvcache``), its SSM slot in the slot pool through a
slot guard; a ``SequenceState`` holds a handle on the first and the guard of the second, and reads
through them. The engine reads ``block_table``, ``slot_idx``, ``ssm_addrs`` and appends the tokens it
computed (``append_tokens``); only the model changes the rest.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final, final

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from lifecycle._kvcache import KVCacheCore
    from lifecycle._slots import SlotGuard

#: ``slot_idx`` of a sequence whose slot was given up with ``detach_slot_for_reuse``. It equals the
#: padding slot's index from the end, so a stale kernel index lands on padding, never on a live slot.
DETACHED_SLOT: Final[int] = -1

#: Sentinel of ``adapter_slot`` for a sequence served without a LoRA adapter.
NO_ADAPTER: Final[int] = -1


class SeqStatus(enum.Enum):
    """Where a sequence is in its life. Transitions: ACTIVE -> RETIRED -> FREED, ACTIVE -> FREED."""

    ACTIVE = "active"
    RETIRED = "retired"
    FREED = "freed"


_NO_IDS: Final = np.empty(0, dtype=np.int32)

# Indexed by the core's status code (0 freed, 1 active, 2 retired).
_STATUS: Final = (SeqStatus.FREED, SeqStatus.ACTIVE, SeqStatus.RETIRED)


@final
class SequenceState:
    """One sequence's memory, as handed out by ``alloc_sequence``. Not constructed directly."""

    __slots__ = (
        "_core",
        "_handle",
        "_seq_id",
        "_guard",
        "_addrs_by_slot",
        "budget_tokens",
        "_draft_tokens",
        "_open",
        "_drop_queue",
        "__weakref__",
    )

    def __init__(
        self,
        core: KVCacheCore,
        handle: int,
        seq_id: int,
        guard: SlotGuard,
        addrs_by_slot: Sequence[tuple[tuple[int, int], ...]],
        budget_tokens: int,
        drop_queue: deque[int],
    ) -> None:
        self._core = core
        self._handle = handle
        self._seq_id = seq_id
        self._guard: SlotGuard | None = guard
        self._addrs_by_slot = addrs_by_slot
        #: The most tokens this request can reach (prompt + max new tokens).
        self.budget_tokens = budget_tokens
        self._draft_tokens: npt.NDArray[np.int32] | None = None
        # Whether the model has not released the handle yet: a sequence dropped while open is
        # reaped by the model (its guard releases the slot by itself).
        self._open = True
        self._drop_queue = drop_queue

    def __del__(self) -> None:
        if self._open:
            self._drop_queue.append(self._handle)

    def __repr__(self) -> str:
        if not self._open:
            return f"SequenceState(seq_id={self._seq_id}, status=freed)"
        return (
            f"SequenceState(seq_id={self._seq_id}, slot_idx={self.slot_idx}, blocks={self.num_blocks}, "
            f"tokens={self.num_tokens}, status={self.status.value}{', failed' if self.failed else ''})"
        )

    # --- read side -------------------------------------------------------------------------------

    # A freed sequence holds nothing: its readers answer as for an empty one.

    @property
    def seq_id(self) -> int:
        return self._seq_id

    @property
    def slot_idx(self) -> int:
        """The SSM pool slot holding this sequence's state, or ``DETACHED_SLOT``."""
        guard = self._guard
        return guard.slot if guard is not None and guard.held else DETACHED_SLOT

    @property
    def ssm_addrs(self) -> tuple[tuple[int, int], ...]:
        """Per SSM layer, the (h_state, conv_state) device addresses of this sequence's slot."""
        slot = self.slot_idx
        return self._addrs_by_slot[slot] if slot >= 0 else ()

    @property
    def draft_tokens(self) -> npt.NDArray[np.int32]:
        """Per-sequence proposer state for speculative decoding: draft token ids, sized to the
        budget (allocated on first use, so sequences that never draft pay nothing)."""
        if self._draft_tokens is None:
            self._draft_tokens = np.zeros(self.budget_tokens, dtype=np.int32)
        return self._draft_tokens

    @property
    def block_table(self) -> npt.NDArray[np.int32]:
        """The sequence's block ids in order (int32, a copy safe to hand to a kernel)."""
        return self._core.block_table(self._handle) if self._open else _NO_IDS.copy()

    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks(self._handle) if self._open else 0

    @property
    def tokens(self) -> npt.NDArray[np.int32]:
        """Prompt and generated tokens so far (a copy; empty once freed)."""
        return self._core.tokens(self._handle) if self._open else _NO_IDS.copy()

    @property
    def num_tokens(self) -> int:
        return self._core.num_tokens(self._handle) if self._open else 0

    def block_hashes(self) -> npt.NDArray[np.uint64]:
        """Content hashes of the sequence's full blocks (docs/content-hashes.md): the same on every
        process and machine for the same tokens and adapter, computed once per block."""
        return self._core.block_hashes(self._handle) if self._open else np.empty(0, dtype=np.uint64)

    @property
    def prompt_len(self) -> int:
        """Tokens of the prompt (the rest of ``tokens`` was generated)."""
        return self._core.prompt_len(self._handle) if self._open else 0

    @prompt_len.setter
    def prompt_len(self, value: int) -> None:
        self._core.set_prompt_len(self._handle, value)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache."""
        return self._core.cached_tokens(self._handle) if self._open else 0

    @property
    def ssm_tokens(self) -> int | None:
        """How many tokens the SSM state in the slot has consumed (set by the engine; None means
        ``num_tokens``). A snapshot is only taken where this falls on a block boundary."""
        value = self._core.ssm_tokens(self._handle) if self._open else -1
        return None if value < 0 else value

    @ssm_tokens.setter
    def ssm_tokens(self, value: int | None) -> None:
        self._core.set_ssm_tokens(self._handle, value)

    @property
    def adapter_slot(self) -> int:
        """The LoRA adapter slot this sequence holds a reference on, or ``NO_ADAPTER``."""
        return self._core.adapter_slot(self._handle) if self._open else NO_ADAPTER

    @property
    def status(self) -> SeqStatus:
        return _STATUS[self._core.status(self._handle)] if self._open else SeqStatus.FREED

    @property
    def is_detached(self) -> bool:
        return self.slot_idx == DETACHED_SLOT

    @property
    def is_freed(self) -> bool:
        return self.status is SeqStatus.FREED

    @property
    def failed(self) -> bool:
        return self._core.failed(self._handle) if self._open else False

    # --- engine side -----------------------------------------------------------------------------

    def mark_failed(self) -> None:
        """Mark the sequence failed: its KV is not trusted, so it is never inserted in the cache."""
        self._core.mark_failed(self._handle)

    def append_tokens(self, tokens: Iterable[int] | npt.NDArray[np.integer]) -> None:
        """Record tokens whose KV the engine has computed (prompt first, then generated ones).
        Token ids are integers in [0, 2**31); anything else is refused with nothing recorded."""
        self._core.append(self._handle, tokens if isinstance(tokens, (np.ndarray, list, tuple)) else list(tokens))
