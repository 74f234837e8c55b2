"""Argument checks the tiers share: content hashes and the tokens of whole blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from lifecycle.errors import InvalidId

#: Content hashes of blocks: ints in [0, 2**64), or a uint64 array.
HashesLike = Sequence[int] | npt.NDArray[np.uint64]

_TOKEN_LIMIT: Final = 1 << 31
_HASH_LIMIT: Final = 1 << 64


def content_hashes(call: str, hashes: HashesLike) -> list[int]:
    """``hashes`` as Python ints; InvalidId unless each is in [0, 2**64)."""
    if isinstance(hashes, list) and all(type(h) is int and 0 <= h < _HASH_LIMIT for h in hashes):
        return hashes
    try:
        array = np.asarray(hashes, dtype=np.uint64)
    except (OverflowError, ValueError, TypeError):
        raise InvalidId(f"{call}: content hashes must be ints in [0, 2**64), got {hashes!r}") from None
    if array.ndim != 1:
        raise InvalidId(f"{call}: content hashes must be one-dimensional, got shape {array.shape}")
    values: list[int] = array.tolist()
    return values


def token_blocks(call: str, tokens: npt.ArrayLike, count: int, block_size: int) -> npt.NDArray[np.int32]:
    """``tokens`` as ``(count, block_size)`` int32; InvalidId unless there are that many integer
    token ids, each in [0, 2**31)."""
    try:
        raw = np.asarray(tokens)
    except (ValueError, TypeError):
        raise InvalidId(f"{call}: tokens must be an array of token ids, got {tokens!r}") from None
    if raw.size != count * block_size or (raw.size and raw.dtype.kind not in "iu"):
        raise InvalidId(
            f"{call}: tokens must be {count} blocks of block_size={block_size} integer token ids, "
            f"got {raw.size} of dtype {raw.dtype}"
        )
    if raw.size:
        low = int(raw.min())
        # int32 and narrower signed ids cannot reach 2**31: only their sign needs a look
        high = int(raw.max()) if raw.dtype.itemsize > 4 or raw.dtype.kind == "u" else 0
        if low < 0 or high >= _TOKEN_LIMIT:
            raise InvalidId(f"{call}: token id {low if low < 0 else high} is out of range: token ids are in [0, 2**31)")
    if raw.dtype != np.int32 or raw.shape != (count, block_size):
        raw = raw.reshape(count, block_size).astype(np.int32, copy=False)
    return raw


#: Tier keys: ints in [0, 2**64) (the high word; the low word 0), or a ``(n, 2)`` uint64 array of
#: (high, low) rows.
KeysLike = Sequence[int] | npt.NDArray[np.uint64]
#: One tier key: an int in [0, 2**64) (the high word), or a (high, low) pair.
KeyLike = int | tuple[int, int]


def tier_keys(call: str, keys: KeysLike, name: str = "keys") -> tuple[list[int], npt.NDArray[np.uint64]]:
    """``keys`` as the list of their high words (what the tiers index by) and a ``(n, 2)`` uint64
    array; InvalidId unless each word is in [0, 2**64)."""
    rows = tier_key_rows(call, keys, name)
    high: list[int] = rows[:, 0].tolist()
    return high, rows


def tier_key_rows(call: str, keys: KeysLike, name: str = "keys") -> npt.NDArray[np.uint64]:
    """``keys`` as a C-contiguous ``(n, 2)`` uint64 array of (high, low) rows; InvalidId unless
    each word is in [0, 2**64)."""
    if isinstance(keys, np.ndarray) and keys.ndim == 2:
        if keys.shape[1] != 2 or keys.dtype != np.uint64:
            raise InvalidId(f"{call}: {name} must be (n, 2) uint64 rows, got shape {keys.shape} of {keys.dtype}")
        return np.ascontiguousarray(keys)
    high = content_hashes(call, keys)
    rows = np.zeros((len(high), 2), dtype=np.uint64)
    rows[:, 0] = high
    return rows


def tier_key(call: str, key: KeyLike) -> tuple[int, int]:
    """One key as (high, low); InvalidId unless each word is in [0, 2**64)."""
    pair = key if isinstance(key, tuple) else (key, 0)
    if len(pair) != 2 or not all(type(word) is int and 0 <= word < _HASH_LIMIT for word in pair):
        raise InvalidId(f"{call}: a key is an int in [0, 2**64) or a (high, low) pair of them, got {key!r}")
    return pair


def chained_parents(keys: npt.NDArray[np.uint64], first: tuple[int, int]) -> npt.NDArray[np.uint64]:
    """The parent of each of ``keys`` when they are one chain after ``first``."""
    parents = np.empty_like(keys)
    if len(keys):
        parents[0] = first
        parents[1:] = keys[:-1]
    return parents
