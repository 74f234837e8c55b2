"""The block record of the shared store: what decodes, and what is refused as foreign or corrupt."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from lifecycle.config import AttentionLayer, ModelConfig
from lifecycle.errors import InvalidId
from lifecycle.tiers.records import HEADER_BYTES, RecordCorrupt, RecordForeign, RecordLayout, adapter_id

CONFIG = ModelConfig(layers=(AttentionLayer(num_kv_heads=2, head_dim=8),) * 2, block_size=4, num_blocks=8)
LAYOUT = RecordLayout.of(CONFIG)
TOKENS = np.array([5, 6, 7, 8], dtype=np.int32)
KV = bytes(range(256)) * (LAYOUT.kv_bytes // 256)
HASH = 0xFEED_0000_0000_0001
ADAPTER = adapter_id("tenant-a")


def encoded() -> bytearray:
    return bytearray(LAYOUT.encode(HASH, ADAPTER, TOKENS, KV))


def test_a_record_decodes_to_its_tokens_and_kv() -> None:
    record = LAYOUT.decode(bytes(encoded()), HASH, ADAPTER)
    assert (record.content_hash, record.adapter_id, record.tokens.tolist(), bytes(record.kv)) == (
        HASH, ADAPTER, TOKENS.tolist(), KV,
    )


def test_the_layout_follows_the_model() -> None:
    expected = (CONFIG.fingerprint(), 4, CONFIG.kv_block_bytes())
    assert (LAYOUT.fingerprint, LAYOUT.block_size, LAYOUT.kv_bytes) == expected
    assert len(encoded()) == LAYOUT.record_bytes == HEADER_BYTES + 4 * 4 + CONFIG.kv_block_bytes()


def test_a_flipped_kv_byte_is_corrupt() -> None:
    value = encoded()
    value[-1] ^= 0x01
    with pytest.raises(RecordCorrupt, match="checksum"):
        LAYOUT.decode(bytes(value), HASH, ADAPTER)


def test_a_flipped_token_is_corrupt() -> None:
    value = encoded()
    value[HEADER_BYTES] ^= 0x01
    with pytest.raises(RecordCorrupt):
        LAYOUT.decode(bytes(value), HASH, ADAPTER)


def test_a_flipped_header_field_is_corrupt() -> None:
    value = encoded()
    value[24] ^= 0x01  # the content hash
    with pytest.raises(RecordCorrupt):
        LAYOUT.decode(bytes(value), HASH, ADAPTER)


def test_a_record_of_another_block_is_foreign() -> None:
    with pytest.raises(RecordForeign, match="content hash"):
        LAYOUT.decode(bytes(encoded()), HASH + 1, ADAPTER)


def test_a_record_of_another_adapter_is_foreign() -> None:
    with pytest.raises(RecordForeign, match="adapter id"):
        LAYOUT.decode(bytes(encoded()), HASH, adapter_id(""))


def test_a_record_of_another_model_is_foreign() -> None:
    other = RecordLayout(LAYOUT.fingerprint ^ 1, LAYOUT.block_size, LAYOUT.kv_bytes)
    with pytest.raises(RecordForeign, match="fingerprint"):
        LAYOUT.decode(other.encode(HASH, ADAPTER, TOKENS, KV), HASH, ADAPTER)


def test_a_truncated_record_is_foreign() -> None:
    with pytest.raises(RecordForeign, match=f"takes {LAYOUT.record_bytes}"):
        LAYOUT.decode(bytes(encoded()[:-1]), HASH, ADAPTER)


def test_bytes_that_are_no_record_are_foreign() -> None:
    with pytest.raises(RecordForeign, match="magic"):
        LAYOUT.decode(b"x" * LAYOUT.record_bytes, HASH, ADAPTER)


def test_a_record_of_another_version_is_foreign() -> None:
    value = encoded()
    struct.pack_into("<H", value, 4, 2)
    with pytest.raises(RecordForeign, match="version 2"):
        LAYOUT.decode(bytes(value), HASH, ADAPTER)


def test_encode_refuses_kv_of_another_size() -> None:
    with pytest.raises(InvalidId, match=f"kv_bytes={LAYOUT.kv_bytes}"):
        LAYOUT.encode(HASH, ADAPTER, TOKENS, KV[:-1])


def test_no_adapter_has_id_zero_and_a_name_a_stable_nonzero_id() -> None:
    assert adapter_id("") == 0
    assert adapter_id("tenant-a") == adapter_id("tenant-a") != 0
    assert adapter_id("tenant-a") != adapter_id("tenant-b")


def test_a_model_without_attention_layers_has_no_layout() -> None:
    from lifecycle.config import SSMLayer

    ssm_only = ModelConfig(layers=(SSMLayer(h_state_bytes=64, conv_state_bytes=32),))
    with pytest.raises(InvalidId, match="no attention layer"):
        RecordLayout.of(ssm_only)
