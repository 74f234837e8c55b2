"""Host memory of the prefix cache per cached block, measured as resident set size.

    python bench/memory.py --json        # ~1M cached blocks of 16 tokens, W3-shaped requests

Fills a KV cache core whose pool holds just over ``--blocks`` blocks with requests shaped like W3's
(prompts of 15k tokens on average, every fourth one continuing an earlier prompt, so the trie has
branches as well as long runs), each admitted and finished (its full blocks cached), until the
cache holds ``--blocks`` blocks. The resident set size grows by the token ids of the cached blocks
(4 bytes per token) and by everything else the cache keeps per block: trie nodes and buckets, the
block-id arrays of the cached runs, chunk headers and allocation slack. The second figure, per
cached block, is what ``metadata_bytes_per_block`` reports (the pool's own refcount and free-list
arrays, 8 bytes per block of the pool, exist before any caching and are reported apart).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BLOCK_SIZE = 16


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def measure(target_blocks: int, seed: int = 11) -> dict[str, object]:
    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore

    rng = np.random.default_rng(seed)
    # The requests first, so that their own arrays are resident before the baseline.
    requests: list[np.ndarray] = []
    planned = 0
    while planned < target_blocks * 1.3:
        blocks = int(rng.integers(200, 1700))
        fresh = rng.integers(0, 32_000, blocks * BLOCK_SIZE, dtype=np.int32)
        if requests and rng.random() < 0.25:  # a later turn: an earlier prompt, then more
            fresh = np.concatenate([requests[int(rng.integers(0, len(requests)))], fresh])
        requests.append(fresh)
        planned += blocks
    pool = BlockPool(target_blocks + 4096)
    gc.collect()
    before_core = rss_bytes()
    core = KVCacheCore(pool, BLOCK_SIZE)
    before = rss_bytes()
    token_bytes = 0
    for tokens in requests:
        room = target_blocks - core.num_cached_blocks
        if room <= 0:
            break
        cached_before = core.num_cached_blocks
        core.finish(core.admit(tokens[: (core.num_cached_blocks + room) * BLOCK_SIZE], len(tokens) // BLOCK_SIZE))
        token_bytes += (core.num_cached_blocks - cached_before) * BLOCK_SIZE * 4
    gc.collect()
    after = rss_bytes()
    cached = core.num_cached_blocks
    core.check_invariants()
    memory = core.memory()
    return {
        "cached_blocks": cached,
        "trie_nodes": core.trie.num_nodes,
        "rss_growth_bytes": after - before,
        "token_bytes": token_bytes,
        "metadata_bytes_per_block": round((after - before - token_bytes) / cached, 2),
        "core_construction_bytes": before - before_core,
        "pool_bytes_per_block": 8,
        "accounted": memory,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="cached blocks to reach")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.blocks)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
