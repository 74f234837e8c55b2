"""Attaching a prompt's cached prefix (``HybridModel.attach_prefix``) where the core's one call is
not the whole of it, and the host tier's part of a reclaim for a prompt.

The rules of an attach: ``prompt`` becomes the sequence's tokens; its longest cached prefix under
the sequence's adapter (whole blocks, never the prompt's last token; on a hybrid model only up to a
node with an SSM snapshot, which is restored into the slot) is pinned and its blocks put at the
head of the block table; the reused token count is returned. A retried attach of the same sequence
and prompt takes no second set of references. ``grow_to``: then the table grows to cover that many
tokens, as ``grow(seq, grow_to)`` would, in the same call; it ends as the two calls would (when the
growth raises ``OutOfBlocks`` the prefix stays attached), and a ``grow_to`` that ``grow`` would
refuse is refused first, before anything is attached or recorded.

``cache_salt`` and ``mm_keys`` (multimodal inputs as ``(content_hash, start, end)``) are part of the
blocks' identity (:mod:`lifecycle.cache_keys`): the same tokens under another salt or image never
match. The salted key goes to the record before its first attach and into the core's salt map
(``core.salts``), which KV events read. With a host tier the lookup continues past the device's
match into the tiers (:mod:`lifecycle.tiers.promote`): blocks found there are copied into the table
and count as reused. The pure-attention path without tiers is one core call and never comes here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, final

import numpy as np
import numpy.typing as npt

from lifecycle.block_tables import raise_if_wrong_type
from lifecycle.cache_keys import MMKey, identity_tokens
from lifecycle.errors import InvalidId, LifecycleError, OutOfBlocks, SequenceStateError
from lifecycle.protocol import PrefixReclaim

if TYPE_CHECKING:
    from lifecycle._kvcache import KVCacheCore, SequenceState
    from lifecycle.snapshots import SnapshotPool
    from lifecycle.tiers.promote import ModelTiers

__all__ = ["PrefixAttach"]

Prompt = Sequence[int] | npt.NDArray[np.integer]


@final
class PrefixAttach:
    """The attach paths of one model beyond the core's one call: over its ``core``, its SSM
    ``snapshots`` (None without SSM layers) and its ``tiers`` (None without any)."""

    __slots__ = ("_block_size", "_core", "_snapshots", "_tiers")

    def __init__(
        self, core: KVCacheCore, block_size: int, snapshots: SnapshotPool | None, tiers: ModelTiers | None
    ) -> None:
        self._core = core
        self._block_size = block_size
        self._snapshots = snapshots
        self._tiers = tiers

    def keyed(
        self, seq: SequenceState, prompt: Prompt, cache_salt: bytes | str | int | None, mm_keys: Sequence[MMKey] | None
    ) -> tuple[Prompt, int | None]:
        """The prompt as matched (multimodal spans as identity tokens), with the record's cache
        key salted before its first attach (a retried attach must bring the same salt); and the
        key before, when this call salted it (put back by :meth:`unsalt` if the attach is refused)."""
        core = self._core
        handle = core.handle_of(seq)
        if mm_keys:
            prompt = identity_tokens(prompt, mm_keys)
        if cache_salt is None:
            return prompt, None
        key = core.cache_key(handle)
        salts = core.salts
        base = salts.base_of(key)
        salted = salts.salted(base, cache_salt)
        if core.num_tokens(handle) != 0:
            if salted != key:
                raise SequenceStateError(f"attach_prefix: sequence {seq.seq_id} was attached with another cache salt")
            return prompt, None
        if salted == key:  # salted already by an attach that recorded nothing (an empty prompt)
            return prompt, None
        core.set_cache_key(handle, salted)
        salts.add(salted, base, cache_salt)
        return prompt, key

    def keyed_attach(
        self, attach: Callable[..., int], seq: SequenceState, prompt: Prompt, grow_to: int | None,
        cache_salt: bytes | str | int | None, mm_keys: Sequence[MMKey] | None,
    ) -> int:
        """``attach`` (the model's ``attach_prefix``) of the prompt as :meth:`keyed` makes it, the
        record's key put back as it was if the attach is refused."""
        keyed, unsalted = self.keyed(seq, prompt, cache_salt, mm_keys)
        try:
            return attach(seq, keyed, grow_to=grow_to)
        except BaseException:
            if unsalted is not None:
                self.unsalt(seq, unsalted)
            raise

    def unsalt(self, seq: SequenceState, key: int) -> None:
        """After a refused attach that salted the record's key: the key as it was, unless the
        attach recorded the prompt (a growth that failed after the prefix was attached)."""
        core, handle = self._core, seq.handle
        with suppress(LifecycleError):  # the refusal being raised is what the caller must see
            if core.is_live(handle) and core.num_tokens(handle) == 0:
                core.set_cache_key(handle, key)

    def hybrid(self, seq: SequenceState, prompt: Prompt, grow_to: int | None) -> int:
        """Attach on a model with SSM layers: the snapshot at the end of the prefix goes into the
        sequence's slot (also when the growth raises ``OutOfBlocks``: the prefix stays attached)."""
        if seq.is_open and seq.is_detached:
            raise SequenceStateError(f"attach_prefix: sequence {seq.seq_id} is detached")
        try:
            reused: int = self._core.attach_seq(seq, prompt, grow_to)
        except OutOfBlocks:
            self._restore_prefix(seq)
            raise
        except InvalidId as error:
            raise_if_wrong_type(error, "attach_prefix", {"prompt": prompt})
            raise
        # (any other error refused the call before anything changed: the slot keeps its state)
        self._restore_prefix(seq)
        if self._tiers is None or self._tiers.host is None:
            return reused
        self._tiers.drain()  # the host tier: blocks and the SSM snapshot after them
        tokens = np.asarray(prompt, dtype=np.int32)
        found = self._tiers.promote(seq.handle, tokens, reused // self._block_size, seq.slot_idx)
        return reused + found * self._block_size

    def _restore_prefix(self, seq: SequenceState) -> None:
        if seq.is_open and self._snapshots is not None:
            self._snapshots.restore_prefix(self._core, seq)

    def tiered(self, seq: SequenceState, prompt: Prompt, grow_to: int | None) -> int:
        """Attach with tiers: what the attach evicted is demoted first, then the tiers' blocks past
        the device's match are promoted into the table; returns the tokens reused from both."""
        assert self._tiers is not None
        try:
            reused: int = self._core.attach_seq(seq, prompt, grow_to)
        except InvalidId as error:
            raise_if_wrong_type(error, "attach_prefix", {"prompt": prompt})
            raise
        finally:
            self._tiers.drain()  # what it evicted goes down before anything reuses the blocks
        tokens = np.asarray(prompt, dtype=np.int32)
        return reused + self._tiers.promote(seq.handle, tokens, reused // self._block_size) * self._block_size

    def reclaim_for(self, prompt: Prompt, key: int, blocks_needed: int) -> PrefixReclaim:
        """``reclaim_prefix_blocks_for`` under cache key ``key``: the core's eviction, then the
        host tier's leading run past the device's match (promoted at attach, not prefilled)."""
        try:
            target, free = self._core.reclaim_for(prompt, key, blocks_needed)
        except InvalidId as error:
            raise_if_wrong_type(error, "reclaim_prefix_blocks_for", {"prompt": prompt})
            raise
        finally:
            if self._tiers is not None and self._tiers.host is not None:
                self._tiers.drain()
        host = self._tiers.host if self._tiers is not None else None
        if host is None or target == 0:
            return PrefixReclaim(target, free)
        tokens = np.asarray(prompt, dtype=np.int32)
        limit = min((len(tokens) - 1) // self._block_size, blocks_needed)
        assert self._tiers is not None
        found = self._tiers.lookup(key, tokens, blocks_needed - target, limit)
        return PrefixReclaim(target, free, host_blocks=found)

    def prefetch(
        self, prompt: Prompt, key: int, cache_salt: bytes | str | int | None, mm_keys: Sequence[MMKey] | None
    ) -> int:
        """``prefetch_prefix`` under adapter key ``key``: the store is asked, on its reader thread, for
        the prompt's blocks the host tier lacks, so that an admission with the same adapter, salt and
        multimodal keys promotes what has arrived without a round trip. Returns the blocks asked for
        (0 without a store); never waits on the store."""
        if self._tiers is None:
            return 0
        if cache_salt is not None:
            key = self._core.salts.salted(key, cache_salt)
        return self._tiers.prefetch(key, identity_tokens(prompt, mm_keys) if mm_keys else prompt)
