"""Fuzzing of swap records: mutated records (bit flips, truncations, splices, inserted and deleted
bytes, header fields rewritten under a valid header checksum, payload flips under a valid section
checksum) restored into a fresh sequence. Each must be rejected with a ``SwapError`` subclass,
leaving the pools and the sequence exactly as before (or, where the mutation resealed every
checksum and produced a record the reader may take, be accepted whole); no other exception, no
hang; the invariants hold after each.

Budget: ``FUZZ_EXAMPLES`` hypothesis examples per test (``LIFECYCLE_LONG=1``: 20,000), plus the
exhaustive single-byte suites. ``bench/reliability.py`` runs the same mutations from a seeded
``random.Random`` for the counts in docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
import io
import os
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifecycle.device.base import Device
from lifecycle.errors import LifecycleError, OutOfBlocks, SwapError, SwapFormatError
from lifecycle.model import HybridModel
from lifecycle.sequence import NO_ADAPTER, SequenceState
from lifecycle.swap import HEADER_BYTES, parse_header
from devices import make_device
from reliability_driver import (
    CONFIGS,
    MUTATIONS,
    SYSTEM_PROMPTS,
    FuzzCounts,
    model_digest,
    mutate,
    restore_mutated,
    section_spans,
    seq_digest,
)

LONG = os.environ.get("LIFECYCLE_LONG") == "1"
FUZZ_EXAMPLES = 20_000 if LONG else 250
RESEALING = {i for i, name in enumerate(MUTATIONS) if name in ("header_field", "header_sizes", "resealed_flip")}


@dataclass
class Subject:
    """A model, a saved record of one of its sequences, and a second record to splice from."""

    model: HybridModel
    source: SequenceState
    record: bytes
    donor: bytes
    adapter_slot: int

    @property
    def num_blocks(self) -> int:
        return self.source.num_blocks


def make_subject(dev: Device, config_name: str, with_adapter: bool) -> Subject:
    model = HybridModel(CONFIGS[config_name], dev)
    adapter = model.load_adapter("alpha") if with_adapter else NO_ADAPTER
    source = model.alloc_sequence()
    if with_adapter:
        model.bind_adapter(source, adapter)
    model.attach_prefix(source, SYSTEM_PROMPTS[1])
    model.grow(source, 20)
    source.append_tokens(range(30, 38))
    out = io.BytesIO()
    model.save_sequence_state(source, out)
    other = model.alloc_sequence()
    model.attach_prefix(other, SYSTEM_PROMPTS[0])
    model.grow(other, 9)
    donor = io.BytesIO()
    model.save_sequence_state(other, donor)
    model.free_sequence(other)
    model.check_invariants()
    return Subject(model, source, out.getvalue(), donor.getvalue(), adapter)


@pytest.fixture(scope="module")
def subjects() -> Iterator[dict[str, Subject]]:
    dev = make_device()
    made = {
        "hybrid+adapter": make_subject(dev, "hybrid", True),
        "attention": make_subject(dev, "attention", False),
    }
    yield made
    for subject in made.values():
        subject.model.free_sequence(subject.source)
        subject.model.teardown()
        assert subject.model.teardown_report is not None and subject.model.teardown_report.leaked == 0
    dev.close()


mutation = st.tuples(
    st.integers(0, len(MUTATIONS) - 1), st.integers(0, 1 << 20), st.integers(0, 1 << 20), st.integers(0, 1 << 20)
)
mutation_lists = st.lists(mutation, min_size=1, max_size=4)
fuzz_settings = settings(max_examples=FUZZ_EXAMPLES, deadline=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def fuzz_one(
    subject: Subject, mutations: list[tuple[int, int, int, int]], reader: type[io.BytesIO] = io.BytesIO
) -> None:
    mutated = mutate(subject.record, mutations, subject.donor)
    resealed = any(k in RESEALING for k, *_ in mutations)
    restore_mutated(subject.model, subject.record, subject.num_blocks, mutated, resealed=resealed,
                    adapter_slot=subject.adapter_slot, reader=reader)


@fuzz_settings
@given(mutations=mutation_lists)
def test_a_mutated_hybrid_record_is_rejected_cleanly(
    subjects: dict[str, Subject], mutations: list[tuple[int, int, int, int]]
) -> None:
    fuzz_one(subjects["hybrid+adapter"], mutations)


@fuzz_settings
@given(mutations=mutation_lists)
def test_a_mutated_attention_record_is_rejected_cleanly(
    subjects: dict[str, Subject], mutations: list[tuple[int, int, int, int]]
) -> None:
    fuzz_one(subjects["attention"], mutations)


class TrickleReader(io.BytesIO):
    """Hands out at most 7 bytes per read: restore must not assume full reads."""

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        return super().readinto(view[: min(7, view.nbytes)])


@settings(max_examples=FUZZ_EXAMPLES // 5, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutations=mutation_lists)
def test_a_mutated_record_read_in_short_pieces_is_rejected_cleanly(
    subjects: dict[str, Subject], mutations: list[tuple[int, int, int, int]]
) -> None:
    fuzz_one(subjects["hybrid+adapter"], mutations, reader=TrickleReader)


@pytest.mark.parametrize("name", ["hybrid+adapter", "attention"])
def test_every_truncation_of_a_record_is_rejected_as_truncated(subjects: dict[str, Subject], name: str) -> None:
    subject = subjects[name]
    for length in range(len(subject.record)):
        mutated = subject.record[:length]
        seq = subject.model.alloc_sequence()
        if subject.adapter_slot != NO_ADAPTER:
            subject.model.bind_adapter(seq, subject.adapter_slot)
        before = model_digest(subject.model)
        with pytest.raises(SwapFormatError, match="truncated"):
            subject.model.restore_sequence_state(seq, subject.num_blocks, io.BytesIO(mutated))
        assert model_digest(subject.model) == before and seq.num_blocks == 0 and seq.num_tokens == 0
        subject.model.free_sequence(seq)
    subject.model.check_invariants()


@pytest.mark.parametrize("name", ["hybrid+adapter", "attention"])
def test_a_flipped_bit_in_any_byte_is_rejected(subjects: dict[str, Subject], name: str) -> None:
    subject = subjects[name]
    counts = FuzzCounts()
    for pos in range(len(subject.record)):
        mutated = bytearray(subject.record)
        mutated[pos] ^= 1 << (pos % 8)
        restore_mutated(subject.model, subject.record, subject.num_blocks, bytes(mutated), resealed=False,
                        adapter_slot=subject.adapter_slot, counts=counts)
    assert counts.rejected == len(subject.record) and counts.accepted == 0


def test_a_reader_that_fails_midway_is_reported_as_a_swap_error(subjects: dict[str, Subject]) -> None:
    subject = subjects["hybrid+adapter"]

    class Failing(io.BytesIO):
        def __init__(self, data: bytes, fail_at: int) -> None:
            super().__init__(data)
            self.fail_at = fail_at

        def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
            if self.tell() >= self.fail_at:
                raise OSError("connection reset")
            view = memoryview(buffer).cast("B")
            return super().readinto(view[: max(1, min(view.nbytes, self.fail_at - self.tell()))])

    for fail_at in range(0, len(subject.record), 97):
        seq = subject.model.alloc_sequence()
        subject.model.bind_adapter(seq, subject.adapter_slot)
        before, seq_before = model_digest(subject.model), seq_digest(seq)
        with pytest.raises(SwapError) as failure:
            subject.model.restore_sequence_state(seq, subject.num_blocks, Failing(subject.record, fail_at))
        assert isinstance(failure.value.__cause__, OSError)
        assert model_digest(subject.model) == before and seq_digest(seq) == seq_before
        subject.model.free_sequence(seq)
    subject.model.check_invariants()


def test_the_unmutated_record_restores(subjects: dict[str, Subject]) -> None:
    """The control: the fuzzer's base record is valid, so rejections come from the mutations."""
    for subject in subjects.values():
        seq = subject.model.alloc_sequence()
        if subject.adapter_slot != NO_ADAPTER:
            subject.model.bind_adapter(seq, subject.adapter_slot)
        subject.model.restore_sequence_state(seq, subject.num_blocks, TrickleReader(subject.record))
        assert np.array_equal(seq.tokens, subject.source.tokens)
        subject.model.free_sequence(seq)
        subject.model.check_invariants()


# ----------------------------------------------------------------------------- regressions (bugs these suites found)


def forged_token_count(record: bytes, num_tokens: int) -> bytes:
    """``record`` with a header announcing ``num_tokens`` tokens, every size field and the header
    checksum consistent with it (the payload is not)."""
    header = parse_header(record[:HEADER_BYTES])
    delta = 4 * (num_tokens - header.num_tokens)
    forged = dataclasses.replace(header, num_tokens=num_tokens, meta_bytes=header.meta_bytes + delta,
                                 record_bytes=header.record_bytes + delta)
    return forged.pack() + record[HEADER_BYTES:]


def test_a_forged_token_count_is_refused_without_allocating_for_it(subjects: dict[str, Subject]) -> None:
    subject = subjects["attention"]
    forged = forged_token_count(subject.record, 2**31 - 1)
    seq = subject.model.alloc_sequence()
    tracemalloc.start()
    try:
        with pytest.raises(SwapError):
            subject.model.restore_sequence_state(seq, subject.num_blocks, io.BytesIO(forged))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        subject.model.free_sequence(seq)
    assert peak < 64 << 20, f"restore of a {len(forged)}-byte record peaked at {peak >> 20} MiB"


def test_a_bad_record_evicts_nothing_from_the_prefix_cache() -> None:
    dev = make_device()
    m = HybridModel(CONFIGS["attention"], dev)
    try:
        filler = m.alloc_sequence()
        m.attach_prefix(filler, SYSTEM_PROMPTS[3])
        m.grow(filler, 16)
        m.cache_sequence(filler)
        m.free_sequence(filler)  # its 4 blocks stay cached
        hogs = []
        while m.num_free_blocks() > 1:  # hogs take all but one free block
            hogs.append(m.alloc_sequence())
            m.grow(hogs[-1], 4 * min(16, m.num_free_blocks() - 1))
        cached = m.core.num_cached_blocks
        target = m.alloc_sequence()
        # A restore never evicts: short of free blocks, it is refused before reading the record.
        with pytest.raises(OutOfBlocks):
            m.restore_sequence_state(target, 3, io.BytesIO(b"not a swap record"))
        m.check_invariants()
        assert m.core.num_cached_blocks == cached
    finally:
        m.teardown()
        dev.close()


# ----------------------------------------------------------------------------- open findings


def test_a_record_over_the_per_sequence_block_limit_is_refused() -> None:
    config = dataclasses.replace(CONFIGS["attention"], max_blocks_per_seq=4)
    dev = make_device()
    m = HybridModel(config, dev)
    try:
        source = m.alloc_sequence()
        m.grow(source, 16)
        source.append_tokens(range(16))
        out = io.BytesIO()
        m.save_sequence_state(source, out)
        record = out.getvalue()
        header = parse_header(record[:HEADER_BYTES])
        over = 10  # blocks, the limit being 4
        kv = [bytes([i + 1]) * (over * n) for i, n in enumerate(np.frombuffer(
            record, dtype="<u8", count=header.num_attention_layers, offset=HEADER_BYTES).tolist())]
        forged_bytes = header.record_bytes + (over - header.num_blocks) * header.kv_block_bytes
        forged_header = dataclasses.replace(header, num_blocks=over, record_bytes=forged_bytes)
        meta_start, meta_end = section_spans(record)[0]
        meta = record[meta_start:meta_end]
        forged = forged_header.pack() + meta + xxhash.xxh3_64_intdigest(meta, 1).to_bytes(8, "little")
        for index, payload in enumerate(kv, start=2):
            forged += payload + xxhash.xxh3_64_intdigest(payload, index).to_bytes(8, "little")
        target = m.alloc_sequence()
        before = model_digest(m)
        with pytest.raises(LifecycleError):
            m.restore_sequence_state(target, over, io.BytesIO(forged))
        assert model_digest(m) == before and target.num_blocks == 0
    finally:
        m.teardown()
        dev.close()
