"""Helpers shared by the swap suites: small hybrid models, sequences filled with random (never
zero) KV and SSM state, and byte images of what a sequence holds, read back from the device."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import numpy as np
import numpy.typing as npt

from lifecycle.config import AttentionLayer, ModelConfig, SSMLayer
from lifecycle.device import Device
from lifecycle.model import HybridModel
from lifecycle.sequence import SequenceState
from lifecycle.swap import HEADER_BYTES
from devices import read_device, write_device

BS = 4


def swap_config(**overrides: Any) -> ModelConfig:
    """Two attention and two SSM layers of different sizes, a few KiB of state in all."""
    fields: dict[str, Any] = dict(
        layers=(
            AttentionLayer(num_kv_heads=2, head_dim=8),
            SSMLayer(h_state_bytes=256, conv_state_bytes=64),
            AttentionLayer(num_kv_heads=1, head_dim=8, dtype="float32"),
            SSMLayer(h_state_bytes=128, conv_state_bytes=32),
        ),
        block_size=BS,
        num_blocks=48,
        max_seqs=6,
        num_adapter_slots=2,
        name="swap-test",
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture
def model(device: Device) -> Iterator[HybridModel]:
    """A model of :func:`swap_config` on the test's device (the ``device`` fixture), torn down
    after the test."""
    m = HybridModel(swap_config(), device)
    yield m
    m.teardown()


def random_bytes(rng: np.random.Generator, nbytes: int) -> npt.NDArray[np.uint8]:
    """Random bytes, none of them zero (zeros would hide a restore that wrote nothing)."""
    return rng.integers(1, 256, size=nbytes, dtype=np.uint8)


def fill_sequence(model: HybridModel, seq: SequenceState, num_tokens: int, rng: np.random.Generator) -> None:
    """Grow ``seq`` to ``num_tokens`` tokens, append random token ids and write random bytes into
    every block of every attention layer and into its SSM slot."""
    if model.kv_pool is not None:
        model.grow(seq, num_tokens)
    seq.append_tokens(rng.integers(0, 50_000, size=num_tokens))
    seq.prompt_len = num_tokens // 2
    device = model.device
    kv = model.kv_pool
    if kv is not None:
        for addr, nbytes in kv.block_ranges(seq.block_table.tolist()):
            write_device(device, addr, random_bytes(rng, nbytes))
    ssm = model.ssm_pool
    if ssm is not None and not seq.is_detached:
        for addr, nbytes in ssm.slot_ranges(seq.slot_idx):
            write_device(device, addr, random_bytes(rng, nbytes))


def kv_image(model: HybridModel, seq: SequenceState) -> bytes:
    """The KV bytes of the sequence's blocks, every layer, in block-table order."""
    kv = model.kv_pool
    if kv is None:
        return b""
    return b"".join(read_device(model.device, a, n).tobytes() for a, n in kv.block_ranges(seq.block_table.tolist()))


def slot_image(model: HybridModel, slot: int) -> bytes:
    """Every SSM byte of ``slot``."""
    ssm = model.ssm_pool
    if ssm is None:
        return b""
    return b"".join(read_device(model.device, a, n).tobytes() for a, n in ssm.slot_ranges(slot))


def section_spans(model: HybridModel, num_blocks: int, meta_bytes: int) -> list[tuple[str, int, int]]:
    """(name, start, end) of every part of a record of ``model``: the header, then each section's
    payload and its checksum."""
    spans = [("header", 0, HEADER_BYTES)]
    sizes: list[tuple[str, int]] = [("meta", meta_bytes)]
    kv = model.kv_pool
    if kv is not None:
        sizes += [(f"kv attention-layer {i}", num_blocks * kv.layer_block_bytes(i)) for i in range(kv.num_layers)]
    ssm = model.ssm_pool
    if ssm is not None:
        sizes += [
            (f"ssm layer {i // 2} {'conv' if i % 2 else 'h'}-state", n) for i, (_, n) in enumerate(ssm.slot_ranges(0))
        ]
    offset = HEADER_BYTES
    for name, size in sizes:
        spans.append((name, offset, offset + size))
        spans.append((f"{name} checksum", offset + size, offset + size + 8))
        offset += size + 8
    return spans

