"""The host copy kernel: batches past the streaming threshold (non-temporal stores) stay bit-exact
whatever the alignment and size of each row, and overlapping rows keep memmove semantics."""

from __future__ import annotations

import numpy as np

from lifecycle._hostcopy import memmove_rows


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
