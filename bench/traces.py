"""The benchmark inputs shipped in the repository, so that every figure can be reproduced from a clone.

``bench/data/traces.npz`` holds the W1 and W2 reference traces (the exact operations that vLLM's
``BlockPool`` and SGLang's ``RadixCache`` were measured on) in a compact form; :func:`load_traces`
turns it back into the arrays of the original ``traces.npz`` (keys ``w1_ops``, ``w2_prompt_tokens``,
``w2_prompt_offsets``, ``w2_gen_tokens``, ``w2_system_id``, ``meta``), identical element for element.
It reads an original-format ``traces.npz`` as well, so ``--trace PATH`` may name either.

The compact form keeps what cannot be derived and drops what can:

- W1: an allocation row's sequence id is its rank among the allocations (0, 1, 2, ...) and a free
  row's block count is what that sequence allocated, so only the row kinds, the allocation sizes
  and the freed sequence ids are stored.
- W2: every prompt is one of 20 system prompts followed by a unique suffix, so the system prompts
  are stored once, then the suffixes and their lengths; tokens (a 32,000-token vocabulary) take 15
  bits each.

``bench/data/mooncake_synthetic.jsonl.xz`` is the Mooncake project's synthetic trace (W3), xz
compressed and otherwise unchanged; see ``bench/data/README.md`` for its origin and licence.

Only numpy and the standard library here: the peers' environments import this module too.

    python bench/traces.py pack PATH/traces.npz   # rewrite bench/data/traces.npz from an original
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
#: The W1/W2 reference traces, compact form (the default of every W1/W2 benchmark).
TRACES = DATA / "traces.npz"
#: The W3 input: Mooncake's synthetic trace, one JSON object per line, xz compressed.
MOONCAKE_TRACE = DATA / "mooncake_synthetic.jsonl.xz"
#: Where the originals live in this project's workspace (a sibling of the clone), when present.
SHARED_BENCH = HERE.parent.parent / "shared" / "bench"

ORIGINAL_KEYS = ("w1_ops", "w2_prompt_tokens", "w2_prompt_offsets", "w2_gen_tokens", "w2_system_id", "meta")
_COMPACT_MARKER = "w2_system_prompts"

Arrays = dict[str, NDArray[Any]]


def _pack15(tokens: NDArray[np.uint16]) -> NDArray[np.uint8]:
    """Tokens below 2**15 as a bit string of 15 bits each (the vocabulary is 32,000: the 16th bit is
    always 0, and deflate alone does not drop it)."""
    if tokens.size and int(tokens.max()) >= 1 << 15:
        raise ValueError(f"token {int(tokens.max())} does not fit in 15 bits")
    bits = np.unpackbits(tokens.astype(">u2").view(np.uint8)).reshape(-1, 16)
    return np.packbits(bits[:, 1:])


def _unpack15(packed: NDArray[np.uint8], shape: tuple[int, ...]) -> NDArray[np.uint16]:
    count = int(np.prod(shape))
    bits = np.zeros((count, 16), dtype=np.uint8)
    bits[:, 1:] = np.unpackbits(packed, count=count * 15).reshape(count, 15)
    return np.packbits(bits, axis=1).view(">u2").astype(np.uint16).reshape(shape)


def _common_prefix_len(prompts: NDArray[Any], offsets: NDArray[Any], system_id: NDArray[Any]) -> int:
    """How many leading tokens every request shares with the others of its system prompt."""
    first: dict[int, NDArray[Any]] = {}
    shortest = int(np.diff(offsets).min())
    for i, sid in enumerate(system_id.tolist()):
        prompt = prompts[offsets[i] : offsets[i + 1]]
        if sid not in first:
            first[sid] = prompt
            continue
        n = min(len(prompt), len(first[sid]))
        differ = np.flatnonzero(prompt[:n] != first[sid][:n])
        shortest = min(shortest, int(differ[0]) if len(differ) else n)
    return shortest


def pack(original: Arrays) -> Arrays:
    """The compact form of an original ``traces.npz``'s arrays (raises if they lack its structure)."""
    ops = np.asarray(original["w1_ops"], dtype=np.int32)
    is_alloc = ops[:, 0] == 1
    allocs, frees = ops[is_alloc], ops[~is_alloc]
    if not np.array_equal(allocs[:, 1], np.arange(len(allocs))) or not np.all(frees[:, 0] == 0):
        raise ValueError("w1_ops: allocation rows must number their sequences 0, 1, 2, ... in order")
    alloc_k = allocs[:, 2]
    in_range = alloc_k.min(initial=1) >= 1 and alloc_k.max(initial=1) <= 255
    if not in_range or not np.array_equal(frees[:, 2], alloc_k[frees[:, 1]]):
        raise ValueError("w1_ops: a free row's k must be the block count its sequence allocated (1..255)")

    prompts = original["w2_prompt_tokens"]
    offsets = original["w2_prompt_offsets"]
    system_id = original["w2_system_id"]
    num_systems = int(system_id.max()) + 1
    system_len = _common_prefix_len(prompts, offsets, system_id)
    systems = np.zeros((num_systems, system_len), dtype=prompts.dtype)
    seen = np.zeros(num_systems, dtype=bool)
    suffixes = []
    for i, sid in enumerate(system_id.tolist()):
        prompt = prompts[offsets[i] : offsets[i + 1]]
        if not seen[sid]:
            systems[sid], seen[sid] = prompt[:system_len], True
        elif not np.array_equal(systems[sid], prompt[:system_len]):
            raise ValueError(f"w2 request {i}: its first {system_len} tokens are not system prompt {sid}")
        suffixes.append(prompt[system_len:])
    return {
        "w1_is_alloc": is_alloc,
        "w1_alloc_k": alloc_k.astype(np.uint8),
        "w1_free_seq": frees[:, 1].astype(np.int32),
        _COMPACT_MARKER: systems,
        "w2_system_id": system_id,
        "w2_suffix_lens": np.array([len(s) for s in suffixes], dtype=np.int32),
        "w2_suffix_tokens": _pack15(np.concatenate(suffixes)),
        "w2_gen_tokens": _pack15(original["w2_gen_tokens"]),
        "w2_gen_shape": np.array(original["w2_gen_tokens"].shape, dtype=np.int64),
        "w2_offsets_dtype": np.array(str(offsets.dtype)),
        "meta": original["meta"],
    }


def unpack(compact: Arrays) -> Arrays:
    """The original arrays from their compact form (the inverse of :func:`pack`)."""
    is_alloc = compact["w1_is_alloc"]
    alloc_k = compact["w1_alloc_k"].astype(np.int32)
    free_seq = compact["w1_free_seq"]
    ops = np.zeros((len(is_alloc), 3), dtype=np.int32)
    ops[is_alloc, 0] = 1
    ops[is_alloc, 1] = np.arange(len(alloc_k), dtype=np.int32)
    ops[is_alloc, 2] = alloc_k
    ops[~is_alloc, 1] = free_seq
    ops[~is_alloc, 2] = alloc_k[free_seq]

    systems = compact[_COMPACT_MARKER]
    system_id = compact["w2_system_id"]
    suffix_lens = compact["w2_suffix_lens"].astype(np.int64)
    system_len = systems.shape[1]
    suffix_tokens = _unpack15(compact["w2_suffix_tokens"], (int(suffix_lens.sum()),))
    prompt_lens = suffix_lens + system_len
    offsets = np.zeros(len(prompt_lens) + 1, dtype=np.int64)
    np.cumsum(prompt_lens, out=offsets[1:])
    # Every prompt is [system prompt | suffix]: scatter both halves into place, no per-request loop.
    prompts = np.empty(int(offsets[-1]), dtype=suffix_tokens.dtype)
    system_starts = offsets[:-1]
    prompts[(system_starts[:, None] + np.arange(system_len)).ravel()] = systems[system_id].ravel()
    in_suffix = np.ones(len(prompts), dtype=bool)
    in_suffix[(system_starts[:, None] + np.arange(system_len)).ravel()] = False
    prompts[in_suffix] = suffix_tokens
    return {
        "w1_ops": ops,
        "w2_prompt_tokens": prompts,
        "w2_prompt_offsets": offsets.astype(str(compact["w2_offsets_dtype"])),
        "w2_gen_tokens": _unpack15(compact["w2_gen_tokens"], tuple(compact["w2_gen_shape"].tolist())),
        "w2_system_id": system_id,
        "meta": compact["meta"],
    }


def load_traces(path: Path = TRACES) -> Arrays:
    """The W1/W2 arrays under the original keys, from a compact or an original ``traces.npz``."""
    with np.load(path) as stored:
        arrays = {key: stored[key] for key in stored.files}
    return unpack(arrays) if _COMPACT_MARKER in arrays else arrays


def meta(path: Path = TRACES) -> dict[str, Any]:
    """The traces' metadata (pool sizes and counts), as a dict."""
    with np.load(path) as stored:
        decoded: dict[str, Any] = json.loads(str(stored["meta"]))
    return decoded


def mooncake_lines(path: Path = MOONCAKE_TRACE) -> Iterator[str]:
    """The lines of a Mooncake-format JSONL trace, xz-compressed (``.xz``) or plain."""
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        yield from (line for line in lines if line.strip())


def _pack_command(source: Path) -> int:
    original = load_traces(source)
    compact = pack(original)
    restored = unpack(compact)
    for key in ORIGINAL_KEYS:
        if restored[key].dtype != original[key].dtype or not np.array_equal(restored[key], original[key]):
            raise SystemExit(f"{key}: the compact form does not restore the original")
    DATA.mkdir(exist_ok=True)
    np.savez_compressed(TRACES, **compact)  # type: ignore[arg-type]
    print(f"wrote {TRACES} ({TRACES.stat().st_size:,} bytes) from {source} ({source.stat().st_size:,} bytes)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    packer = commands.add_parser("pack", help="rewrite bench/data/traces.npz from an original traces.npz")
    packer.add_argument("source", type=Path)
    args = parser.parse_args(argv)
    return _pack_command(args.source)


if __name__ == "__main__":
    sys.exit(main())
