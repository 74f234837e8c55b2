"""W3, the long-context replay (SPEC §7): the Mooncake synthetic trace, expanded to tokens.

:func:`load_w3` reads ``bench/data/mooncake_synthetic.jsonl.xz`` (3,993 requests, 61,194,628 prompt
tokens) and expands every request into int32 tokens by the rules every library is measured with:

- ``splitmix64(x)``: ``z = x + 0x9E3779B97F4A7C15; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EB; return z ^ (z >> 31)``, all mod 2**64;
- prompt token ``j`` (0..511) of chunk ``h`` is ``splitmix64(h * 512 + j) % 32000``; a prompt is its
  chunks' tokens concatenated, cut to ``input_length``;
- generated token ``j`` of request ``r`` (its line number, from 0) is
  ``splitmix64(2**40 + r * 2**20 + j) % 32000``, ``output_length`` of them.

The replay follows W2's rules (a FIFO window of at most 32 live requests; at finish every full block
of prompt + generated tokens is cached; admission reuses the longest cached prefix in whole blocks,
never the block holding the prompt's last token, and allocates the rest, evicting least recently
used unpinned cached blocks when short) with blocks of 16 tokens and a pool of 262,144 blocks.
:func:`never_evict_hits` gives the ceiling: what a cache that never evicts would hit.

Only numpy and the standard library here, so that the peers' environments can import it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from traces import MOONCAKE_TRACE, mooncake_lines  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 262_144
MAX_LIVE = 32
CHUNK_TOKENS = 512
VOCAB = 32_000
#: The shipped trace's size, for checks.
REFERENCE_REQUESTS = 3_993
REFERENCE_PROMPT_TOKENS = 61_194_628

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GEN_BASE = 1 << 40
_GEN_STRIDE = 1 << 20
# Elements per splitmix64 pass: bounds the temporaries (8 bytes each) whatever the trace's size.
_BATCH = 1 << 22


def splitmix64(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64 of every element (uint64 arithmetic wraps mod 2**64, as the rule says)."""
    z = x + _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def _tokens_of(x: NDArray[np.uint64]) -> NDArray[np.int32]:
    """``splitmix64(x) % VOCAB`` as int32, computed in batches."""
    out = np.empty(x.shape, dtype=np.int32)
    flat_in, flat_out = x.reshape(-1), out.reshape(-1)
    for start in range(0, flat_in.size, _BATCH):
        stop = start + _BATCH
        flat_out[start:stop] = splitmix64(flat_in[start:stop]) % np.uint64(VOCAB)
    return out


def chunk_tokens(chunk_ids: NDArray[np.integer[Any]]) -> NDArray[np.int32]:
    """The 512 tokens of each chunk id: shape ``(len(chunk_ids), 512)``."""
    ids = np.asarray(chunk_ids, dtype=np.uint64)
    positions = np.arange(CHUNK_TOKENS, dtype=np.uint64)
    return _tokens_of(ids[:, None] * np.uint64(CHUNK_TOKENS) + positions)


def generated_tokens(requests: NDArray[np.integer[Any]], counts: NDArray[np.integer[Any]]) -> NDArray[np.int32]:
    """The generated tokens of each request number, ``counts[i]`` of request ``requests[i]``, all
    concatenated in order."""
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    position = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
    base = np.uint64(_GEN_BASE) + np.asarray(requests, dtype=np.uint64) * np.uint64(_GEN_STRIDE)
    return _tokens_of(np.repeat(base, counts) + position.astype(np.uint64))


@dataclass(frozen=True)
class W3Trace:
    """The W3 requests, expanded: request ``i``'s prompt then generated tokens are ``tokens[i]``
    (int32, a view into one array), its first ``prompt_lens[i]`` being the prompt."""

    tokens: list[NDArray[np.int32]]
    prompt_lens: list[int]
    gen_lens: list[int]
    chunk_ids: list[list[int]]
    block_size: int = BLOCK_SIZE
    num_blocks: int = NUM_BLOCKS
    max_live: int = MAX_LIVE

    @property
    def num_requests(self) -> int:
        return len(self.tokens)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over all requests (the denominator of the hit rate)."""
        return sum(self.prompt_lens)

    def prompt(self, i: int) -> NDArray[np.int32]:
        return self.tokens[i][: self.prompt_lens[i]]

    def generated(self, i: int) -> NDArray[np.int32]:
        return self.tokens[i][self.prompt_lens[i] :]

    def blocks_needed(self, i: int) -> int:
        """Blocks request ``i`` holds while live: its prompt and every token it generates."""
        return -(-(self.prompt_lens[i] + self.gen_lens[i]) // self.block_size)

    def full_blocks(self, i: int) -> int:
        """Full blocks of request ``i``'s prompt + generated tokens: what it caches at finish."""
        return (self.prompt_lens[i] + self.gen_lens[i]) // self.block_size

    def reusable_blocks(self, i: int) -> int:
        """Most cached blocks request ``i`` may reuse: never the block holding its last prompt token."""
        return (self.prompt_lens[i] - 1) // self.block_size if self.prompt_lens[i] > 0 else 0


def expand(records: Iterable[Mapping[str, Any]]) -> W3Trace:
    """Expand Mooncake records (``input_length``, ``output_length``, ``hash_ids``), numbered from 0
    in the order given, into a :class:`W3Trace`."""
    records = list(records)
    prompt_lens = [int(r["input_length"]) for r in records]
    gen_lens = [int(r["output_length"]) for r in records]
    chunk_ids = [[int(h) for h in r["hash_ids"]] for r in records]
    for i, (length, ids) in enumerate(zip(prompt_lens, chunk_ids)):
        if not 0 < length <= len(ids) * CHUNK_TOKENS:
            raise ValueError(f"request {i}: input_length {length} does not fit its {len(ids)} chunks of {CHUNK_TOKENS}")

    # Every distinct chunk is expanded once; requests gather their chunks' rows.
    all_ids = np.fromiter((h for ids in chunk_ids for h in ids), dtype=np.int64)
    unique_ids, row_of = np.unique(all_ids, return_inverse=True)
    table = chunk_tokens(unique_ids)
    generated = generated_tokens(np.arange(len(records)), np.array(gen_lens, dtype=np.int64))

    lengths = np.array(prompt_lens, dtype=np.int64) + np.array(gen_lens, dtype=np.int64)
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.int32)
    tokens: list[NDArray[np.int32]] = []
    first_row = gen_start = 0
    for i, (length, gen_len, ids) in enumerate(zip(prompt_lens, gen_lens, chunk_ids)):
        start = int(offsets[i])
        rows = row_of[first_row : first_row + len(ids)]
        first_row += len(ids)
        flat[start : start + length] = table[rows].reshape(-1)[:length]
        flat[start + length : start + length + gen_len] = generated[gen_start : gen_start + gen_len]
        gen_start += gen_len
        tokens.append(flat[start : int(offsets[i + 1])])
    return W3Trace(tokens=tokens, prompt_lens=prompt_lens, gen_lens=gen_lens, chunk_ids=chunk_ids)


def load_w3(path: Path = MOONCAKE_TRACE, limit: int | None = None) -> W3Trace:
    """Read a Mooncake JSONL trace (``.xz`` or plain) and expand it; ``limit`` keeps the first
    requests only (their tokens are the same as in the whole trace)."""
    records: list[dict[str, Any]] = []
    for line in mooncake_lines(path):
        if limit is not None and len(records) >= limit:
            break
        records.append(json.loads(line))
    return expand(records)


def never_evict_hits(trace: W3Trace) -> NDArray[np.int64]:
    """Hit tokens of each request under W2's rules with a cache that never evicts: the ceiling of
    any replay's hit tokens (a replay evicting least recently used blocks hits at most as much).

    Request ``i`` (from ``max_live`` on) is admitted after request ``i - max_live`` finished, so it
    sees the full blocks of requests ``0 .. i - max_live``. A prompt block of chunk ``c``, position
    ``p`` is identified by its chunk-id path ``chunk_ids[:c + 1]`` and ``p``: equal paths are equal
    tokens, and tests/test_bench_inputs.py checks that the expansion gives distinct blocks for
    distinct paths (and for every block holding a generated token, which no later prompt contains).
    So one record per chunk path, the number of its leading blocks cached, decides every hit.
    """
    blocks_per_chunk = CHUNK_TOKENS // trace.block_size
    if CHUNK_TOKENS % trace.block_size:
        raise ValueError(f"block size {trace.block_size} does not divide the chunk size {CHUNK_TOKENS}")
    path_of: dict[tuple[int, int], int] = {}
    paths = []
    for ids in trace.chunk_ids:
        parent, path = -1, []
        for chunk in ids:
            parent = path_of.setdefault((parent, chunk), len(path_of))
            path.append(parent)
        paths.append(path)
    cached = np.zeros(len(path_of), dtype=np.int64)  # leading blocks of each chunk path that are cached

    def finish(r: int) -> None:
        prompt_blocks = trace.prompt_lens[r] // trace.block_size  # blocks after these hold generated tokens
        for c, node in enumerate(paths[r]):
            blocks = min(blocks_per_chunk, prompt_blocks - c * blocks_per_chunk)
            if blocks <= 0:
                break
            cached[node] = max(int(cached[node]), blocks)

    hits = np.zeros(trace.num_requests, dtype=np.int64)
    for i in range(trace.num_requests):
        if i >= trace.max_live:
            finish(i - trace.max_live)
        matched = 0
        for node in paths[i]:
            blocks = int(cached[node])
            matched += blocks
            if blocks < blocks_per_chunk:
                break
        hits[i] = min(matched, trace.reusable_blocks(i)) * trace.block_size
    return hits


def never_evict_hit_tokens(trace: W3Trace) -> int:
    """The ceiling's hit tokens over the whole trace (see :func:`never_evict_hits`)."""
    return int(never_evict_hits(trace).sum())


if __name__ == "__main__":
    import time

    started = time.perf_counter()
    w3 = load_w3()
    loaded = time.perf_counter()
    ceiling = never_evict_hit_tokens(w3)
    print(
        json.dumps(
            {
                "workload": "W3",
                "library": "never-evict ceiling",
                "requests": w3.num_requests,
                "prompt_tokens": w3.prompt_tokens,
                "hit_tokens": ceiling,
                "hit_rate": round(ceiling / w3.prompt_tokens, 6),
                "load_seconds": round(loaded - started, 2),
                "ceiling_seconds": round(time.perf_counter() - loaded, 2),
            }
        )
    )
