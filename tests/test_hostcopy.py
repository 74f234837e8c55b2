"""The host copy kernel: batches past the streaming threshold (non-temporal stores) stay bit-exact
whatever the alignment and size of each row, and overlapping rows keep memmove semantics."""

from __future__ import annotations

import numpy as np

import pytest

from lifecycle._hostcopy import memmove_rows, put_int32, stream_copy
from lifecycle.errors import InvalidId


def test_a_large_batch_of_unaligned_rows_is_copied_exactly() -> None:
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 48 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    sizes = [4096, 4097, 65536 + 13, 1 << 20, 3, 5000, 2 << 20, 4095]
    rows, placed, i = [], 0, 0
    while placed < (40 << 20):  # well past the streaming threshold
        nbytes = sizes[i % len(sizes)]
        src_off = (13 * i * 1001) % (src.shape[0] - nbytes)
        dst_off = placed + i % 7  # every alignment mod 16 shows up
        rows.append((dst.ctypes.data + dst_off, src.ctypes.data + src_off, nbytes))
        placed, i = dst_off + nbytes + 16, i + 1
    memmove_rows(np.array(rows, dtype=np.int64))
    for dst_addr, src_addr, nbytes in rows:
        d, s = dst_addr - dst.ctypes.data, src_addr - src.ctypes.data
        assert np.array_equal(dst[d : d + nbytes], src[s : s + nbytes])


def test_overlapping_rows_keep_memmove_semantics_in_a_large_batch() -> None:
    buf = np.arange(64 << 20, dtype=np.uint8)  # repeating 0..255
    expected = buf.copy()
    expected[1000 : 1000 + (20 << 20)] = buf[0 : 20 << 20].copy()
    base = buf.ctypes.data
    memmove_rows(np.array([(base + 1000, base, 20 << 20)], dtype=np.int64))
    assert np.array_equal(buf, expected)


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 63, 64, 65, 4096 + 7, (1 << 20) + 3])
@pytest.mark.parametrize("offset", [0, 1, 8, 13])
def test_stream_copy_is_exact_at_every_alignment(size: int, offset: int) -> None:
    rng = np.random.default_rng(size + offset)
    src = rng.integers(0, 256, size + 32, dtype=np.uint8)
    dst = np.zeros(size + 32, dtype=np.uint8)
    stream_copy(dst.data[offset : offset + size], src.data[3 : 3 + size])
    assert np.array_equal(dst[offset : offset + size], src[3 : 3 + size])
    assert not dst[:offset].any() and not dst[offset + size :].any()


def test_stream_copy_refuses_unequal_sizes_and_overlap() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    with pytest.raises(InvalidId, match="holds 8 bytes, source 9"):
        stream_copy(buf.data[:8], buf.data[16:25])
    with pytest.raises(InvalidId, match="overlap"):
        stream_copy(buf.data[:16], buf.data[8:24])
    with pytest.raises(InvalidId, match="dst must be a writable"):
        stream_copy(memoryview(bytes(8)), buf.data[:8])  # read-only destination


def test_put_int32_copies_into_place_or_declines() -> None:
    dst = np.full(10, -1, dtype=np.int32)
    assert put_int32(dst, 2, np.arange(3, dtype=np.int32))
    assert dst.tolist() == [-1, -1, 0, 1, 2, -1, -1, -1, -1, -1]
    assert put_int32(dst, 10, np.empty(0, dtype=np.int32))
    # Anything it cannot do as one memcpy is declined, with nothing written.
    before = dst.copy()
    assert not put_int32(dst, 8, np.arange(3, dtype=np.int32))  # past the end
    assert not put_int32(dst, -1, np.arange(1, dtype=np.int32))
    assert not put_int32(dst, 0, np.arange(3))  # type: ignore[arg-type]  # int64
    assert not put_int32(dst, 0, np.arange(6, dtype=np.int32)[::2])  # strided
    assert not put_int32(dst[::2], 0, np.arange(3, dtype=np.int32))
    assert not put_int32(dst, 0, [1, 2, 3])  # type: ignore[arg-type]
    readonly = np.zeros(4, dtype=np.int32)
    readonly.flags.writeable = False
    assert not put_int32(readonly, 0, np.arange(2, dtype=np.int32))
    assert np.array_equal(dst, before)
