"""Differential check of the KV cache groups: the same workloads through two builds, compared.

    python bench/groups_diff.py --against /work/main            # this checkout against main's build
    python bench/groups_diff.py --dump out.json                 # one build's record (the child)

Each build runs in a process of its own (``PYTHONPATH`` and cwd its checkout, ``lifecycle`` checked
to come from there) and writes, per workload, a digest after every request or operation of what
the core did: each group's block table of the request admitted, the blocks it reused, the event
log drained (entries, hashes, tokens, ids), and at the end the counters, ``group_stats()`` and
every pool's refcounts; the first workload step where the two builds differ is named.

Workloads: W3 prefilled in chunks (bench/groups_replay.py's calls) through each of ``--presets``'
groups at issue 31's budget, with events off and with events on; and seeded random
lives (admissions prefilled in chunks from shared stems, decode steps with group tables, finishes
with and without caching, mid-life caching, evictions of group 0 and of a window group, retention
hints on a manual clock, prefix pins) on small pools of each kind of group, sink blocks and
checkpoints included, so that every group is short often.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

PRESETS = "gpt-oss-120b,gemma-3-27b,llama-4-scout"


class Digest:
    """A running sha256 of a workload and one short digest per step (to find the first difference)."""

    def __init__(self) -> None:
        self.total = hashlib.sha256()
        self.steps: list[str] = []
        self._step = hashlib.sha256()

    def add(self, *parts: Any) -> None:
        for part in parts:
            if isinstance(part, (list, tuple)) and any(hasattr(x, "tobytes") for x in part):
                self.add(*part)
                continue
            data = part.tobytes() if hasattr(part, "tobytes") else repr(part).encode()
            self._step.update(len(data).to_bytes(8, "little"))
            self._step.update(data)

    def events(self, core: Any) -> None:
        raw = core.take_events()
        entries = raw.entries
        # field by field: the structured entries have padding bytes no one writes
        self.add([entries[name].copy() for name in entries.dtype.names], raw.hashes, raw.tokens, raw.ids, raw.dropped)

    def step(self) -> None:
        value = self._step.hexdigest()[:16]
        self.steps.append(value)
        self.total.update(value.encode())
        self._step = hashlib.sha256()

    def record(self) -> dict[str, Any]:
        return {"total": self.total.hexdigest(), "steps": self.steps}


def tables(core: Any, handle: int) -> list[Any]:
    return [core.block_table(handle, g) for g in range(core.num_groups)]


def counters(core: Any) -> list[tuple[str, int]]:
    """The core's counters but its time in the library (which no two runs share)."""
    return sorted((k, v) for k, v in core.counters().items() if k != "time_in_library_ns")


def final_state(core: Any, digest: Digest) -> None:
    core.check_invariants()
    digest.add(counters(core), core.group_stats())
    for pool in core.group_pools:
        digest.add(pool.refcounts(), pool.num_free)
    digest.step()


def w3_workload(preset: str, events: bool) -> dict[str, Any]:
    from groups_replay import PREFILL_CHUNK, _NOTHING, chunked_requests, new_core
    from w3 import load_w3
    from workloads import reference_presets

    trace = load_w3()
    core = new_core(trace, reference_presets()[preset], 0)
    if events:
        core.set_events(True)
    digest = Digest()
    bs = core.block_size
    live: list[int] = []
    for tokens, reusable in chunked_requests(trace):
        if len(live) == trace.max_live:
            core.finish(live.pop(0))
        # groups_replay.admit_chunked's calls, each group's table looked at after every chunk
        probe = core.admit(tokens, 0, reusable)
        cut = core.num_blocks(probe)
        core.finish(probe, False)
        total = len(tokens)
        end = min(total, cut * bs + PREFILL_CHUNK)
        handle = core.open()
        reused = core.attach(handle, tokens[:end], -(-end // bs), cut)
        core.cache(handle, end // bs)
        digest.add(cut, reused, tables(core, handle))
        while end < total:
            stop = min(total, end + PREFILL_CHUNK)
            core.grow(handle, -(-stop // bs))
            core.append(handle, tokens[end:stop])
            end = stop
            core.cache(handle, end // bs)
            digest.add(tables(core, handle))
        core.append(handle, _NOTHING)
        digest.add(tables(core, handle), core.counters()["blocks_evicted"])
        if events:
            digest.events(core)
        digest.step()
        live.append(handle)
    while live:
        core.finish(live.pop(0))
    if events:
        digest.events(core)
    final_state(core, digest)
    return digest.record()


def random_workload(seed: int) -> dict[str, Any]:
    import numpy as np

    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore
    from lifecycle.errors import LifecycleError

    rng = random.Random(seed)
    bs = 4
    kind = ["sliding_window", "chunked_local", "sliding_window", "chunked_local", "full"][seed % 5]
    window = rng.choice([4, 8, 12, 16, 32]) if kind != "full" else 0
    sink = rng.choice([0, 0, 4, 8]) if kind == "sliding_window" else 0
    retention = rng.choice([0, 0, 16, 32])
    two = kind != "full" and rng.random() < 0.3  # a second windowed group
    pool = BlockPool(rng.choice([48, 64, 96]))
    groups = [(kind, window, sink, BlockPool(rng.choice([16, 24, 32, 48])))]
    if two:
        groups.append(("chunked_local" if kind == "sliding_window" else "sliding_window", 8, 0,
                       BlockPool(rng.choice([16, 24, 32]))))
    width = 48
    core = KVCacheCore(pool, bs, groups=groups, retention_interval=retention, max_blocks_per_seq=width)
    if rng.random() < 0.5:
        core.set_events(True)
    digest = Digest()
    digest.add(kind, window, sink, retention, two)
    clock = 0.0
    core.retention.set_time(clock)
    live: list[int] = []
    stems = [[rng.randrange(0, 50) for _ in range(rng.choice([4, 8, 12, 24]))] for _ in range(6)]
    pinned: list[list[int]] = []
    ng = core.num_groups
    for _ in range(400):
        op = rng.choices(
            ["admit", "step", "finish", "evict", "evict_group", "cache", "hint", "tick", "pin", "unpin"],
            [30, 25, 15, 5, 4, 8, 4, 3, 2, 2],
        )[0]
        try:
            if op == "admit":
                tokens = [t for _ in range(rng.randint(1, 4)) for t in rng.choice(stems)]
                tokens += [rng.randrange(50, 60) for _ in range(rng.randint(0, 6))]
                tokens = tokens[: (width - 4) * bs]
                probe = core.admit(tokens, 0)
                cut = core.num_blocks(probe)
                core.finish(probe, False)
                chunk = rng.choice([4, 8, 12, 16])
                end = min(len(tokens), cut * bs + chunk)
                h = core.open()
                live.append(h)
                digest.add("attach", core.attach(h, tokens[:end], -(-end // bs), cut))
                if rng.random() < 0.7:
                    core.cache(h, end // bs)
                while end < len(tokens):
                    stop = min(len(tokens), end + chunk)
                    core.grow(h, -(-stop // bs))
                    core.append(h, tokens[end:stop])
                    end = stop
                    if rng.random() < 0.7:
                        core.cache(h, end // bs)
                core.append(h, [])
                digest.add(tables(core, h))
            elif op == "step" and live:
                batch = rng.sample(live, min(len(live), rng.randint(1, 3)))
                table = np.full((len(batch), width), -1, dtype=np.int32)
                extra = [np.full((len(batch), width), -1, dtype=np.int32) for _ in range(ng - 1)]
                for _ in range(rng.randint(1, 6)):
                    refused = core.step(batch, [rng.randrange(60, 70) for _ in batch], table=table,
                                        cache=rng.random() < 0.3, group_tables=extra or None)
                    digest.add(refused, table, extra)
                    if refused.size:
                        break
            elif op == "finish" and live:
                digest.add("finish", core.finish(live.pop(rng.randrange(len(live))), cache=rng.random() < 0.8))
            elif op == "evict":
                digest.add("evict", core.evict(rng.randint(1, 16)))
            elif op == "evict_group" and ng > 1:
                digest.add("evict_group", core.evict_group(rng.randrange(1, ng), rng.randint(1, 8)))
            elif op == "cache" and live:
                target = live[rng.randrange(len(live))]
                if rng.random() < 0.5:
                    core.append(target, [])
                core.cache(target, min(core.num_tokens(target) // bs, core.num_blocks(target)))
            elif op == "hint" and live:
                priority = rng.choice([0, 35, 90])
                core.set_retention(live[rng.randrange(len(live))], [(0, bs, priority, 2.0)], decode_priority=priority)
            elif op == "tick":
                clock += 1.0
                core.retention.set_time(clock)
            elif op == "pin":
                stem = rng.choice(stems)
                got = core.pin_prefix(stem)
                digest.add("pin", got)
                if got:
                    pinned.append(stem)
            elif op == "unpin" and pinned:
                core.unpin_prefix(pinned.pop(rng.randrange(len(pinned))))
        except LifecycleError as refused:
            digest.add(type(refused).__name__, str(refused))
        digest.add(op, counters(core), core.group_stats())
        if core.events_on[0]:
            digest.events(core)
        digest.step()
        if len(digest.steps) % 25 == 0:
            core.check_invariants()
    core.check_invariants()
    while live:
        core.finish(live.pop())
    for stem in pinned:
        core.unpin_prefix(stem)
    if core.events_on[0]:
        digest.events(core)
    final_state(core, digest)
    return digest.record()


def dump(path: Path, presets: list[str], seeds: int) -> None:
    import lifecycle

    out: dict[str, Any] = {"lifecycle": lifecycle.__file__}
    for preset in presets:
        for events in (False, True):
            out[f"w3:{preset}:{'events' if events else 'quiet'}"] = w3_workload(preset, events)
    for seed in range(seeds):
        out[f"random:{seed}"] = random_workload(seed)
    path.write_text(json.dumps(out))


def run_build(root: Path, out: Path, presets: str, seeds: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONHASHSEED="0")
    subprocess.run([sys.executable, __file__, "--dump", str(out), "--presets", presets, "--seeds", str(seeds)],
                   cwd=root, env=env, check=True)
    record: dict[str, Any] = json.loads(out.read_text())
    if not record["lifecycle"].startswith(str(root)):
        raise SystemExit(f"{root}: imported lifecycle from {record['lifecycle']}")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, help="the other checkout (built), e.g. /work/main")
    parser.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--seeds", type=int, default=60, help="random workloads")
    args = parser.parse_args()
    presets = [p for p in args.presets.split(",") if p]
    if args.dump:
        dump(args.dump, presets, args.seeds)
        return
    if args.against is None:
        parser.error("--against CHECKOUT is needed")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        mine = run_build(HERE.parent, Path(tmp) / "mine.json", args.presets, args.seeds)
        theirs = run_build(args.against.resolve(), Path(tmp) / "theirs.json", args.presets, args.seeds)
    differ = 0
    for name in mine:
        if name == "lifecycle":
            continue
        a, b = mine[name], theirs.get(name)
        if b is not None and a["total"] == b["total"]:
            print(f"{name}: same ({len(a['steps'])} steps)")
            continue
        differ += 1
        first = next((i for i, (x, y) in enumerate(zip(a["steps"], b["steps"] if b else [])) if x != y), None)
        print(f"{name}: DIFFERS (first at step {first}; {len(a['steps'])} vs {len(b['steps']) if b else 0} steps)")
    print("identical" if differ == 0 else f"{differ} workloads differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
