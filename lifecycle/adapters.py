"""The old name of :mod:`lifecycle.lora`, the LoRA adapter slots: it re-exports that module's names
and warns (``DeprecationWarning``) when imported. Import from :mod:`lifecycle.lora`, or
``AdapterInfo`` from :mod:`lifecycle`. (The engine adapters are :mod:`lifecycle.integrations`.)"""

from __future__ import annotations

import warnings

from lifecycle.lora import AdapterInfo, AdapterTable, adapter_key

__all__ = ["AdapterInfo", "AdapterTable", "adapter_key"]

warnings.warn(
    "lifecycle.adapters is deprecated: import from lifecycle.lora (AdapterInfo also from lifecycle)",
    DeprecationWarning,
    stacklevel=2,
)
