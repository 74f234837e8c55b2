"""The per-request calls of ``HybridModel``, compiled into its base class (pyx/modelcalls.pyx)."""

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

from lifecycle._records import SequenceState

_Prompt = Sequence[int] | npt.NDArray[np.integer]
_MMKey = tuple[bytes | str | int, int, int]

@disjoint_base
class ModelCalls:
    """The per-request calls of a model (a base of ``HybridModel``, which binds them once it has
    built its parts: :meth:`_bind_calls`)."""

    _torn_down: bool
    def _bind_calls(
        self, parts: Any, on_release: Callable[[int], None], budget_limit: int, plain_alloc: bool,
        plain_attach: bool, plain_finish: bool,
    ) -> None: ...
    def alloc_sequence_for(self, budget_tokens: int) -> SequenceState: ...
    def attach_prefix(
        self, seq: SequenceState, prompt: _Prompt, *, grow_to: int | None = None,
        cache_salt: bytes | str | int | None = None, mm_keys: Sequence[_MMKey] | None = None,
    ) -> int: ...
    def finish_sequence(self, seq: SequenceState) -> None: ...
