"""``HybridModel.step`` off its one core call: the sequences' handles, a table that is no numpy
array (a CPU tensor or buffer, read in place; rows apart in memory, stepped in a copy; a table in
CUDA memory, whose rows of the batch are written whole through the model's pinned staging in one
host-to-device copy, as :func:`lifecycle.block_tables.write_block_tables` does), and a refusal
turned into the error that names an argument of a type a step cannot take.

The forms a step takes: ``seqs`` are the sequences or, cheaper for a scheduler that keeps them,
their ``handle`` values (an int64 numpy array or CPU tensor, read in place; a list). ``tokens``,
``counts`` and ``rows``: ints as numpy arrays, CPU tensors (int32 and contiguous ones are read in
place, others converted) or lists. ``table``: a numpy array, a CPU tensor (DLPack) or anything with
the buffer protocol, written in place; on a CUDA model also a table in GPU memory
(``__cuda_array_interface__``: torch, CuPy), whose columns past a sequence's blocks get ``pad``
(default: the null block). An argument of a type it cannot take is refused with
:class:`~lifecycle.errors.InvalidType` (a ``TypeError``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, final

import numpy as np
import numpy.typing as npt

from lifecycle.block_tables import TableStaging, raise_if_wrong_type, step_cuda_table
from lifecycle.errors import InvalidId

if TYPE_CHECKING:
    from lifecycle._kvcache import KVCacheCore
    from lifecycle.device.base import Device

__all__ = ["Stepper", "handles_of", "step_refused"]

StepCall = Callable[..., npt.NDArray[np.int32]]


def handles_of(seqs: Any) -> Any:
    """The handles of a step's ``seqs``: read off sequences into an int64 array; handles (a list,
    a tuple, a tensor) as they are, for the core to convert."""
    try:
        return np.fromiter((s.handle for s in seqs), np.int64, len(seqs))
    except AttributeError:
        return seqs
    except TypeError as error:
        raise_if_wrong_type(InvalidId(str(error)), "step", {"seqs": seqs})
        raise


def step_refused(
    error: InvalidId, handles: object, tokens: object, counts: object, rows: object, table: object
) -> None:
    """After the core refused a step: raise ``InvalidType`` for an argument of a type a step
    cannot take; return when the refusal was of a value (the caller re-raises it)."""
    raise_if_wrong_type(error, "step", {"seqs": handles, **_inputs(tokens, counts, rows)}, {"table": table})


def _inputs(tokens: object, counts: object, rows: object) -> dict[str, object]:
    """A step's input arguments by name, those given."""
    return {"tokens": tokens, **{k: v for k, v in (("counts", counts), ("rows", rows)) if v is not None}}


@final
class Stepper:
    """The steps of one model into a table that is no plain numpy array: ``step`` is the model's
    own (for the copy of a host table), the CUDA path runs in ``gate`` (the model's lock) counted
    by ``clock``, ``drained`` after it."""

    __slots__ = ("_clock", "_core", "_device", "_drained", "_gate", "_staging", "_step")

    def __init__(
        self, core: KVCacheCore, device: Device, staging: TableStaging, gate: AbstractContextManager[None],
        clock: AbstractContextManager[None], drained: Callable[[], None], step: StepCall,
    ) -> None:
        self._core, self._device, self._staging = core, device, staging
        self._gate, self._clock, self._drained, self._step = gate, clock, drained, step

    def into(
        self, handles: Any, tokens: Any, counts: Any, table: object, host: npt.NDArray[np.int32] | None, rows: Any,
        cache: bool, pad: int | None,
    ) -> npt.NDArray[np.int32]:
        """A step whose new block ids go into ``table``: in CUDA memory (``host`` None), or a host
        table whose rows lie apart in memory (``host``, its array: a slice of rows), stepped in a copy."""
        if host is None:
            return self._cuda(handles, tokens, counts, table, rows, cache, pad)
        scratch = np.ascontiguousarray(host)
        refused = self._step(handles, tokens, counts=counts, table=scratch, rows=rows, cache=cache)
        host[...] = scratch
        return refused

    def _cuda(
        self, handles: object, tokens: object, counts: object, table: object, rows: object, cache: bool,
        pad: int | None,
    ) -> npt.NDArray[np.int32]:
        try:
            wanted = np.asarray(handles, dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as error:
            raise_if_wrong_type(InvalidId(str(error)), "step", {"seqs": handles})
            raise InvalidId(f"step: handles must be ints, got {handles!r:.60}") from error
        if pad is None and self._core.null_block >= 0:
            pad = int(self._core.null_block)
        with self._gate, self._clock:
            try:
                return step_cuda_table(
                    self._core, self._device, self._staging, wanted, tokens, counts, table, rows, pad, cache
                )
            except InvalidId as error:
                raise_if_wrong_type(error, "step", _inputs(tokens, counts, rows))
                raise
            finally:
                self._drained()
