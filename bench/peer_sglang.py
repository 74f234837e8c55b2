"""W1, W2 and W4 on SGLang's ``RadixCache`` and ``PagedTokenToKVPoolAllocator`` (run inside the
SGLang peer environment by ``peers.py``).

W2 follows what SGLang's scheduler does for one request: ``match_prefix`` on the page-aligned
prompt (cut so that the last prompt token is never reused), ``inc_lock_ref`` on the matched node,
``evict`` when the allocator is short, ``alloc`` of the remaining pages; at finish ``insert`` of
every full page of prompt + output with the request's KV indices, freeing the duplicates the
insert exposed and the unfinished last page, then ``dec_lock_ref``.

W4 (bench/w4.py) adds the decode step, batched over the running requests as
``ScheduleBatch.prepare_for_decode`` does it on a paged pool (``alloc_for_decode_default``), with a
``ReqToTokenPool`` (one row per lane, ``max_context_len`` 5,120) holding each request's token
slots. Every step, timed:

- ``last_loc = req_to_token[req_pool_indices, seq_lens - 1]``;
- ``evict_from_tree_cache(tree, batch_size * page_size)`` (evicts when fewer slots are free);
- ``out_cache_loc = allocator.alloc_decode(seq_lens + 1, seq_lens_cpu + 1, last_loc)`` (a new page
  for each request whose new token starts one, the next slot of its last page otherwise; on CPU the
  allocator runs its torch path, ``alloc_decode_naive``);
- ``req_to_token_pool.write((req_pool_indices, seq_lens.clone()), out_cache_loc.to(torch.int32))``;
- ``seq_lens = seq_lens + 1``, ``seq_lens_cpu = seq_lens_cpu + 1``.

SGLang keeps a request's generated token ids in ``req.output_ids`` while it processes the step's
results, not in the memory pool; that append is left out of its figure. Admission (timed apart) is
W2's, then the prompt's slots written into the lane's row
(``req_to_token_pool.write((row, slice(0, P)), ...)``), the prompt published into the tree as the
scheduler's ``checkpoint_kv_cache`` does after a prefill (``RadixCache.checkpoint``: ``insert`` of
its whole pages, the row repointed at the tree's slots, the lock moved to the new node) and the
lane's ``seq_lens`` set; finish is W2's ``insert`` over the row's slots of prompt + generated tokens.
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
from w4 import GEN_MAX, PROMPT_MAX, DecodeRun, W4Trace  # noqa: E402

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.common import evict_from_tree_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
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


def admit(
    tree: RadixCache, allocator: PagedTokenToKVPoolAllocator, tokens: array[int], reusable: int, needed: int
) -> tuple[torch.Tensor, int, Any, int]:
    """W2's admission: the request's KV indices (``needed`` slots), its hit, its locked node, and the
    tokens evicted to make room."""
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:reusable])))
    hit = match.device_prefix_len
    node = match.last_device_node
    tree.inc_lock_ref(node)
    prefix = tree.path_device_indices(node)
    short = needed - hit - allocator.available_size()
    evicted = tree.evict(EvictParams(num_tokens=short)).num_tokens_evicted if short > 0 else 0
    return torch.cat([prefix, allocator.alloc(needed - hit)]), hit, node, evicted


def finish(
    tree: RadixCache, allocator: PagedTokenToKVPoolAllocator, tokens: array[int], kv_indices: torch.Tensor,
    hit: int, full: int, node: Any,
) -> None:
    """W2's finish: the first ``full`` tokens (whole pages) into the tree, the rest freed."""
    inserted = tree.insert(InsertParams(key=RadixKey(tokens[:full]), value=kv_indices[:full]))
    allocator.free(kv_indices[hit : inserted.prefix_len])
    allocator.free(kv_indices[full:])
    tree.dec_lock_ref(node)


def checkpoint(
    tree: RadixCache, req_to_token_pool: ReqToTokenPool, allocator: PagedTokenToKVPoolAllocator, row: int,
    tokens: array[int], kv_indices: torch.Tensor, hit: int, node: Any,
) -> tuple[int, Any]:
    """What ``RadixCache.checkpoint`` does after a prefill: the prompt's whole pages into the tree,
    the row repointed at the tree's copy, the lock moved to the node the insert ended on. Returns
    the row's tree-owned length and that node."""
    full = len(tokens) // allocator.page_size * allocator.page_size
    inserted = tree.insert(InsertParams(key=RadixKey(tokens[:full]), value=kv_indices[:full]))
    allocator.free(kv_indices[hit : inserted.prefix_len])
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:full])))
    new_node = match.last_device_node
    tree_indices = tree.path_device_indices(new_node)
    req_to_token_pool.write((row, slice(hit, len(tree_indices))), tree_indices[hit:].to(torch.int32))
    tree.dec_lock_ref(node)
    tree.inc_lock_ref(new_node)
    return len(tree_indices), new_node


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
    start = time.perf_counter()
    for tokens, reusable, needed, full in requests:
        if len(live) == trace.max_live:
            old_tokens, kv_indices, hit, old_full, node = live.popleft()
            finish(tree, allocator, old_tokens, kv_indices, hit, old_full, node)
        kv_indices, hit, node, evicted = admit(tree, allocator, tokens, reusable, needed)
        hit_tokens += hit
        evicted_tokens += evicted
        live.append((tokens, kv_indices, hit, full, node))
    while live:
        finish(tree, allocator, *live.popleft())
    seconds = time.perf_counter() - start
    return seconds, hit_tokens, evicted_tokens // bs


def replay_w4(trace: W4Trace, cache_class: Any = RadixCache, allocator_class: Any = None) -> DecodeRun:
    """W4 through ``cache_class`` and ``allocator_class`` (SGLang's own by default, or lifecycle's
    adapters)."""
    bs = trace.block_size
    if allocator_class is None:
        allocator = make_allocator(trace.num_blocks, bs)
    else:
        allocator = allocator_class((trace.num_blocks + 1) * bs, bs, torch.float16, "cpu", None, need_sort=False)
    tree = cache_class.create_simulated(mock_allocator=allocator, page_size=bs)
    req_to_token_pool = ReqToTokenPool(trace.running, PROMPT_MAX + GEN_MAX + bs, "cpu", False)
    req_to_token = req_to_token_pool.req_to_token
    rows = req_to_token_pool.alloc_rows(trace.running)
    if rows is None:
        raise AssertionError("W4: no rows for the running requests")
    req_pool_indices = torch.tensor(rows, dtype=torch.int64)
    seq_lens = torch.zeros(trace.running, dtype=torch.int64)
    seq_lens_cpu = torch.zeros(trace.running, dtype=torch.int64)
    # By lane: (sequence, prompt, tree-owned length, locked node); lane i owns row rows[i] throughout.
    running: list[tuple[int, array[int], int, Any] | None] = [None] * trace.running
    perf = time.perf_counter_ns
    step_ns = turnover_ns = turnovers = refused = hit_tokens = 0
    for s in range(trace.steps):
        admitted = trace.admitted_before(s)
        if admitted:
            # Trace preparation: tokens as array('q'), SGLang's key type.
            prompts = [array("q", trace.prompt(r).tolist()) for r in admitted]
            finishing = [running[int(trace.lanes[r])] for r in admitted]
            outputs = [array("q", trace.generated(old[0]).tolist()) if old else array("q") for old in finishing]
            started = perf()
            for r, prompt, previous, output in zip(admitted, prompts, finishing, outputs):
                lane = int(trace.lanes[r])
                row = rows[lane]
                if previous is not None:
                    _, old_prompt, owned, node = previous
                    tokens = old_prompt + output
                    kv_indices = req_to_token[row, : len(tokens)].to(torch.int64)
                    finish(tree, allocator, tokens, kv_indices, owned, len(tokens) // bs * bs, node)
                length = len(prompt)
                kv_indices, hit, node, _ = admit(
                    tree, allocator, prompt, trace.reusable_blocks(r) * bs, -(-length // bs) * bs
                )
                req_to_token_pool.write((row, slice(0, length)), kv_indices[:length].to(torch.int32))
                owned, node = checkpoint(tree, req_to_token_pool, allocator, row, prompt, kv_indices, hit, node)
                seq_lens[lane] = length
                seq_lens_cpu[lane] = length
                running[lane] = (r, prompt, owned, node)
                hit_tokens += hit
            turnover_ns += perf() - started
            turnovers += len(admitted)
        started = perf()
        last_loc = req_to_token[req_pool_indices, seq_lens - 1]
        evict_from_tree_cache(tree, trace.running * bs)
        out_cache_loc = allocator.alloc_decode(seq_lens + 1, seq_lens_cpu + 1, last_loc)
        if out_cache_loc is None:
            refused += trace.running
        else:
            req_to_token_pool.write((req_pool_indices, seq_lens.clone()), out_cache_loc.to(torch.int32))
            seq_lens = seq_lens + 1
            seq_lens_cpu = seq_lens_cpu + 1
        step_ns += perf() - started
    return DecodeRun(step_ns, turnover_ns, turnovers, refused, hit_tokens)


if __name__ == "__main__":
    raise SystemExit(
        main(
            "sglang",
            replay_w1,
            replay_w2,
            w1_note="PagedTokenToKVPoolAllocator, page 16",
            w2_note="RadixCache (Python tree) + paged allocator",
            replay_w4=replay_w4,
            w4_note="paged allocator alloc_decode + req_to_token writes, batched (torch on CPU)",
        )
    )
