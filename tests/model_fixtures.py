"""Fixtures the model suites share (imported by name into each suite, as ``devices``' are)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lifecycle.model import HybridModel


@pytest.fixture
def models() -> Iterator[list[HybridModel]]:
    """Models a test builds; each is checked and torn down after it, and must not have leaked."""
    built: list[HybridModel] = []
    yield built
    for model in built:
        if model.teardown_report is None:
            model.check_invariants()
            model.teardown()
        report = model.teardown_report
        assert report is not None and report.leaked == 0, report
