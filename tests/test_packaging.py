"""lifecycle._packaging: the pip command a message should name, and an installed copy shadowing
the checkout a user works in."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lifecycle import _packaging


def make_checkout(folder: Path) -> Path:
    (folder / "lifecycle").mkdir(parents=True)
    (folder / "lifecycle" / "__init__.py").write_text("")
    (folder / "pyproject.toml").write_text('[project]\nname = "kv-lifecycle"\n')
    return folder


def test_the_plot_hint_keeps_an_editable_install_editable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_packaging, "editable_checkout", lambda: tmp_path)
    hint = _packaging.plot_install_hint()
    assert f"pip install -e '{tmp_path}[plot]'" in hint
    assert "pip install matplotlib" in hint


def test_the_plot_hint_of_an_installed_copy_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_packaging, "editable_checkout", lambda: None)
    assert "pip install 'kv-lifecycle[plot]'" in _packaging.plot_install_hint()


def test_a_copy_running_inside_a_checkout_is_reported(tmp_path: Path) -> None:
    checkout = make_checkout(tmp_path / "src")
    (checkout / "docs").mkdir()
    installed = tmp_path / "site-packages" / "lifecycle"
    assert _packaging.shadowed_checkout(checkout / "docs", installed) == checkout


def copy_of(checkout: Path, site_packages: Path) -> Path:
    installed = site_packages / "lifecycle"
    shutil.copytree(checkout / "lifecycle", installed)
    return installed


def test_a_fresh_pip_install_of_the_checkout_is_not_reported(tmp_path: Path) -> None:
    checkout = make_checkout(tmp_path / "src")
    (checkout / "lifecycle" / "model.py").write_text("x = 1\n")
    installed = copy_of(checkout, tmp_path / "site-packages")
    (installed / "_kvcache.pyi").write_text("")  # the wheel's stubs are not sources
    assert _packaging.shadowed_checkout(checkout, installed) is None


@pytest.mark.parametrize("change", ["edited", "added", "removed"])
def test_a_copy_older_than_the_checkouts_edits_is_reported(tmp_path: Path, change: str) -> None:
    checkout = make_checkout(tmp_path / "src")
    (checkout / "lifecycle" / "model.py").write_text("x = 1\n")
    installed = copy_of(checkout, tmp_path / "site-packages")
    if change == "edited":
        (checkout / "lifecycle" / "model.py").write_text("x = 2\n")
    elif change == "added":
        (checkout / "lifecycle" / "sub").mkdir()
        (checkout / "lifecycle" / "sub" / "new.py").write_text("")
    else:
        (checkout / "lifecycle" / "model.py").unlink()
    assert _packaging.shadowed_checkout(checkout, installed) == checkout


def test_the_warning_says_the_sources_differ_and_how_to_run_the_checkout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    checkout = make_checkout(tmp_path / "src")
    monkeypatch.setattr(_packaging, "PACKAGE_DIR", tmp_path / "site-packages" / "lifecycle")
    monkeypatch.setattr(_packaging, "shadowed_checkout", lambda cwd: checkout)
    warning = _packaging.shadowed_checkout_warning(checkout)
    assert warning is not None and "sources differ from the checkout" in warning
    assert f"pip install -e '{checkout}[test,plot]'" in warning and "editable" not in warning.split(";")[0]


def test_the_checkout_itself_running_is_not_reported(tmp_path: Path) -> None:
    checkout = make_checkout(tmp_path / "src")
    assert _packaging.shadowed_checkout(checkout, checkout / "lifecycle") is None


def test_outside_any_checkout_nothing_is_reported(tmp_path: Path) -> None:
    assert _packaging.shadowed_checkout(tmp_path, tmp_path / "site-packages" / "lifecycle") is None


def test_another_project_with_a_lifecycle_folder_is_not_a_checkout(tmp_path: Path) -> None:
    other = make_checkout(tmp_path / "other")
    (other / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    assert _packaging.shadowed_checkout(other, tmp_path / "site-packages" / "lifecycle") is None


def test_this_test_run_imports_the_checkout_it_tests() -> None:
    root = Path(__file__).resolve().parent.parent
    assert _packaging.shadowed_checkout(root) is None
    assert _packaging.shadowed_checkout_warning(root) is None
