"""``SequenceState``: one request's handle on the memory the model lent it.

The request's state (tokens, block table, pinned prefix, content hashes, adapter reference, status)
lives in the model's KV cache core (``lifecycle._kvcache``), its SSM slot in the slot pool through a
slot guard; a ``SequenceState`` (compiled with the core, so that reading it costs a C call) holds a
handle on the first and the guard of the second, and reads through them. The engine reads
``block_table``, ``slot_idx``, ``ssm_addrs`` and appends the tokens it computed (``append_tokens``);
only the model changes the rest.
"""

from __future__ import annotations

from typing import Final

from lifecycle._kvcache import SeqStatus, SequenceState

__all__ = ["DETACHED_SLOT", "NO_ADAPTER", "SeqStatus", "SequenceState"]

#: ``slot_idx`` of a sequence whose slot was given up with ``detach_slot_for_reuse``. It equals the
#: padding slot's index from the end, so a stale kernel index lands on padding, never on a live slot.
DETACHED_SLOT: Final[int] = -1

#: Sentinel of ``adapter_slot`` for a sequence served without a LoRA adapter.
NO_ADAPTER: Final[int] = -1
