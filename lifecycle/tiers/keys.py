"""Tier keys: what the host tier and the store find a block by, and what they check before
serving it.

The core's content hash (``docs/content-hashes.md``) is public and fast, and a tenant can craft two
blocks of other tokens with one hash; its trie compares every token, so the device cache does not
care, but a tier that finds a block by that hash would serve KV computed after one prefix to a
request that continues after another. The tiers use their own keys instead:

- a *namespace* (:func:`namespace_of`): the model's name, a fingerprint of its weights the engine
  sets, and the configuration's fingerprint (block size, dtype, layer layout), so two fine-tunes of
  one shape never meet;
- a *root key* per cache key (the adapter's name and generation, and the cache salt, are in it;
  multimodal inputs are in the identity tokens the prompt is matched by);
- the key of block ``i``: SipHash-1-3-128 under a per-deployment secret of the key of block
  ``i - 1`` (the root key for the first) and the block's tokens (``lifecycle._tierkey``). Without
  the secret nobody can aim two prefixes at one key.

Every tier entry and store record carries its key, its parent's key and its tokens, and a tier
serves it only when all three are the ones asked for: a key finds a block, the chain and the tokens
prove it. The secret comes from an argument, else ``LIFECYCLE_TIER_SECRET``, else it is drawn once
per process: engines that share a store must share it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Final

import numpy as np
import numpy.typing as npt

from lifecycle._tierkey import chain_keys, siphash128
from lifecycle.config import ModelConfig
from lifecycle.errors import ConfigError

__all__ = ["SECRET_ENV", "Key", "TierKeys", "namespace_of"]

#: The environment variable a deployment's tier secret is read from (text; engines sharing a
#: store must have the same).
SECRET_ENV: Final = "LIFECYCLE_TIER_SECRET"

#: A tier key: (high, low) 64-bit words.
Key = tuple[int, int]

_PROCESS_SECRET: Final = os.urandom(32)
_ROOTS_MAX: Final = 4096


def namespace_of(config: ModelConfig, weights_fingerprint: bytes | str | None = None) -> bytes:
    """16 bytes naming what computes a block's KV: the model's name, its weights' fingerprint
    (``None``: none given) and its byte format (``ModelConfig.fingerprint()``)."""
    if weights_fingerprint is not None and not isinstance(weights_fingerprint, bytes | str):
        raise ConfigError(f"weights_fingerprint must be bytes or str, got {type(weights_fingerprint).__name__}")
    weights = weights_fingerprint.encode() if isinstance(weights_fingerprint, str) else (weights_fingerprint or b"")
    parts = (config.name.encode(), weights, config.fingerprint().to_bytes(8, "little"))
    framed = b"".join(len(part).to_bytes(4, "little") + part for part in parts)
    return hashlib.blake2b(framed, digest_size=16, person=b"lc-tier-ns").digest()


def _secret_words(secret: bytes | str | None) -> tuple[int, int]:
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or _PROCESS_SECRET
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ConfigError(
            f"tier_secret must be bytes or str of at least 16 bytes (a deployment's secret), got "
            f"{type(secret).__name__} of {len(secret) if isinstance(secret, bytes) else 0} bytes"
        )
    digest = hashlib.blake2b(secret, digest_size=16, person=b"lc-tier-key").digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")


class TierKeys:
    """The tier keys of one model's blocks: its namespace (:func:`namespace_of`) under the
    deployment's secret (``secret``; see the module)."""

    def __init__(
        self, config: ModelConfig, *, weights_fingerprint: bytes | str | None = None,
        secret: bytes | str | None = None,
    ) -> None:
        self.namespace = namespace_of(config, weights_fingerprint)
        self.block_size = config.block_size
        self._k0, self._k1 = _secret_words(secret)
        self._roots: dict[int, Key] = {}
        self._lock = threading.Lock()

    def root(self, cache_key: int) -> Key:
        """The key the chains of cache key ``cache_key`` (the core's: adapter and salt) start from."""
        root = self._roots.get(cache_key)
        if root is None:
            root = siphash128(self.namespace + (cache_key & (2**64 - 1)).to_bytes(8, "little"), self._k0, self._k1)
            with self._lock:
                if len(self._roots) >= _ROOTS_MAX:
                    self._roots.clear()
                self._roots[cache_key] = root
        return root

    def chain(self, tokens: npt.NDArray[np.int32], parent: Key) -> npt.NDArray[np.uint64]:
        """The keys of the whole blocks of ``tokens`` (int32, a multiple of the block size) after
        the block of key ``parent`` (or a root key): ``(blocks, 2)`` (high, low) rows."""
        return chain_keys(tokens, self.block_size, self._k0, self._k1, parent[0], parent[1])

    def same_secret(self, other: TierKeys) -> bool:
        return (self._k0, self._k1) == (other._k0, other._k1)
