"""The swap record: a versioned, checksummed image of one sequence's memory, and the streaming
save and restore that write and read it.

The byte layout and the versioning policy are in ``docs/swap-format.md``; in short: a 128-byte
little-endian header with its own xxh3-64 checksum, then sections (meta: layer table, adapter name,
tokens; one per attention layer: the KV of the sequence's blocks in block-table order; one per SSM
slot range: h / conv state), each followed by the xxh3-64 of its payload seeded with the section's
index, so two equal-sized sections swapped in the stream do not verify. A model of KV cache groups
writes format 2.0 (``GROUPED_MAJOR``): the header names the groups and the window state, the meta
section where each group holds blocks, and each group's layers have their sections of the blocks
that group holds.

Data moves through a bounded staging buffer (pinned host memory on CUDA, double-buffered so the
copy of one half overlaps the hashing and I/O of the other), so memory use does not grow with the
sequence. On the host device, whose "device" memory is host memory, the bytes are hashed and
written straight from the pools (``SwapContext.zero_copy_host``), which saves one copy.

Writers and readers over memory can skip their own ``write`` / ``readinto`` copy: a writer with
``reserve(nbytes) -> memoryview`` (the next ``nbytes`` of its destination, counted as written) and
a reader with ``claim(nbytes) -> memoryview`` (its next bytes, at most ``nbytes``, counted as read)
get the payload copied in and out with streaming stores, each piece hashed while it is still in
the cache. The swap tier's host pool works this way.

``restore`` is all-or-nothing for the sequence: KV streams into the freshly allocated blocks (the
caller frees them on failure), but the SSM sections (one slot's worth, whatever the sequence's
length) and the token ids are buffered on the host and only written into the sequence's slot and
token list once every checksum verified.

What a record may hold is bounded by the model: at most its per-sequence block limit, and as many
tokens as those blocks cover; ``prompt_len`` and ``ssm_tokens`` within the tokens; token ids in
int32's non-negative range. ``save`` refuses a sequence outside these bounds before writing a byte
(``SequenceStateError``; :func:`check_saveable` is the same rule for a caller that must decide
before anything else, such as a swap tier about to free the sequence), and ``restore`` refuses a
header announcing more before reading past it, so a forged size costs no memory.

Errors: a malformed or truncated record raises :class:`SwapFormatError`, a record of another model
(or block count, or adapter) :class:`SwapModelMismatch`, a corrupted section
:class:`SwapChecksumError`. A reader or writer that breaks the stream contract (a count that is
negative, past what was asked, or not an int; None from a non-blocking stream) raises
:class:`SwapStreamError` at its first such answer. An exception raised by the reader or writer
itself is re-raised as :class:`SwapError` chained from the original (``__cause__``) and naming the
section and offset; a ``LifecycleError`` or a ``BaseException`` that is not an ``Exception``
(``KeyboardInterrupt``) propagates unchanged.

The rooms: :mod:`~lifecycle.swap.format` (constants, header, sizes and bounds),
:mod:`~lifecycle.swap.context` (what save and restore work on), :mod:`~lifecycle.swap.streams`
(the writer and reader), :mod:`~lifecycle.swap.staging` (the staging buffer and the device copies),
:mod:`~lifecycle.swap.saving` and :mod:`~lifecycle.swap.restoring`; :mod:`~lifecycle.swap.sequences`
is a model's sequence saved and restored with its accounting, :mod:`~lifecycle.swap.tier` the
whole-sequence swap tier built on them. Every name below is importable from here.
"""

from __future__ import annotations

from lifecycle.swap.context import SwapContext
from lifecycle.swap.format import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    GROUPED_MAJOR,
    HEADER_BYTES,
    MAGIC,
    MAX_RECORD_TOKENS,
    SwapHeader,
    parse_header,
    record_nbytes,
)
from lifecycle.swap.restoring import read_header, restore
from lifecycle.swap.saving import check_saveable, save
from lifecycle.swap.staging import DEFAULT_STAGING_BYTES, StagingBuffer

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "MAX_RECORD_TOKENS",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "GROUPED_MAJOR",
    "HEADER_BYTES",
    "MAGIC",
    "StagingBuffer",
    "SwapContext",
    "SwapHeader",
    "check_saveable",
    "parse_header",
    "read_header",
    "record_nbytes",
    "restore",
    "save",
]
