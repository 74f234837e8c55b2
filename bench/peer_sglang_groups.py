"""W3 on SGLang's SWA cache and on its ``RadixCache`` per model of issue 31 (run inside the SGLang
peer environment by ``peers.py --workloads w3-groups``).

Which models SGLang serves with its SWA memory (sglang 0.5.23):

- gpt-oss (``GptOssForCausalLM`` is in ``SWA_SINK_ARCHS``, so ``is_hybrid_swa_model``; layer ids from
  ``get_hybrid_layer_ids``, window ``sliding_window - 1`` = 127 as ``get_attention_sliding_window_size``
  gives it): ``sglang-swa`` below;
- gemma-3: ``arg_groups/model_overrides/gemma2_gemma3.py`` returns ``disable_hybrid_swa_memory=True``
  for ``Gemma3ForCausalLM`` / ``Gemma3ForConditionalGeneration``: not served with SWA (no record);
- llama-4-scout: ``Llama4ForConditionalGeneration`` is a hybrid SWA model whose window is
  ``attention_chunk_size`` (``resolve_sliding_window_size``: 8,192), its chunked layers kept as a
  sliding window of 8,192 tokens: ``sglang-swa`` too.

Pool sizes follow ``HybridSWAPoolConfigurator`` (model_executor/pool_configurator.py): bytes per
token of the full pool ``cell = full_per_token * full_layers + swa_full_tokens_ratio *
swa_per_token * swa_layers`` (``_recompute_cell_size``), ``full_tokens = budget // cell``
(``calculate_pool_sizes``), ``swa_tokens = full_tokens * swa_full_tokens_ratio`` page-aligned
(``_solve_pool_sizes``), ``swa_full_tokens_ratio`` its fallback 0.8 (arg_groups/fields/schedule.py).
The pools (``SWAKVPool`` with ``SWATokenToKVPoolAllocator``, pages of 16) are built with those token
counts and one head of one element per layer (the bookkeeping is the same; the KV itself would not
fit on this machine), under a ``UnifiedRadixCache`` with the FULL and SWA components, as
``sglang/test/kits/unified_radix_cache/fixtures.py`` builds it.

The W3 replay drives them as the scheduler does a request, with a one-step prefill and a one-step
decode: ``Req``, a ``ReqToTokenPool`` row, ``match_kv_cache`` (its hit), ``tree.lock(last_node)``,
``evict_from_tree_cache`` when short, the prompt's and output's pages from both pools (the kit's
replica of ``alloc_extend``: full pages, SWA pages, the full-to-SWA mapping), the row written,
``evict_sliding_windows`` (what ``maybe_evict_swa`` calls in decode), and at finish
``release_kv_cache(req, tree, checkpoint=True)`` (the tree keeps what it can key, the rest freed).

``sglang`` is W3 at the same budget through ``RadixCache`` with one full-attention pool
(``peer_sglang.replay_w2``: today's W3 replay, every layer full), ``budget // (block bytes of all
layers)`` pages.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from array import array
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peer_common import stub_torchvision  # noqa: E402

stub_torchvision()

import torch  # noqa: E402
from group_presets import BLOCK_SIZE, CONTEXT_32K, DEFAULT_PRESETS, PRESETS, GroupPreset  # noqa: E402
from peer_sglang import replay_w2  # noqa: E402
from w2 import no_gc  # noqa: E402

from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import (  # noqa: E402
    checkpoint_kv_cache,
    evict_from_tree_cache,
    match_kv_cache,
    release_kv_cache,
)  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

SWA_FULL_TOKENS_RATIO = 0.8  # arg_groups/fields/schedule.py: swa_full_tokens_ratio's fallback
SERVED = {"gpt-oss-120b", "gpt-oss-20b", "llama-4-scout"}
NOT_SERVED = {"gemma-3-27b": "SGLang forces hybrid SWA memory off for Gemma3 (disable_hybrid_swa_memory)"}


def pool_tokens(preset: GroupPreset) -> tuple[int, int]:
    """(full_tokens, swa_tokens) of HybridSWAPoolConfigurator at the preset's budget."""
    per_token = preset.bytes_per_token_per_layer
    full_layers = preset.count("full")
    swa_layers = len(preset.layers) - full_layers
    cell = per_token * full_layers + SWA_FULL_TOKENS_RATIO * per_token * swa_layers
    full_tokens = int(preset.budget_bytes // cell) // BLOCK_SIZE * BLOCK_SIZE
    swa_tokens = int(full_tokens * SWA_FULL_TOKENS_RATIO) // BLOCK_SIZE * BLOCK_SIZE
    return full_tokens, swa_tokens


def sglang_window(preset: GroupPreset) -> int:
    """The ``sliding_window_size`` SGLang serves ``preset`` with: gpt-oss's
    ``get_attention_sliding_window_size`` is ``config.sliding_window - 1`` (HF's window counts the
    query's own token, SGLang's does not), Llama 4's the chunk (``resolve_sliding_window_size``)."""
    return preset.window - 1 if preset.name.startswith("gpt-oss") else preset.window


class SWACache:
    """A UnifiedRadixCache (FULL + SWA) over an SWATokenToKVPoolAllocator sized for ``preset``."""

    def __init__(self, preset: GroupPreset, max_live: int, max_context: int, lifecycle: bool = False) -> None:
        server_args = ServerArgs(model_path="dummy", page_size=BLOCK_SIZE)
        set_global_server_args_for_scheduler(server_args)
        self.full_tokens, self.swa_tokens = pool_tokens(preset)
        self.window = sglang_window(preset)
        self.req_to_token_pool = ReqToTokenPool(
            size=max_live + 1, max_context_len=max_context, device="cpu", enable_memory_saver=False
        )
        kv_pool = SWAKVPool(
            size=self.full_tokens,
            size_swa=self.swa_tokens,
            page_size=BLOCK_SIZE,
            dtype=torch.bfloat16,
            head_num=1,
            head_dim=1,
            swa_attention_layer_ids=[0],
            full_attention_layer_ids=[1],
            device="cpu",
        )
        self.allocator = SWATokenToKVPoolAllocator(
            size=self.full_tokens,
            size_swa=self.swa_tokens,
            page_size=BLOCK_SIZE,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=kv_pool,
            need_sort=False,
        )
        params = CacheInitParams(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=BLOCK_SIZE,
            disable=False,
            sliding_window_size=self.window,
            tree_components=(ComponentType.FULL, ComponentType.SWA),
        )
        if lifecycle:
            if str(HERE.parent) not in sys.path:
                sys.path.insert(0, str(HERE.parent))  # the checkout's lifecycle (built in place)
            from lifecycle.integrations.sglang import swa_radix_cache_class

            self.tree = swa_radix_cache_class()(params)
        else:
            self.tree = UnifiedRadixCache(params=params)

    def alloc(self, need: int) -> torch.Tensor | None:
        """``need`` slots (whole pages) in both pools, mapped full to SWA: what ``alloc_extend``
        does for a request starting on a page boundary (the kit's replica: the SWA allocator's
        ``alloc`` is for pages of one token)."""
        allocator = self.allocator
        aligned = -(-need // BLOCK_SIZE) * BLOCK_SIZE
        full_free = allocator.full_attn_allocator.available_size()
        swa_free = allocator.swa_attn_allocator.available_size()
        if aligned > full_free or aligned > swa_free:
            return None
        full = allocator.full_attn_allocator.alloc(aligned)
        swa = allocator.swa_attn_allocator.alloc(aligned)
        allocator.full_to_swa_index_mapping[full] = swa
        return full[:need]


def replay_swa(preset: GroupPreset, trace: Any, as_scheduled: bool,
               lifecycle: bool = False) -> tuple[float, int, int, dict[str, Any]]:
    """One W3 replay; (seconds, hit tokens, refused admissions, stop). ``as_scheduled``: the prompt is
    published into the tree after its prefill (``checkpoint_kv_cache``), as the scheduler does;
    else only at finish (W3's rule), after the decode slid its window. ``stop``: where and why
    the replay stopped, when one of SGLang's own checks failed ({} when it ran to the end).
    ``lifecycle``: through ``LifecycleSWARadixCache`` in place of ``UnifiedRadixCache``."""
    longest = max(len(t) for t in trace.tokens)
    cache = SWACache(preset, trace.max_live, longest + BLOCK_SIZE, lifecycle)
    # Trace preparation: token arrays, SGLang's key type.
    requests = [
        (array("q", trace.prompt(i).tolist()), array("q", trace.generated(i).tolist()))
        for i in range(trace.num_requests)
    ]
    live: deque[Req] = deque()
    counts = [0, 0, 0]  # hit tokens, refused admissions, the request being replayed

    def finish(req: Req) -> None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, cache.tree, checkpoint=True)

    stopped: dict[str, Any] = {}
    with no_gc():
        start = time.perf_counter()
        try:
            seconds = _replay_requests(cache, requests, live, finish, trace.max_live, as_scheduled, counts)
        except AssertionError as error:
            seconds = time.perf_counter() - start
            stopped = {"stopped_at_request": counts[2], "error": _where(error)}
    return seconds, counts[0], counts[1], stopped


def _where(error: BaseException) -> str:
    """The failing check's file, line and function (SGLang's asserts carry no message)."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"AssertionError at {Path(frame.filename).name}:{frame.lineno} in {frame.name}: {frame.line}"


def _replay_requests(
    cache: SWACache, requests: list[tuple[array[int], array[int]]], live: deque[Req], finish: Any, max_live: int,
    as_scheduled: bool, counts: list[int],
) -> float:
    """The replay's loop; ``counts`` gathers hit tokens, refusals and the requests begun."""
    tree, pool = cache.tree, cache.req_to_token_pool
    start = time.perf_counter()
    for number, (prompt, output) in enumerate(requests):
        counts[2] = number
        if len(live) == max_live:
            finish(live.popleft())
        req = Req(
            rid=str(number),
            origin_input_text="",
            origin_input_ids=prompt,
            sampling_params=SamplingParams(temperature=0, max_new_tokens=max(len(output), 1)),
        )
        match_kv_cache(req, tree, prompt)
        hit = req.prefix_len
        req.kv.cache_protected_len = hit  # as Req.init_next_round_input sets it after its match
        req.lock = tree.lock(req.last_node)
        total = len(prompt) + len(output)
        # The tokens to allocate, whole pages: the allocator evicts what either pool lacks.
        evict_from_tree_cache(tree, -(-(total - hit) // BLOCK_SIZE) * BLOCK_SIZE)
        new = cache.alloc(total - hit)
        if new is None:
            counts[1] += 1
            tree.unlock(req.lock)
            req.lock = None
            continue
        prefix = tree.prefix_device_indices(req) if hit else new[:0]
        pool.alloc([req])
        row = req.kv.req_pool_idx
        pool.write((row, slice(0, total)), torch.cat([prefix.to(torch.int64), new]).to(torch.int32))
        req.extend_end = len(prompt)
        counts[0] += hit
        if as_scheduled:
            req.full_untruncated_fill_ids = prompt
            req.kv.kv_allocated_len = req.kv.kv_committed_len = len(prompt)
            checkpoint_kv_cache(req, tree)
        req.output_ids = output
        req.kv.kv_allocated_len = req.kv.kv_committed_len = total
        # The decode steps slide the window over the prompt and the output.
        tree.evict_sliding_windows(req, total - 1)
        live.append(req)
    counts[2] = len(requests)
    while live:
        finish(live.popleft())
    return time.perf_counter() - start


def memory_record(preset: GroupPreset) -> dict[str, Any]:
    """Concurrent 32k-token sequences, computed from the pool sizes: a resident sequence holds its
    32k tokens in the full pool and, once its window slid, ``window`` rounded up to pages plus one
    page in the SWA pool (``free_swa_out_of_window_slots`` keeps ``ceil_align(window, page)``)."""
    full_tokens, swa_tokens = pool_tokens(preset)
    swa_need = -(-preset.window // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE
    used = full_tokens * preset.bytes_per_token_per_layer * preset.count("full") + swa_tokens * (
        preset.bytes_per_token_per_layer * (len(preset.layers) - preset.count("full"))
    )
    return {
        "concurrent_32k_sequences": min(full_tokens // CONTEXT_32K, swa_tokens // swa_need),
        "concurrent_32k_sequences_how": "computed from the pool sizes (full pool 32k tokens, SWA pool window + a page)",
        "padding_waste": 0,
        "padding_waste_how": "one pool per kind at its own page size: no padding",
        "unplaced_budget_bytes": preset.budget_bytes - used,
        "pools": {"full_tokens": full_tokens, "swa_tokens": swa_tokens, "swa_full_tokens_ratio": SWA_FULL_TOKENS_RATIO},
    }


def record(preset: GroupPreset, library: str, seconds: float, hits: int, trace: Any, **extra: Any) -> dict[str, Any]:
    # A replay that stopped early is timed over the requests it replayed.
    replayed = extra.get("stopped_at_request") or trace.num_requests
    return {
        "workload": "W3-groups",
        "preset": preset.name,
        "library": library,
        "us_per_request": round(seconds / replayed * 1e6, 3),
        "hit_tokens": hits,
        "prompt_tokens": trace.prompt_tokens,
        "hit_rate": round(hits / trace.prompt_tokens, 6),
        "requests": trace.num_requests,
        "ideal_32k_sequences": preset.ideal_32k_sequences(),
        **extra,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default=",".join(DEFAULT_PRESETS))
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--libraries", default="sglang-swa,lifecycle-swa,sglang")
    parser.add_argument("--caching", default="as-scheduled,at-finish")
    args = parser.parse_args()
    from w3 import load_w3

    trace = load_w3(limit=args.requests)
    libraries = args.libraries.split(",")
    for name in args.presets.split(","):
        preset = PRESETS[name]
        for library in ("sglang-swa", "lifecycle-swa"):
            if library not in libraries:
                continue
            if name in SERVED:
                for caching in args.caching.split(","):
                    seconds, hits, refused, stopped = replay_swa(
                        preset, trace, caching == "as-scheduled", lifecycle=library == "lifecycle-swa"
                    )
                    entry = record(
                        preset, library, seconds, hits, trace,
                        caching=caching, refused=refused, **stopped, **memory_record(preset),
                    )
                    print(json.dumps(entry), flush=True)
            else:
                reason = NOT_SERVED.get(name, "not a hybrid SWA model in SGLang")
                entry = {"workload": "W3-groups", "preset": name, "library": library, "not_served": reason}
                print(json.dumps(entry), flush=True)
        if "sglang" in libraries:
            pages = preset.budget_bytes // (preset.bytes_per_token_per_layer * len(preset.layers) * BLOCK_SIZE)
            seconds, hits, evicted = replay_w2(replace(trace, num_blocks=pages))  # type: ignore[arg-type]
            print(
                json.dumps(
                    record(
                        preset, "sglang", seconds, hits, trace, caching="at-finish", blocks_evicted=evicted,
                        concurrent_32k_sequences=pages // (CONTEXT_32K // BLOCK_SIZE),
                        concurrent_32k_sequences_how="computed: pages // 2048",
                        padding_waste=0, pools={"full_pages": pages},
                    )
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
