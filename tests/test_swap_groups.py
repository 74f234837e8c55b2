"""Swap records of a model of KV cache groups (format 2.0, docs/swap-format.md): every group's held
blocks and where it holds them, the window state, restored in one all-or-nothing core call."""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from lifecycle import HybridModel
from lifecycle.config import (
    AttentionLayer,
    ChunkedLocalLayer,
    IndexerLayer,
    MLALayer,
    ModelConfig,
    SlidingWindowLayer,
)
from lifecycle.errors import OutOfBlocks, SwapChecksumError, SwapFormatError, SwapModelMismatch
from lifecycle.sequence import SequenceState
from lifecycle.swap import GROUPED_MAJOR, HEADER_BYTES, parse_header, record_nbytes
from lifecycle.swap.tier import SwapTier

BLOCK = 4
FULL = AttentionLayer(num_kv_heads=2, head_dim=8)
SWA = SlidingWindowLayer(num_kv_heads=2, head_dim=8, window=16)
SWA_F32 = SlidingWindowLayer(num_kv_heads=1, head_dim=8, window=16, dtype="float32")
CHUNK = ChunkedLocalLayer(num_kv_heads=2, head_dim=8, chunk_size=16)


def config(layers: tuple[Any, ...] = (SWA, FULL, SWA_F32), **overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "layers": layers,
        "block_size": BLOCK,
        "num_blocks": (64, 32),
        "max_seqs": 6,
        "max_model_len": 256,
        "name": "swap-groups",
    }
    fields.update(overrides)
    return ModelConfig(**fields)


def opened(cfg: ModelConfig) -> HybridModel:
    """A host model of ``cfg`` whose every KV page holds random non-zero bytes."""
    model = HybridModel(cfg, "host")
    rng = np.random.default_rng(31)
    for pool in model.kv_pools:
        for layer in range(pool.num_layers):
            view = pool.kv_view(layer)
            assert isinstance(view, np.ndarray)
            view.view(np.uint8)[...] = rng.integers(1, 256, size=view.view(np.uint8).shape, dtype=np.uint8)
    return model


@pytest.fixture
def model() -> Iterator[HybridModel]:
    m = opened(config())
    yield m
    m.teardown()


def prefilled(model: HybridModel, tokens: int, start: int = 0) -> SequenceState:
    """A sequence of ``tokens`` prompt tokens whose KV is computed (each window released)."""
    seq = model.alloc_sequence_for(tokens + 32)
    prompt = np.arange(start, start + tokens, dtype=np.int32)
    model.attach_prefix(seq, prompt, grow_to=tokens)
    model.core.append(seq.handle, prompt[:0])
    return seq


def decode(model: HybridModel, seq: SequenceState, steps: int) -> None:
    for token in range(steps):
        model.grow(seq, seq.num_tokens + 1)
        seq.append_tokens([1000 + token])


def saved(model: HybridModel, seq: SequenceState) -> bytes:
    out = io.BytesIO()
    model.save_sequence_state(seq, out)
    return out.getvalue()


def pages(model: HybridModel, seq: SequenceState) -> list[bytes]:
    """Per group and layer, the bytes of the blocks the sequence holds, in table order."""
    out = []
    for group, pool in enumerate(model.kv_pools):
        table = model.block_table(seq, group)
        for layer in range(pool.num_layers):
            view = pool.kv_view(layer)
            assert isinstance(view, np.ndarray)
            out.append(view[table[table >= 0]].tobytes())
    return out


def state(model: HybridModel, seq: SequenceState) -> tuple[Any, ...]:
    """What a restore must reproduce: tokens, prompt length, each group's -1 entries, the window state."""
    holes = tuple(tuple(np.flatnonzero(model.block_table(seq, g) < 0)) for g in range(len(model.kv_pools)))
    return (seq.tokens.tolist(), seq.prompt_len, seq.num_blocks, holes, model.core.kv_tokens(seq.handle))


def counts(model: HybridModel) -> list[tuple[int, int, int]]:
    return [(g["num_free"], g["num_blocks"], g["num_cached"]) for g in model.group_stats()]


def restored(model: HybridModel, seq: SequenceState, record: bytes) -> SequenceState:
    target = model.alloc_sequence_for(seq.num_tokens + 32)
    model.restore_sequence_state(target, seq.num_blocks, io.BytesIO(record))
    return target


def assert_refused(model: HybridModel, record: bytes, num_blocks: int, error: type[Exception], match: str) -> None:
    """The restore is refused with ``error`` and changes nothing: pools, the target, invariants."""
    target = model.alloc_sequence_for(num_blocks * BLOCK)
    before = counts(model)
    with pytest.raises(error, match=match):
        model.restore_sequence_state(target, num_blocks, io.BytesIO(record))
    assert counts(model) == before
    assert (target.num_blocks, target.num_tokens) == (0, 0)
    model.check_invariants()
    model.free_sequence(target)


# -- round trips --------------------------------------------------------------------------------


def test_a_grouped_record_is_format_two_with_every_groups_held_blocks(model: HybridModel) -> None:
    seq = prefilled(model, 40)
    record = saved(model, seq)
    header = parse_header(record[:HEADER_BYTES])
    held = int(np.count_nonzero(model.block_table(seq, 1) >= 0))
    assert (header.major, header.num_groups, header.kv_tokens) == (GROUPED_MAJOR, 2, 40)
    assert 0 < held < seq.num_blocks  # the window moved: the record skips what group 1 released
    assert len(record) == record_nbytes(model.config, seq.num_blocks, seq.num_tokens, held=[held])


def test_a_round_trip_after_the_window_moved_restores_every_groups_bytes_tables_and_window(
    model: HybridModel,
) -> None:
    seq = prefilled(model, 40)
    decode(model, seq, 5)
    target = restored(model, seq, saved(model, seq))
    assert state(model, target) == state(model, seq)
    assert pages(model, target) == pages(model, seq)
    model.check_invariants()


def test_a_chunked_local_group_round_trips() -> None:
    m = opened(config((CHUNK, FULL)))
    try:
        seq = prefilled(m, 38)
        assert m.block_table(seq, 1)[0] == -1  # the first chunk was released
        target = restored(m, seq, saved(m, seq))
        assert state(m, target) == state(m, seq)
        assert pages(m, target) == pages(m, seq)
        m.check_invariants()
    finally:
        m.teardown()


def test_a_restored_sequence_decodes_as_the_saved_one_does(model: HybridModel) -> None:
    seq = prefilled(model, 37)
    target = restored(model, seq, saved(model, seq))
    decode(model, seq, 9)
    decode(model, target, 9)
    assert state(model, target)[2:] == state(model, seq)[2:]  # the same blocks released at the same steps
    model.check_invariants()


def test_a_freed_restored_sequence_gives_every_groups_blocks_back(model: HybridModel) -> None:
    seq = prefilled(model, 40)
    record = saved(model, seq)
    before = counts(model)
    target = restored(model, seq, record)
    model.free_sequence(target)
    assert counts(model) == before
    model.check_invariants()


def test_a_record_without_checkpoints_holds_only_the_window(model: HybridModel) -> None:
    assert model.core.retention_interval > 64  # no checkpoint below 64 tokens
    seq = prefilled(model, 64)
    held = np.flatnonzero(model.block_table(seq, 1) >= 0)
    target = restored(model, seq, saved(model, seq))
    assert np.array_equal(np.flatnonzero(model.block_table(target, 1) >= 0), held)
    assert len(held) <= SWA.window // BLOCK + 1


def test_the_window_before_a_checkpoint_is_kept_in_the_record() -> None:
    m = opened(config(num_blocks=(2100, 48), max_model_len=8192))
    try:
        interval = m.core.retention_interval
        seq = prefilled(m, 16)
        for _ in range(interval // 16 + 2):  # in chunks, as a long prefill goes: the window releases as it moves
            m.grow(seq, seq.num_tokens + 16)
            seq.append_tokens(np.arange(16, dtype=np.int32))
        kept = np.flatnonzero(m.block_table(seq, 1) >= 0)
        assert kept[0] < (interval - SWA.window) // BLOCK + 1 < kept[-1]  # below the live window: kept
        target = restored(m, seq, saved(m, seq))
        assert state(m, target) == state(m, seq)
        assert pages(m, target) == pages(m, seq)
        m.check_invariants()
    finally:
        m.teardown()


def test_a_file_round_trip(model: HybridModel, tmp_path: Path) -> None:
    seq = prefilled(model, 40)
    path = tmp_path / "seq.rec"
    with open(path, "wb") as file:
        model.save_sequence_state(seq, file)
    target = model.alloc_sequence_for(72)
    with open(path, "rb") as file:
        model.restore_sequence_state(target, seq.num_blocks, file)
    assert pages(model, target) == pages(model, seq)
    assert state(model, target) == state(model, seq)


def test_mla_and_indexer_pages_round_trip_beside_a_window_group() -> None:
    layers = (MLALayer(kv_lora_rank=16, qk_rope_head_dim=4), IndexerLayer(head_dim=8), SWA)
    m = opened(config(layers))
    try:
        seq = prefilled(m, 40)
        target = restored(m, seq, saved(m, seq))
        assert pages(m, target) == pages(m, seq)
        assert state(m, target) == state(m, seq)
        m.check_invariants()
    finally:
        m.teardown()


def test_a_full_group_of_mla_layers_alone_round_trips() -> None:
    m = opened(config((MLALayer(kv_lora_rank=16, qk_rope_head_dim=4),), num_blocks=32))
    try:
        seq = prefilled(m, 21)
        record = saved(m, seq)
        assert parse_header(record[:HEADER_BYTES]).num_groups == 1
        target = restored(m, seq, record)
        assert pages(m, target) == pages(m, seq)
    finally:
        m.teardown()


# -- refusals -----------------------------------------------------------------------------------


def test_a_group_short_of_blocks_refuses_the_restore_naming_it() -> None:
    m = opened(config(num_blocks=(64, 16)))
    try:
        seq = prefilled(m, 40)
        record = saved(m, seq)
        hogs: list[SequenceState] = []  # held until the teardown
        while m.core.group_pools[1].num_free >= 4:
            hogs.append(prefilled(m, 16, start=500 + 16 * len(hogs)))  # a window of 4 blocks each
        assert m.core.group_pools[0].num_free >= seq.num_blocks  # group 0 has room, group 1 not
        assert_refused(m, record, seq.num_blocks, OutOfBlocks, "4 blocks of KV cache group 1 are needed")
    finally:
        m.teardown()


def test_a_record_of_another_config_is_refused(model: HybridModel) -> None:
    other = opened(config((SlidingWindowLayer(2, 8, window=32), FULL, SlidingWindowLayer(1, 8, 32, dtype="float32"))))
    try:
        seq = prefilled(other, 40)
        record, num_blocks = saved(other, seq), seq.num_blocks
    finally:
        other.teardown()
    assert_refused(model, record, num_blocks, SwapModelMismatch, "fingerprint")


def test_a_corrupted_window_page_is_refused_and_every_group_given_back(model: HybridModel) -> None:
    seq = prefilled(model, 40)
    record = bytearray(saved(model, seq))
    record[-40] ^= 0x01  # in the last KV section: group 1's second layer
    assert_refused(model, bytes(record), seq.num_blocks, SwapChecksumError, "kv group 1 layer 1")


def reseal_meta(record: bytes, edit: Any) -> bytes:
    """``record`` with its meta section changed by ``edit(bytearray)`` and its checksum recomputed."""
    meta_bytes = parse_header(record[:HEADER_BYTES]).meta_bytes
    meta = bytearray(record[HEADER_BYTES : HEADER_BYTES + meta_bytes])
    edit(meta)
    seal = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(meta), 1))
    return record[:HEADER_BYTES] + bytes(meta) + seal + record[HEADER_BYTES + meta_bytes + 8 :]


def test_positions_out_of_order_are_refused(model: HybridModel) -> None:
    seq = prefilled(model, 40)
    record = saved(model, seq)

    def swap_last_two(meta: bytearray) -> None:
        meta[-8:] = meta[-4:] + meta[-8:-4]

    assert_refused(model, reseal_meta(record, swap_last_two), seq.num_blocks, SwapFormatError, "ascend")


def test_a_one_group_model_refuses_a_grouped_record_by_its_version(model: HybridModel) -> None:
    seq = prefilled(model, 8)
    record = saved(model, seq)
    plain = HybridModel(config((FULL,), num_blocks=32), "host")
    try:
        assert_refused(plain, record, seq.num_blocks, SwapFormatError, r"version 2\.0 is not supported by this model")
    finally:
        plain.teardown()


# -- the swap tier ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["host", "file"])
def test_the_swap_tier_swaps_a_grouped_sequence_out_and_back(
    model: HybridModel, tmp_path: Path, where: str
) -> None:
    seq = prefilled(model, 40)
    decode(model, seq, 3)
    expected, image = state(model, seq), pages(model, seq)
    empty = counts(model)
    with SwapTier(model, host_bytes=1 << 20 if where == "host" else 0, spill_dir=tmp_path) as tier:
        handle = tier.swap_out(seq)
        assert handle.location == where
        assert [g["num_free"] for g in model.group_stats()] == [64, 32]
        back = tier.swap_in(handle)
    assert state(model, back) == expected
    assert pages(model, back) == image
    assert counts(model) == empty
    model.check_invariants()


def test_the_cores_allocate_refuses_positions_that_do_not_ascend_within_the_table(model: HybridModel) -> None:
    from lifecycle.errors import InvalidId

    seq = model.alloc_sequence_for(40)
    before = counts(model)
    with pytest.raises(InvalidId, match=r"held\[0\] must hold ascending positions in \[0, 10\)"):
        model.core.allocate(seq.handle, 10, "restore", [np.array([3, 2])], 0)
    with pytest.raises(InvalidId, match=r"held\[0\] must hold ascending positions in \[0, 10\)"):
        model.core.allocate(seq.handle, 10, "restore", [np.array([9, 10])], 0)
    assert counts(model) == before and seq.num_blocks == 0
    model.check_invariants()


def test_the_cores_allocate_refuses_positions_missing_what_the_window_still_reads(model: HybridModel) -> None:
    from lifecycle.errors import InvalidId

    seq = model.alloc_sequence_for(40)
    before = counts(model)
    # A 16-token window over blocks of 4: at 40 tokens it reads blocks 6 to 9.
    with pytest.raises(InvalidId, match=r"held\[0\] lacks blocks KV cache group 1 still reads at kv_tokens=40: "
                                        r"it needs positions \[0, 0\) and \[6, 10\), got \[7, 8, 9\]"):
        model.core.allocate(seq.handle, 10, "restore", [np.array([7, 8, 9])], 40)
    assert counts(model) == before and seq.num_blocks == 0
    model.core.allocate(seq.handle, 10, "restore", [np.array([6, 7, 8, 9])], 40)
    assert model.core.block_table(seq.handle, 1).tolist()[:6] == [-1] * 6
    model.check_invariants()
    model.free_sequence(seq)
    assert counts(model) == before
