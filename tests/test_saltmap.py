"""The core's cache salts (``lifecycle._saltmap``): what a salted key was salted from, and with what."""

from __future__ import annotations

import pytest

from lifecycle import AttentionLayer, HybridModel, ModelConfig
from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore
from lifecycle._saltmap import SaltMap
from lifecycle.cache_keys import salted_key
from lifecycle.errors import ConfigError, SequenceStateError


def small_model() -> HybridModel:
    config = ModelConfig(layers=(AttentionLayer(num_kv_heads=1, head_dim=8),), block_size=4, num_blocks=16, max_seqs=4)
    return HybridModel(config, "host")


def test_a_core_owns_one_salt_map() -> None:
    core = KVCacheCore(BlockPool(8), 4)
    assert isinstance(core.salts, SaltMap)
    assert core.salts is core.salts and len(core.salts) == 0


def test_a_salted_attach_records_its_key_in_the_core() -> None:
    model = small_model()
    seq = model.alloc_sequence()
    model.attach_prefix(seq, list(range(9)), cache_salt="tenant-a")
    key = model.core.cache_key(seq.handle)
    assert key == salted_key(0, "tenant-a")
    assert model.core.salts.base_of(key) == 0
    assert model.core.salts.salt_of(key) == "tenant-a"
    model.free_sequence(seq)
    model.check_invariants()
    model.teardown()


def test_a_refused_salted_attach_records_nothing_new() -> None:
    model = small_model()
    seq = model.alloc_sequence()
    model.attach_prefix(seq, list(range(9)), cache_salt="a")
    with pytest.raises(SequenceStateError, match="another cache salt"):
        model.attach_prefix(seq, list(range(9)), cache_salt="b")
    assert model.core.salts.salt_of(salted_key(0, "b")) is None
    assert len(model.core.salts) == 1
    model.free_sequence(seq)
    model.teardown()


def test_a_key_that_was_never_salted_is_its_own_base_and_has_no_salt() -> None:
    salts = SaltMap()
    assert salts.base_of(12345) == 12345
    assert salts.salt_of(12345) is None


def test_salted_computes_the_key_without_recording_it() -> None:
    salts = SaltMap()
    assert salts.salted(7, b"s") == salted_key(7, b"s")
    assert len(salts) == 0


def test_derived_names_the_keys_salted_from_one_base_only() -> None:
    salts = SaltMap()
    salts.add(salts.salted(7, "x"), 7, "x")
    salts.add(salts.salted(7, "y"), 7, "y")
    salts.add(salts.salted(8, "x"), 8, "x")
    assert salts.derived(7) == {salted_key(7, "x"), salted_key(7, "y")}
    assert salts.derived(9) == frozenset()


def test_past_its_capacity_the_oldest_entry_goes() -> None:
    salts = SaltMap(2)
    for base in (1, 2, 3):
        salts.add(100 + base, base, f"s{base}")
    assert len(salts) == 2
    assert salts.salt_of(101) is None and salts.base_of(101) == 101
    assert salts.salt_of(102) == "s2" and salts.salt_of(103) == "s3"


def test_past_its_capacity_a_salt_read_since_outlives_a_stale_one() -> None:
    salts = SaltMap(2)
    salts.add(101, 1, "s1")
    salts.add(102, 2, "s2")
    assert salts.salt_of(101) == "s1"       # an event names 101's salt: in use
    salts.add(103, 3, "s3")
    assert salts.salt_of(102) is None
    assert salts.salt_of(101) == "s1" and salts.base_of(103) == 3


def test_past_its_capacity_a_salt_handed_out_again_outlives_a_stale_one() -> None:
    salts = SaltMap(2)
    salts.add(101, 1, "s1")
    salts.add(102, 2, "s2")
    salts.add(101, 1, "s1")                 # a new request under the same salt
    salts.add(103, 3, "s3")
    assert salts.base_of(102) == 102 and salts.salt_of(102) is None
    assert salts.base_of(101) == 1 and len(salts) == 2


def test_a_salt_in_use_survives_a_stream_of_one_off_salts_past_the_capacity() -> None:
    salts = SaltMap(64)
    salts.add(1, 0, "tenant")
    for key in range(2, 2 + 10 * 64):
        salts.add(key, 0, f"once-{key}")
        assert salts.salt_of(1) == "tenant"
    assert len(salts) == 64 and salts.salt_of(2) is None


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="capacity=0"):
        SaltMap(0)
