"""Modules under their old names: each re-exports its new home's names and warns when imported."""

from __future__ import annotations

import importlib
import sys

import pytest

import lifecycle.lora


def test_the_old_adapters_module_reexports_the_lora_slots_and_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "lifecycle.adapters", raising=False)
    with pytest.warns(DeprecationWarning, match=r"lifecycle\.adapters is deprecated: import from lifecycle\.lora"):
        old = importlib.import_module("lifecycle.adapters")
    for name in old.__all__:
        assert getattr(old, name) is getattr(lifecycle.lora, name), name
    assert set(old.__all__) == {"AdapterInfo", "AdapterTable", "adapter_key"}
