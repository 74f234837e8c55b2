"""Modules under their old names: each re-exports its new home's names and warns when imported."""

from __future__ import annotations

import importlib
import sys

import pytest

import lifecycle.lora
import lifecycle.tiers.promote


def test_the_old_adapters_module_reexports_the_lora_slots_and_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "lifecycle.adapters", raising=False)
    with pytest.warns(DeprecationWarning, match=r"lifecycle\.adapters is deprecated: import from lifecycle\.lora"):
        old = importlib.import_module("lifecycle.adapters")
    for name in old.__all__:
        assert getattr(old, name) is getattr(lifecycle.lora, name), name
    assert set(old.__all__) == {"AdapterInfo", "AdapterTable", "adapter_key"}


def test_the_old_tiering_module_reexports_the_model_tiers_and_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "lifecycle.tiering", raising=False)
    warning = r"lifecycle\.tiering is deprecated: import from lifecycle\.tiers\.promote"
    with pytest.warns(DeprecationWarning, match=warning):
        old = importlib.import_module("lifecycle.tiering")
    for name in old.__all__:
        assert getattr(old, name) is getattr(lifecycle.tiers.promote, name), name
    assert "ModelTiers" in old.__all__
