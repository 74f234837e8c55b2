"""W2 and W3 through lifecycle's drop-in adapters beside the engine's own classes, in one process
(run inside the engine's peer environment by ``peers.py``; lifecycle is imported from the checkout).

    <env>/bin/python bench/peer_adapters.py sglang TRACE --site HOST_SITE_PACKAGES [--repeats 3] [--w3-repeats 1]
    <env>/bin/python bench/peer_adapters.py vllm TRACE --site HOST_SITE_PACKAGES [--workloads w2,w3,w4]

One replay per engine, the same for both implementations, makes the engine's own calls in its
scheduler's order, following W2's rules (``w2.py``):

- SGLang, as ``peer_sglang.py``: ``match_prefix`` of the prompt's reusable pages, ``inc_lock_ref``,
  ``path_device_indices``, ``evict`` when the allocator is short, ``alloc``; at finish ``insert``
  of every full page, ``free`` of the duplicates and of the unfinished page, ``dec_lock_ref``. Once
  with ``RadixCache`` and ``PagedTokenToKVPoolAllocator``, once with ``LifecycleRadixCache`` and
  ``LifecyclePagedAllocator``.
- vLLM: block hashes of the prompt as a request arrives (vLLM's request block hasher, sha256; the
  facade needs none), ``get_computed_blocks``, ``allocate_slots`` of the prompt with the generated
  tokens as lookahead; at finish the generated tokens appended (hashed for vLLM),
  ``cache_blocks``, ``free``. Once with ``KVCacheManager``, once with ``LifecycleKVCacheManager``.

W4, the decode step, is the peers' own W4 replay (``peer_sglang.replay_w4``, ``peer_vllm.replay_w4``:
``alloc_decode`` with the ``req_to_token`` writes; ``allocate_slots(request, 1)`` per running
request) once through the engine's classes and once through the adapters, per step.

The two alternate, ``--repeats`` times each (``--w3-repeats`` for W3), so that a slow spell of a
shared machine hits both. Building each request's input (token lists, ``Request`` objects) is left
out of the clock, as the peers' runners do. Two figures per replay: ``us_per_request``, the whole
replay; ``cache_us_per_request``, the time inside the calls above (the caches, the allocators and
vLLM's hashing), without the replay's own work (keys, slices, ``torch.cat``), which is the same for
both and bounds the whole figure's ratio. Best and median of the repeats, and the adapter's
speedups over the engine for each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Run:
    seconds: float
    cache_seconds: float
    hit_tokens: int
    blocks_evicted: int


Replay = Callable[[Any, bool], Run]


def sglang_replays() -> Replay:
    """The SGLang replay: ``replay(trace, lifecycle)``."""
    from array import array

    from peer_common import stub_torchvision

    stub_torchvision()  # see peer_sglang.py
    import torch

    from lifecycle.integrations.sglang import allocator_class, radix_cache_class
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    def replay(trace: Any, lifecycle: bool) -> Run:
        bs = trace.block_size
        cache_class, allocator_class_ = (
            (radix_cache_class(), allocator_class()) if lifecycle else (RadixCache, PagedTokenToKVPoolAllocator)
        )
        allocator = allocator_class_((trace.num_blocks + 1) * bs, bs, torch.float16, "cpu", None, need_sort=False)
        capacity = allocator.available_size()  # SGLang's allocator: the pages after its reserved page 0
        tree = cache_class.create_simulated(mock_allocator=allocator, page_size=bs)
        live: deque[tuple[Any, Any, int, int, Any]] = deque()
        hit_tokens = evicted_tokens = 0
        total = in_cache = 0.0

        def finish() -> float:
            tokens, kv_indices, hit, full, node = live.popleft()
            params = InsertParams(key=RadixKey(tokens[:full]), value=kv_indices[:full])
            start = perf_counter()
            inserted = tree.insert(params)
            allocator.free(kv_indices[hit : inserted.prefix_len])
            allocator.free(kv_indices[full:])
            tree.dec_lock_ref(node)
            return perf_counter() - start

        for i in range(trace.num_requests):
            tokens = array("q", trace.tokens[i].tolist())  # the engine's key type, built off the clock
            reusable, needed = trace.reusable_blocks(i) * bs, trace.blocks_needed(i) * bs
            full = (len(trace.tokens[i]) // bs) * bs
            start = perf_counter()
            if len(live) == trace.max_live:
                in_cache += finish()
            params = MatchPrefixParams(key=RadixKey(tokens[:reusable]))
            calls = perf_counter()
            match = tree.match_prefix(params)
            hit = match.device_prefix_len
            node = match.last_device_node
            tree.inc_lock_ref(node)
            prefix = tree.path_device_indices(node)
            short = needed - hit - allocator.available_size()
            if short > 0:
                evicted_tokens += tree.evict(EvictParams(num_tokens=short)).num_tokens_evicted
            new = allocator.alloc(needed - hit)
            in_cache += perf_counter() - calls
            kv_indices = torch.cat([prefix, new])
            hit_tokens += hit
            live.append((tokens, kv_indices, hit, full, node))
            total += perf_counter() - start
        start = perf_counter()
        while live:
            in_cache += finish()
        total += perf_counter() - start
        if lifecycle:
            tree.check_invariants()
            allocator.check_invariants()
        if allocator.available_size() + tree.total_size() != capacity:
            raise AssertionError(f"leaked KV slots: {allocator.available_size()} free + {tree.total_size()} cached")
        return Run(total, in_cache, hit_tokens, evicted_tokens // bs)

    return replay


def vllm_replays() -> Replay:
    """The vLLM replay: ``replay(trace, lifecycle)``."""
    import torch

    from lifecycle.integrations.vllm import LifecycleKVCacheManager
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)

    def replay(trace: Any, lifecycle: bool) -> Run:
        bs = trace.block_size
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float16)
        # One more block: vLLM's null block.
        config = KVCacheConfig(num_blocks=trace.num_blocks + 1, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        manager_class = LifecycleKVCacheManager if lifecycle else KVCacheManager
        manager = manager_class(config, max_model_len=1 << 22, scheduler_block_size=bs, hash_block_size=bs,
                                enable_caching=True)
        hasher = None if lifecycle else get_request_block_hasher(bs, hash_fn)
        params = SamplingParams(max_tokens=1 << 20)
        live: deque[tuple[Any, list[int]]] = deque()
        hit_tokens = 0
        total = in_cache = 0.0

        def finish() -> float:
            request, generated = live.popleft()
            start = perf_counter()
            request.append_output_token_ids(generated)
            if hasher is not None:
                request.block_hashes.extend(hasher(request))
            manager.cache_blocks(request, request.num_tokens)
            manager.free(request)
            return perf_counter() - start

        for i in range(trace.num_requests):
            prompt_len = trace.prompt_lens[i]
            generated = trace.tokens[i][prompt_len:].tolist()
            # The engine's request, built off the clock; vLLM hashes its blocks on the clock below.
            request = Request(str(i), trace.tokens[i][:prompt_len].tolist(), params, None)
            start = perf_counter()
            if len(live) == trace.max_live:
                in_cache += finish()
            calls = perf_counter()
            if hasher is not None:
                request.block_hashes.extend(hasher(request))
            computed, num_computed, _ = manager.get_computed_blocks(request)
            blocks = manager.allocate_slots(request, prompt_len - num_computed, num_computed, computed,
                                            num_lookahead_tokens=len(generated))
            in_cache += perf_counter() - calls
            if blocks is None:
                raise AssertionError(f"request {i} did not fit")
            request.num_computed_tokens = prompt_len
            hit_tokens += num_computed
            live.append((request, generated))
            total += perf_counter() - start
        start = perf_counter()
        while live:
            in_cache += finish()
        total += perf_counter() - start
        if lifecycle:
            manager.check_invariants()
        evicted = manager.core.counters()["blocks_evicted"] if lifecycle else -1
        return Run(total, in_cache, hit_tokens, evicted)

    return replay


def w4_replay(engine: str) -> Callable[[Any, bool], Any]:
    """W4 (the decode step) as the peers' own runners replay it (``peer_sglang.replay_w4``,
    ``peer_vllm.replay_w4``), through the engine's classes or lifecycle's adapters."""
    if engine == "sglang":
        import peer_sglang

        from lifecycle.integrations.sglang import allocator_class, radix_cache_class

        def replay(trace: Any, lifecycle: bool) -> Any:
            if lifecycle:
                return peer_sglang.replay_w4(trace, radix_cache_class(), allocator_class())
            return peer_sglang.replay_w4(trace)

        return replay
    import peer_vllm

    from lifecycle.integrations.vllm import LifecycleKVCacheManager
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    def replay_vllm(trace: Any, lifecycle: bool) -> Any:
        return peer_vllm.replay_w4(trace, LifecycleKVCacheManager if lifecycle else KVCacheManager)

    return replay_vllm


def w4_records(engine: str, repeats: int) -> list[dict[str, Any]]:
    """W4's two records (engine's, adapter's), the adapter's with its speedup per step."""
    from w2 import no_gc
    from w4 import generate, record

    trace = generate()
    replay = w4_replay(engine)
    runs: dict[bool, list[Any]] = {False: [], True: []}
    for _ in range(repeats):
        for lifecycle in (False, True):
            with no_gc():
                runs[lifecycle].append(replay(trace, lifecycle))
    theirs = record(f"{engine}-own", runs[False], trace)
    ours = record(f"lifecycle-{engine}", runs[True], trace)
    if ours["hit_tokens"] != theirs["hit_tokens"]:
        raise AssertionError(f"W4: the adapter hit {ours['hit_tokens']} tokens, {engine} {theirs['hit_tokens']}")
    ours["speedup"] = {key: round(theirs[key] / ours[key], 2) for key in ("us_per_step", "median_us_per_step")}
    return [theirs, ours]


def records(
    workload: str, engine: str, runs: dict[bool, list[Run]], trace: Any, prompt_tokens: int
) -> list[dict[str, Any]]:
    """The two JSON records (engine's, adapter's) of one workload."""
    names = {False: f"{engine}-own", True: f"lifecycle-{engine}"}
    notes = {
        "sglang": {
            False: "RadixCache + PagedTokenToKVPoolAllocator",
            True: "LifecycleRadixCache + LifecyclePagedAllocator",
        },
        "vllm": {False: "KVCacheManager, sha256 block hashes", True: "LifecycleKVCacheManager, no block hashes"},
    }[engine]
    per = 1e6 / trace.num_requests
    out = []
    for lifecycle in (False, True):
        done = runs[lifecycle]
        hits = {run.hit_tokens for run in done}
        if len(hits) != 1:
            raise AssertionError(f"{workload} {names[lifecycle]}: replays hit {sorted(hits)} tokens")
        out.append({
            "workload": workload,
            "library": names[lifecycle],
            "us_per_request": round(min(run.seconds for run in done) * per, 3),
            "median_us_per_request": round(statistics.median(run.seconds for run in done) * per, 3),
            "cache_us_per_request": round(min(run.cache_seconds for run in done) * per, 3),
            "median_cache_us_per_request": round(statistics.median(run.cache_seconds for run in done) * per, 3),
            "hit_rate": round(done[0].hit_tokens / prompt_tokens, 6),
            "hit_tokens": done[0].hit_tokens,
            "prompt_tokens": prompt_tokens,
            "blocks_evicted": done[0].blocks_evicted,
            "replays": len(done),
            "note": notes[lifecycle],
        })
    theirs, ours = out
    out[1]["speedup"] = {
        key: round(theirs[key] / ours[key], 2)
        for key in ("us_per_request", "median_us_per_request", "cache_us_per_request", "median_cache_us_per_request")
    }
    if ours["hit_tokens"] < theirs["hit_tokens"]:
        raise AssertionError(
            f"{workload}: the adapter hit {ours['hit_tokens']} tokens, {engine} {theirs['hit_tokens']}"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", choices=("sglang", "vllm"))
    parser.add_argument("trace", type=Path)
    parser.add_argument("--site", action="append", default=[],
                        help="site-packages holding lifecycle's dependencies (searched after the environment's own)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--w3-repeats", type=int, default=1)
    parser.add_argument("--w4-repeats", type=int, default=1)
    parser.add_argument("--workloads", default="w2,w3,w4")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(HERE)]
    sys.path.extend(args.site)
    from w2 import load_w2, no_gc
    from w3 import load_w3

    from traces import MOONCAKE_TRACE

    replay = sglang_replays() if args.engine == "sglang" else vllm_replays()
    wanted = args.workloads.split(",")
    for workload in ("w2", "w3", "w4"):
        if workload not in wanted:
            continue
        if workload == "w4":
            for record in w4_records(args.engine, args.w4_repeats):
                print(json.dumps(record), flush=True)
            continue
        trace = load_w2(args.trace) if workload == "w2" else load_w3(MOONCAKE_TRACE)
        runs: dict[bool, list[Run]] = {False: [], True: []}
        for _ in range(args.repeats if workload == "w2" else args.w3_repeats):
            for lifecycle in (False, True):
                with no_gc():
                    runs[lifecycle].append(replay(trace, lifecycle))
        for record in records(workload.upper(), args.engine, runs, trace, sum(trace.prompt_lens)):
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
