"""W1 and W2 on vLLM's v1 ``BlockPool`` (run inside the vLLM peer environment by ``peers.py``).

W2 follows what vLLM's KV cache manager does for one request, at the block-pool level: block hashes
chained with vLLM's own ``hash_block_tokens`` (sha256, its default), the longest run of cached
hashes (``get_cached_block``), ``touch`` to hold the hit, ``get_new_blocks`` for the rest (which
evicts cached free blocks lazily, oldest freed first), and at finish ``cache_full_blocks`` then
``free_blocks`` in reverse order, as the manager frees them.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from numpy.typing import NDArray  # noqa: E402
from peer_common import main  # noqa: E402
from w2 import W2Trace  # noqa: E402

from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402

HASH_FN = get_hash_fn_by_name("sha256")
kv_cache_utils.init_none_hash(HASH_FN)
hash_block_tokens = kv_cache_utils.hash_block_tokens


class RequestBlocks:
    """What ``cache_full_blocks`` reads from a request: its block hashes."""

    __slots__ = ("block_hashes", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.block_hashes: list[Any] = []


def replay_w1(ops: NDArray[np.int32], num_blocks: int) -> float:
    # One extra block: vLLM reserves block 0 as its null block. Caching off: plain churn.
    pool = BlockPool(num_blocks + 1, enable_caching=False, hash_block_size=16)
    rows = ops.tolist()
    held: dict[int, list[Any]] = {}
    start = time.perf_counter()
    for op, seq_id, k in rows:
        if op == 1:
            held[seq_id] = pool.get_new_blocks(k)
        else:
            pool.free_blocks(held.pop(seq_id))
    return time.perf_counter() - start


def replay_w2(trace: W2Trace) -> tuple[float, int, int]:
    bs = trace.block_size
    pool = BlockPool(trace.num_blocks + 1, enable_caching=True, hash_block_size=bs)
    # Trace preparation: tokens as Python lists, vLLM's input type.
    requests = [
        (trace.tokens[i].tolist(), trace.reusable_blocks(i), trace.blocks_needed(i), len(trace.tokens[i]) // bs)
        for i in range(trace.num_requests)
    ]
    live: deque[tuple[RequestBlocks, list[Any], int, int]] = deque()
    hit_tokens = 0
    cached_in_all = 0

    def finish() -> None:
        nonlocal cached_in_all
        request, blocks, hit, full_blocks = live.popleft()
        pool.cache_full_blocks(request, blocks, hit, full_blocks, bs, 0)
        cached_in_all += full_blocks - hit
        pool.free_blocks(reversed(blocks))

    start = time.perf_counter()
    for number, (tokens, reusable, needed, full_blocks) in enumerate(requests):
        if len(live) == trace.max_live:
            finish()
        request = RequestBlocks(str(number))
        parent = None
        for b in range(full_blocks):
            parent = hash_block_tokens(HASH_FN, parent, tokens[b * bs : (b + 1) * bs])
            request.block_hashes.append(parent)
        hit_blocks: list[Any] = []
        for block_hash in request.block_hashes[:reusable]:
            cached = pool.get_cached_block(block_hash, [0])
            if cached is None:
                break
            hit_blocks.append(cached[0])
        pool.touch(hit_blocks)
        hit_tokens += len(hit_blocks) * bs
        blocks = hit_blocks + pool.get_new_blocks(needed - len(hit_blocks))
        live.append((request, blocks, len(hit_blocks), full_blocks))
    while live:
        finish()
    seconds = time.perf_counter() - start
    still_cached = sum(1 for block in pool.blocks if block.block_hash is not None)
    return seconds, hit_tokens, cached_in_all - still_cached


if __name__ == "__main__":
    raise SystemExit(
        main(
            "vllm",
            replay_w1,
            replay_w2,
            w1_note="v1 BlockPool, caching off",
            w2_note="v1 BlockPool, sha256 block hashes",
        )
    )
