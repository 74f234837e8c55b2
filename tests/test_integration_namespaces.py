"""Cache namespaces of the adapters: keys stable across processes, a bounded table."""

from __future__ import annotations

import subprocess
import sys

from lifecycle.integrations import CacheNamespaces


def test_none_is_key_zero_and_others_are_nonzero_and_distinct() -> None:
    names: CacheNamespaces[tuple[str | None, str | None]] = CacheNamespaces()
    keys = {names.key((f"lora-{i}", None)) for i in range(1000)}
    assert names.key(None) == 0
    assert 0 not in keys and len(keys) == 1000
    assert all(0 < key < 2**63 for key in keys)
    assert names.namespace(names.key(("lora-7", "salt"))) == ("lora-7", "salt")
    assert names.namespace(0) is None


def test_keys_are_the_same_in_another_process() -> None:
    """Content hashes and KV events carry the key: two engines must agree on it."""
    code = (
        "from lifecycle.integrations import CacheNamespaces\n"
        "n = CacheNamespaces()\n"
        "print(n.key(('extra', None)), n.key((None, 'salt')), n.key(((3, 'lora'), 'salt')))\n"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    names: CacheNamespaces[object] = CacheNamespaces()
    here = [names.key(("bogus-first", None)), names.key(("extra", None)), names.key((None, "salt")),
            names.key(((3, "lora"), "salt"))]
    assert [int(key) for key in other] == here[1:]


def test_the_table_forgets_the_oldest_namespaces_past_its_capacity() -> None:
    names: CacheNamespaces[str] = CacheNamespaces(capacity=4)
    keys = [names.key(f"salt-{i}") for i in range(10)]
    assert len(names) == 5  # four remembered, and None
    assert names.namespace(keys[0]) is None  # forgotten: events then carry no name
    assert names.namespace(keys[-1]) == "salt-9"
    assert names.key("salt-0") == keys[0]  # the key itself never changes
