"""What importing lifecycle loads: its public names come on first use (PEP 562), so that a light
module such as ``lifecycle.protocol`` loads no compiled code, and ``import lifecycle`` loads
nothing but the package itself.

Each check runs in a fresh interpreter, since this process has imported everything already.
"""

from __future__ import annotations

import ast
import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lifecycle

ROOT = Path(__file__).resolve().parent.parent


def loaded_after(statement: str) -> list[str]:
    """The lifecycle modules in sys.modules after ``statement`` runs in a fresh interpreter."""
    report = "import json, sys; print(json.dumps(sorted(m for m in sys.modules if m.startswith('lifecycle'))))"
    script = f"{statement}\n{report}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120, check=True)
    modules: list[str] = json.loads(result.stdout.splitlines()[-1])
    return modules


def test_importing_the_protocol_loads_no_compiled_module() -> None:
    loaded = loaded_after("import lifecycle.protocol")
    assert "lifecycle.protocol" in loaded
    assert not [m for m in loaded if m.startswith("lifecycle._")], loaded


def test_importing_the_package_loads_no_submodule() -> None:
    assert loaded_after("import lifecycle") == ["lifecycle"]


def test_a_public_name_loads_its_module_on_first_use() -> None:
    loaded = loaded_after("import lifecycle\nlifecycle.HybridModel")
    assert {"lifecycle.model", "lifecycle._kvcache"} <= set(loaded)


def test_every_public_name_is_the_object_its_module_defines() -> None:
    table = lifecycle._MODULE_OF
    assert set(table) == set(lifecycle.__all__) - {"__version__"}
    for name in lifecycle.__all__:
        value = getattr(lifecycle, name)
        if name != "__version__":
            assert value is getattr(importlib.import_module(table[name]), name), name


def test_the_typed_imports_name_the_same_modules_as_the_lazy_table() -> None:
    # mypy reads the TYPE_CHECKING imports, the runtime the table: they must agree name for name.
    tree = ast.parse((ROOT / "lifecycle" / "__init__.py").read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    typed = {alias.name: node.module for node in guarded.body if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    assert typed == lifecycle._MODULE_OF


def test_star_import_gives_every_public_name() -> None:
    namespace: dict[str, object] = {}
    exec("from lifecycle import *", namespace)
    assert set(lifecycle.__all__) <= set(namespace)


def test_dir_lists_every_public_name() -> None:
    assert set(lifecycle.__all__) <= set(dir(lifecycle))


def test_a_submodule_is_an_attribute_without_its_own_import() -> None:
    loaded = loaded_after("import lifecycle\nassert lifecycle.config.ModelConfig.__name__ == 'ModelConfig'")
    assert "lifecycle.config" in loaded


@pytest.mark.parametrize("name", ["NoSuchName", "no_such_module", "_private"])
def test_an_unknown_name_raises_attribute_error(name: str) -> None:
    with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
        getattr(lifecycle, name)


def test_the_package_logger_has_a_null_handler() -> None:
    handlers = logging.getLogger("lifecycle").handlers
    assert any(isinstance(handler, logging.NullHandler) for handler in handlers), handlers
