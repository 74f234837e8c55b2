"""The paths of ``HybridModel.step`` off its one core call: a refusal turned into the error that
names the argument of a wrong type, and a step into a block table in CUDA memory
(:func:`lifecycle.block_tables.step_cuda_table`, the model's pinned staging, one host-to-device
copy). The model calls :func:`step_cuda` under its lock."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from lifecycle.block_tables import TableStaging, raise_if_wrong_type, step_cuda_table
from lifecycle.errors import InvalidId

if TYPE_CHECKING:
    from lifecycle._kvcache import KVCacheCore
    from lifecycle.device.base import Device

__all__ = ["cuda_handles", "step_cuda", "step_refused"]


def step_refused(
    error: InvalidId, handles: object, tokens: object, counts: object, rows: object, table: object
) -> None:
    """After the core refused a step: raise ``InvalidType`` for an argument of a type a step
    cannot take; return when the refusal was of a value (the caller re-raises it)."""
    raise_if_wrong_type(error, "step", {"seqs": handles, **_inputs(tokens, counts, rows)}, {"table": table})


def _inputs(tokens: object, counts: object, rows: object) -> dict[str, object]:
    """A step's input arguments by name, those given."""
    return {"tokens": tokens, **{k: v for k, v in (("counts", counts), ("rows", rows)) if v is not None}}


def cuda_handles(handles: object) -> npt.NDArray[np.int64]:
    """A step's handles as the int64 array a CUDA table's step reads."""
    try:
        return np.asarray(handles, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as error:
        raise_if_wrong_type(InvalidId(str(error)), "step", {"seqs": handles})
        raise InvalidId(f"step: handles must be ints, got {handles!r:.60}") from error


def step_cuda(
    core: KVCacheCore, device: Device, staging: TableStaging, handles: npt.NDArray[np.int64], tokens: object,
    counts: object, table: object, rows: object, pad: int | None, cache: bool,
) -> npt.NDArray[np.int32]:
    """A step whose new block ids go into ``table`` in CUDA memory; ``pad`` fills the columns
    past each sequence's blocks."""
    try:
        return step_cuda_table(core, device, staging, handles, tokens, counts, table, rows, pad, cache)
    except InvalidId as error:
        raise_if_wrong_type(error, "step", _inputs(tokens, counts, rows))
        raise
