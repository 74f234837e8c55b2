"""W2, the prefix-cache serving replay (SPEC §7): its trace and the record every library reports.

``load_w2`` reads ``w2_*`` of the reference traces (``bench/data/traces.npz``): 2,000 requests, at
most 64 live (FIFO), blocks of 16 tokens, a pool of 32,768 blocks; ``bench/replay.py`` replays them
through lifecycle and ``peer_*.py`` through the peers, by the same rules.

The module imports only numpy and the standard library, so that the peers' runners (run inside the
peers' virtual environments) can share it.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

# The repository root, so that a source checkout replays without installing the package.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))

from traces import TRACES, load_traces, meta  # noqa: E402

REFERENCE_HIT_TOKENS = 1_965_056
REFERENCE_PROMPT_TOKENS = 4_365_010
# Best of REPEATS replays. Ours is ~30-50x shorter than a peer's, so one stray context switch
# weighs more: it takes LIFECYCLE_REPEATS tries where a peer takes REPEATS.
REPEATS = 3
LIFECYCLE_REPEATS = 10


@dataclass(frozen=True)
class W2Trace:
    """The W2 requests, prepared: per request its prompt + generated tokens as one int32 array."""

    tokens: list[NDArray[np.int32]]
    prompt_lens: list[int]
    block_size: int
    num_blocks: int
    max_live: int
    gen_len: int

    @property
    def num_requests(self) -> int:
        return len(self.tokens)

    def blocks_needed(self, i: int) -> int:
        """Blocks request ``i`` holds while live: its prompt and every token it generates."""
        return -(-(self.prompt_lens[i] + self.gen_len) // self.block_size)

    def reusable_blocks(self, i: int) -> int:
        """Most cached blocks request ``i`` may reuse: never the block holding its last prompt token."""
        return (self.prompt_lens[i] - 1) // self.block_size if self.prompt_lens[i] > 0 else 0


def load_w2(trace_path: Path) -> W2Trace:
    """Read the W2 trace and convert it to int32 arrays (done before any clock starts)."""
    trace = load_traces(trace_path)
    w2 = meta(trace_path)["w2"]
    prompts = trace["w2_prompt_tokens"]
    offsets = trace["w2_prompt_offsets"]
    generated = trace["w2_gen_tokens"]
    tokens = [
        np.concatenate([prompts[offsets[i] : offsets[i + 1]], generated[i]]).astype(np.int32)
        for i in range(len(offsets) - 1)
    ]
    prompt_lens = [int(offsets[i + 1] - offsets[i]) for i in range(len(offsets) - 1)]
    return W2Trace(
        tokens=tokens,
        prompt_lens=prompt_lens,
        block_size=int(w2["block_size"]),
        num_blocks=int(w2["num_blocks"]),
        max_live=int(w2["max_live"]),
        gen_len=int(w2["gen_len"]),
    )


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect, then keep the cyclic GC off while a replay runs (as ``timeit`` does)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def timed(replay: Callable[[W2Trace], tuple[float, int, int]], trace: W2Trace) -> tuple[float, int, int]:
    with no_gc():
        return replay(trace)


def result(
    library: str, seconds: float, hit_tokens: int, prompt_tokens: int, blocks_evicted: int, requests: int
) -> dict[str, Any]:
    """The W2 JSON record every library reports."""
    return {
        "workload": "W2",
        "library": library,
        "us_per_request": round(seconds / requests * 1e6, 3),
        "hit_rate": round(hit_tokens / prompt_tokens, 6),
        "hit_tokens": hit_tokens,
        "prompt_tokens": prompt_tokens,
        "blocks_evicted": blocks_evicted,
    }


if __name__ == "__main__":
    trace = load_w2(TRACES)
    print(json.dumps({"requests": trace.num_requests, "prompt_tokens": sum(trace.prompt_lens)}))
