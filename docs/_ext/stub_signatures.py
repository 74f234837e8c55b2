"""Sphinx extension: signatures of the compiled modules' functions and methods from their stubs.

The Cython modules (``lifecycle._blockpool`` and the others, built from ``pyx/``) carry docstrings
and untyped signatures (``__text_signature__``, embedded by Cython). Their typed signatures live in
the hand-written stubs ``stubs/lifecycle/_NAME.pyi`` (checked against the modules by
``mypy.stubtest``). This extension reads every stub with :mod:`ast` and hands autodoc the stub's
parameters and return annotation for each compiled function, method and property it documents.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sphinx.util.inspect import safe_getattr

STUBS = Path(__file__).resolve().parents[2] / "stubs" / "lifecycle"

Signature = tuple[str, str]  # (parameters in parentheses, return annotation)


def _signature(function: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> Signature:
    arguments = function.args
    if method and arguments.args and arguments.args[0].arg in ("self", "cls"):
        arguments = ast.arguments(
            posonlyargs=arguments.posonlyargs,
            args=arguments.args[1:],
            vararg=arguments.vararg,
            kwonlyargs=arguments.kwonlyargs,
            kw_defaults=arguments.kw_defaults,
            kwarg=arguments.kwarg,
            defaults=arguments.defaults,  # they belong to the last parameters, never to self
        )
    returns = ast.unparse(function.returns) if function.returns is not None else ""
    return f"({ast.unparse(arguments)})", returns


def _is_property(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in function.decorator_list)


def read_stub(module: str, source: str) -> dict[str, Signature]:
    """``{qualified name: signature}`` of every function, method and property of one stub."""
    found: dict[str, Signature] = {}

    def visit(body: list[ast.stmt], prefix: str, in_class: bool) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.", True)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{node.name}"
                if _is_property(node):
                    found[name] = ("", ast.unparse(node.returns) if node.returns is not None else "")
                elif node.name == "__init__" and in_class:
                    found[prefix.rstrip(".")] = (_signature(node, method=True)[0], "")
                else:
                    found.setdefault(name, _signature(node, method=in_class))

    visit(ast.parse(source).body, f"{module}.", False)
    return found


def load_stubs(folder: Path = STUBS) -> dict[str, Signature]:
    """The signatures of every stub in ``folder`` (``_NAME.pyi`` describes ``lifecycle._NAME``)."""
    signatures: dict[str, Signature] = {}
    for stub in sorted(folder.glob("_*.pyi")):
        signatures.update(read_stub(f"lifecycle.{stub.stem}", stub.read_text()))
    return signatures


def _stub_name(obj: Any, name: str) -> str | None:
    """The stub key of the documented object: its defining module and qualified name."""
    target = obj.fget if isinstance(obj, property) else obj
    module = getattr(target, "__module__", None) or getattr(getattr(target, "__objclass__", None), "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if module is None or qualname is None:
        return None
    return f"{module}.{qualname}"


def _class_getattr(signatures: dict[str, Signature]) -> Callable[..., Any]:
    """autodoc's ``getattr`` for classes. A compiled class's ``__init__`` is a slot wrapper, which
    autodoc takes no constructor signature from (and then cannot take one from the stub either); it
    gets a stand-in function with the wrapper's signature instead."""

    def get(cls: Any, name: str, *default: Any) -> Any:
        value = safe_getattr(cls, name, *default)
        if name != "__init__" or not isinstance(value, _SLOT_WRAPPER) or _stub_name(cls, name) not in signatures:
            return value

        def stand_in(*args: Any, **kwargs: Any) -> None:
            raise NotImplementedError("documentation only")

        stand_in.__signature__ = inspect.signature(value)  # type: ignore[attr-defined]
        return stand_in

    return get


_SLOT_WRAPPER = type(object.__init__)


def setup(app: Any) -> dict[str, Any]:
    signatures = load_stubs()
    app.add_autodoc_attrgetter(type, _class_getattr(signatures))

    def process_signature(
        app: Any, what: str, name: str, obj: Any, options: Any, signature: str | None, return_annotation: str | None
    ) -> Signature | None:
        key = _stub_name(obj, name)
        if key is None or key not in signatures:
            return None
        parameters, returns = signatures[key]
        if what in ("property", "attribute"):
            return None
        return parameters, returns

    app.connect("autodoc-process-signature", process_signature)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
