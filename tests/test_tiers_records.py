"""The block record of the shared store: what decodes, and what is refused as foreign or corrupt."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from lifecycle.config import AttentionLayer, ModelConfig
from lifecycle.errors import InvalidId
from lifecycle.tiers.keys import namespace_of
from lifecycle.tiers.records import HEADER_BYTES, RecordCorrupt, RecordForeign, RecordLayout

CONFIG = ModelConfig(layers=(AttentionLayer(num_kv_heads=2, head_dim=8),) * 2, block_size=4, num_blocks=8)
LAYOUT = RecordLayout.of(CONFIG)
TOKENS = np.array([5, 6, 7, 8], dtype=np.int32)
KV = bytes(range(256)) * (LAYOUT.kv_bytes // 256)
KEY = (0xFEED_0000_0000_0001, 0x0BAD_0000_0000_0002)
PARENT = (0x1111, 0x2222)


def encoded() -> bytearray:
    return bytearray(LAYOUT.encode(KEY, PARENT, TOKENS, KV))


def test_a_record_decodes_to_its_key_parent_tokens_and_kv() -> None:
    record = LAYOUT.decode(bytes(encoded()), KEY, PARENT)
    assert (record.key, record.parent, record.tokens.tolist(), bytes(record.kv)) == (KEY, PARENT, TOKENS.tolist(), KV)


def test_the_layout_follows_the_model() -> None:
    expected = (CONFIG.fingerprint(), 4, CONFIG.kv_block_bytes(), namespace_of(CONFIG))
    assert (LAYOUT.fingerprint, LAYOUT.block_size, LAYOUT.kv_bytes, LAYOUT.namespace) == expected
    assert len(encoded()) == LAYOUT.record_bytes == HEADER_BYTES + 4 * 4 + CONFIG.kv_block_bytes()


def test_a_flipped_kv_byte_is_corrupt() -> None:
    value = encoded()
    value[-1] ^= 0x01
    with pytest.raises(RecordCorrupt, match="checksum"):
        LAYOUT.decode(bytes(value), KEY, PARENT)


def test_a_flipped_token_is_corrupt() -> None:
    value = encoded()
    value[HEADER_BYTES] ^= 0x01
    with pytest.raises(RecordCorrupt):
        LAYOUT.decode(bytes(value), KEY, PARENT)


@pytest.mark.parametrize("offset", [16, 32, 48])  # the namespace, the key, the parent
def test_a_flipped_header_field_is_corrupt(offset: int) -> None:
    value = encoded()
    value[offset] ^= 0x01
    with pytest.raises(RecordCorrupt):
        LAYOUT.decode(bytes(value), KEY, PARENT)


def test_a_record_of_another_key_is_foreign() -> None:
    with pytest.raises(RecordForeign, match="key low word"):
        LAYOUT.decode(bytes(encoded()), (KEY[0], KEY[1] + 1), PARENT)


def test_a_record_after_another_parent_is_foreign() -> None:
    with pytest.raises(RecordForeign, match="parent key high word"):
        LAYOUT.decode(bytes(encoded()), KEY, (PARENT[0] + 1, PARENT[1]))


@pytest.mark.parametrize("other", [CONFIG.replace(name="other-model"), None])
def test_a_record_of_another_namespace_is_foreign(other: ModelConfig | None) -> None:
    namespace = namespace_of(CONFIG, "other weights") if other is None else namespace_of(other)
    foreign = RecordLayout.of(CONFIG, namespace)
    with pytest.raises(RecordForeign, match="namespace"):
        LAYOUT.decode(foreign.encode(KEY, PARENT, TOKENS, KV), KEY, PARENT)


def test_a_record_of_another_byte_format_is_foreign() -> None:
    other = RecordLayout(LAYOUT.fingerprint ^ 1, LAYOUT.block_size, LAYOUT.kv_bytes, LAYOUT.namespace)
    with pytest.raises(RecordForeign, match="fingerprint"):
        LAYOUT.decode(other.encode(KEY, PARENT, TOKENS, KV), KEY, PARENT)


def test_a_truncated_record_is_foreign() -> None:
    with pytest.raises(RecordForeign, match=f"takes {LAYOUT.record_bytes}"):
        LAYOUT.decode(bytes(encoded()[:-1]), KEY, PARENT)


def test_bytes_that_are_no_record_are_foreign() -> None:
    with pytest.raises(RecordForeign, match="magic"):
        LAYOUT.decode(b"x" * LAYOUT.record_bytes, KEY, PARENT)


def test_a_record_of_another_version_is_foreign() -> None:
    value = encoded()
    struct.pack_into("<H", value, 4, 1)
    with pytest.raises(RecordForeign, match="version 1"):
        LAYOUT.decode(bytes(value), KEY, PARENT)


def test_encode_refuses_kv_of_another_size() -> None:
    with pytest.raises(InvalidId, match=f"kv_bytes={LAYOUT.kv_bytes}"):
        LAYOUT.encode(KEY, PARENT, TOKENS, KV[:-1])


def test_a_model_without_attention_layers_has_no_layout() -> None:
    from lifecycle.config import SSMLayer

    ssm_only = ModelConfig(layers=(SSMLayer(h_state_bytes=64, conv_state_bytes=32),))
    with pytest.raises(InvalidId, match="no attention layer"):
        RecordLayout.of(ssm_only)
