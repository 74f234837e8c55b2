"""The swap record format itself: header layout and version policy, section checksums, the staging
path (double-buffered, in chunks far smaller than the record) against the zero-copy host path, and
the streams save and restore accept."""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np
import pytest
import xxhash

from lifecycle.device.base import Device
from lifecycle.device.host import HostDevice
from lifecycle.errors import SwapChecksumError, SwapError, SwapFormatError
from lifecycle.model import HybridModel
from lifecycle.sequence import SequenceState
from lifecycle.swap import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    HEADER_BYTES,
    MAGIC,
    StagingBuffer,
    SwapContext,
    SwapHeader,
    parse_header,
    read_header,
    restore,
    save,
)
from lifecycle.swap.staging import _block_runs
from devices import device, live_allocations  # noqa: F401  (the shared device fixture)
from swap_helpers import BS, model, fill_sequence, kv_image, slot_image, swap_config  # noqa: F401  (model: a fixture)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(99)


def context(model: HybridModel, **options: Any) -> SwapContext:
    return SwapContext(model.config, model.device, model.kv_pool, model.ssm_pool, **options)


def filled(model: HybridModel, rng: np.random.Generator, num_tokens: int) -> SequenceState:
    seq = model.alloc_sequence()
    fill_sequence(model, seq, num_tokens, rng)
    return seq


def fragmented(model: HybridModel, rng: np.random.Generator, num_tokens: int) -> SequenceState:
    """A sequence whose block table mixes runs of consecutive ids with isolated ones."""
    seq, other = model.alloc_sequence(), model.alloc_sequence()
    bs = model.config.block_size
    for step in range(1, 4):
        model.grow(seq, 3 * step * bs)
        model.grow(other, step * bs)
    model.free_sequence(other)
    fill_sequence(model, seq, num_tokens, rng)
    return seq


#: Blocks of 1 KiB per layer: a 300-token sequence spans several 4 KiB staging halves per layer.
BIG_BLOCKS = dict(block_size=16, num_blocks=48)


def save_bytes(ctx: SwapContext, seq: SequenceState) -> bytes:
    out = io.BytesIO()
    assert save(ctx, seq, out) == out.tell()
    return out.getvalue()


def restored(model: HybridModel, ctx: SwapContext, record: bytes, num_blocks: int) -> SequenceState:
    target = model.alloc_sequence()
    model.grow(target, num_blocks * model.config.block_size)
    assert restore(ctx, target, num_blocks, io.BytesIO(record)) == len(record)
    return target


# ------------------------------------------------------------------------------------------ header


def sample_header(**changes: int) -> SwapHeader:
    fields = dict(
        major=FORMAT_MAJOR, minor=FORMAT_MINOR, fingerprint=0x0123456789ABCDEF, record_bytes=4096,
        block_size=16, num_blocks=3, num_tokens=40, prompt_len=30, num_attention_layers=2,
        num_ssm_layers=1, kv_block_bytes=512, ssm_bytes=96, adapter_name_bytes=5,
        adapter_generation=2, meta_bytes=200, ssm_tokens=32, flags=1, num_ssm_ranges=2,
    )  # fmt: skip
    fields.update(changes)
    return SwapHeader(**fields)


def test_header_is_128_little_endian_bytes_at_documented_offsets() -> None:
    raw = sample_header().pack()
    assert len(raw) == HEADER_BYTES == 128
    assert raw[:8] == MAGIC
    assert struct.unpack_from("<HHI", raw, 8) == (FORMAT_MAJOR, FORMAT_MINOR, 128)
    assert struct.unpack_from("<QQ", raw, 16) == (0x0123456789ABCDEF, 4096)
    assert struct.unpack_from("<IIQQ", raw, 32) == (16, 3, 40, 30)
    assert struct.unpack_from("<IIQQ", raw, 56) == (2, 1, 512, 96)
    assert struct.unpack_from("<IIQqII", raw, 80) == (5, 2, 200, 32, 1, 2)
    assert raw[112:120] == bytes(8)
    assert struct.unpack_from("<Q", raw, 120)[0] == xxhash.xxh3_64_intdigest(raw[:120], 0)


def test_header_round_trips_through_parse() -> None:
    header = sample_header(ssm_tokens=-1)
    assert parse_header(header.pack()) == header


def test_a_short_header_is_truncated() -> None:
    with pytest.raises(SwapFormatError, match="header needs 128 bytes, got 127"):
        parse_header(sample_header().pack()[:127])


def test_magic_is_checked_before_the_checksum() -> None:
    with pytest.raises(SwapFormatError, match="not a lifecycle swap record"):
        parse_header(b"GARBAGE!" + bytes(120))


def resealed(raw: bytes, offset: int, fmt: str, value: int) -> bytes:
    body = bytearray(raw[:120])
    struct.pack_into(fmt, body, offset, value)
    return bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body), 0))


def test_an_unknown_major_version_is_refused_clearly() -> None:
    with pytest.raises(SwapFormatError, match=r"version 3\.0 is not supported: this reader reads major version 1"):
        parse_header(resealed(sample_header().pack(), 8, "<H", 3))


def test_a_newer_minor_version_with_reserved_bytes_set_is_accepted() -> None:
    raw = bytearray(resealed(sample_header().pack(), 10, "<H", 4))
    raw[112:120] = b"\x01" * 8  # a 1.4 writer may use the reserved bytes; a 1.0 reader ignores them
    raw[120:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(raw[:120]), 0))
    assert parse_header(bytes(raw)).minor == 4


def test_a_flipped_header_bit_fails_the_header_checksum() -> None:
    raw = bytearray(sample_header().pack())
    raw[40] ^= 0x10
    with pytest.raises(SwapChecksumError, match="section 'header'"):
        parse_header(bytes(raw))


def test_a_wrong_header_size_is_refused() -> None:
    with pytest.raises(SwapFormatError, match="header_bytes=64"):
        parse_header(resealed(sample_header().pack(), 12, "<I", 64))


def test_read_header_consumes_exactly_the_header(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, 6)
    stream = io.BytesIO(save_bytes(context(model), seq))
    header = read_header(stream)
    assert stream.tell() == HEADER_BYTES
    assert (header.num_blocks, header.num_tokens, header.fingerprint) == (2, 6, model.config.fingerprint())


# ------------------------------------------------------------------------------------------ layout


def test_block_runs_group_consecutive_ids_in_table_order() -> None:
    ids = np.array([5, 6, 7, 2, 9, 10, 3], dtype=np.int32)
    assert _block_runs(ids) == [(5, 3), (2, 1), (9, 2), (3, 1)]
    assert _block_runs(np.empty(0, dtype=np.int32)) == []


def test_kv_sections_hold_each_layers_blocks_in_block_table_order(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, 10)
    record = save_bytes(context(model), seq)
    header = parse_header(record[:HEADER_BYTES])
    start = HEADER_BYTES + header.meta_bytes + 8
    image = kv_image(model, seq)  # layer-major, block-table order: the record's KV layout
    layer0 = seq.num_blocks * model.kv_pool.layer_block_bytes(0)  # type: ignore[union-attr]
    assert record[start : start + layer0] == image[:layer0]
    assert record[start + layer0 + 8 : start + layer0 + 8 + len(image) - layer0] == image[layer0:]


# ------------------------------------------------------------------------------------------ staging path


@pytest.mark.parametrize("deferred", [False, True])
def test_staged_path_writes_the_same_record_as_the_zero_copy_path(rng: np.random.Generator, deferred: bool) -> None:
    model = HybridModel(swap_config(**BIG_BLOCKS), HostDevice(deferred=deferred))
    try:
        seq = fragmented(model, rng, 300)
        staging = StagingBuffer(model.device, 8192)
        staged = context(model, staging=staging, zero_copy_host=False)
        record = save_bytes(staged, seq)
        assert record == save_bytes(context(model), seq)
        target = restored(model, staged, record, seq.num_blocks)
        assert kv_image(model, target) == kv_image(model, seq)
        assert slot_image(model, target.slot_idx) == slot_image(model, seq.slot_idx)
        staging.release()
    finally:
        model.teardown()


def test_staged_path_round_trips_on_every_device(device: Device, rng: np.random.Generator) -> None:
    model = HybridModel(swap_config(**BIG_BLOCKS), device)
    try:
        seq = fragmented(model, rng, 300)
        ctx = context(model, staging=StagingBuffer(model.device, 8192), zero_copy_host=False)
        target = restored(model, ctx, save_bytes(ctx, seq), seq.num_blocks)
        assert kv_image(model, target) == kv_image(model, seq)
        assert slot_image(model, target.slot_idx) == slot_image(model, seq.slot_idx)
        assert ctx.staging is not None
        ctx.staging.release()
    finally:
        model.teardown()


def test_staging_buffer_is_allocated_once_and_reused(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, 9)
    before = live_allocations(model.device)
    staging = StagingBuffer(model.device, 16384)
    ctx = context(model, staging=staging, zero_copy_host=False)
    assert not staging.allocated
    save_bytes(ctx, seq)
    ptr = staging.acquire()[0]
    save_bytes(ctx, seq)
    assert staging.acquire()[0] == ptr
    assert live_allocations(model.device) == before + 1
    staging.release()
    staging.release()
    assert live_allocations(model.device) == before


def test_without_a_staging_buffer_each_call_frees_its_own(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, 9)
    before = live_allocations(model.device)
    save_bytes(context(model, zero_copy_host=False), seq)
    assert live_allocations(model.device) == before


def test_a_staging_buffer_smaller_than_two_pages_is_refused(model: HybridModel) -> None:
    with pytest.raises(SwapError, match="nbytes=4096"):
        StagingBuffer(model.device, 4096)


# ------------------------------------------------------------------------------------------ streams


class Trickle(io.RawIOBase):
    """A raw stream moving at most ``step`` bytes per call, as sockets and pipes do."""

    def __init__(self, step: int, data: bytes = b"") -> None:
        self.data, self.step, self.pos = bytearray(data), step, 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(self.step, view.nbytes, len(self.data) - self.pos)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = min(self.step, view.nbytes)
        self.data += view[:n]
        return n


@pytest.mark.parametrize("zero_copy", [True, False])
def test_short_reads_and_short_writes_are_completed(
    model: HybridModel, rng: np.random.Generator, zero_copy: bool
) -> None:
    seq = filled(model, rng, 9)
    ctx = context(model, zero_copy_host=zero_copy)
    writer = Trickle(step=97)
    save(ctx, seq, writer)  # type: ignore[arg-type]
    assert bytes(writer.data) == save_bytes(context(model), seq)
    target = model.alloc_sequence()
    model.grow(target, seq.num_blocks * BS)
    restore(ctx, target, seq.num_blocks, Trickle(step=61, data=bytes(writer.data)))  # type: ignore[arg-type]
    assert kv_image(model, target) == kv_image(model, seq)


class ReadOnly:
    """A reader with ``read`` only (no ``readinto``)."""

    def __init__(self, data: bytes) -> None:
        self._stream = io.BytesIO(data)

    def read(self, n: int) -> bytes:
        return self._stream.read(n)


def test_a_reader_without_readinto_is_served_by_read(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, 9)
    record = save_bytes(context(model), seq)
    target = model.alloc_sequence()
    model.grow(target, seq.num_blocks * BS)
    assert restore(context(model), target, seq.num_blocks, ReadOnly(record)) == len(record)  # type: ignore[arg-type]
    assert target.tokens.tolist() == seq.tokens.tolist()


def test_a_writer_returning_none_counts_as_a_full_write(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, 5)
    chunks: list[bytes] = []

    class Collect:
        def write(self, data: Any) -> None:
            chunks.append(bytes(data))

    assert save(context(model), seq, Collect()) == len(b"".join(chunks))  # type: ignore[arg-type]
    assert b"".join(chunks) == save_bytes(context(model), seq)


def test_a_meta_checksum_mismatch_is_found_before_any_kv_is_written(
    model: HybridModel, rng: np.random.Generator
) -> None:
    seq = filled(model, rng, 9)
    record = bytearray(save_bytes(context(model), seq))
    record[HEADER_BYTES + 3] ^= 0x01  # in the meta section's layer table
    target = model.alloc_sequence()
    model.grow(target, seq.num_blocks * BS)
    kv_before = kv_image(model, target)
    with pytest.raises(SwapChecksumError, match="section 'meta'"):
        restore(context(model), target, seq.num_blocks, io.BytesIO(bytes(record)))
    assert kv_image(model, target) == kv_before
