"""One exception hierarchy for the whole library.

Every message names the offending value and the limit it broke, so that a scheduler's log line is
enough to find the bug. Errors raised on bad input leave every pool exactly as before the call.
"""

from __future__ import annotations


class LifecycleError(Exception):
    """Base of every error this library raises on purpose."""


class ConfigError(LifecycleError, ValueError):
    """A configuration field is invalid; the message names the field."""


class TornDown(LifecycleError):
    """The model (or pool) was torn down; no call but another teardown is allowed."""


class PoolExhausted(LifecycleError):
    """A pool has nothing left to hand out."""


class OutOfBlocks(PoolExhausted):
    """Fewer free KV blocks than requested; nothing was taken."""


class OutOfSlots(PoolExhausted):
    """No free SSM state slot (or snapshot, or adapter slot) is left."""


class InvalidId(LifecycleError, ValueError):
    """An id (block, slot, adapter) is out of range or not in the state the call needs."""


class InvalidType(InvalidId, TypeError):
    """An argument is of a type the call cannot take (a str or a float array where ids go, an
    object with neither the buffer protocol, DLPack nor ``__array__``, device memory where host
    memory is read); the message names the argument and what it takes."""


class BlockIdOutOfRange(InvalidId):
    """A block id is negative or >= the pool's size."""


class SlotOutOfRange(InvalidId):
    """A slot index is negative or >= the number of slots."""


class DoubleFree(LifecycleError):
    """A release would take a refcount below zero; nothing was changed."""


class SlotInUse(LifecycleError):
    """A slot that must be free (or owned by the caller) belongs to someone else."""


class ForeignSequence(LifecycleError):
    """A sequence that belongs to another model instance was passed in."""


class SequenceStateError(LifecycleError):
    """A sequence is not in a state that allows the call (freed, detached, failed...)."""


class AdapterError(LifecycleError):
    """A LoRA adapter slot reference is invalid (unknown slot, released twice, stale generation)."""


class RetentionError(LifecycleError, ValueError):
    """A retention hint or pin refused: a range past the prompt, a priority outside 0-100, a
    negative duration or TTL, a pin over the budget."""


class InvariantViolation(LifecycleError, AssertionError):
    """``check_invariants()`` found a count that does not match a recount from scratch."""


class Unsupported(LifecycleError, NotImplementedError):
    """The model does not implement an optional method (e.g. swap on a model without pools)."""


class MalformedEvent(LifecycleError, ValueError):
    """An entry of the core's raw KV event log does not have the shape of an event; the message
    names the entry."""


class DeviceError(LifecycleError):
    """A device operation failed."""


class DriverNotFound(DeviceError):
    """No CUDA driver could be loaded, or no GPU is present."""


class ForkedAfterCudaInit(DriverNotFound):
    """This process was forked after its parent initialised CUDA: CUDA cannot be used here (the
    driver refuses every call of a forked child); start workers with the 'spawn' method."""


class CudaError(DeviceError):
    """A CUDA driver call failed; carries the driver's error name, text and the failing call."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        self.call = call
        self.code = code
        self.name = name
        self.text = text
        super().__init__(f"{call} failed: {name} ({code}): {text}")

    def __reduce__(self) -> tuple[type[CudaError], tuple[str, int, str, str]]:
        return (CudaError, (self.call, self.code, self.name, self.text))


class SwapError(LifecycleError):
    """Saving or restoring a sequence failed; the sequence and the pools are unchanged."""


class SwapFormatError(SwapError):
    """A swap record is malformed: wrong magic, version, truncated, or inconsistent header."""


class SwapModelMismatch(SwapError):
    """A swap record was written by a model with another fingerprint, or another block count."""


class SwapChecksumError(SwapError):
    """A section of a swap record does not match its checksum."""


class SwapStreamError(SwapError):
    """The reader or writer broke the stream contract: a count that is negative, not an int, or
    more than was asked; None (a non-blocking stream with nothing ready); a ``reserve`` or
    ``claim`` of the wrong size. Raised at the first such answer, never looped on."""
