"""W1 and W2 on SGLang's ``RadixCache`` and ``PagedTokenToKVPoolAllocator`` (run inside the SGLang
peer environment by ``peers.py``).

W2 follows what SGLang's scheduler does for one request: ``match_prefix`` on the page-aligned
prompt (cut so that the last prompt token is never reused), ``inc_lock_ref`` on the matched node,
``evict`` when the allocator is short, ``alloc`` of the remaining pages; at finish ``insert`` of
every full page of prompt + output with the request's KV indices, freeing the duplicates the
insert exposed and the unfinished last page, then ``dec_lock_ref``.
"""

from __future__ import annotations

import sys
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_common import stub_torchvision  # noqa: E402

# sglang's config package imports torchvision.transforms at import time (multimodal configs), and
# PyPI's torchvision wheels link CUDA (libc10_cuda.so), so they cannot load next to CPU-only torch.
# Neither the radix tree nor the allocator uses torchvision: an import stub stands in for it.
stub_torchvision()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numpy.typing import NDArray  # noqa: E402
from peer_common import main  # noqa: E402
from w2 import W2Trace  # noqa: E402

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402


def make_allocator(num_pages: int, page_size: int) -> PagedTokenToKVPoolAllocator:
    # One extra page: SGLang reserves page 0 for padded tokens.
    return PagedTokenToKVPoolAllocator(
        (num_pages + 1) * page_size, page_size, torch.float16, "cpu", None, need_sort=False
    )


def replay_w1(ops: NDArray[np.int32], num_blocks: int) -> float:
    page_size = 16
    allocator = make_allocator(num_blocks, page_size)
    rows = ops.tolist()
    held: dict[int, torch.Tensor] = {}
    start = time.perf_counter()
    for op, seq_id, k in rows:
        if op == 1:
            held[seq_id] = allocator.alloc(k * page_size)
        else:
            allocator.free(held.pop(seq_id))
    return time.perf_counter() - start


def replay_w2(trace: W2Trace) -> tuple[float, int, int]:
    bs = trace.block_size
    allocator = make_allocator(trace.num_blocks, bs)
    tree = RadixCache.create_simulated(mock_allocator=allocator, page_size=bs)
    # Trace preparation: tokens as array('q'), SGLang's key type.
    requests = [
        (array("q", trace.tokens[i].tolist()), trace.reusable_blocks(i) * bs, trace.blocks_needed(i) * bs,
         (len(trace.tokens[i]) // bs) * bs)
        for i in range(trace.num_requests)
    ]
    live: deque[tuple[array[int], torch.Tensor, int, int, Any]] = deque()
    hit_tokens = 0
    evicted_tokens = 0

    def finish() -> None:
        tokens, kv_indices, hit, full, node = live.popleft()
        inserted = tree.insert(InsertParams(key=RadixKey(tokens[:full]), value=kv_indices[:full]))
        allocator.free(kv_indices[hit : inserted.prefix_len])
        allocator.free(kv_indices[full:])
        tree.dec_lock_ref(node)

    start = time.perf_counter()
    for tokens, reusable, needed, full in requests:
        if len(live) == trace.max_live:
            finish()
        match = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:reusable])))
        hit = match.device_prefix_len
        node = match.last_device_node
        tree.inc_lock_ref(node)
        prefix = tree.path_device_indices(node)
        short = needed - hit - allocator.available_size()
        if short > 0:
            evicted_tokens += tree.evict(EvictParams(num_tokens=short)).num_tokens_evicted
        kv_indices = torch.cat([prefix, allocator.alloc(needed - hit)])
        hit_tokens += hit
        live.append((tokens, kv_indices, hit, full, node))
    while live:
        finish()
    seconds = time.perf_counter() - start
    return seconds, hit_tokens, evicted_tokens // bs


if __name__ == "__main__":
    raise SystemExit(
        main(
            "sglang",
            replay_w1,
            replay_w2,
            w1_note="PagedTokenToKVPoolAllocator, page 16",
            w2_note="RadixCache (Python tree) + paged allocator",
        )
    )
