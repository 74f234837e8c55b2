"""How lifecycle was installed, for messages that tell the right ``pip`` command.

A source checkout is installed editable (``pip install -e '.[test]'``): the package imported is the
checkout itself. Installing an extra later with ``pip install '.[plot]'`` (no ``-e``) silently
replaces that with a copy in site-packages, and the checkout's edits stop being what runs. The
command line warns when it sees this (:func:`shadowed_checkout`), and the plot hint names the
command that keeps an editable install editable (:func:`plot_install_hint`).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

DISTRIBUTION = "kv-lifecycle"
PACKAGE_DIR = Path(__file__).resolve().parent


def editable_checkout() -> Path | None:
    """The checkout lifecycle is installed from in editable mode, or None (a copy, or not installed
    through pip)."""
    try:
        text = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    origin = json.loads(text)
    if not origin.get("dir_info", {}).get("editable"):
        return None
    url = urlparse(str(origin.get("url", "")))
    return Path(unquote(url.path)) if url.scheme == "file" else None


def plot_install_hint() -> str:
    """What to run so that ``--plot`` finds matplotlib, keeping an editable install editable."""
    checkout = editable_checkout()
    if checkout is not None:
        return (
            f"--plot needs matplotlib: pip install -e '{checkout}[plot]' (keeps this editable install; "
            "without -e pip would replace it with a copy), or: pip install matplotlib"
        )
    return "--plot needs matplotlib: pip install 'kv-lifecycle[plot]', or: pip install matplotlib"


def _is_lifecycle_checkout(folder: Path) -> bool:
    pyproject = folder / "pyproject.toml"
    if not pyproject.is_file() or not (folder / "lifecycle" / "__init__.py").is_file():
        return False
    return f'name = "{DISTRIBUTION}"' in pyproject.read_text(encoding="utf-8", errors="replace")


def shadowed_checkout(cwd: Path, package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The lifecycle checkout at or above ``cwd`` when the package running is not that checkout's
    (an installed copy shadows it), else None."""
    for folder in (cwd, *cwd.parents):
        if _is_lifecycle_checkout(folder):
            return None if (folder / "lifecycle").resolve() == package_dir.resolve() else folder
    return None


def shadowed_checkout_warning(cwd: Path) -> str | None:
    """A warning for :func:`shadowed_checkout`, or None when there is nothing to say."""
    checkout = shadowed_checkout(cwd)
    if checkout is None:
        return None
    return (
        f"warning: running the lifecycle installed at {PACKAGE_DIR}, not the checkout {checkout} "
        f"(a `pip install '.[...]'` without -e replaces an editable install with a copy); "
        f"to run the checkout: pip install -e '{checkout}[test,plot]'"
    )
