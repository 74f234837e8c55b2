"""StoreTier against a real Valkey/Redis server (tests/store_server.py): sharing, one round trip per
request, and every fault (down, slow, full, corrupt, foreign) ending as a counted miss."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from store_server import StoreServer, free_port, running_cluster, running_server

from lifecycle.config import AttentionLayer, ModelConfig
from lifecycle.device.host import HostDevice
from lifecycle.errors import ConfigError
from lifecycle.pools import KVPool
from lifecycle.tiers.host import HeldBlock, HostTier
from lifecycle.tiers.keys import namespace_of
from lifecycle.tiers.store import StoreTier, StoreUnavailable

BLOCK_SIZE = 4
NUM_BLOCKS = 8
CONFIG = ModelConfig(
    layers=(AttentionLayer(num_kv_heads=2, head_dim=8), AttentionLayer(num_kv_heads=2, head_dim=8)),
    block_size=BLOCK_SIZE,
    num_blocks=NUM_BLOCKS,
)
HASHES = [0x1000 + i for i in range(4)]
LOGGER = "lifecycle.tiers.store"
TESTS = Path(__file__).resolve().parent


def tokens_of(hashes: Sequence[int]) -> npt.NDArray[np.int32]:
    return np.array([[(h * 7 + i) % 30000 for i in range(BLOCK_SIZE)] for h in hashes], dtype=np.int32)


def pool_bytes(seed: int) -> list[bytes]:
    """The KV bytes of every block of a pool filled from ``seed`` (every layer, slot layout)."""
    rng = np.random.default_rng(seed)
    layer_bytes = CONFIG.attention_layers[0].block_bytes(BLOCK_SIZE)
    layers = [rng.integers(0, 256, NUM_BLOCKS * layer_bytes, dtype=np.uint8) for _ in CONFIG.attention_layers]
    return [b"".join(layer[b * layer_bytes : (b + 1) * layer_bytes].tobytes() for layer in layers)
            for b in range(NUM_BLOCKS)]


class Engine:
    """What one engine holds for these tests: a host device, a KV pool filled from ``seed`` and a
    host tier over it (the store's source)."""

    def __init__(self, seed: int) -> None:
        self.device = HostDevice()
        self.pool = KVPool(self.device, CONFIG)
        rng = np.random.default_rng(seed)
        for layer, ptr in enumerate(self.pool.layer_ptrs):
            nbytes = NUM_BLOCKS * self.pool.layer_block_bytes(layer)
            self.device.host_array(ptr, nbytes)[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        self.tier = HostTier(self.device, self.pool, NUM_BLOCKS, BLOCK_SIZE)

    def block_bytes(self, block: int) -> bytes:
        """Every layer's bytes of device block ``block``, layer after layer."""
        pool = self.pool
        return b"".join(
            self.device.host_array(pool.block_addr(layer, block), pool.layer_block_bytes(layer)).tobytes()
            for layer in range(pool.num_layers)
        )

    def demote(self, hashes: Sequence[int], blocks: Sequence[int]) -> None:
        self.tier.demote(hashes, blocks, tokens_of(hashes))

    def close(self) -> None:
        self.tier.close()
        self.pool.release()
        self.device.close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    held = Engine(seed=1)
    yield held
    held.close()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    with running_server(tmp_path_factory.mktemp("valkey")) as server:
        yield server


@pytest.fixture
def server(shared_server: StoreServer) -> StoreServer:
    """The module's server, emptied for this test."""
    with shared_server.client() as client:
        client.flushall()
        client.config_set("maxmemory", 0)
    return shared_server


@pytest.fixture
def private_server(tmp_path: Path) -> Iterator[StoreServer]:
    """A server of this test's own, which it may kill, pause or fill."""
    with running_server(tmp_path / "valkey") as server:
        yield server


StoreFactory = Callable[..., StoreTier]


@pytest.fixture
def make_store(engine: Engine) -> Iterator[StoreFactory]:
    """Builds stores reading from ``engine``'s tier (unless told otherwise); closes them all, and
    checks their invariants, after the test."""
    stores: list[StoreTier] = []

    def build(url: str, **options: object) -> StoreTier:
        options.setdefault("source", engine.tier)
        options.setdefault("retry_after_s", 0.0)
        options.setdefault("timeout_s", 0.25)
        store = StoreTier(url, CONFIG, **options)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield build
    for store in stores:
        store.check_invariants()
        store.close()


def publish(engine: Engine, store: StoreTier, hashes: Sequence[int] = HASHES) -> None:
    """Demote blocks 0.. under ``hashes`` and write them behind, waiting for the writes."""
    engine.demote(hashes, list(range(len(hashes))))
    assert store.write_behind(hashes) == len(hashes)
    assert store.flush()


def kv_found(store: StoreTier, hashes: Sequence[int] = HASHES) -> list[bytes | None]:
    return [None if r is None else bytes(r.kv) for r in store.get_many(hashes, tokens_of(hashes))]


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(1 for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING and text in r.message)


# -- sharing -----------------------------------------------------------------------------------------


def test_blocks_written_behind_are_read_back_with_their_kv(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    store = make_store(server.url)
    publish(engine, store)
    assert kv_found(store) == pool_bytes(seed=1)[: len(HASHES)]


def test_a_subscribed_store_writes_every_block_the_host_tier_stores(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    store = make_store(server.url)
    engine.tier.subscribe(store.write_behind)
    engine.demote(HASHES, range(len(HASHES)))
    engine.demote(HASHES, range(len(HASHES)))  # already held: not written again
    store.flush()
    assert store.stats().queued == len(HASHES)
    assert kv_found(store) == pool_bytes(seed=1)[: len(HASHES)]


def test_store_hits_reach_device_blocks_through_the_host_tier(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    publish(engine, make_store(server.url))
    other = Engine(seed=2)
    try:
        store = make_store(server.url, source=other.tier)
        wanted = [*HASHES[:2], 0x9999]
        assert other.tier.lookup(wanted, tokens_of(wanted)) == 0
        records = store.get_many(wanted, tokens_of(wanted))
        run = next(i for i, record in enumerate(records) if record is None)
        other.tier.load([record for record in records[:run] if record is not None])
        other.tier.promote(wanted[:run], [6, 7], tokens_of(wanted[:run]))
        other.tier.check_invariants()
        assert [other.block_bytes(block) for block in (6, 7)] == pool_bytes(seed=1)[:2]
    finally:
        other.close()


def test_a_request_is_one_round_trip_whatever_its_blocks(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    store = make_store(server.url)
    publish(engine, store)
    with server.client() as client:
        client.config_resetstat()
        store.get_many([*HASHES, 0x9999])
        commands = client.info("commandstats")
    mine = ("cmdstat_info", "cmdstat_config")  # the test's own
    ours = {name: stats["calls"] for name, stats in commands.items() if not name.startswith(mine)}
    assert ours == {"cmdstat_mget": 1}


def test_absent_blocks_are_misses(server: StoreServer, make_store: StoreFactory) -> None:
    store = make_store(server.url)
    assert store.get_many(HASHES) == [None] * len(HASHES)
    assert store.stats().misses == len(HASHES)


def test_a_block_with_other_tokens_is_a_miss(server: StoreServer, engine: Engine, make_store: StoreFactory) -> None:
    store = make_store(server.url)
    publish(engine, store)
    other = tokens_of(HASHES)
    other[1, 0] += 1
    found = store.get_many(HASHES, other)
    assert [r is not None for r in found] == [True, False, True, True]
    assert store.stats().token_mismatch == 1


def test_blocks_asked_for_after_another_parent_are_foreign(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    store = make_store(server.url)
    publish(engine, store)  # one chain after key 0: each block's parent is the one before it
    records = store.get_many(HASHES, tokens_of(HASHES), parent=5)
    assert [record is None for record in records] == [True, False, False, False]
    assert store.stats().foreign == 1


def test_models_of_another_byte_format_do_not_meet(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    publish(engine, make_store(server.url))
    other_config = CONFIG.replace(block_size=8)
    with StoreTier(server.url, other_config, timeout_s=0.25) as other:
        assert other.get_many(HASHES) == [None] * len(HASHES)
        assert other.stats().foreign == len(HASHES)


@pytest.mark.parametrize("weights", [None, "other weights"])
def test_models_of_another_namespace_do_not_meet_even_with_the_same_byte_format(
    server: StoreServer, engine: Engine, make_store: StoreFactory, weights: str | None
) -> None:
    publish(engine, make_store(server.url))
    other_config = CONFIG.replace(name="another-model") if weights is None else CONFIG
    assert other_config.fingerprint() == CONFIG.fingerprint()
    namespace = namespace_of(other_config, weights)
    with StoreTier(server.url, other_config, namespace=namespace, timeout_s=0.25) as other:
        assert other.get_many(HASHES) == [None] * len(HASHES)
        assert other.stats().foreign == len(HASHES)  # keys met (no tier keys here): the records' namespace refused them
    with StoreTier(server.url, CONFIG, timeout_s=0.25) as same:  # the same model, in another tier
        assert all(record is not None for record in same.get_many(HASHES, tokens_of(HASHES)))


def test_a_block_gone_from_the_host_tier_before_its_write_is_dropped(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    store = make_store(server.url)
    store.write_behind([0x7777])  # never demoted
    store.flush()
    assert store.stats().dropped_gone == 1


def test_two_processes_share_blocks_through_the_store(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    publish(engine, make_store(server.url))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, server.url], cwd=TESTS.parent, capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": f"{TESTS}:{TESTS.parent}"},
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    assert report == {"read_equal": len(HASHES), "wrote": len(CHILD_HASHES)}
    reader = make_store(server.url)
    assert kv_found(reader, CHILD_HASHES) == pool_bytes(seed=2)[: len(CHILD_HASHES)]


CHILD_HASHES = [0x2000 + i for i in range(3)]
# The other engine: reads what this process wrote (its pool was filled from seed 1), then writes
# blocks of its own pool (seed 2).
CHILD = f"""
import json, sys
from test_tiers_store import CONFIG, HASHES, Engine, kv_found, pool_bytes, publish
from lifecycle.tiers.store import StoreTier
engine = Engine(seed=2)
with StoreTier(sys.argv[1], CONFIG, source=engine.tier, timeout_s=2.0) as store:
    found = kv_found(store, HASHES)
    read_equal = sum(kv == want for kv, want in zip(found, pool_bytes(seed=1)))
    publish(engine, store, {CHILD_HASHES!r})
    print(json.dumps({{"read_equal": read_equal, "wrote": store.stats().written}}))
engine.close()
"""


def test_a_cluster_url_spreads_blocks_over_the_nodes(tmp_path: Path, engine: Engine, make_store: StoreFactory) -> None:
    hashes = [0x3000 + i for i in range(NUM_BLOCKS)]
    with running_cluster(tmp_path / "cluster") as nodes:
        store = make_store(f"redis+cluster://127.0.0.1:{nodes[0].port}", timeout_s=2.0)
        publish(engine, store, hashes)
        assert kv_found(store, hashes) == pool_bytes(seed=1)
        sizes = []
        for node in nodes:
            with node.client() as client:
                sizes.append(client.dbsize())
        store.close()
    assert sum(sizes) == len(hashes) and sum(1 for size in sizes if size) > 1


# -- faults: every one a counted miss ------------------------------------------------------------------


def test_a_killed_store_costs_misses_and_is_logged_once(
    private_server: StoreServer, engine: Engine, make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(private_server.url)
    publish(engine, store)
    private_server.kill()
    assert kv_found(store) == [None] * len(HASHES)
    assert kv_found(store) == [None] * len(HASHES)
    stats = store.stats()
    assert (stats.unavailable, stats.outages) == (2 * len(HASHES), 1)
    assert warnings_of(caplog, "a read failed") == 1


def test_writes_to_a_killed_store_are_dropped_and_counted(
    private_server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    store = make_store(private_server.url)
    private_server.kill()
    publish(engine, store)
    assert store.stats().dropped_unavailable == len(HASHES)


def test_the_tier_resumes_when_the_store_comes_back(
    private_server: StoreServer, engine: Engine, make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(private_server.url)
    private_server.kill()
    assert kv_found(store) == [None] * len(HASHES)
    private_server.start()  # same port, empty
    publish(engine, store)
    assert kv_found(store) == pool_bytes(seed=1)[: len(HASHES)]
    assert warnings_of(caplog, "answers again after") == 1


def test_an_unavailable_store_is_not_asked_again_before_retry_after(
    private_server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    store = make_store(private_server.url, retry_after_s=3600.0)
    publish(engine, store)
    private_server.kill()
    store.get_many(HASHES)
    private_server.start()
    with private_server.client() as client:
        client.config_resetstat()
        assert store.get_many(HASHES) == [None] * len(HASHES)
        assert "cmdstat_mget" not in client.info("commandstats")


def test_a_store_that_stops_answering_costs_misses_not_a_hang(
    private_server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    store = make_store(private_server.url, timeout_s=0.1)
    publish(engine, store)
    private_server.pause()
    try:
        assert kv_found(store) == [None] * len(HASHES)
    finally:
        private_server.resume()
    assert store.stats().unavailable == len(HASHES)
    assert kv_found(store) == pool_bytes(seed=1)[: len(HASHES)]


def test_a_full_store_refuses_writes_and_still_serves_reads(
    server: StoreServer, engine: Engine, make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(server.url)
    publish(engine, store, HASHES[:2])
    with server.client() as client:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
    publish(engine, store, HASHES[2:])
    assert store.stats().refused_full == 2
    assert [kv is not None for kv in kv_found(store)] == [True, True, False, False]
    assert warnings_of(caplog, "out of memory") == 1


def test_a_corrupt_value_is_a_miss_logged_once(
    server: StoreServer, engine: Engine, make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(server.url)
    publish(engine, store)
    with server.client() as client:
        for content_hash in HASHES[:2]:
            key = store.key(content_hash)
            last = client.getrange(key, -1, -1)
            client.setrange(key, client.strlen(key) - 1, bytes([last[0] ^ 0xFF]))
    assert [kv is not None for kv in kv_found(store)] == [False, False, True, True]
    assert store.stats().corrupt == 2
    assert warnings_of(caplog, "corrupt") == 1


def test_a_foreign_value_is_a_miss(server: StoreServer, engine: Engine, make_store: StoreFactory) -> None:
    store = make_store(server.url)
    publish(engine, store)
    with server.client() as client:
        client.set(store.key(HASHES[0]), b"written by someone else")
    assert [kv is not None for kv in kv_found(store)] == [False, True, True, True]
    assert store.stats().foreign == 1


# -- the write queue -----------------------------------------------------------------------------------


class BlockedSource:
    """A source whose reads wait until ``release`` is set; ``entered`` tells a read has begun."""

    def __init__(self, inner: HostTier) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def read_blocks(self, hashes: Sequence[int]) -> list[HeldBlock | None]:
        self.entered.set()
        assert self.release.wait(timeout=30), "the test never released the source"
        return self.inner.read_blocks(hashes)


def test_a_full_write_queue_drops_blocks_instead_of_waiting(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    source = BlockedSource(engine.tier)
    store = make_store(server.url, source=source, queue_blocks=2)
    engine.demote(HASHES, range(len(HASHES)))
    store.write_behind(HASHES[:1])
    assert source.entered.wait(timeout=30)  # the writer holds block 0 in flight
    assert store.write_behind(HASHES[1:]) == 2
    source.release.set()
    store.flush()
    stats = store.stats()
    assert (stats.queued, stats.dropped_queue_full, stats.written) == (3, 1, 3)


def test_writes_of_a_closed_host_tier_are_dropped_as_gone(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    store = make_store(server.url)
    engine.demote(HASHES, range(len(HASHES)))
    engine.tier.close()
    store.write_behind(HASHES)
    store.flush()
    assert store.stats().dropped_gone == len(HASHES)


def test_every_queued_block_is_accounted_for_while_the_writer_runs(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    store = make_store(server.url, batch_blocks=2)
    engine.demote(HASHES, range(len(HASHES)))
    for _ in range(50):
        store.write_behind(HASHES)
        store.check_invariants()
    store.flush()
    store.check_invariants()
    assert store.stats().written == store.stats().queued


def test_close_drops_queued_writes_and_stops_the_writer(
    server: StoreServer, engine: Engine, make_store: StoreFactory
) -> None:
    source = BlockedSource(engine.tier)
    store = make_store(server.url, source=source)
    engine.demote(HASHES, range(len(HASHES)))
    store.write_behind(HASHES[:1])
    assert source.entered.wait(timeout=30)
    store.write_behind(HASHES[1:])
    closing = threading.Thread(target=store.close)
    closing.start()
    deadline = time.monotonic() + 30
    while store.stats().queue_depth > 1:  # close drops the queue at once, then waits for block 0
        assert time.monotonic() < deadline, "close did not drop the queued writes"
        time.sleep(0.001)
    source.release.set()
    closing.join()
    stats = store.stats()
    assert (stats.written, stats.dropped_closed) == (1, len(HASHES) - 1)
    assert not [t for t in threading.enumerate() if t.name == "lifecycle-store-writer"]


# -- configuration ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url", ["", "http://127.0.0.1:6379", "redis://", "redis://127.0.0.1:99999", "redis+shard://127.0.0.1:1",
            "unix+cluster:///tmp/x.sock"],
)
def test_a_malformed_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="url"):
        StoreTier(url, CONFIG)


def test_an_unreachable_store_fails_at_construction_naming_url_and_timeout() -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    with pytest.raises(StoreUnavailable, match=rf"{url}.*timeout_s=0.2"):
        StoreTier(url, CONFIG, timeout_s=0.2)


def test_the_password_of_an_unreachable_url_is_not_shown() -> None:
    with pytest.raises(StoreUnavailable) as refused:
        StoreTier(f"redis://user:hunter2@127.0.0.1:{free_port()}", CONFIG, timeout_s=0.2)
    assert "hunter2" not in str(refused.value) and "user:***@" in str(refused.value)


def test_a_timeout_of_zero_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"timeout_s=0 must be in \[0.001, 60.0\]"):
        StoreTier("redis://127.0.0.1:6379", CONFIG, timeout_s=0)


def test_writes_without_a_source_are_refused(server: StoreServer, make_store: StoreFactory) -> None:
    store = make_store(server.url, source=None)
    with pytest.raises(ConfigError, match="without a source"):
        store.write_behind(HASHES)
