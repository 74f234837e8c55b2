"""W3 and W4 on vLLM's hybrid ``KVCacheManager`` per model of issue 31 (run inside the vLLM peer
environment by ``peers.py --workloads w3-groups,w4-groups``).

Per preset (bench/group_presets.py) the manager is configured the way vLLM's engine core does it,
with vLLM's own planning code:

- a ``ModelConfig`` read from the preset's published ``config.json`` fields (written to a scratch
  directory: no weights, no tokenizer), ``max_model_len`` the trace's longest request (beyond some
  models' ``max_position_embeddings``: ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``), block size 16, prefix
  caching on, everything else vLLM's defaults;
- the hybrid manager switched on as a CUDA platform would: ``VllmConfig.__post_init__`` disables it
  when ``current_platform.support_hybrid_kv_cache()`` is False, which it is on this machine's
  ``UnspecifiedPlatform`` (``CudaPlatform`` returns True); the runner answers True for the platform
  in hand. Chunked local attention (llama-4-scout) also needs
  ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1``: without it vLLM turns the hybrid manager
  off for such models, so its default for them is the ``vllm`` row (one full group);
- the layer specs a worker reports, built from the config: ``FullAttentionSpec``,
  ``SlidingWindowSpec(sliding_window=...)``, ``ChunkedLocalAttentionSpec(attention_chunk_size=...)``,
  ``MLAAttentionSpec`` (bf16, 16-token blocks);
- the layout resolved from the default preference (``resolve_kv_cache_layout``; the CUDA attention
  backends of these models declare none), then ``get_global_kv_cache_groups`` and
  ``get_kv_cache_configs(..., available_memory=[budget])`` (grouping and block count are vLLM's),
  ``generate_scheduler_kv_cache_config``, ``resolve_kv_cache_block_sizes``, and the
  ``KVCacheManager`` built with the arguments ``Scheduler.__init__`` passes.

``vllm-hybrid`` is that manager; ``vllm`` the same with ``disable_hybrid_kv_cache_manager=True``
(``unify_hybrid_kv_cache_specs`` turns every local layer into full attention: one group).

W3 replays the Mooncake trace by W3's rules through the manager as the scheduler drives it:
``Request`` (hashes the prompt's blocks), ``get_computed_blocks`` (its hit; the scheduler's
``shared_prefix_boundary`` set on the request), ``allocate_slots(request, P - hit, hit, computed)``
(the prefill in one step), the generated tokens appended and ``allocate_slots(request, G)`` (the
decode in one step: it caches every full block of prompt + output and drops blocks that left a
window), and ``free(request)`` when the request leaves the FIFO window of 32.

Memory: ``concurrent_32k_sequences`` allocates 32,768-token requests (distinct tokens) until the
manager refuses one, each prefilled in chunks of the scheduler's ``max_num_batched_tokens`` (the
blocks that left a window go back between chunks, as they do between steps); beside it the count
when each prompt is allocated in one step, and ``num_blocks`` divided by the blocks one sequence
holds. ``padding_waste``: with those sequences resident, the bytes of the blocks they hold that hold
no KV (a block is as large as the largest group's layers, so a group with fewer layers leaves part
of each of its blocks empty, and padded pages leave the rest).

W4 replays bench/w4.py's decode trace through the same manager (``peer_vllm.replay_w4``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from group_presets import BLOCK_SIZE, CONTEXT_32K, DEFAULT_PRESETS, PRESETS, GroupPreset  # noqa: E402
from peer_vllm import HASH_FN, replay_w4  # noqa: E402
from w2 import no_gc  # noqa: E402

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs  # noqa: E402
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, resolve_kv_cache_block_sizes  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

LIBRARIES = ("vllm-hybrid", "vllm")


def layer_specs(preset: GroupPreset) -> dict[str, KVCacheSpec]:
    """What each attention layer's ``get_kv_cache_spec`` reports for ``preset``."""
    specs: dict[str, KVCacheSpec] = {}
    for i, (kind, window) in enumerate(preset.layers):
        name = f"model.layers.{i}.self_attn.attn"
        common: dict[str, Any] = {"block_size": BLOCK_SIZE, "dtype": torch.bfloat16}
        if preset.mla_dim:
            specs[name] = MLAAttentionSpec(num_kv_heads=1, head_size=preset.mla_dim, **common)
        elif kind == "sliding_window":
            specs[name] = SlidingWindowSpec(
                num_kv_heads=preset.num_kv_heads, head_size=preset.head_dim, sliding_window=window, **common
            )
        elif kind == "chunked_local":
            specs[name] = ChunkedLocalAttentionSpec(
                num_kv_heads=preset.num_kv_heads, head_size=preset.head_dim, attention_chunk_size=window, **common
            )
        else:
            specs[name] = FullAttentionSpec(num_kv_heads=preset.num_kv_heads, head_size=preset.head_dim, **common)
    return specs


def vllm_config(preset: GroupPreset, max_model_len: int, hybrid: bool, scratch: Path) -> VllmConfig:
    model_dir = scratch / preset.name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(preset.config_json()))
    model = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16"
    )
    platform = type(current_platform)
    saved = platform.__dict__.get("support_hybrid_kv_cache")
    # What CudaPlatform.support_hybrid_kv_cache returns; off for the plain manager.
    platform.support_hybrid_kv_cache = classmethod(lambda cls: hybrid)
    try:
        return VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_model_len=max_model_len, is_encoder_decoder=False, disable_hybrid_kv_cache_manager=not hybrid
            )
            if not hybrid
            else SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False),
            device_config=DeviceConfig(device="cpu"),
        )
    finally:
        if saved is None:
            del platform.support_hybrid_kv_cache
        else:
            platform.support_hybrid_kv_cache = saved


class Setup:
    """One preset's manager as vLLM's engine core plans it, and the plan's figures."""

    def __init__(self, preset: GroupPreset, max_model_len: int, hybrid: bool, scratch: Path) -> None:
        self.preset = preset
        self.library = "vllm-hybrid" if hybrid else "vllm"
        env = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"
        saved = os.environ.get(env)
        if hybrid:
            os.environ[env] = "1"
        try:
            self.config = vllm_config(preset, max_model_len, hybrid, scratch)
        finally:
            if saved is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = saved
        if self.config.scheduler_config.disable_hybrid_kv_cache_manager == hybrid:
            raise AssertionError(f"{preset.name}: the hybrid manager is not {'on' if hybrid else 'off'}")
        specs = [layer_specs(preset)]
        resolve_kv_cache_layout(self.config, [[m.name for m in get_supported_kv_cache_layouts([])]], specs[0].values())
        groups = get_global_kv_cache_groups(self.config, specs)
        configs = get_kv_cache_configs(self.config, specs, [preset.budget_bytes], groups)
        self.kv_config: KVCacheConfig = generate_scheduler_kv_cache_config(configs)
        self.block_bytes = self.kv_config.kv_cache_tensors[0].size // self.kv_config.num_blocks
        self.tensor_bytes = max(t.size + t.offset for t in self.kv_config.kv_cache_tensors)
        self.scheduler_block_size, self.hash_block_size = resolve_kv_cache_block_sizes(self.kv_config, self.config)
        self.max_model_len = max_model_len

    def manager(self) -> KVCacheManager:
        sched = self.config.scheduler_config
        return KVCacheManager(
            kv_cache_config=self.kv_config,
            max_model_len=self.max_model_len,
            max_in_flight_tokens=self.config.max_in_flight_tokens,
            enable_caching=True,
            scheduler_block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
            watermark=sched.watermark,
        )

    def hasher(self) -> Any:
        return kv_cache_utils.get_request_block_hasher(self.hash_block_size, HASH_FN)

    def groups(self) -> list[dict[str, Any]]:
        """Each group's kind, window, layer count and the KV bytes one block of it holds."""
        out = []
        for group in self.kv_config.kv_cache_groups:
            spec = group.kv_cache_spec
            real = sum(_layer_spec(group, name).real_page_size_bytes for name in group.layer_names)
            window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None) or 0
            out.append(
                {
                    "spec": type(spec).__name__,
                    "window": window,
                    "layers": len(group.layer_names),
                    "kv_bytes_per_block": real,
                }
            )
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "num_blocks": self.kv_config.num_blocks,
            "block_bytes": self.block_bytes,
            "budget_bytes": self.preset.budget_bytes,
            "tensor_bytes": self.tensor_bytes,
            "groups": self.groups(),
            "layout": self.config.cache_config.kv_cache_layout,
            "max_num_batched_tokens": self.config.scheduler_config.max_num_batched_tokens,
        }


def _layer_spec(group: Any, name: str) -> Any:
    spec = group.kv_cache_spec
    return spec.kv_cache_specs[name] if hasattr(spec, "kv_cache_specs") else spec


def held_blocks(manager: KVCacheManager, request_id: str) -> list[int]:
    """Blocks ``request_id`` holds in each group (the null blocks standing for freed ones left out)."""
    return [
        sum(1 for block in m.req_to_blocks.get(request_id, ()) if not block.is_null)
        for m in manager.coordinator.single_type_managers
    ]


def fill_32k(setup: Setup, chunk: int, length: int = CONTEXT_32K) -> tuple[int, list[int], KVCacheManager]:
    """How many requests of ``length`` tokens the manager holds at once, each prefilled in steps of
    ``chunk`` tokens (all of it in one step when ``chunk`` >= ``length``); the blocks the first
    holds per group."""
    manager = setup.manager()
    hasher = setup.hasher()
    per_sequence: list[int] = []
    count = 0
    while True:
        tokens = (np.arange(length, dtype=np.int64) + count * CONTEXT_32K).tolist()
        request = Request(f"s{count}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        computed, hit, boundary = manager.get_computed_blocks(request)
        request.shared_prefix_boundary = boundary
        done, first = hit, True
        while done < length:
            step = min(chunk, length - done)
            if first:
                new = manager.allocate_slots(request, step, hit, computed)
            else:
                new = manager.allocate_slots(request, step)
            if new is None:
                return count, per_sequence, manager
            first = False
            done += step
            request.num_computed_tokens = done
            request.status = RequestStatus.RUNNING
        # The next step would drop what left the window: count what the sequence holds then.
        manager.remove_skipped_blocks(request.request_id, length, num_prompt_tokens=length)
        if count == 0:
            per_sequence = held_blocks(manager, request.request_id)
        count += 1


def memory_record(setup: Setup) -> dict[str, Any]:
    chunk = setup.config.scheduler_config.max_num_batched_tokens
    concurrent, per_sequence, manager = fill_32k(setup, chunk)
    one_step, _, _ = fill_32k(setup, CONTEXT_32K)
    chunked = any(isinstance(g.kv_cache_spec, ChunkedLocalAttentionSpec) for g in setup.kv_config.kv_cache_groups)
    # At 32,768 tokens a chunked group has just finished a chunk and holds almost nothing: its
    # worst case is one token earlier, with the whole chunk held.
    before_boundary = fill_32k(setup, chunk, CONTEXT_32K - 1)[0] if chunked else concurrent
    groups = setup.groups()
    held = [0] * len(groups)
    for m_index, m in enumerate(manager.coordinator.single_type_managers):
        held[m_index] = sum(sum(1 for b in blocks if not b.is_null) for blocks in m.req_to_blocks.values())
    # Blocks the resident sequences hold in each group, each block_bytes large, holding that group's KV.
    held_bytes = sum(held) * setup.block_bytes
    waste = sum(h * (setup.block_bytes - g["kv_bytes_per_block"]) for h, g in zip(held, groups))
    return {
        "concurrent_32k_sequences": concurrent,
        "concurrent_32k_sequences_how": f"allocated until refused, prefill chunks of {chunk} tokens",
        "concurrent_32k_sequences_one_step_prefill": one_step,
        "concurrent_sequences_of_32767_tokens": before_boundary,
        "concurrent_32k_sequences_from_num_blocks": (setup.kv_config.num_blocks - 1) // max(sum(per_sequence), 1),
        "blocks_per_32k_sequence": per_sequence,
        "padding_waste": waste,
        "padding_waste_fraction": round(waste / held_bytes, 6) if held_bytes else 0.0,
        "unplaced_budget_bytes": setup.preset.budget_bytes - setup.tensor_bytes,
    }


def replay_w3(setup: Setup, trace: Any, as_scheduled: bool) -> tuple[float, int, int]:
    """One W3 replay through ``setup``'s manager; (seconds, hit tokens, refused admissions).
    ``as_scheduled``: ``allocate_slots`` caches the blocks as they are computed, as the scheduler
    has it; else (W3's rule) they are cached at finish: ``allocate_slots(...,
    delay_cache_blocks=True)`` (vLLM's P/D path) and ``cache_blocks(request, P + G)`` before
    ``free``."""
    delay = not as_scheduled
    manager = setup.manager()
    hasher = setup.hasher()
    # Trace preparation: prompts and outputs as Python lists, vLLM's input type.
    requests = [
        (str(i), trace.prompt(i).tolist(), trace.generated(i).tolist()) for i in range(trace.num_requests)
    ]
    live: deque[Request] = deque()
    hit_tokens = refused = 0
    get_computed, allocate, free = manager.get_computed_blocks, manager.allocate_slots, manager.free

    def finish(request: Request) -> None:
        if delay:
            manager.cache_blocks(request, request.num_computed_tokens)
        free(request)

    with no_gc():
        start = time.perf_counter()
        for request_id, prompt, output in requests:
            if len(live) == trace.max_live:
                finish(live.popleft())
            params = SamplingParams(max_tokens=max(len(output), 1))
            request = Request(request_id, prompt, params, None, block_hasher=hasher)
            computed, hit, boundary = get_computed(request)
            request.shared_prefix_boundary = boundary
            if allocate(request, len(prompt) - hit, hit, computed, delay_cache_blocks=delay) is None:
                refused += 1
                continue
            hit_tokens += hit
            request.num_computed_tokens = len(prompt)
            request.status = RequestStatus.RUNNING
            if output:
                request.append_output_token_ids(output)
                if allocate(request, len(output), delay_cache_blocks=delay) is None:
                    refused += 1
                request.num_computed_tokens = len(prompt) + len(output)
            live.append(request)
        while live:
            finish(live.popleft())
        seconds = time.perf_counter() - start
    return seconds, hit_tokens, refused


def run_w3(setup: Setup, trace: Any, caching: str, memory: dict[str, Any]) -> dict[str, Any]:
    seconds, hits, refused = replay_w3(setup, trace, caching == "as-scheduled")
    return {
        "workload": "W3-groups",
        "preset": setup.preset.name,
        "library": setup.library,
        "caching": caching,
        "us_per_request": round(seconds / trace.num_requests * 1e6, 3),
        "hit_tokens": hits,
        "prompt_tokens": trace.prompt_tokens,
        "hit_rate": round(hits / trace.prompt_tokens, 6),
        "requests": trace.num_requests,
        "refused": refused,
        "ideal_32k_sequences": setup.preset.ideal_32k_sequences(),
        **memory,
        "plan": setup.describe(),
    }


def run_w4(setup: Setup, steps: int) -> dict[str, Any]:
    from w4 import generate, record

    trace = replace(generate(steps=steps), num_blocks=setup.kv_config.num_blocks - 1)
    with no_gc():
        run = replay_w4(trace, manager=setup.manager(), hasher=setup.hasher())
    entry = record(setup.library, [run], trace, note="KVCacheManager.allocate_slots(request, 1) per running request")
    return {**entry, "workload": "W4-groups", "preset": setup.preset.name}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default=",".join(DEFAULT_PRESETS))
    parser.add_argument("--workloads", default="w3-groups,w4-groups")
    parser.add_argument("--requests", type=int, default=None, help="the first N requests of the W3 trace")
    parser.add_argument("--w4-steps", type=int, default=2000)
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--caching", default="as-scheduled,at-finish")
    args = parser.parse_args()
    wanted = set(args.workloads.split(","))
    trace = None
    if "w3-groups" in wanted:
        from w3 import load_w3

        trace = load_w3(limit=args.requests)
    longest = max((len(t) for t in trace.tokens), default=0) if trace is not None else 0
    max_model_len = -(-max(longest, CONTEXT_32K + BLOCK_SIZE, 5120) // BLOCK_SIZE) * BLOCK_SIZE
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.presets.split(","):
            preset = PRESETS[name]
            for library in args.libraries.split(","):
                setup = Setup(preset, max_model_len, library == "vllm-hybrid", Path(scratch))
                if trace is not None:
                    memory = memory_record(setup)
                    for caching in args.caching.split(","):
                        print(json.dumps(run_w3(setup, trace, caching, memory)), flush=True)
                if "w4-groups" in wanted:
                    print(json.dumps(run_w4(setup, args.w4_steps)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
