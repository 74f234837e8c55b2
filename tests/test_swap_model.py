"""save_sequence_state / restore_sequence_state through HybridModel, on every device.

Round trips are bit-exact with random (never zero) KV and SSM state. Every refused restore leaves
the pools and the sequence exactly as before: free blocks, invariants, tokens, and the bytes of the
sequence's SSM slot (which the tests fill with random bytes first, so a partial write would show).
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np
import pytest
import xxhash

from lifecycle.config import AttentionLayer, ModelDims, SSMLayer
from lifecycle.device.base import Device
from lifecycle.errors import (
    CudaError,
    LifecycleError,
    OutOfBlocks,
    SequenceStateError,
    SwapChecksumError,
    SwapError,
    SwapFormatError,
    SwapModelMismatch,
)
from lifecycle.model import HybridModel
from lifecycle.sequence import SequenceState
from lifecycle.swap import HEADER_BYTES, parse_header, record_nbytes
from lifecycle.swap.tier import _ViewReader, _ViewWriter
from devices import CUDA_ERROR_LAUNCH_FAILED, Emulator, device, emu, write_device  # noqa: F401  (fixtures)
from swap_helpers import BS, model, fill_sequence, kv_image, random_bytes, section_spans, slot_image, swap_config  # noqa: F401  (model: a fixture)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def saved(model: HybridModel, seq: SequenceState) -> bytes:
    out = io.BytesIO()
    model.save_sequence_state(seq, out)
    return out.getvalue()


def filled(model: HybridModel, rng: np.random.Generator, num_tokens: int = 7) -> SequenceState:
    seq = model.alloc_sequence()
    fill_sequence(model, seq, num_tokens, rng)
    model.check_invariants()
    return seq


def fresh_target(model: HybridModel, rng: np.random.Generator) -> SequenceState:
    """A sequence to restore into, its slot scribbled over so that any write to it would show."""
    seq = model.alloc_sequence()
    ssm = model.ssm_pool
    if ssm is not None:
        for addr, nbytes in ssm.slot_ranges(seq.slot_idx):
            write_device(model.device, addr, random_bytes(rng, nbytes))
    return seq


def observable(model: HybridModel, seq: SequenceState) -> tuple[Any, ...]:
    return (
        seq.num_blocks,
        seq.tokens.tolist(),
        seq.prompt_len,
        seq.ssm_tokens,
        seq.failed,
        seq.adapter_slot,
        slot_image(model, seq.slot_idx),
    )


def assert_refused(
    model: HybridModel,
    seq: SequenceState,
    record: bytes | io.RawIOBase,
    num_blocks: int,
    error: type[LifecycleError],
    match: str | None = None,
) -> LifecycleError:
    """Restore must raise ``error`` and leave the model and ``seq`` exactly as they were."""
    free, before = model.num_free_blocks(), observable(model, seq)
    reader = io.BytesIO(record) if isinstance(record, bytes) else record
    with pytest.raises(error, match=match) as info:
        model.restore_sequence_state(seq, num_blocks, reader)  # type: ignore[arg-type]
    model.check_invariants()
    assert model.num_free_blocks() == free
    assert observable(model, seq) == before
    return info.value


def with_header(record: bytes, offset: int, fmt: str, value: int) -> bytes:
    """``record`` with one header field rewritten and the header checksum recomputed."""
    header = bytearray(record[: HEADER_BYTES - 8])
    struct.pack_into(fmt, header, offset, value)
    return bytes(header) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(header), 0)) + record[HEADER_BYTES:]


# ------------------------------------------------------------------------------------------ round trips


def test_round_trip_restores_kv_ssm_and_tokens_bit_exact(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, num_tokens=11)
    seq.ssm_tokens = 8
    record = saved(model, seq)
    target = fresh_target(model, rng)
    model.restore_sequence_state(target, seq.num_blocks, io.BytesIO(record))
    model.check_invariants()
    assert kv_image(model, target) == kv_image(model, seq)
    assert slot_image(model, target.slot_idx) == slot_image(model, seq.slot_idx)
    assert target.tokens.tolist() == seq.tokens.tolist()
    assert (target.prompt_len, target.ssm_tokens, target.failed) == (seq.prompt_len, 8, False)


def test_round_trip_into_another_model_with_the_same_config(device: Device, rng: np.random.Generator) -> None:
    source, other = HybridModel(swap_config(), device), HybridModel(swap_config(), device)
    try:
        seq = filled(source, rng, num_tokens=13)
        target = fresh_target(other, rng)
        other.restore_sequence_state(target, seq.num_blocks, io.BytesIO(saved(source, seq)))
        other.check_invariants()
        assert kv_image(other, target) == kv_image(source, seq)
        assert slot_image(other, target.slot_idx) == slot_image(source, seq.slot_idx)
    finally:
        source.teardown()
        other.teardown()


def test_round_trip_of_a_fragmented_block_table(model: HybridModel, rng: np.random.Generator) -> None:
    seq, other = model.alloc_sequence(), model.alloc_sequence()
    for step in range(1, 6):  # interleaved growth: seq's block ids are not consecutive
        model.grow(seq, step * BS)
        model.grow(other, step * BS)
    model.free_sequence(other)
    model.grow(seq, 9 * BS)  # and then a run of consecutive ones
    fill_sequence(model, seq, 9 * BS, rng)
    assert not np.all(np.diff(seq.block_table) == 1)
    target = fresh_target(model, rng)
    model.restore_sequence_state(target, seq.num_blocks, io.BytesIO(saved(model, seq)))
    model.check_invariants()
    assert kv_image(model, target) == kv_image(model, seq)


@pytest.mark.parametrize("kind", ["attention-only", "ssm-only"])
def test_round_trip_of_a_single_kind_model(device: Device, rng: np.random.Generator, kind: str) -> None:
    layers: tuple[Any, ...] = (
        (AttentionLayer(num_kv_heads=2, head_dim=8),) * 2
        if kind == "attention-only"
        else (SSMLayer(h_state_bytes=96, conv_state_bytes=48),) * 3
    )
    m = HybridModel(swap_config(layers=layers, num_blocks=48 if kind == "attention-only" else 0), device)
    try:
        seq = filled(m, rng, num_tokens=10)
        target = fresh_target(m, rng)
        m.restore_sequence_state(target, seq.num_blocks, io.BytesIO(saved(m, seq)))
        m.check_invariants()
        assert kv_image(m, target) == kv_image(m, seq)
        assert slot_image(m, target.slot_idx) == slot_image(m, seq.slot_idx)
        assert target.tokens.tolist() == seq.tokens.tolist()
    finally:
        m.teardown()


def test_empty_sequence_round_trips(model: HybridModel, rng: np.random.Generator) -> None:
    seq = model.alloc_sequence()
    target = fresh_target(model, rng)
    model.restore_sequence_state(target, 0, io.BytesIO(saved(model, seq)))
    model.check_invariants()
    assert (target.num_blocks, target.num_tokens) == (0, 0)
    assert slot_image(model, target.slot_idx) == bytes(len(slot_image(model, seq.slot_idx)))


def test_a_failed_sequence_restores_failed_and_is_never_cached(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, num_tokens=8)
    seq.mark_failed()
    target = fresh_target(model, rng)
    model.restore_sequence_state(target, seq.num_blocks, io.BytesIO(saved(model, seq)))
    assert target.failed
    model.cache_sequence(target)
    model.check_invariants()
    assert model.stats().blocks_cached == 0


def test_save_changes_nothing_and_frees_nothing(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng)
    free, before, kv = model.num_free_blocks(), observable(model, seq), kv_image(model, seq)
    saved(model, seq)
    model.check_invariants()
    assert (model.num_free_blocks(), observable(model, seq), kv_image(model, seq)) == (free, before, kv)


def test_record_size_is_predictable_and_counted_in_stats(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, num_tokens=9)
    record = saved(model, seq)
    assert len(record) == record_nbytes(model.config, seq.num_blocks, seq.num_tokens)
    target = fresh_target(model, rng)
    model.restore_sequence_state(target, seq.num_blocks, io.BytesIO(record))
    stats = model.stats()
    assert (stats.swaps_out, stats.bytes_swapped_out, stats.swaps_in, stats.bytes_swapped_in) == (
        1, len(record), 1, len(record),
    )  # fmt: skip


def test_restore_reads_exactly_one_record_from_a_stream(model: HybridModel, rng: np.random.Generator) -> None:
    first, second = filled(model, rng, num_tokens=5), filled(model, rng, num_tokens=9)
    stream = io.BytesIO(saved(model, first) + saved(model, second))
    a, b = fresh_target(model, rng), fresh_target(model, rng)
    model.restore_sequence_state(a, first.num_blocks, stream)
    model.restore_sequence_state(b, second.num_blocks, stream)
    model.check_invariants()
    assert kv_image(model, a) == kv_image(model, first)
    assert kv_image(model, b) == kv_image(model, second)


def test_high_speed_swap_dims_describe_the_model(model: HybridModel) -> None:
    dims = model.high_speed_swap_dims()
    assert isinstance(dims, ModelDims)
    assert (dims.fingerprint, dims.block_size, dims.num_attention_layers, dims.num_ssm_layers) == (
        model.config.fingerprint(), BS, 2, 2,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ adapters


def test_adapter_name_and_generation_travel_with_the_record(model: HybridModel, rng: np.random.Generator) -> None:
    slot = model.load_adapter("support-bot")
    seq = model.alloc_sequence()
    model.bind_adapter(seq, slot)
    fill_sequence(model, seq, 6, rng)
    record = saved(model, seq)
    bound, unbound = fresh_target(model, rng), fresh_target(model, rng)
    model.bind_adapter(bound, slot)
    model.restore_sequence_state(bound, seq.num_blocks, io.BytesIO(record))
    model.check_invariants()
    assert kv_image(model, bound) == kv_image(model, seq)
    assert_refused(model, unbound, record, seq.num_blocks, SwapModelMismatch, "'support-bot' generation 1")


def test_a_record_of_a_reloaded_adapter_generation_is_refused(model: HybridModel, rng: np.random.Generator) -> None:
    slot = model.load_adapter("support-bot")
    seq = model.alloc_sequence()
    model.bind_adapter(seq, slot)
    fill_sequence(model, seq, 6, rng)
    record, num_blocks = saved(model, seq), seq.num_blocks
    model.free_sequence(seq)
    reloaded = model.load_adapter("support-bot")
    target = fresh_target(model, rng)
    model.bind_adapter(target, reloaded)
    assert_refused(model, target, record, num_blocks, SwapModelMismatch, "generation 1.*generation 2")


# ------------------------------------------------------------------------------------------ refusals


def small_record(model: HybridModel, rng: np.random.Generator) -> tuple[SequenceState, bytes]:
    seq = filled(model, rng, num_tokens=5)
    return seq, saved(model, seq)


def test_a_cut_at_every_byte_offset_is_refused_as_truncated(model: HybridModel, rng: np.random.Generator) -> None:
    seq, record = small_record(model, rng)
    target = fresh_target(model, rng)
    free, before = model.num_free_blocks(), observable(model, target)
    for cut in range(len(record)):
        with pytest.raises(SwapFormatError, match=f"truncated: stream ended at byte {cut}\\b"):
            model.restore_sequence_state(target, seq.num_blocks, io.BytesIO(record[:cut]))
        model.check_invariants()
        assert model.num_free_blocks() == free
        assert target.num_blocks == 0 and target.num_tokens == 0
    assert observable(model, target) == before
    model.restore_sequence_state(target, seq.num_blocks, io.BytesIO(record))  # still usable
    assert kv_image(model, target) == kv_image(model, seq)


def test_bit_flips_in_every_section_are_refused_naming_the_section(
    model: HybridModel, rng: np.random.Generator
) -> None:
    seq, record = small_record(model, rng)
    header = parse_header(record[:HEADER_BYTES])
    target = fresh_target(model, rng)
    for name, start, end in section_spans(model, seq.num_blocks, header.meta_bytes):
        for bit in rng.choice((end - start) * 8, size=min(4, (end - start) * 8), replace=False).tolist():
            corrupt = bytearray(record)
            corrupt[start + bit // 8] ^= 1 << (bit % 8)
            error = assert_refused(model, target, bytes(corrupt), seq.num_blocks, SwapError)
            if name != "header" and not name.startswith("meta"):
                assert isinstance(error, SwapChecksumError), (name, error)
                assert repr(name.removesuffix(" checksum")) in str(error), (name, error)


def test_two_equal_sized_sections_swapped_are_refused(model: HybridModel, rng: np.random.Generator) -> None:
    seq, record = small_record(model, rng)
    header = parse_header(record[:HEADER_BYTES])
    spans = {name: (start, end) for name, start, end in section_spans(model, seq.num_blocks, header.meta_bytes)}
    # The test config's two attention layers have blocks of 256 bytes each (float16 x 2 heads,
    # float32 x 1 head): their sections, checksums included, are interchangeable byte for byte.
    a, b = spans["kv attention-layer 0"], spans["kv attention-layer 1"]
    assert a[1] - a[0] == b[1] - b[0]
    corrupt = bytearray(record)
    corrupt[a[0] : a[1] + 8], corrupt[b[0] : b[1] + 8] = record[b[0] : b[1] + 8], record[a[0] : a[1] + 8]
    target = fresh_target(model, rng)
    assert_refused(model, target, bytes(corrupt), seq.num_blocks, SwapChecksumError, "attention-layer 0")


def test_wrong_magic_is_refused(model: HybridModel, rng: np.random.Generator) -> None:
    seq, record = small_record(model, rng)
    assert_refused(model, fresh_target(model, rng), b"NOTSWAP!" + record[8:], seq.num_blocks, SwapFormatError, "magic")


def test_an_unknown_major_version_is_refused(model: HybridModel, rng: np.random.Generator) -> None:
    seq, record = small_record(model, rng)
    future = with_header(record, 8, "<H", 2)
    target = fresh_target(model, rng)
    assert_refused(model, target, future, seq.num_blocks, SwapFormatError, r"version 2\.0 is not supported")


def test_a_newer_minor_version_is_read(model: HybridModel, rng: np.random.Generator) -> None:
    seq, record = small_record(model, rng)
    target = fresh_target(model, rng)
    model.restore_sequence_state(target, seq.num_blocks, io.BytesIO(with_header(record, 10, "<H", 9)))
    assert kv_image(model, target) == kv_image(model, seq)


def test_another_models_record_is_refused_by_fingerprint(device: Device, rng: np.random.Generator) -> None:
    layers = (AttentionLayer(num_kv_heads=2, head_dim=8), SSMLayer(h_state_bytes=256, conv_state_bytes=64))
    foreign_model = HybridModel(swap_config(layers=layers), device)
    model = HybridModel(swap_config(), device)
    try:
        seq, record = small_record(foreign_model, rng)
        assert_refused(model, fresh_target(model, rng), record, seq.num_blocks, SwapModelMismatch, "fingerprint")
    finally:
        foreign_model.teardown()
        model.teardown()


@pytest.mark.parametrize("delta", [-1, 1])
def test_a_block_count_mismatch_is_refused_naming_both(
    model: HybridModel, rng: np.random.Generator, delta: int
) -> None:
    seq, record = small_record(model, rng)
    asked = seq.num_blocks + delta
    assert_refused(
        model, fresh_target(model, rng), record, asked, SwapModelMismatch,
        f"record holds {seq.num_blocks} blocks but restore was asked for num_blocks={asked}",
    )  # fmt: skip


class FailingReader(io.RawIOBase):
    """Serves ``limit`` bytes of ``data``, then raises OSError."""

    def __init__(self, data: bytes, limit: int) -> None:
        self._data, self._limit, self._pos = data, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._pos >= self._limit:
            raise OSError(f"connection reset at byte {self._pos}")
        view = memoryview(buffer).cast("B")
        n = min(view.nbytes, self._limit - self._pos)
        view[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


def test_a_reader_that_raises_half_way_is_reported_chained(model: HybridModel, rng: np.random.Generator) -> None:
    seq, record = small_record(model, rng)
    target = fresh_target(model, rng)
    for limit in (0, HEADER_BYTES // 2, HEADER_BYTES + 40, len(record) // 2, len(record) - 20):
        reader = FailingReader(record, limit)
        error = assert_refused(model, target, reader, seq.num_blocks, SwapError, "reading section")
        assert isinstance(error.__cause__, OSError)
        assert f"at byte {limit}" in str(error)


def test_no_free_blocks_at_restore_is_refused(model: HybridModel, rng: np.random.Generator) -> None:
    seq, record = small_record(model, rng)
    hog = model.alloc_sequence()
    model.grow(hog, model.num_free_blocks() * BS)
    assert_refused(model, fresh_target(model, rng), record, seq.num_blocks, OutOfBlocks)
    model.free_sequence(hog)
    model.check_invariants()


def test_restore_into_a_sequence_that_holds_tokens_is_refused(model: HybridModel, rng: np.random.Generator) -> None:
    seq, record = small_record(model, rng)
    assert_refused(model, seq, record, seq.num_blocks, SequenceStateError, "freshly allocated")


class FailingWriter(io.RawIOBase):
    def __init__(self, limit: int) -> None:
        self.written, self._limit = 0, limit

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self.written + n > self._limit:
            raise OSError("disk full")
        self.written += n
        return n


def test_a_writer_that_fails_leaves_the_sequence_untouched(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng)
    free, before, kv = model.num_free_blocks(), observable(model, seq), kv_image(model, seq)
    with pytest.raises(SwapError, match="writing section") as info:
        model.save_sequence_state(seq, FailingWriter(300))  # type: ignore[arg-type]
    assert isinstance(info.value.__cause__, OSError)
    model.check_invariants()
    assert (model.num_free_blocks(), observable(model, seq), kv_image(model, seq)) == (free, before, kv)
    assert model.stats().swap_failures == 1


def test_a_device_error_during_restore_changes_nothing(
    model: HybridModel, rng: np.random.Generator, emu: Emulator
) -> None:
    seq, record = small_record(model, rng)
    target = fresh_target(model, rng)
    emu.fail_call("cuMemcpyHtoDAsync", CUDA_ERROR_LAUNCH_FAILED)
    assert_refused(model, target, record, seq.num_blocks, CudaError, "cuMemcpyHtoDAsync")


class InterruptedReader(io.RawIOBase):
    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        raise KeyboardInterrupt


def test_a_keyboard_interrupt_from_the_reader_propagates_unchanged(
    model: HybridModel, rng: np.random.Generator
) -> None:
    seq, _ = small_record(model, rng)
    target = fresh_target(model, rng)
    free, before = model.num_free_blocks(), observable(model, target)
    with pytest.raises(KeyboardInterrupt):
        model.restore_sequence_state(target, seq.num_blocks, InterruptedReader())  # type: ignore[arg-type]
    model.check_invariants()
    assert (model.num_free_blocks(), observable(model, target)) == (free, before)


# ------------------------------------------------- writers with reserve(), readers with claim()
# The swap tier's host pool offers them; large pieces are then copied in and out directly.


def test_reserve_and_claim_round_trip_bit_exact(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, num_tokens=13)
    record = saved(model, seq)
    extent = bytearray(len(record))
    model.save_sequence_state(seq, _ViewWriter(memoryview(extent)))  # type: ignore[arg-type]
    assert bytes(extent) == record
    target = fresh_target(model, rng)
    model.restore_sequence_state(target, seq.num_blocks, _ViewReader(memoryview(extent)))  # type: ignore[arg-type]
    model.check_invariants()
    assert kv_image(model, target) == kv_image(model, seq)
    assert slot_image(model, target.slot_idx) == slot_image(model, seq.slot_idx)


def test_a_cut_at_every_byte_offset_of_a_claiming_reader_is_refused(
    model: HybridModel, rng: np.random.Generator
) -> None:
    seq, record = small_record(model, rng)
    target = fresh_target(model, rng)
    free, before = model.num_free_blocks(), observable(model, target)
    for cut in range(len(record)):
        with pytest.raises(SwapFormatError, match=f"truncated: stream ended at byte {cut}\\b"):
            model.restore_sequence_state(target, seq.num_blocks, _ViewReader(memoryview(record[:cut])))  # type: ignore[arg-type]
        assert model.num_free_blocks() == free
    model.check_invariants()
    assert observable(model, target) == before


class _BadReserve(_ViewWriter):
    def reserve(self, nbytes: int) -> memoryview:
        return super().reserve(nbytes)[:-1]  # one byte short


class _FailingClaim(_ViewReader):
    def __init__(self, view: memoryview, limit: int) -> None:
        super().__init__(view)
        self.limit, self.claimed = limit, 0

    def claim(self, nbytes: int) -> memoryview:
        self.claimed += 1
        if self.claimed > self.limit:
            raise OSError("mapping went away")
        return super().claim(nbytes)


def test_a_reserve_of_the_wrong_size_is_refused(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng)
    free, before, kv = model.num_free_blocks(), observable(model, seq), kv_image(model, seq)
    with pytest.raises(SwapError, match="reserve"):
        model.save_sequence_state(seq, _BadReserve(memoryview(bytearray(1 << 16))))  # type: ignore[arg-type]
    model.check_invariants()
    assert (model.num_free_blocks(), observable(model, seq), kv_image(model, seq)) == (free, before, kv)


def test_a_claim_that_raises_is_reported_chained(model: HybridModel, rng: np.random.Generator) -> None:
    if model.device.kind != "host":
        pytest.skip("only the direct host path claims pieces; the staged path reads through readinto")
    seq, record = small_record(model, rng)
    target = fresh_target(model, rng)
    counting = _FailingClaim(memoryview(record), 1 << 30)
    model.restore_sequence_state(fresh_target(model, rng), seq.num_blocks, counting)  # type: ignore[arg-type]
    assert counting.claimed >= 2  # a piece per KV layer and SSM range
    for limit in range(counting.claimed):
        reader = _FailingClaim(memoryview(record), limit)
        error = assert_refused(model, target, reader, seq.num_blocks, SwapError, "reading section")  # type: ignore[arg-type]
        assert isinstance(error.__cause__, OSError) and reader.claimed == limit + 1
