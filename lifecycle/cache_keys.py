"""What makes two requests' blocks the same block, beyond their token ids.

A block is matched and hashed under its request's *cache key* (the prefix trie's root) and by its
token ids. Three things besides the tokens decide whether KV can be shared, and each enters the
identity here:

- the **adapter**, by name and generation (:func:`lifecycle.lora.adapter_key`): a key per
  loaded generation, the same in every process;
- a **cache salt** (vLLM's ``cache_salt``: a tenant or a secret), mixed into the key by
  :func:`salted_key`, so salted requests share blocks only with requests of the same salt;
- **multimodal inputs**: the placeholder tokens an image or audio clip occupies are the same for
  every image, so :func:`identity_tokens` replaces them, for matching and hashing only, by tokens
  derived from the input's content hash and the position in the span (SGLang pads its radix tree
  the same way). Token ids from ``2**30`` up are reserved for them: no vocabulary comes near.

Both change every content hash after the point where they apply (the hash is chained), so events
and tiers keep same-token blocks of different salts or images apart too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lifecycle.errors import InvalidId

__all__ = ["IDENTITY_TOKEN_BASE", "MMKey", "identity_tokens", "salted_key"]

#: Identity tokens of multimodal spans lie in ``[IDENTITY_TOKEN_BASE, 2**31)``.
IDENTITY_TOKEN_BASE = 1 << 30
_TOKEN_MAX = (1 << 31) - 1

#: ``(content_hash, start, end)``: the input whose content hash (bytes, str or int) fills the
#: prompt's token positions ``[start, end)``.
MMKey = tuple[bytes | str | int, int, int]


def _digest(value: bytes | str | int, person: bytes) -> bytes:
    if isinstance(value, bool) or not isinstance(value, bytes | str | int):
        raise InvalidId(f"a cache salt or content hash must be bytes, str or int, got {type(value).__name__}")
    if isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
    elif isinstance(value, str):
        raw = value.encode()
    else:
        raw = value
    return hashlib.blake2b(raw, digest_size=16, person=person).digest()


def salted_key(key: int, salt: bytes | str | int) -> int:
    """The cache key of requests with prefix-cache key ``key`` (an adapter's, 0 for none) and
    cache salt ``salt``: 63 bits, never 0."""
    digest = hashlib.blake2b(
        key.to_bytes(8, "little", signed=True) + _digest(salt, b"lc-salt"), digest_size=8, person=b"lc-salted"
    ).digest()
    return (int.from_bytes(digest, "little") & (2**63 - 1)) or 1


def identity_tokens(
    prompt: Sequence[int] | npt.NDArray[np.integer], mm_keys: Sequence[MMKey]
) -> npt.NDArray[np.int32]:
    """A copy of ``prompt`` (int32) whose multimodal spans hold identity tokens: position ``i`` of
    the span of an input with content hash ``h`` becomes ``2**30 + (mix(h, i) mod 2**30)``, the
    same wherever the input sits in a prompt. Spans must lie inside the prompt and not overlap."""
    try:
        given: npt.NDArray[Any] | None = np.asarray(prompt)
    except (TypeError, ValueError):
        given = None
    # integer ids only, checked before the int32 copy: 1.7 must not become token 1, nor 2**31 wrap
    if given is None or given.ndim != 1 or (given.size and given.dtype.kind not in "iu"):
        raise InvalidId(f"attach_prefix: a prompt is a 1-D sequence of integer token ids, got {prompt!r}")
    if given.size and (int(given.min()) < 0 or int(given.max()) > _TOKEN_MAX):
        bad = int(given.min()) if int(given.min()) < 0 else int(given.max())
        raise InvalidId(f"attach_prefix: token id {bad} is out of range: token ids are in [0, {_TOKEN_MAX}]")
    tokens = given.astype(np.int32)
    taken = np.zeros(len(tokens), dtype=np.bool_)
    for index, entry in enumerate(mm_keys):
        if not isinstance(entry, tuple) or len(entry) != 3:
            raise InvalidId(f"mm_keys[{index}] must be (content_hash, start, end), got {entry!r}")
        content, start, end = entry
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)) or not 0 <= start < end <= len(
            tokens
        ):
            raise InvalidId(
                f"mm_keys[{index}]: span [{start!r}, {end!r}) must be ints with 0 <= start < end <= {len(tokens)}"
            )
        if taken[start:end].any():
            raise InvalidId(f"mm_keys[{index}]: span [{start}, {end}) overlaps an earlier span")
        taken[start:end] = True
        seed = np.frombuffer(_digest(content, b"lc-mm"), dtype=np.uint64)
        positions = np.arange(end - start, dtype=np.uint64)
        with np.errstate(over="ignore"):
            mixed = (positions + seed[0]) * np.uint64(0x9E3779B97F4A7C15) ^ seed[1]
            mixed ^= mixed >> np.uint64(31)
            mixed *= np.uint64(0xBF58476D1CE4E5B9)
            mixed ^= mixed >> np.uint64(29)
        tokens[start:end] = (mixed & np.uint64(IDENTITY_TOKEN_BASE - 1)).astype(np.int32) + IDENTITY_TOKEN_BASE
    return tokens
