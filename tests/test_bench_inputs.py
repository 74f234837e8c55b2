"""The benchmark inputs shipped in bench/data: the W1/W2 reference traces and the W3 trace with its
token expansion and never-evict ceiling (bench/traces.py, bench/w3.py).

Where the project's originals are present (``../shared/bench`` beside the clone) the shipped copies
are compared with them; elsewhere those tests skip and the digest and count checks still run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
import sys
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import traces  # noqa: E402
import w3  # noqa: E402

SHARED_TRACES = traces.SHARED_BENCH / "traces.npz"
SHARED_MOONCAKE = traces.SHARED_BENCH / "mooncake_synthetic.jsonl"
MOONCAKE_SHA256 = "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"
MASK64 = (1 << 64) - 1


def splitmix64_reference(x: int) -> int:
    """The rule exactly as bench/data/README.md and the reference README write it, in Python ints."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@pytest.fixture(scope="module")
def full_w3() -> w3.W3Trace:
    return w3.load_w3()


# --- W1 / W2 ----------------------------------------------------------------------------------------


@pytest.mark.skipif(not SHARED_TRACES.is_file(), reason="the original traces (../shared/bench) are not present")
@pytest.mark.parametrize("key", traces.ORIGINAL_KEYS)
def test_shipped_traces_restore_the_original_array(key: str) -> None:
    shipped = traces.load_traces()[key]
    with np.load(SHARED_TRACES) as original:
        expected = original[key]
    assert shipped.dtype == expected.dtype
    assert shipped.shape == expected.shape
    assert np.array_equal(shipped, expected)


def test_shipped_traces_match_their_own_metadata() -> None:
    arrays = traces.load_traces()
    meta = traces.meta()
    ops = arrays["w1_ops"]
    assert len(ops) == meta["w1"]["n_main_ops"] + meta["w1"]["n_drain_ops"]
    assert int(ops[ops[:, 0] == 1, 2].sum()) == meta["w1"]["blocks_allocated"] == 3_279_954
    assert len(arrays["w2_prompt_offsets"]) == meta["w2"]["n_requests"] + 1
    assert int(arrays["w2_prompt_offsets"][-1]) == len(arrays["w2_prompt_tokens"]) == 4_365_010
    assert arrays["w2_gen_tokens"].shape == (meta["w2"]["n_requests"], meta["w2"]["gen_len"])


def test_the_compact_form_unpacks_and_packs_back_to_itself() -> None:
    with np.load(traces.TRACES) as stored:
        compact = {key: stored[key] for key in stored.files}
    repacked = traces.pack(traces.unpack(compact))
    assert sorted(repacked) == sorted(compact)
    for key, array in compact.items():
        assert repacked[key].dtype == array.dtype, key
        assert np.array_equal(repacked[key], array), key


def test_load_traces_reads_the_original_format_too(tmp_path: Path) -> None:
    arrays = traces.load_traces()
    original = tmp_path / "traces.npz"
    np.savez(original, **arrays)  # type: ignore[arg-type]
    reread = traces.load_traces(original)
    assert all(np.array_equal(reread[key], arrays[key]) for key in traces.ORIGINAL_KEYS)


def test_pack_refuses_w1_ops_whose_free_rows_lack_the_block_count() -> None:
    arrays = traces.load_traces()
    ops = arrays["w1_ops"].copy()
    first_free = int(np.flatnonzero(ops[:, 0] == 0)[0])
    ops[first_free, 2] += 1
    with pytest.raises(ValueError, match="free row's k"):
        traces.pack({**arrays, "w1_ops": ops})


# --- W3 input -----------------------------------------------------------------------------------------


def test_shipped_mooncake_trace_is_the_published_file() -> None:
    with lzma.open(traces.MOONCAKE_TRACE) as compressed:
        assert hashlib.sha256(compressed.read()).hexdigest() == MOONCAKE_SHA256


@pytest.mark.skipif(not SHARED_MOONCAKE.is_file(), reason="the original trace (../shared/bench) is not present")
def test_shipped_mooncake_trace_equals_the_projects_copy() -> None:
    with lzma.open(traces.MOONCAKE_TRACE) as compressed:
        assert compressed.read() == SHARED_MOONCAKE.read_bytes()


def test_mooncake_licence_and_attribution_ship_with_the_trace() -> None:
    notes = (BENCH / "data" / "README.md").read_text()
    assert "kvcache-ai/Mooncake" in notes and "Apache License, Version 2.0" in notes and MOONCAKE_SHA256 in notes
    assert "Apache License" in (BENCH / "data" / "LICENSE-Apache-2.0.txt").read_text()


# --- W3 expansion -------------------------------------------------------------------------------------


def test_splitmix64_matches_the_rule_in_python_integers() -> None:
    xs = [0, 1, 511, 2**40, 2**40 + 3 * 2**20 + 7, 2**63 + 12345, MASK64]
    got = w3.splitmix64(np.array(xs, dtype=np.uint64)).tolist()
    assert got == [splitmix64_reference(x) for x in xs]
    assert got[0] == 0xE220A8397B1DCDAF  # splitmix64's well-known first output from state 0


def test_prompt_tokens_are_the_chunks_tokens_cut_to_the_input_length() -> None:
    record = {"input_length": 600, "output_length": 3, "hash_ids": [7, 2]}
    trace = w3.expand([record])
    prompt = trace.prompt(0)
    assert len(prompt) == 600
    expected = [splitmix64_reference(7 * 512 + j) % 32_000 for j in range(512)]
    expected += [splitmix64_reference(2 * 512 + j) % 32_000 for j in range(88)]
    assert prompt.dtype == np.int32 and prompt.tolist() == expected


def test_generated_tokens_follow_the_request_number() -> None:
    records = [
        {"input_length": 5, "output_length": 2, "hash_ids": [0]},
        {"input_length": 5, "output_length": 4, "hash_ids": [0]},
    ]
    trace = w3.expand(records)
    assert trace.generated(1).tolist() == [splitmix64_reference(2**40 + 1 * 2**20 + j) % 32_000 for j in range(4)]
    assert len(trace.tokens[1]) == 9 and trace.prompt_lens == [5, 5] and trace.gen_lens == [2, 4]


def test_expand_refuses_an_input_length_beyond_its_chunks() -> None:
    with pytest.raises(ValueError, match="input_length 1025"):
        w3.expand([{"input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}])


def test_a_limited_load_is_the_start_of_the_whole_trace(full_w3: w3.W3Trace) -> None:
    head = w3.load_w3(limit=40)
    assert head.num_requests == 40
    assert all(np.array_equal(head.tokens[i], full_w3.tokens[i]) for i in range(40))


def test_full_trace_has_the_published_size(full_w3: w3.W3Trace) -> None:
    assert full_w3.num_requests == w3.REFERENCE_REQUESTS
    assert full_w3.prompt_tokens == w3.REFERENCE_PROMPT_TOKENS
    assert sum(full_w3.gen_lens) == 595_432
    assert (full_w3.block_size, full_w3.num_blocks, full_w3.max_live) == (16, 262_144, 32)


def test_load_w3_reads_a_plain_jsonl_file(tmp_path: Path) -> None:
    plain = tmp_path / "trace.jsonl"
    plain.write_text("\n".join(json.dumps({"input_length": 20, "output_length": 1, "hash_ids": [i]}) for i in range(3)))
    trace = w3.load_w3(plain)
    assert trace.num_requests == 3 and trace.chunk_ids == [[0], [1], [2]]


# --- W3 never-evict ceiling ---------------------------------------------------------------------------


def token_trie_hits(trace: w3.W3Trace) -> NDArray[np.int64]:
    """The ceiling the slow, obvious way: a trie keyed on every block's actual tokens."""
    children: dict[tuple[int, bytes], int] = {}
    bs = trace.block_size
    hits = np.zeros(trace.num_requests, dtype=np.int64)
    for i in range(trace.num_requests):
        if i >= trace.max_live:
            finished = i - trace.max_live
            node, tokens = -1, trace.tokens[finished]
            for b in range(trace.full_blocks(finished)):
                node = children.setdefault((node, tokens[b * bs : (b + 1) * bs].tobytes()), len(children))
        node, tokens = -1, trace.tokens[i]
        for b in range(trace.reusable_blocks(i)):
            found = children.get((node, tokens[b * bs : (b + 1) * bs].tobytes()))
            if found is None:
                break
            node = found
            hits[i] += bs
    return hits


def test_ceiling_equals_a_token_trie_on_the_first_requests() -> None:
    head = w3.load_w3(limit=500)
    hits = w3.never_evict_hits(head)
    assert hits.sum() > 0
    assert np.array_equal(hits, token_trie_hits(head))


def test_ceiling_counts_a_repeated_prompt_up_to_its_last_block() -> None:
    prompt = {"input_length": 1000, "output_length": 10, "hash_ids": [5, 6]}
    trace = dataclasses.replace(w3.expand([prompt, prompt]), max_live=1)
    assert w3.never_evict_hits(trace).tolist() == [0, (999 // 16) * 16]


def test_ceiling_sees_nothing_from_requests_still_live() -> None:
    prompt = {"input_length": 1000, "output_length": 10, "hash_ids": [5, 6]}
    assert w3.never_evict_hits(w3.expand([prompt, prompt])).tolist() == [0, 0]  # max_live 32: both live


def test_distinct_chunk_paths_expand_to_distinct_blocks(full_w3: w3.W3Trace) -> None:
    """The premise of the ceiling's chunk-level bookkeeping: no two blocks of different chunks (or
    at different positions), and no block holding a generated token, have the same tokens."""
    bs = full_w3.block_size
    chunk_ids = np.unique(np.fromiter((h for ids in full_w3.chunk_ids for h in ids), dtype=np.int64))
    blocks = [w3.chunk_tokens(chunk_ids).reshape(-1, bs)]
    for i in range(full_w3.num_requests):
        first = full_w3.prompt_lens[i] // bs
        blocks.append(full_w3.tokens[i][first * bs : full_w3.full_blocks(i) * bs].reshape(-1, bs))
    rows = np.ascontiguousarray(np.concatenate(blocks)).view(np.uint64)  # two tokens per word
    # Distinct 64-bit digests imply distinct rows.
    digest = np.zeros(len(rows), dtype=np.uint64)
    for column in range(rows.shape[1]):
        digest = w3.splitmix64(digest ^ rows[:, column])
    assert len(np.unique(digest)) == len(rows)


def test_full_trace_ceiling(full_w3: w3.W3Trace) -> None:
    hit_tokens = w3.never_evict_hit_tokens(full_w3)
    assert hit_tokens == 39_539_184  # 64.61% of the prompt tokens (checked once against token_trie_hits)
