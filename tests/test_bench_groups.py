"""The model presets of issue 31's group benchmarks (bench/group_presets.py) and the table
bench/peers_groups.py prints: layer kinds, budget and ideal capacity from the published configs'
arithmetic, and how rows without numbers read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import group_presets  # noqa: E402
import peers_groups  # noqa: E402

PRESETS = group_presets.PRESETS


@pytest.mark.parametrize(
    ("name", "full", "windowed", "window"),
    [
        ("gpt-oss-120b", 18, 18, 128),
        ("gpt-oss-20b", 12, 12, 128),
        ("gemma-3-27b", 10, 52, 1024),
        ("llama-4-scout", 12, 36, 8192),
        ("deepseek-v3", 61, 0, 0),
    ],
)
def test_layer_kinds_follow_the_config(name: str, full: int, windowed: int, window: int) -> None:
    preset = PRESETS[name]
    assert (preset.count("full"), len(preset.layers) - preset.count("full"), preset.window) == (full, windowed, window)


def test_config_layer_types_match_the_layer_kinds() -> None:
    for name in ("gpt-oss-120b", "gemma-3-27b"):
        preset = PRESETS[name]
        types = preset.config_json()["layer_types"]
        assert [t == "full_attention" for t in types] == [kind == "full" for kind, _ in preset.layers]


def test_llama4_nope_layers_are_the_full_ones() -> None:
    preset = PRESETS["llama-4-scout"]
    no_rope = preset.config_json()["no_rope_layers"]
    assert [flag == 0 for flag in no_rope] == [kind == "full" for kind, _ in preset.layers]


@pytest.mark.parametrize(("name", "bytes_per_token"), [("gpt-oss-120b", 2 * 8 * 64 * 2), ("deepseek-v3", 576 * 2)])
def test_bytes_per_token_per_layer(name: str, bytes_per_token: int) -> None:
    assert PRESETS[name].bytes_per_token_per_layer == bytes_per_token


def test_budget_is_half_the_all_full_footprint() -> None:
    preset = PRESETS["gpt-oss-120b"]
    assert preset.budget_bytes == 262_144 * 16 * 36 * 2048 // 2


@pytest.mark.parametrize(("name", "ideal"), [("gpt-oss-120b", 127), ("llama-4-scout", 146)])
def test_ideal_32k_sequences_match_the_issue(name: str, ideal: int) -> None:
    assert PRESETS[name].ideal_32k_sequences() == ideal


def test_table_prints_unavailable_and_not_served_rows_without_numbers() -> None:
    rows = [
        {
            "workload": "W3-GROUPS",
            "preset": "gemma-3-27b",
            "library": "lifecycle",
            "unavailable": peers_groups.UNAVAILABLE,
        },
        {"workload": "W3-GROUPS", "preset": "gemma-3-27b", "library": "sglang-swa", "not_served": "forced off"},
    ]
    lines = peers_groups.table(rows).splitlines()
    assert f"lifecycle     {peers_groups.UNAVAILABLE}" in lines
    assert "sglang-swa    not served: forced off" in lines
