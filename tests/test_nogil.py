"""The hot loops of the C core run without the GIL (SPEC: "hot loops run without the GIL, on C
arrays, behind the library's own lock").

Cython refuses to compile a Python operation inside a function declared ``noexcept nogil``, so the
declaration is what holds a loop to C: each loop named below must carry it where it is defined (and
where its ``.pxd`` declares it), and must not take the GIL back (``with gil``). Where the build left
its generated C in ``pyx/``, each loop's C function is read too: it must not touch a reference
count or the GIL's state. The entry points run these loops inside the one lock form of
``pyx/lifecycle/_sync.pxd``, which releases the GIL for long calls.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYX = ROOT / "pyx"

#: (module, class or None, function): the free list's batch allocation and release, the trie's
#: walk and the changes along it, the slot pool's claims and releases behind the slot guards, the host
#: tier index's batch loops.
HOT_LOOPS: list[tuple[str, str | None, str]] = [
    ("blockpool", "BlockPool", "_allocate_locked"),
    ("blockpool", "BlockPool", "_inc_ref_locked"),
    ("blockpool", "BlockPool", "_dec_ref_locked"),
    ("blockpool", None, "_pop_free"),
    ("blockpool", None, "_inc_ref_batch"),
    ("blockpool", None, "_dec_ref_batch"),
    ("radix", "RadixTrie", "_walk"),
    ("radix", None, "_find_child"),
    ("radix", "RadixTrie", "_split"),
    ("radix", "RadixTrie", "_add_leaf"),
    ("radix", "RadixTrie", "_extend"),
    ("radix", "RadixTrie", "_pin"),
    ("radix", "RadixTrie", "_unpin"),
    ("radix", "RadixTrie", "_touch"),
    ("radix", "RadixTrie", "_trim"),
    ("radix", "RadixTrie", "_path_blocks"),
    ("slots", "SlotPool", "_pop_free"),
    ("slots", "SlotPool", "_claim"),
    ("slots", "SlotPool", "_release"),
    ("slots", "SlotPool", "_detach"),
    ("slots", "SlotPool", "_state_of"),
    ("hosttier", "HostIndex", "_demote"),
    ("hosttier", "HostIndex", "_held_run"),
    ("hosttier", "HostIndex", "_verified_run"),
    ("hosttier", "HostIndex", "_rows"),
    ("hosttier", "HostIndex", "_load"),
    ("hosttier", "HostIndex", "_find"),
    ("hosttier", "HostIndex", "_table_remove"),
    ("hosttier", "HostIndex", "_first_repeated_id"),
]

_IDS = [f"{module}.{cls + '.' if cls else ''}{name}" for module, cls, name in HOT_LOOPS]
#: What a C function that runs without the GIL never does.
_NEEDS_GIL = re.compile(
    r"\b(?:Py_X?INCREF|Py_X?DECREF|__Pyx_X?GOTREF|__Pyx_X?DECREF|PyGILState_Ensure|__Pyx_RefNannySetupContext)\b"
)
_METHODS = [entry for entry in HOT_LOOPS if entry[1]]


def _scope(lines: list[str], cls: str | None) -> range:
    """The line numbers of class ``cls`` (every line for None)."""
    if cls is None:
        return range(len(lines))
    first = next(i for i, line in enumerate(lines) if re.match(rf"^(?:cdef )?class {cls}\b", line))
    last = next(
        (i for i in range(first + 1, len(lines)) if re.match(r"^[^\s#@]", lines[i])), len(lines)
    )
    return range(first + 1, last)


def _definition(lines: list[str], cls: str | None, name: str) -> tuple[str, list[str]]:
    """The signature (its lines joined, up to the closing ``:``) and the body of ``name`` (a method
    of ``cls`` when given) in a ``.pyx`` or ``.pxd``'s lines."""
    indent = "    " if cls else ""
    start = re.compile(rf"^{indent}cdef\b[^=(]*\b{re.escape(name)}\(")
    for i in _scope(lines, cls):
        if not start.match(lines[i]):
            continue
        j = i
        while j + 1 < len(lines) and lines[j].count("(") - lines[j].count(")") + sum(
            line.count("(") - line.count(")") for line in lines[i:j]
        ) > 0:
            j += 1
        signature = " ".join(part.strip() for part in lines[i : j + 1])
        body = []
        for line in lines[j + 1 :]:
            if line.strip() and len(line) - len(line.lstrip()) <= len(indent):
                break
            body.append(line)
        return signature, body
    raise AssertionError(f"no definition of {name} ({cls or 'module level'})")


@pytest.mark.parametrize(("module", "cls", "name"), HOT_LOOPS, ids=_IDS)
def test_the_hot_loop_is_compiled_without_the_gil(module: str, cls: str | None, name: str) -> None:
    signature, _ = _definition((PYX / f"{module}.pyx").read_text().splitlines(), cls, name)
    assert re.search(r"\bnoexcept nogil\b", signature), f"pyx/{module}.pyx: {signature!r} is not noexcept nogil"


@pytest.mark.parametrize(("module", "cls", "name"), HOT_LOOPS, ids=_IDS)
def test_the_hot_loop_never_takes_the_gil_back(module: str, cls: str | None, name: str) -> None:
    _, body = _definition((PYX / f"{module}.pyx").read_text().splitlines(), cls, name)
    taking = [line.strip() for line in body if re.search(r"\bwith gil\b", line)]
    assert not taking, f"pyx/{module}.pyx {name} takes the GIL: {taking}"


@pytest.mark.parametrize(("module", "cls", "name"), _METHODS, ids=[f"{m}.{c}.{n}" for m, c, n in _METHODS])
def test_the_pxd_declares_the_method_nogil_too(module: str, cls: str | None, name: str) -> None:
    pxd = PYX / "lifecycle" / f"_{module}.pxd"
    signature, _ = _definition(pxd.read_text().splitlines(), cls, name)
    assert re.search(r"\bnoexcept nogil\b", signature), f"{pxd.name}: {signature!r} is not noexcept nogil"


def _c_body(source: str, module: str, cls: str | None, name: str) -> str:
    prefix = f"__pyx_f_9lifecycle_{len(module) + 1}_{module}_"
    owner = f"{len(cls)}{cls}_" if cls else ""
    definition = rf"^static [^;{{]*\b{prefix}{owner}{re.escape(name)}\([^;{{]*\)\s*\{{\n(.*?)^\}}"
    match = re.search(definition, source, re.M | re.S)
    assert match, f"pyx/{module}.c has no definition of {prefix}{owner}{name}"
    return match.group(1)


@pytest.mark.parametrize(("module", "cls", "name"), HOT_LOOPS, ids=_IDS)
def test_the_generated_c_of_the_hot_loop_touches_no_python_object(module: str, cls: str | None, name: str) -> None:
    generated = PYX / f"{module}.c"
    if not generated.exists():
        pytest.skip(f"pyx/{module}.c is not there (a build in place leaves it)")
    body = _c_body(generated.read_text(), module, cls, name)
    found = sorted(set(_NEEDS_GIL.findall(body)))
    assert not found, f"pyx/{module}.c {name} needs the GIL: it calls {found}"


def test_the_scan_finds_a_python_operation_in_a_c_body() -> None:
    source = (
        "static int __pyx_f_9lifecycle_6_slots_8SlotPool__claim(struct __pyx_obj *self) {\n"
        "  Py_INCREF(self->owner);\n"
        "}\n"
    )
    assert _NEEDS_GIL.findall(_c_body(source, "slots", "SlotPool", "_claim")) == ["Py_INCREF"]


def test_the_scan_reads_a_signature_without_nogil_as_such() -> None:
    lines = ["cdef class SlotPool:", "    cdef int _claim(self, int32_t slot) noexcept:", "        return 0"]
    signature, body = _definition(lines, "SlotPool", "_claim")
    assert "nogil" not in signature and body == ["        return 0"]
