"""SwapTier: preemption to a bounded host pool or spill files, and back (SPEC §8 scenario 15).

Every test ends with the model's free blocks and live sequences back where they started and
``check_invariants()`` clean; spill files never outlive their record.
"""

from __future__ import annotations

import importlib
import io
import sys
from pathlib import Path

import numpy as np
import pytest

from lifecycle.errors import (
    CudaError,
    InvalidId,
    OutOfBlocks,
    PoolExhausted,
    SequenceStateError,
    SwapChecksumError,
    SwapError,
    SwapModelMismatch,
    TornDown,
)
from lifecycle.model import HybridModel
from lifecycle.sequence import SequenceState
from lifecycle.swap import record_nbytes
from lifecycle.swap.tier import DEFAULT_HOST_BYTES, SwapHandle, SwapTier
from devices import CUDA_ERROR_LAUNCH_FAILED, Emulator, device, emu  # noqa: F401  (shared fixtures)
from swap_helpers import BS, model, fill_sequence, kv_image, slot_image, swap_config  # noqa: F401  (model: a fixture)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def test_the_old_module_name_still_imports_the_swap_tier_and_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "lifecycle.swap_tier", raising=False)
    with pytest.warns(DeprecationWarning, match=r"swap_tier is deprecated: import from lifecycle\.swap\.tier"):
        old = importlib.import_module("lifecycle.swap_tier")
    assert old.SwapTier is SwapTier and old.SwapHandle is SwapHandle
    assert old.DEFAULT_HOST_BYTES == DEFAULT_HOST_BYTES


def filled(model: HybridModel, rng: np.random.Generator, num_tokens: int = 9) -> SequenceState:
    seq = model.alloc_sequence()
    fill_sequence(model, seq, num_tokens, rng)
    model.check_invariants()
    return seq


def image(model: HybridModel, seq: SequenceState) -> tuple[object, ...]:
    return (kv_image(model, seq), slot_image(model, seq.slot_idx), seq.tokens.tolist(), seq.prompt_len)


def record_size(model: HybridModel, seq: SequenceState) -> int:
    return record_nbytes(model.config, seq.num_blocks, seq.num_tokens)


def test_swap_out_to_host_frees_the_sequence_and_swap_in_restores_it(
    model: HybridModel, rng: np.random.Generator
) -> None:
    free, live = model.num_free_blocks(), model.num_live_sequences
    tier = SwapTier(model, host_bytes=1 << 20)
    seq = filled(model, rng)
    expected, size = image(model, seq), record_size(model, seq)
    handle = tier.swap_out(seq)
    model.check_invariants()
    assert seq.is_freed and model.num_free_blocks() == free and model.num_live_sequences == live
    assert (handle.location, handle.nbytes, handle.num_tokens) == ("host", size, 9)
    assert tier.host_bytes_used >= handle.nbytes
    back = tier.swap_in(handle)
    model.check_invariants()
    assert image(model, back) == expected
    assert (tier.host_bytes_used, tier.num_swapped_out) == (0, 0)
    model.free_sequence(back)
    assert model.num_free_blocks() == free


def test_host_memory_is_reused_after_swap_in(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng)
    tier = SwapTier(model, host_bytes=record_size(model, seq) + 64)
    for _ in range(3):
        seq = tier.swap_in(tier.swap_out(seq))
        model.check_invariants()
    model.free_sequence(seq)


def test_records_that_do_not_fit_in_host_memory_spill_to_files(
    model: HybridModel, rng: np.random.Generator, tmp_path: Path
) -> None:
    first, second = filled(model, rng), filled(model, rng, 13)
    expected = image(model, second)
    tier = SwapTier(model, host_bytes=record_size(model, first) + 64, spill_dir=tmp_path)
    in_host, spilled = tier.swap_out(first), tier.swap_out(second)
    model.check_invariants()
    assert (in_host.location, spilled.location) == ("host", "file")
    assert spilled.path is not None and spilled.path.parent == tmp_path
    assert spilled.path.stat().st_size == spilled.nbytes
    back = tier.swap_in(spilled)
    assert image(model, back) == expected
    assert list(tmp_path.iterdir()) == []
    model.free_sequence(back)
    model.free_sequence(tier.swap_in(in_host))
    model.check_invariants()


def test_swap_out_without_room_raises_and_leaves_the_sequence_live(
    model: HybridModel, rng: np.random.Generator
) -> None:
    seq = filled(model, rng)
    tier = SwapTier(model, host_bytes=record_size(model, seq) - 1)
    free, before = model.num_free_blocks(), image(model, seq)
    with pytest.raises(PoolExhausted, match=f"needs {record_size(model, seq)} bytes.*no spill_dir"):
        tier.swap_out(seq)
    model.check_invariants()
    assert not seq.is_freed and model.num_free_blocks() == free and image(model, seq) == before
    assert tier.num_swapped_out == 0
    model.free_sequence(seq)


def test_a_failed_swap_out_frees_the_sequence_and_loses_no_blocks(
    model: HybridModel, rng: np.random.Generator, tmp_path: Path
) -> None:
    free, live = model.num_free_blocks(), model.num_live_sequences
    seq = filled(model, rng)
    spill = tmp_path / "spill"
    spill.mkdir()
    tier = SwapTier(model, host_bytes=0, spill_dir=spill)
    spill.rmdir()  # the spill file cannot be created
    with pytest.raises(FileNotFoundError):
        tier.swap_out(seq)
    model.check_invariants()
    assert seq.is_freed and model.num_free_blocks() == free and model.num_live_sequences == live
    assert tier.num_swapped_out == 0


def test_a_device_error_during_swap_out_frees_the_sequence(
    model: HybridModel, rng: np.random.Generator, emu: Emulator
) -> None:
    free, live = model.num_free_blocks(), model.num_live_sequences
    seq = filled(model, rng)
    tier = SwapTier(model, host_bytes=1 << 20)
    emu.fail_call("cuMemcpyDtoHAsync", CUDA_ERROR_LAUNCH_FAILED)
    with pytest.raises(CudaError, match="cuMemcpyDtoHAsync"):
        tier.swap_out(seq)
    emu.reset()
    model.check_invariants()
    assert seq.is_freed and model.num_free_blocks() == free and model.num_live_sequences == live
    assert (tier.num_swapped_out, tier.host_bytes_used) == (0, 0)


def test_a_detached_retired_sequence_whose_save_fails_is_dropped_and_its_slot_kept_by_the_survivor(
    model: HybridModel, rng: np.random.Generator
) -> None:
    # Scenario 1: a survivor is compacted into a retired sequence's slot; the retired one's
    # swap-out save then fails (it is detached) and the tier frees it: the slot stays the survivor's.
    free, live = model.num_free_blocks(), model.num_live_sequences
    retired, survivor = filled(model, rng), filled(model, rng)
    survivor_state = image(model, survivor)
    model.retire_sequence(retired)
    model.compact_sequence(survivor, retired.slot_idx)
    assert retired.is_detached
    tier = SwapTier(model, host_bytes=1 << 20)
    with pytest.raises(SequenceStateError, match="detached"):
        tier.swap_out(retired)
    model.check_invariants()
    assert retired.is_freed and tier.host_bytes_used == 0
    assert image(model, survivor) == survivor_state
    model.free_sequence(survivor)
    model.check_invariants()
    assert model.num_free_blocks() == free and model.num_live_sequences == live


def test_a_failed_swap_in_frees_the_new_sequence_and_removes_the_spill_file(
    model: HybridModel, rng: np.random.Generator, tmp_path: Path
) -> None:
    tier = SwapTier(model, host_bytes=0, spill_dir=tmp_path)
    handle = tier.swap_out(filled(model, rng))
    assert handle.path is not None
    data = bytearray(handle.path.read_bytes())
    data[-3] ^= 0x40  # inside the last section's checksum
    handle.path.write_bytes(bytes(data))
    free, live = model.num_free_blocks(), model.num_live_sequences
    with pytest.raises(SwapChecksumError):
        tier.swap_in(handle)
    model.check_invariants()
    assert model.num_free_blocks() == free and model.num_live_sequences == live
    assert list(tmp_path.iterdir()) == [] and tier.num_swapped_out == 0


def test_a_failed_swap_in_releases_the_host_record(model: HybridModel, rng: np.random.Generator) -> None:
    tier = SwapTier(model, host_bytes=1 << 20)
    handle = tier.swap_out(filled(model, rng))
    tier._host.view(handle.nbytes - 3, 1)[0] ^= 0x40  # inside the last section's checksum
    free, live = model.num_free_blocks(), model.num_live_sequences
    with pytest.raises(SwapChecksumError):
        tier.swap_in(handle)
    model.check_invariants()
    assert model.num_free_blocks() == free and model.num_live_sequences == live
    assert (tier.host_bytes_used, tier.num_swapped_out) == (0, 0)


def test_a_swap_in_short_of_blocks_is_refused_and_the_handle_stays_live(
    model: HybridModel, rng: np.random.Generator
) -> None:
    tier = SwapTier(model, host_bytes=1 << 20)
    seq = filled(model, rng)
    expected = image(model, seq)
    handle = tier.swap_out(seq)
    hog = model.alloc_sequence()
    model.grow(hog, model.num_free_blocks() * BS)
    free, live, used = model.num_free_blocks(), model.num_live_sequences, tier.host_bytes_used
    with pytest.raises(OutOfBlocks, match=f"needs {handle.num_blocks} blocks, {free} of 48 are free"):
        tier.swap_in(handle)
    model.check_invariants()
    assert model.num_free_blocks() == free and model.num_live_sequences == live
    assert (tier.host_bytes_used, tier.num_swapped_out) == (used, 1)
    model.free_sequence(hog)
    back = tier.swap_in(handle)
    assert image(model, back) == expected
    model.free_sequence(back)
    model.check_invariants()


def test_swap_in_evicts_cached_prefix_blocks_to_make_room(model: HybridModel, rng: np.random.Generator) -> None:
    tier = SwapTier(model, host_bytes=1 << 20)
    handle = tier.swap_out(filled(model, rng))
    cached = model.alloc_sequence()
    model.grow(cached, model.num_free_blocks() * BS)
    cached.append_tokens(np.arange(1, model.num_total_blocks() * BS + 1))
    model.cache_sequence(cached)
    model.free_sequence(cached)  # every block is now held by the prefix cache alone
    assert model.num_free_blocks() == 0
    back = tier.swap_in(handle)
    model.check_invariants()
    assert back.num_blocks == handle.num_blocks and model.stats().blocks_evicted >= handle.num_blocks
    model.free_sequence(back)


def test_a_handle_is_consumed_once(model: HybridModel, rng: np.random.Generator) -> None:
    tier = SwapTier(model, host_bytes=1 << 20)
    handle = tier.swap_out(filled(model, rng))
    model.free_sequence(tier.swap_in(handle))
    with pytest.raises(SwapError, match="not live in this tier"):
        tier.swap_in(handle)
    with pytest.raises(SwapError, match="not live in this tier"):
        tier.discard(handle)
    model.check_invariants()


def test_discard_drops_the_record_and_its_spill_file(
    model: HybridModel, rng: np.random.Generator, tmp_path: Path
) -> None:
    tier = SwapTier(model, host_bytes=0, spill_dir=tmp_path)
    handle = tier.swap_out(filled(model, rng))
    tier.discard(handle)
    assert list(tmp_path.iterdir()) == [] and tier.num_swapped_out == 0


def test_close_removes_every_spill_file_and_refuses_later_swap_outs(
    model: HybridModel, rng: np.random.Generator, tmp_path: Path
) -> None:
    seq = filled(model, rng)
    with SwapTier(model, host_bytes=0, spill_dir=tmp_path) as tier:
        tier.swap_out(filled(model, rng))
        tier.swap_out(filled(model, rng))
        assert len(tier.spill_files) == 2
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TornDown):
        tier.swap_out(seq)
    assert not seq.is_freed
    model.free_sequence(seq)


def test_host_extents_coalesce_so_a_large_record_fits_again(model: HybridModel, rng: np.random.Generator) -> None:
    small = [filled(model, rng, 4) for _ in range(3)]
    size = record_size(model, small[0])
    tier = SwapTier(model, host_bytes=3 * (-(-size // 64) * 64))
    handles = [tier.swap_out(seq) for seq in small]
    for handle in (handles[0], handles[2], handles[1]):  # the middle one last: both neighbours free
        tier.discard(handle)
    big = filled(model, rng, 20)
    assert record_size(model, big) <= tier.host_bytes
    model.free_sequence(tier.swap_in(tier.swap_out(big)))
    model.check_invariants()


def test_bad_arguments_are_refused(model: HybridModel, tmp_path: Path) -> None:
    with pytest.raises(InvalidId, match="host_bytes=-1"):
        SwapTier(model, host_bytes=-1)
    with pytest.raises(InvalidId, match="is not a directory"):
        SwapTier(model, spill_dir=tmp_path / "missing")


def test_swap_in_rebinds_the_same_adapter(model: HybridModel, rng: np.random.Generator) -> None:
    slot = model.load_adapter("sql-helper")
    seq = model.alloc_sequence()
    model.bind_adapter(seq, slot)
    fill_sequence(model, seq, 6, rng)
    tier = SwapTier(model, host_bytes=1 << 20)
    handle = tier.swap_out(seq)
    assert handle.adapter == ("sql-helper", 1)
    back = tier.swap_in(handle)
    assert model.adapter_info(back.adapter_slot).name == "sql-helper"
    model.free_sequence(back)
    model.check_invariants()


def test_swap_in_after_the_adapter_was_reloaded_is_refused(model: HybridModel, rng: np.random.Generator) -> None:
    seq = model.alloc_sequence()
    model.bind_adapter(seq, model.load_adapter("sql-helper"))
    fill_sequence(model, seq, 6, rng)
    tier = SwapTier(model, host_bytes=1 << 20)
    handle = tier.swap_out(seq)
    model.load_adapter("sql-helper")  # generation 2: the saved KV is stale
    live = model.num_live_sequences
    with pytest.raises(SwapModelMismatch, match="'sql-helper' generation 1"):
        tier.swap_in(handle)
    model.check_invariants()
    assert model.num_live_sequences == live and tier.num_swapped_out == 0


def test_a_record_written_by_the_tier_is_a_plain_swap_record(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng)
    expected, num_blocks = image(model, seq), seq.num_blocks
    out = io.BytesIO()
    model.save_sequence_state(seq, out)
    tier = SwapTier(model, host_bytes=1 << 20)
    handle = tier.swap_out(seq)
    target = model.alloc_sequence()
    model.restore_sequence_state(target, num_blocks, io.BytesIO(out.getvalue()))
    assert image(model, target) == expected
    model.free_sequence(target)
    model.free_sequence(tier.swap_in(handle))
