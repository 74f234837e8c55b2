"""The old name of :mod:`lifecycle.tiers.promote`, the model's side of the tiers (demotion,
promotion, their counters): it re-exports that module's names and warns (``DeprecationWarning``)
when imported. Import from :mod:`lifecycle.tiers.promote`."""

from __future__ import annotations

import warnings

from lifecycle.tiers.promote import ModelTiers, TierCounters, check_host_blocks, open_tiers

__all__ = ["ModelTiers", "TierCounters", "check_host_blocks", "open_tiers"]

warnings.warn(
    "lifecycle.tiering is deprecated: import from lifecycle.tiers.promote",
    DeprecationWarning,
    stacklevel=2,
)
