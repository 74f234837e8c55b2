"""The record's streams: the caller's writer and reader behind counting, checking wrappers.

A writer with ``reserve(nbytes) -> memoryview`` (the next ``nbytes`` of its destination, counted as
written) and a reader with ``claim(nbytes) -> memoryview`` (its next bytes, at most ``nbytes``,
counted as read) get the payload copied in and out with streaming stores. A stream that breaks the
contract raises :class:`~lifecycle.errors.SwapStreamError`; its own exceptions are re-raised as
:class:`~lifecycle.errors.SwapError` naming the section and offset.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import BinaryIO, Final

import numpy as np
import numpy.typing as npt

from lifecycle._hostcopy import stream_copy
from lifecycle.errors import LifecycleError, SwapError, SwapFormatError, SwapStreamError

__all__: list[str] = []


class _Out:
    """The writer, counting bytes; wraps the writer's own exceptions in SwapError.

    A writer with a ``reserve(nbytes)`` method returning a writable memoryview of the next
    ``nbytes`` bytes of its destination (the swap tier's host pool has one) gets the large
    sections copied straight in with streaming stores, instead of through ``write``."""

    __slots__ = ("writer", "offset", "section", "reserve")

    def __init__(self, writer: BinaryIO) -> None:
        self.writer = writer
        self.offset = 0
        self.section = "header"
        reserve = getattr(writer, "reserve", None)
        self.reserve: Callable[[int], memoryview] | None = reserve if callable(reserve) else None

    def write(self, data: bytes | memoryview) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        total = view.nbytes
        done = 0
        try:
            while done < total:
                done += self._accepted(self.writer.write(view[done:] if done else view), total - done)
        except LifecycleError:
            raise
        except Exception as exc:
            raise SwapError(
                f"writing section {self.section!r} at byte {self.offset + done} failed: {exc!r}"
            ) from exc
        self.offset += total

    def _accepted(self, n: object, offered: int) -> int:
        """How many of the ``offered`` bytes one ``write`` took: 1..offered, or SwapStreamError."""
        if n is None:
            if isinstance(self.writer, io.RawIOBase):
                raise SwapStreamError(
                    f"writer {self.writer!r} returned None for {offered} bytes: a non-blocking stream that "
                    "cannot take them now (swap needs a blocking writer)"
                )
            return offered  # a hand-written writer that, like file.write in Python 2, returns nothing
        count = _stream_count(n)
        if count is None or not 0 < count <= offered:
            raise SwapStreamError(
                f"writer {self.writer!r} returned {n!r} for {offered} bytes offered; a write returns how "
                f"many it took, 1..{offered}"
            )
        return count

    def write_bulk(self, view: memoryview) -> None:
        """``write`` for a large piece of payload (a flat byte view)."""
        if self.reserve is None:
            self.write(view)
            return
        total = view.nbytes
        try:
            dest = self.reserve(total)
            if not isinstance(dest, memoryview) or dest.nbytes != total:
                raise SwapStreamError(f"writer.reserve({total}) returned {dest!r}, not a memoryview of {total} bytes")
            stream_copy(dest.cast("B"), view)
        except LifecycleError:
            raise
        except Exception as exc:
            raise SwapError(f"writing section {self.section!r} at byte {self.offset} failed: {exc!r}") from exc
        self.offset += total


_READ_CHUNK: Final = 1 << 20


class _In:
    """The reader, counting bytes; a short stream raises SwapFormatError naming the offset."""

    __slots__ = ("reader", "offset", "section", "record_bytes", "_readinto", "_claim")

    def __init__(self, reader: BinaryIO) -> None:
        self.reader = reader
        self.offset = 0
        self.section = "header"
        self.record_bytes: int | None = None
        self._readinto = getattr(reader, "readinto", None)
        # A reader with claim(nbytes) -> memoryview of its next (at most) nbytes bytes, counted
        # as read (the swap tier's host pool has one): large pieces are copied straight out of it.
        claim = getattr(reader, "claim", None)
        self._claim: Callable[[int], memoryview] | None = claim if callable(claim) else None

    def _truncated(self, got: int, total: int) -> SwapFormatError:
        size = f" of a {self.record_bytes}-byte record" if self.record_bytes is not None else ""
        return SwapFormatError(
            f"record truncated: stream ended at byte {self.offset + got}{size}, inside section "
            f"{self.section!r} ({total - got} more bytes expected)"
        )

    def readinto_bulk(self, view: memoryview) -> memoryview:
        """``readinto`` for a large piece of payload (a flat byte view); returns a view of the
        same bytes that is still in the cache, for the checksum."""
        if self._claim is None:
            self.readinto(view)
            return view
        total = view.nbytes
        try:
            source = self._claim(total)
            if not isinstance(source, memoryview) or source.nbytes > total:
                raise SwapStreamError(
                    f"reader.claim({total}) returned {source!r}, not a memoryview of at most {total} bytes"
                )
            source = source.cast("B")
            got = source.nbytes
            if got:
                stream_copy(view[:got] if got < total else view, source)
        except LifecycleError:
            raise
        except Exception as exc:
            raise SwapError(f"reading section {self.section!r} at byte {self.offset} failed: {exc!r}") from exc
        if got < total:
            raise self._truncated(got, total)
        self.offset += total
        return source

    def readinto(self, view: memoryview) -> None:
        """Fill ``view`` exactly (it is a byte view)."""
        total = view.nbytes
        got = 0
        try:
            while got < total:
                if self._readinto is not None:
                    n = self._delivered(self._readinto(view[got:] if got else view), total - got, "readinto")
                else:
                    chunk = self.reader.read(total - got)
                    n = self._delivered(None if chunk is None else len(chunk), total - got, "read")
                    view[got : got + n] = chunk
                if not n:
                    break
                got += n
        except LifecycleError:
            raise
        except Exception as exc:
            raise SwapError(f"reading section {self.section!r} at byte {self.offset + got} failed: {exc!r}") from exc
        if got < total:
            raise self._truncated(got, total)
        self.offset += total

    def _delivered(self, n: object, asked: int, call: str) -> int:
        """How many bytes one ``readinto`` / ``read`` delivered: 0 (end of stream) .. asked, or
        SwapStreamError (a count that is not an int, negative, or more than asked; None)."""
        if n is None:
            raise SwapStreamError(
                f"reader {self.reader!r}: {call} returned None for {asked} bytes: a non-blocking stream with no "
                f"data ready (swap needs a blocking reader); section {self.section!r}"
            )
        count = _stream_count(n)
        if count is None or not 0 <= count <= asked:
            raise SwapStreamError(
                f"reader {self.reader!r}: {call} of {asked} bytes returned {n!r}; it must deliver 0..{asked} "
                f"(section {self.section!r})"
            )
        return count

    def read(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """Read exactly ``nbytes``. Memory grows with the bytes that actually arrive (chunks of at
        most ``_READ_CHUNK``), so a forged size on a short stream fails as truncated before it can
        allocate what it announced."""
        if nbytes <= _READ_CHUNK:
            out = np.empty(nbytes, dtype=np.uint8)
            self.readinto(out.data)
            return out
        parts = []
        left = nbytes
        while left:
            part = np.empty(min(left, _READ_CHUNK), dtype=np.uint8)
            self.readinto(part.data)
            parts.append(part)
            left -= part.shape[0]
        return np.concatenate(parts)


def _stream_count(n: object) -> int | None:
    """A byte count a stream returned, as an int (None: not an int, or a bool)."""
    if isinstance(n, bool):
        return None
    if isinstance(n, int):
        return n
    if isinstance(n, np.integer):
        return int(n)
    return None
