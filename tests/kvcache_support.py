"""What the KV cache core's test suites share: its typed surface, a factory, and a pure-Python
reference of the documented content hash (``pyx/lifecycle/_hash.pxd``).

The suites are typed by the compiled modules' stubs (``stubs/lifecycle/``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore
from lifecycle._radix import RadixTrie

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


#: The compiled classes, typed by their stubs (stubs/lifecycle/).
Core = KVCacheCore
Trie = RadixTrie


def make_core(num_blocks: int, block_size: int, **options: Any) -> Core:
    """A core over a fresh pool of ``num_blocks`` blocks (``options``: the core's keywords)."""
    return KVCacheCore(BlockPool(num_blocks), block_size, **options)


# -- the content hash, as docs say it (pyx/lifecycle/_hash.pxd) ------------------------------------


def fmix64(h: int) -> int:
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & MASK64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & MASK64
    return h ^ (h >> 33)


def hash_keys(count: int) -> list[int]:
    """The NH keys: the upper halves of a splitmix64 sequence from its fixed seed."""
    state, keys = 0x243F6A8885A308D3, []
    for _ in range(count):
        state = (state + GOLDEN) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        keys.append((z ^ (z >> 31)) >> 32)
    return keys


def nh(block: Sequence[int], keys: Sequence[int]) -> int:
    """NH of one block: token pairs offset by their keys (mod 2**32) multiplied, summed mod 2**64;
    an odd last token pairs with the key after the block's."""
    n, acc = len(block), 0
    for i in range(0, n - 1, 2):
        acc += ((block[i] + keys[i]) & 0xFFFFFFFF) * ((block[i + 1] + keys[i + 1]) & 0xFFFFFFFF)
    if n % 2:
        acc += ((block[n - 1] + keys[n - 1]) & 0xFFFFFFFF) * keys[n]
    return acc & MASK64


def root_hash(adapter: int) -> int:
    return fmix64(((adapter & MASK64) * 0xD6E8FEB86659FD93 + 0x5851F42D4C957F2D) & MASK64)


def reference_block_hashes(tokens: Sequence[int], block_size: int, adapter: int = 0) -> list[int]:
    """Content hashes of the full blocks of ``tokens``, each chained to the one before it (the
    first to the adapter's root hash)."""
    keys = hash_keys(block_size + 1)
    parent, hashes = root_hash(adapter), []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = (fmix64(nh(tokens[start : start + block_size], keys)) + parent * GOLDEN) & MASK64
        hashes.append(parent)
    return hashes


def chained_hash(parent: int, block: Sequence[int]) -> int:
    """The content hash of ``block`` after the block hashed ``parent`` (or a root hash)."""
    return (fmix64(nh(block, hash_keys(len(block) + 1))) + parent * GOLDEN) & MASK64


def colliding_blocks(block_size: int) -> tuple[list[int], list[int]]:
    """Two blocks of other tokens with equal NH, so equal content hashes after any one parent: the
    first pair's offset tokens ``(a, b)`` become ``(2a, b / 2)``, the rest stay (what a hostile
    tenant who knows the public keys can build)."""
    assert block_size >= 2
    keys = hash_keys(block_size + 1)
    rest = list(range(1, block_size - 1))

    def token(offset: int, key: int) -> int | None:  # the token id whose offset token is ``offset``
        value = (offset - key) & 0xFFFFFFFF
        return value if value < 1 << 31 else None

    for a in range(1 << 20, 1 << 31, 0x1000_0001):
        for b in range(1 << 20, 1 << 32, 0x2000_0002):
            ids = [token(a, keys[0]), token(b, keys[1]), token(2 * a, keys[0]), token(b // 2, keys[1])]
            found = [value for value in ids if value is not None]
            if len(found) == 4:
                x, y = [*found[:2], *rest], [*found[2:], *rest]
                assert x != y and nh(x, keys) == nh(y, keys)
                return x, y
    raise AssertionError("no colliding pair found")
