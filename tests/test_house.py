"""One owner per piece of state: no module writes another module's private fields.

The scan reads the sources, not the running code. A write is ``x._field = ...``, ``x._field[...] =
...``, an augmented assignment, ``del`` or ``setattr(x, "_field", ...)``, where ``x`` is not
``self`` (or ``cls``). Such a write is the module's own business when ``x`` is a plain name and the
module declares ``_field`` itself (a field of a class it defines: a factory filling its own class's
instance); a write through a chain (``self._trie._lock = ...``) always reaches into another object.
Python sources are read with ``ast``; Cython ones with a regex over their lines, the module's own
fields being the private names its ``cdef`` lines and its ``.pxd`` (``pyx/lifecycle/_NAME.pxd``)
declare. What must stay is listed in ``ALLOWED`` with the reason; an entry that no longer matches
anything fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (file, "owner._field") -> why the write stays for now.
ALLOWED: dict[tuple[str, str], str] = {
    ("pyx/slots.pyx", "self._pool._owners"): (
        "a guard clears its slot's owner in its pool: both classes are slots.pyx's own (a guard is its pool's part)"
    ),
}

_SELF = {"self", "cls"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _python_own_fields(tree: ast.AST) -> set[str]:
    """The private names a Python module declares: assigned on ``self``/``cls`` or in a class body."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in _SELF:
            if _private(node.attr):
                own.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for statement in node.body:
                targets = statement.targets if isinstance(statement, ast.Assign) else (
                    [statement.target] if isinstance(statement, ast.AnnAssign) else []
                )
                own.update(t.id for t in targets if isinstance(t, ast.Name) and _private(t.id))
                if isinstance(statement, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__slots__" for t in statement.targets
                ):
                    own.update(
                        e.value for e in ast.walk(statement.value)
                        if isinstance(e, ast.Constant) and isinstance(e.value, str) and _private(e.value)
                    )
    return own


def _foreign(owner: str, field: str, own: set[str]) -> bool:
    if owner in _SELF:
        return False
    return "." in owner or "(" in owner or "[" in owner or field not in own


def python_writes(source: str) -> list[tuple[int, str]]:
    """``(line, "owner._field")`` of every write into another module's private field in ``source``."""
    tree = ast.parse(source)
    own = _python_own_fields(tree)
    found: list[tuple[int, str]] = []

    def target(node: ast.stmt, expression: ast.expr) -> None:
        if isinstance(expression, (ast.Tuple, ast.List)):
            for element in expression.elts:
                target(node, element)
            return
        if isinstance(expression, ast.Starred):
            target(node, expression.value)
            return
        if isinstance(expression, ast.Subscript):
            expression = expression.value
        if isinstance(expression, ast.Attribute) and _private(expression.attr):
            owner = ast.unparse(expression.value)
            if _foreign(owner, expression.attr, own):
                found.append((node.lineno, f"{owner}.{expression.attr}"))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            for expression in node.targets:
                target(node, expression)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            target(node, node.target)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            call = node.value
            named = call.args[1] if len(call.args) >= 2 else None
            if (
                isinstance(call.func, ast.Name) and call.func.id in ("setattr", "delattr")
                and isinstance(named, ast.Constant) and isinstance(named.value, str) and _private(named.value)
            ):
                owner = ast.unparse(call.args[0])
                if _foreign(owner, named.value, own):
                    found.append((node.lineno, f"{owner}.{named.value}"))
    return sorted(found)


_CYTHON_WRITE = re.compile(
    r"(?<![\w.])(?P<owner>[A-Za-z_]\w*(?:\.\w+)*)\.(?P<field>_\w+)\s*(?:\[[^\]\n]*\]\s*)?"
    r"(?:[-+*/|&^%@]|<<|>>|//|\*\*)?=(?!=)"
)
_PRIVATE_NAME = re.compile(r"\b_\w+")


def cython_writes(source: str, declarations: str = "") -> list[tuple[int, str]]:
    """``(line, "owner._field")`` of every write into another module's private field in the Cython
    ``source``, whose own fields are the private names its ``cdef`` lines and ``declarations`` (its
    ``.pxd``) declare."""
    lines = [line.split("#", 1)[0] for line in source.splitlines()]
    own = set(_PRIVATE_NAME.findall(declarations))
    for line in lines:
        if line.lstrip().startswith(("cdef ", "cpdef ")):
            own.update(_PRIVATE_NAME.findall(line))
    found = []
    for number, line in enumerate(lines, 1):
        for match in _CYTHON_WRITE.finditer(line):
            owner, field = match["owner"], match["field"]
            if _foreign(owner, field, own):
                found.append((number, f"{owner}.{field}"))
    return found


def source_writes() -> dict[tuple[str, str], list[int]]:
    writes: dict[tuple[str, str], list[int]] = {}
    for path in sorted((ROOT / "lifecycle").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for line, write in python_writes(path.read_text()):
            writes.setdefault((name, write), []).append(line)
    for path in sorted((ROOT / "pyx").rglob("*.pyx")):
        name = path.relative_to(ROOT).as_posix()
        pxd = ROOT / "pyx" / "lifecycle" / f"_{path.stem}.pxd"
        declarations = pxd.read_text() if pxd.is_file() else ""
        for line, write in cython_writes(path.read_text(), declarations):
            writes.setdefault((name, write), []).append(line)
    return writes


# --- the scanner ---------------------------------------------------------------------------------------


def test_the_python_scan_finds_every_form_of_write_into_another_objects_private_field() -> None:
    source = (
        "def f(seq, pool, guard, name):\n"
        "    seq._guard = None\n"
        "    pool._owners[3] = 1\n"
        "    pool._count += 1\n"
        "    a, guard._slot = 1, 2\n"
        "    setattr(seq, '_open', False)\n"
        "    del seq._handle\n"
        "    seq.public = 1\n"
        "    seq.__dict__ = {}\n"
        "    setattr(seq, name, 1)\n"
    )
    assert python_writes(source) == [
        (2, "seq._guard"), (3, "pool._owners"), (4, "pool._count"), (5, "guard._slot"), (6, "seq._open"),
        (7, "seq._handle"),
    ]


def test_the_python_scan_leaves_a_modules_writes_into_its_own_fields() -> None:
    source = (
        "class View:\n"
        "    _element = None\n"
        "    def __init__(self):\n"
        "        self._count = 0\n"
        "def make(view, other):\n"
        "    view._element = 1\n"
        "    other._count += 1\n"
        "    view._elsewhere = 2\n"
        "    view.owner._element = 3\n"
    )
    assert python_writes(source) == [(8, "view._elsewhere"), (9, "view.owner._element")]


def test_the_cython_scan_finds_writes_into_fields_the_module_does_not_declare() -> None:
    source = (
        "cdef class Core:\n"
        "    cdef int _count\n"
        "    def f(self, SlotPool slots, Core other):\n"
        "        slots._owners[i] = h\n"
        "        self._trie._lock = 1\n"
        "        self._count += 1\n"
        "        other._count = 2\n"
        "        other._ids += 1\n"
        "        if slots._owners[i] == h:  # slots._x = 1 in a comment\n"
        "            pass\n"
    )
    assert cython_writes(source) == [(4, "slots._owners"), (5, "self._trie._lock"), (8, "other._ids")]
    assert cython_writes(source, declarations="cdef class Core:\n    cdef int _ids\n") == [
        (4, "slots._owners"), (5, "self._trie._lock"),
    ]


# --- the sources --------------------------------------------------------------------------------------


def test_no_module_writes_another_modules_private_fields() -> None:
    unlisted = {
        f"{name}:{lines[0]}: {write}" for (name, write), lines in source_writes().items()
        if (name, write) not in ALLOWED
    }
    assert not unlisted, f"writes into another module's private fields (give the owner a method): {sorted(unlisted)}"


def test_every_allowed_write_is_still_there() -> None:
    writes = source_writes()
    stale = sorted(f"{name}: {write}" for name, write in ALLOWED if (name, write) not in writes)
    assert not stale, f"remove from tests/test_house.py's ALLOWED, the write is gone: {stale}"


def test_every_allowed_entry_gives_a_reason() -> None:
    assert all(reason.strip() for reason in ALLOWED.values())


# --- the house as the docs describe it ----------------------------------------------------------------

_NUMBERS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
            "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen")
_PATH = re.compile(r"(?<![\w./])(?:lifecycle|pyx|stubs|tests|bench|tools|docs)/[\w./-]*")


def layout_entries(readme: str) -> dict[str, str]:
    """The README's Layout section as ``{"lifecycle/": "its text on one line", ...}``."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    entries: dict[str, str] = {}
    current = ""
    for line in block.splitlines():
        if line and not line[0].isspace():
            current, _, text = line.partition(" ")
            entries[current] = text.strip()
        elif line.strip() and current:
            entries[current] += " " + line.strip()
    return entries


def named_modules(entry: str) -> set[str]:
    """The modules a Layout entry names: ``pkg/ (a, b)`` names ``pkg``, ``pkg/a`` and ``pkg/b``; any
    other name is what follows the last colon of a comma- or semicolon-separated piece, with
    remarks in parentheses left out."""
    names: set[str] = set()
    for package, members in re.findall(r"(\w+)/ \(([^)]*)\)", entry):
        names.add(package)
        names.update(f"{package}/{member.strip()}" for member in members.split(","))
    rest = re.sub(r"\([^)]*\)", "", re.sub(r"\w+/ \([^)]*\)", "", entry))
    for piece in re.split(r"[,;]", rest):
        name = piece.rsplit(":", 1)[-1].strip().rstrip("/")
        if name:
            names.add(name)
    return names


def package_modules() -> set[str]:
    """Every public module of ``lifecycle``, as the Layout names them (``model``, ``tiers``, ``tiers/host``)."""
    found: set[str] = set()
    for path in (ROOT / "lifecycle").rglob("*.py"):
        parts = path.relative_to(ROOT / "lifecycle").with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and not any(part.startswith("_") for part in parts):
            found.add("/".join(parts))
    return found


def test_the_layout_parser_reads_names_packages_and_members() -> None:
    entry = "leaves: errors, stats (no compiled code); parts: pools, tiers/ (host, store), cli"
    assert named_modules(entry) == {"errors", "stats", "pools", "tiers", "tiers/host", "tiers/store", "cli"}


def test_the_readme_layout_names_every_module_of_the_package_and_nothing_else() -> None:
    named = named_modules(layout_entries((ROOT / "README.md").read_text())["lifecycle/"])
    modules = package_modules()
    assert not modules - named, f"name in the README's Layout (lifecycle/): {sorted(modules - named)}"
    assert not named - modules, f"gone, remove from the README's Layout (lifecycle/): {sorted(named - modules)}"


def test_the_readme_layout_names_and_counts_every_cython_module() -> None:
    entry = layout_entries((ROOT / "README.md").read_text())["pyx/"]
    listed = entry.split(":", 1)[1].split(";", 1)[0]
    named = {name.strip() for name in re.sub(r"\([^)]*\)", "", listed).split(",")}
    modules = {path.stem for path in (ROOT / "pyx").glob("*.pyx")}
    assert named == modules, f"the README's Layout (pyx/) names {sorted(named)}; pyx/ holds {sorted(modules)}"
    assert f"the {_NUMBERS[len(modules)]} Cython modules" in entry


def test_every_path_the_readme_layout_and_the_architecture_page_name_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    texts = {
        "README.md (Layout)": readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0],
        "docs/architecture.md": (ROOT / "docs" / "architecture.md").read_text(),
    }
    missing = sorted(
        f"{where}: {path}" for where, text in texts.items() for path in _PATH.findall(text)
        if "NAME" not in path and not (ROOT / path.rstrip(".")).exists()  # NAME: a placeholder
    )
    assert not missing, f"paths named that do not exist: {missing}"


def test_the_architecture_page_names_every_source_file_of_the_package() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    files = {path.relative_to(ROOT).as_posix() for path in (ROOT / "lifecycle").rglob("*.py")}
    unnamed = sorted(name for name in files if f"`{name}`" not in page)
    assert not unnamed, f"name in docs/architecture.md: {unnamed}"


# --- KV events without a tier ------------------------------------------------------------------------


def test_a_model_with_events_and_no_tier_reads_the_cores_log_itself() -> None:
    from lifecycle.config import AttentionLayer, ModelConfig
    from lifecycle.events import BlockStored
    from lifecycle.model import HybridModel

    config = ModelConfig(layers=(AttentionLayer(num_kv_heads=1, head_dim=8),), block_size=4, num_blocks=8, max_seqs=2)
    model = HybridModel(config, "host", events=True)
    try:
        assert model._tiers is None  # no tiers object stands between the core's log and take_events
        seq = model.alloc_sequence_for(10)
        model.attach_prefix(seq, list(range(9)), grow_to=9)
        model.finish_sequence(seq)
        model.check_invariants()
        events = model.take_events().events
        assert events and all(type(event) is BlockStored for event in events)
        stored = [token for event in events for token in event.token_ids]  # type: ignore[union-attr]
        assert stored == list(range(8))  # the two whole blocks, the ninth token's block not full
        assert model.take_events().events == ()
    finally:
        model.teardown()


def test_every_package_of_the_source_tree_is_in_the_distribution() -> None:
    """A package missing from pyproject.toml's list installs from a checkout but not from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "lifecycle").rglob("__init__.py")
    }
    assert listed == found, f"pyproject.toml lists {sorted(listed)}; the tree has {sorted(found)}"
