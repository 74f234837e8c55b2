"""The old name of :mod:`lifecycle.swap.tier`, the whole-sequence swap tier: it re-exports that
module's names and warns (``DeprecationWarning``) when imported. Import from
:mod:`lifecycle.swap.tier`, or ``SwapTier`` and ``SwapHandle`` from :mod:`lifecycle`."""

from __future__ import annotations

import warnings

from lifecycle.swap.tier import DEFAULT_HOST_BYTES, SwapHandle, SwapTier

__all__ = ["DEFAULT_HOST_BYTES", "SwapHandle", "SwapTier"]

warnings.warn(
    "lifecycle.swap_tier is deprecated: import from lifecycle.swap.tier (SwapTier and SwapHandle also from lifecycle)",
    DeprecationWarning,
    stacklevel=2,
)
