"""How lifecycle was installed, for messages that tell the right ``pip`` command.

A source checkout installed editable (``pip install -e '.[test]'``) is imported as the checkout
itself. One installed with ``pip install .`` (or an editable install that a later
``pip install '.[plot]'`` without ``-e`` replaced) runs a copy in site-packages, and edits to the
checkout stop being what runs. The command line warns when it runs such a copy from inside a
checkout whose Python sources differ from it (:func:`shadowed_checkout`): a fresh ``pip install .``
runs exactly the checkout's code, and gets no warning. The plot hint names the command that keeps
an editable install editable (:func:`plot_install_hint`).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

DISTRIBUTION = "kv-lifecycle"
PACKAGE_DIR = Path(__file__).resolve().parent


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def editable_checkout() -> Path | None:
    """The checkout lifecycle is installed from in editable mode, or None (a copy, or not installed
    through pip). The install's own record counts: the ``kv_lifecycle.egg-info`` a build leaves in
    the checkout (found first when the checkout is on ``sys.path``) records no origin."""
    for distribution in metadata.distributions(name=DISTRIBUTION):
        text = distribution.read_text("direct_url.json")
        if not text:
            continue
        origin = json.loads(text)
        if not origin.get("dir_info", {}).get("editable"):
            return None
        url = urlparse(str(origin.get("url", "")))
        return Path(unquote(url.path)) if url.scheme == "file" else None
    return None


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


def _python_sources(package: Path) -> dict[str, bytes]:
    return {path.relative_to(package).as_posix(): path.read_bytes() for path in sorted(package.rglob("*.py"))}


def sources_differ(checkout_package: Path, installed_package: Path) -> bool:
    """Whether an installed copy's Python files are not the checkout's (one added, removed or
    changed). Tens of small files: read whole, only when a copy runs inside a checkout."""
    try:
        return _python_sources(checkout_package) != _python_sources(installed_package)
    except OSError:
        return True


def shadowed_checkout(cwd: Path, package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The lifecycle checkout at or above ``cwd`` when the package running is a copy of other
    code than that checkout's (its Python sources differ), else None."""
    for folder in (cwd, *cwd.parents):
        if _is_lifecycle_checkout(folder):
            package = (folder / "lifecycle").resolve()
            if package == package_dir.resolve() or not sources_differ(package, package_dir):
                return None
            return folder
    return None


def shadowed_checkout_warning(cwd: Path) -> str | None:
    """A warning for :func:`shadowed_checkout`, or None when there is nothing to say."""
    checkout = shadowed_checkout(cwd)
    if checkout is None:
        return None
    return (
        f"warning: running the lifecycle installed at {PACKAGE_DIR}, whose sources differ from the checkout "
        f"{checkout}: edits to the checkout are not what runs; to run the checkout: "
        f"pip install -e '{checkout}[test,plot]'"
    )
