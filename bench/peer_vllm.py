"""W1, W2 and W4 on vLLM's v1 ``BlockPool`` and ``KVCacheManager`` (run inside the vLLM peer
environment by ``peers.py``).

W2 follows what vLLM's KV cache manager does for one request, at the block-pool level: block hashes
chained with vLLM's own ``hash_block_tokens`` (sha256, its default), the longest run of cached
hashes (``get_cached_block``), ``touch`` to hold the hit, ``get_new_blocks`` for the rest (which
evicts cached free blocks lazily, oldest freed first), and at finish ``cache_full_blocks`` then
``free_blocks`` in reverse order, as the manager frees them.

W4 (bench/w4.py) drives the ``KVCacheManager`` itself, built as vLLM's own tests build it
(tests/v1/core/test_prefix_caching.py: ``make_kv_cache_config`` and ``make_request``): one
full-attention group of 16-token blocks, ``KVCacheManager(config, max_model_len=5120,
scheduler_block_size=16, hash_block_size=16, enable_caching=True)``, requests with
``get_request_block_hasher(16, sha256)``. What the scheduler does for a request:

- admission (timed apart): ``Request(...)`` (which hashes the prompt's full blocks),
  ``get_computed_blocks(request)``, ``allocate_slots(request, P - hit, hit, computed_blocks)``,
  ``num_computed_tokens = P``, status ``RUNNING``, ``append_output_token_ids(first generated)``;
- every step, for every running request in lane order (``Scheduler.schedule`` then
  ``_update_after_schedule`` and ``_update_request_with_output``): ``allocate_slots(request, 1)``
  (grows by a block when the new token starts one, evicting lazily, and caches the blocks that
  filled), ``num_computed_tokens += 1``, ``append_output_token_ids(sampled)`` (which hashes a block
  that filled); the token sampled at a request's last step is a stand-in stop token (0);
- finish (timed apart, with the next admission): ``free(request)``.
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

from w4 import GEN_MAX, PROMPT_MAX, DecodeRun, W4Trace  # noqa: E402

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

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


def make_manager(num_blocks: int, block_size: int, manager_class: Any = KVCacheManager) -> KVCacheManager:
    # One extra block: vLLM reserves block 0 as its null block.
    config = KVCacheConfig(
        num_blocks=num_blocks + 1,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
            )
        ],
    )
    manager: KVCacheManager = manager_class(
        config,
        max_model_len=PROMPT_MAX + GEN_MAX + block_size,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
    )
    return manager


def replay_w4(
    trace: W4Trace, manager_class: Any = KVCacheManager, manager: Any = None, hasher: Any = None
) -> DecodeRun:
    """W4 through ``manager_class`` (vLLM's ``KVCacheManager``, or lifecycle's facade, which
    needs no block hashes: its requests get no hasher), or through ``manager`` built by the caller
    (with its ``hasher``)."""
    bs = trace.block_size
    if manager is None:
        manager = make_manager(trace.num_blocks, bs, manager_class)
        hasher = kv_cache_utils.get_request_block_hasher(bs, HASH_FN) if manager_class is KVCacheManager else None
    step_tokens = trace.step_tokens()
    running: list[Request | None] = [None] * trace.running
    allocate_slots = manager.allocate_slots
    perf = time.perf_counter_ns
    step_ns = turnover_ns = turnovers = refused = hit_tokens = 0
    for s in range(trace.steps):
        admitted = trace.admitted_before(s)
        if admitted:
            # Trace preparation: the prompts as Python lists, vLLM's input type.
            prompts = [trace.prompt(r).tolist() for r in admitted]
            started = perf()
            for r, prompt in zip(admitted, prompts):
                lane = int(trace.lanes[r])
                previous = running[lane]
                if previous is not None:
                    manager.free(previous)
                request = Request(
                    str(r), prompt, SamplingParams(max_tokens=int(trace.gen_lens[r])), None, block_hasher=hasher
                )
                computed, hit, _ = manager.get_computed_blocks(request)
                if manager.allocate_slots(request, len(prompt) - hit, hit, computed) is None:
                    raise AssertionError(f"W4: vLLM could not admit sequence {r}")
                request.num_computed_tokens = len(prompt)
                request.status = RequestStatus.RUNNING
                request.append_output_token_ids(int(step_tokens[s, lane]))
                running[lane] = request
                hit_tokens += hit
            turnover_ns += perf() - started
            turnovers += len(admitted)
        # The tokens sampled this step: each lane's next token, or the stop token at a last step.
        sampled = step_tokens[s + 1].tolist() if s + 1 < trace.steps else [0] * trace.running
        for r in trace.admitted_before(s + 1) if s + 1 < trace.steps else ():
            sampled[trace.lanes[r]] = 0
        started = perf()
        for request, token in zip(running, sampled):
            if allocate_slots(request, 1) is None:
                refused += 1
                continue
            request.num_computed_tokens += 1  # type: ignore[union-attr]
            request.append_output_token_ids(token)  # type: ignore[union-attr]
        step_ns += perf() - started
    return DecodeRun(step_ns, turnover_ns, turnovers, refused, hit_tokens)


if __name__ == "__main__":
    raise SystemExit(
        main(
            "vllm",
            replay_w1,
            replay_w2,
            w1_note="v1 BlockPool, caching off",
            w2_note="v1 BlockPool, sha256 block hashes",
            replay_w4=replay_w4,
            w4_note="v1 KVCacheManager.allocate_slots(request, 1) per running request, sha256 block hashes",
        )
    )
