"""The ``lifecycle`` command line.

``lifecycle simulate`` replays a synthetic multi-turn serving trace through the whole lifecycle API
(see :mod:`lifecycle.simulate`) and prints a summary: a progress bar on stderr while it runs, then a
table (or, with ``--json``, one JSON object) on stdout. ``--plan`` prints the model's KV memory per
group instead. A model with several KV groups (sliding window, chunked local) replays through one
pool per group, prefilled in chunks, without swap (a swap record holds one group), and reports its
memory and counts per group. ``lifecycle info`` prints the versions, the
CUDA driver and device, and what ``open_device("auto")`` picks here. ``--version``; ``--log-level``
shows the library's log records (warnings by default) on stderr.

Every option is checked before anything is allocated: sizes (pools, swap memory, the trace) against
the memory this machine (or GPU) has, each refusal naming the option that asked for too much. Exit
status 2 for a refused option, 1 for a failed run, 130 for Ctrl-C (no traceback). With ``--json``
every error is also one JSON object on stdout: ``{"error": {"type", "message", "option",
"exit_status"}}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn

from lifecycle import __version__
from lifecycle._logging import ROOT_LOGGER
from lifecycle._packaging import editable_checkout, installed_version, plot_install_hint, shadowed_checkout_warning
from lifecycle.config import ModelConfig
from lifecycle.errors import ConfigError, DeviceError, LifecycleError
from lifecycle.presets import preset, preset_names
from lifecycle.stats import human_bytes

if TYPE_CHECKING:
    from lifecycle.device.base import Device
    from lifecycle.simulate import SimulationResult

__all__ = ["main"]

DEFAULT_MODEL: Final = "small-hybrid"
DEFAULT_REQUESTS: Final = 2000
DEFAULT_TURNS: Final = 4
#: Pool sizes ``simulate`` gives a preset unless --blocks/--kv-budget/--snapshots say otherwise: a KV
#: pool that a full batch of the default trace's chats just overflows, so one run shows prefix reuse,
#: eviction and preemption by swap together.
SIMULATION_SIZING: Final[dict[str, dict[str, int]]] = {
    "small-hybrid": {"num_blocks": 2048, "num_snapshots": 256},
}
_PLOT_SUFFIXES: Final = (".png", ".svg", ".pdf")
# Sizes are parsed and printed (lifecycle.stats.human_bytes) by hand: humanfriendly's parse_size
# reads "512M" as 512,000,000 unless told binary=True and would be a dependency for ten lines; the
# units here are binary only, as every pool size is.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
#: Host memory the model's bookkeeping takes per KV block beside the block's tokens in the prefix
#: trie (refcount and free-list entries, the trie node and its hash bucket), and per SSM slot.
_HOST_BYTES_PER_BLOCK: Final = 80
_HOST_BYTES_PER_SLOT_LAYER: Final = 160
#: A trace this large gets a line on stderr before it is generated (it takes a while).
_ANNOUNCE_TRACE_BYTES: Final = 256 << 20
_OPTION = re.compile(r"^argument ([^\s:/]+)")
EXIT_INTERRUPTED: Final = 130
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
#: The option that sets each configuration field, for errors a user reads.
FIELD_OPTIONS: Final = {
    "num_blocks": "--blocks",
    "kv_budget_bytes": "--kv-budget",
    "num_snapshots": "--snapshots",
    "max_seqs": "--max-live",
    "host_tier_blocks": "--host-tier-mb",
}
_FIELD = re.compile(r"\b(" + "|".join(FIELD_OPTIONS) + r")\b(=)?")
#: The oldest NVIDIA driver (Linux) each CUDA major of cuda-bindings runs on.
DRIVER_MINIMUM: Final = {12: "525.60.13", 13: "580.65.06"}


class _UsageError(Exception):
    """A refused option: raised by :class:`_Parser` instead of exiting, so ``main`` can report it
    (and, with ``--json``, print it as JSON)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def _count(minimum: int) -> Any:
    """An argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def _byte_size(text: str) -> int:
    """An argparse type: a byte count such as ``268435456``, ``512M``, ``1.5GiB`` (binary units)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 268435456, 512M, 2GiB)")
    unit = (match.group(2) or "").lower().rstrip("b").rstrip("i")
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 bytes")
    return value


def _log_level_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: object) -> None:
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=default,
        help="the library's log records shown on stderr, from this level up (default: warning)",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lifecycle", description="Memory lifecycle for LLM serving.")
    parser.add_argument("--version", action="version", version=f"lifecycle {__version__}")
    _log_level_option(parser, "warning")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    info = commands.add_parser(
        "info",
        help="versions, the CUDA driver and device, and the device open_device('auto') picks",
        description="Print lifecycle's version and installation, its dependencies' versions, the CUDA "
        "driver and GPU if any, and the device open_device('auto') picks here. Needs no GPU.",
    )
    info.add_argument("--json", action="store_true", help="print one JSON object")
    _log_level_option(info, argparse.SUPPRESS)  # after the command too; the top-level default stands
    info.set_defaults(command_parser=info)
    sim = commands.add_parser(
        "simulate",
        help="replay a synthetic multi-turn serving trace through the lifecycle API",
        description=(
            "Replay a seeded multi-turn chat trace (shared system prompts, LoRA adapters) through "
            "admission, prefix reuse, decode growth, preemption by swap, compaction, caching and "
            "teardown, then print a summary."
        ),
    )
    trace = sim.add_argument_group("trace")
    trace.add_argument(
        "--requests", type=_count(1), default=DEFAULT_REQUESTS, help="requests to serve (default: %(default)s)"
    )
    trace.add_argument(
        "--turns", type=_count(1), default=DEFAULT_TURNS, help="most turns per chat (default: %(default)s)"
    )
    trace.add_argument("--seed", type=_count(0), default=0, help="trace seed (default: %(default)s)")
    model = sim.add_argument_group("model")
    model.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="PRESET",
        help=f"model preset: {', '.join(preset_names())} (default: %(default)s)",
    )
    model.add_argument(
        "--device", choices=("host", "cuda"), default="host", help="device memory (default: %(default)s)"
    )
    sizing = model.add_mutually_exclusive_group()
    sizing.add_argument(
        "--blocks",
        type=_count(1),
        help=f"KV blocks in the pool (default: {SIMULATION_SIZING[DEFAULT_MODEL]['num_blocks']} for "
        f"{DEFAULT_MODEL}, else the preset's)",
    )
    sizing.add_argument(
        "--kv-budget", type=_byte_size, metavar="BYTES", help="KV pool size, e.g. 64M (instead of --blocks)"
    )
    model.add_argument(
        "--snapshots",
        type=_count(0),
        metavar="N",
        help="SSM snapshot pool size of a hybrid model (default: "
        f"{SIMULATION_SIZING[DEFAULT_MODEL]['num_snapshots']} for {DEFAULT_MODEL}, else the preset's)",
    )
    sched = sim.add_argument_group("scheduler")
    sched.add_argument(
        "--max-live", type=_count(1), help="most sequences decoding at once (default: the preset's max_seqs)"
    )
    sched.add_argument(
        "--snapshot-every",
        type=_count(0),
        default=16,
        metavar="BLOCKS",
        help="hybrid models: snapshot SSM state every BLOCKS blocks (prefill chunks, decode) "
        "besides each prompt's end; 0: prompt ends only (default: %(default)s)",
    )
    sched.add_argument(
        "--swap-host-mb",
        type=_count(0),
        default=256,
        metavar="MB",
        help="host memory of the swap tier (default: %(default)s)",
    )
    sched.add_argument(
        "--spill-dir", type=Path, metavar="DIR", help="directory for swap spill files once host memory is full"
    )
    sched.add_argument("--no-swap", action="store_true", help="preempt by recompute instead of swap")
    tiers = sim.add_argument_group("tiers under the KV pool (models without SSM layers, e.g. small-attention)")
    tiers.add_argument(
        "--host-tier-mb",
        type=_count(0),
        default=0,
        metavar="MB",
        help="host memory keeping evicted prefix-cache blocks, promoted back at admission (default: none)",
    )
    tiers.add_argument(
        "--store", metavar="URL", help="a Redis / Valkey URL shared by engines, written behind the host tier"
    )
    sched.add_argument(
        "--check-every",
        type=_count(0),
        default=100,
        metavar="STEPS",
        help="check every invariant each STEPS steps; 0: only at the end (default: %(default)s)",
    )
    out = sim.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of the table (no progress bar)")
    out.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="draw pool occupancy and hit rate over time (needs matplotlib)"
    )
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    out.add_argument(
        "--plan",
        action="store_true",
        help="print the KV memory per group (blocks, bytes, concurrent max_model_len sequences, padding) and "
        "exit instead of replaying",
    )
    _log_level_option(out, argparse.SUPPRESS)
    sim.set_defaults(command_parser=sim)  # errors found after parsing print this command's usage
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what argparse's types cannot see, before any work starts."""
    if args.model not in preset_names():
        parser.error(f"argument --model: unknown preset {args.model!r}; choose from {', '.join(preset_names())}")
    if args.spill_dir is not None:
        spill: Path = args.spill_dir
        if not spill.is_dir() or not os.access(spill, os.W_OK | os.X_OK):
            parser.error(f"argument --spill-dir: {str(spill)!r} is not a writable directory")
    if args.plot is not None:
        plot: Path = args.plot
        if plot.suffix.lower() not in _PLOT_SUFFIXES:
            parser.error(f"argument --plot: {str(plot)!r} must end in one of {', '.join(_PLOT_SUFFIXES)}")
        folder = plot.parent if str(plot.parent) else Path(".")
        if plot.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            parser.error(f"argument --plot: cannot write {str(plot)!r} (its folder is missing or not writable)")
        if plot.exists() and not os.access(plot, os.W_OK):
            parser.error(f"argument --plot: {str(plot)!r} exists and is not writable")
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            parser.error(plot_install_hint())


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelConfig:
    overrides: dict[str, Any] = dict(SIMULATION_SIZING.get(args.model, {}))
    if args.blocks is not None or args.kv_budget is not None:
        overrides.pop("num_blocks", None)
    if args.blocks is not None:
        overrides["num_blocks"] = args.blocks
    if args.kv_budget is not None:
        overrides["kv_budget_bytes"] = args.kv_budget
    if args.snapshots is not None:
        overrides["num_snapshots"] = args.snapshots
    base = preset(args.model)
    if args.max_live is not None and args.max_live > base.max_seqs:
        overrides["max_seqs"] = args.max_live  # one SSM slot per live sequence
    try:
        return preset(args.model, **overrides)
    except ConfigError as exc:
        _refuse_config(parser, exc, "--model")


def in_options(message: str) -> tuple[str | None, str]:
    """A configuration error's message in the command line's words: each field it names
    (``num_blocks=3``) as the option that sets it (``--blocks 3``); and the first such option."""
    named = [FIELD_OPTIONS[match.group(1)] for match in _FIELD.finditer(message)]
    text = _FIELD.sub(lambda match: FIELD_OPTIONS[match.group(1)] + (" " if match.group(2) else ""), message)
    return (named[0] if named else None), text


def _refuse_config(parser: argparse.ArgumentParser, exc: ConfigError, default_option: str) -> NoReturn:
    option, text = in_options(str(exc))
    option = option or default_option
    parser.error(f"argument {option}: {text.removeprefix(option + ' ')}")


@dataclass(frozen=True, slots=True)
class _Need:
    """Memory one part of a run takes, and the option that sizes it."""

    option: str
    what: str
    nbytes: int
    on_device: bool  # device memory (the host's own on the host device)


def _kv_option(args: argparse.Namespace) -> str:
    """The option that sized the KV pool."""
    return "--blocks" if args.blocks is not None else "--kv-budget" if args.kv_budget is not None else "--model"


def _memory_needs(args: argparse.Namespace, config: ModelConfig, trace_bytes: int) -> list[_Need]:
    base = preset(args.model)
    kv_option = _kv_option(args)
    slots_option = "--max-live" if args.max_live is not None and args.max_live > base.max_seqs else "--model"
    snapshots_option = "--snapshots" if args.snapshots is not None else "--model"
    blocks, slots = config.num_blocks_resolved, config.num_ssm_slots
    needs = [
        _Need(
            kv_option,
            f"a KV pool of {blocks:,} blocks of {human_bytes(config.kv_block_bytes())}",
            config.kv_pool_bytes(),
            True,
        ),
        _Need(
            kv_option,
            f"the bookkeeping of {blocks:,} blocks",
            blocks * (_HOST_BYTES_PER_BLOCK + 4 * config.block_size),
            False,
        ),
        _Need(
            slots_option,
            f"{slots:,} SSM slots of {human_bytes(config.ssm_slot_bytes())}",
            config.ssm_pool_bytes(),
            True,
        ),
        _Need(
            slots_option,
            f"the bookkeeping of {config.max_seqs:,} sequence slots",
            config.max_seqs * _HOST_BYTES_PER_SLOT_LAYER * (1 + len(config.ssm_layers)),
            False,
        ),
        _Need(
            snapshots_option,
            f"{config.num_snapshots:,} SSM snapshots of {human_bytes(config.ssm_slot_bytes())}",
            config.num_snapshots * config.ssm_slot_bytes(),
            True,
        ),
        _Need("--requests", f"a trace of {args.requests:,} requests of up to {args.turns} turns", trace_bytes, False),
    ]
    if not args.no_swap:
        needs.append(
            _Need("--swap-host-mb", f"{args.swap_host_mb:,} MiB of swap space", args.swap_host_mb << 20, False)
        )
    if args.host_tier_mb:
        tier = f"a host tier of {args.host_tier_mb:,} MiB"
        needs.append(_Need("--host-tier-mb", tier, args.host_tier_mb << 20, False))
    return needs


def _available_host_bytes() -> int:
    """Host memory that can be had now: MemAvailable on Linux, else the physical memory.

    Read by hand: psutil (virtual_memory().available) would add a compiled dependency for this one
    number."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    from lifecycle.device.host import physical_memory_bytes

    return physical_memory_bytes()


def _check_memory(parser: argparse.ArgumentParser, needs: list[_Need], host_free: int, device_free: int | None) -> None:
    """Refuse, naming the option, a run whose memory does not fit what is available: one part
    alone, or all of them together (the largest part's option is named). Nothing is allocated yet."""
    pools = [("host", host_free, [n for n in needs if device_free is None or not n.on_device])]
    if device_free is not None:
        pools.append(("device", device_free, [n for n in needs if n.on_device]))
    for memory, free, parts in pools:
        for need in parts:
            if need.nbytes > free:
                parser.error(
                    f"argument {need.option}: {need.what} would take {human_bytes(need.nbytes)} of {memory} memory; "
                    f"{human_bytes(free)} is available"
                )
        total = sum(need.nbytes for need in parts)
        if total > free:
            largest = max(parts, key=lambda need: need.nbytes)
            breakdown = ", ".join(f"{need.what}: {human_bytes(need.nbytes)}" for need in parts if need.nbytes)
            parser.error(
                f"argument {largest.option}: the run would take {human_bytes(total)} of {memory} memory in all "
                f"({breakdown}); {human_bytes(free)} is available"
            )


def _check_turns(parser: argparse.ArgumentParser, args: argparse.Namespace, config: ModelConfig) -> None:
    from lifecycle.simulate import MAX_TURN_SHRINK, max_turns

    limit = max_turns(config)
    if 0 < limit < args.turns:  # 0: no chat fits at all, which the trace reports itself
        parser.error(
            f"argument --turns: {args.turns} is more than the {limit} turns a chat can have on "
            f"{config.num_blocks_resolved:,} blocks (its messages would be shortened more than {MAX_TURN_SHRINK} "
            "times below a one-turn chat's); use fewer turns or more --blocks"
        )


def _open_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Device:
    from lifecycle.device import open_device

    try:
        return open_device(args.device)
    except DeviceError as exc:
        parser.error(f"argument --device: {args.device} is not available here: {exc}")


def _simulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from lifecycle.simulate import SimulationOptions, simulate, simulation_model, trace_for_model, trace_nbytes

    warning = shadowed_checkout_warning(Path.cwd())
    if warning is not None:
        print(warning, file=sys.stderr)

    config = _config(parser, args)
    if args.plan:
        return _plan(config, args.json)
    _check_turns(parser, args, config)
    options = SimulationOptions(
        max_live=args.max_live if args.max_live is not None else config.max_seqs,
        check_every=args.check_every,
        snapshot_interval_blocks=args.snapshot_every,
        swap=not args.no_swap and config.is_single_attention_group,
        swap_host_bytes=args.swap_host_mb << 20,
        spill_dir=args.spill_dir,
    )
    trace_bytes = trace_nbytes(config, num_requests=args.requests, turns=args.turns)
    needs = _memory_needs(args, config, trace_bytes)
    device = _open_device(parser, args)
    try:
        device_free = None if device.kind == "host" else device.mem_info()[0]
        _check_memory(parser, needs, _available_host_bytes(), device_free)
        show_progress = not (args.json or args.quiet)
        if show_progress and trace_bytes >= _ANNOUNCE_TRACE_BYTES:
            print(
                f"lifecycle simulate: generating a trace of {args.requests:,} requests "
                f"(about {human_bytes(trace_bytes)})...",
                file=sys.stderr,
                flush=True,
            )
        try:
            trace = trace_for_model(config, seed=args.seed, num_requests=args.requests, turns=args.turns)
        except ConfigError as exc:
            _refuse_config(parser, exc, _kv_option(args))
        host_blocks = (args.host_tier_mb << 20) // max(config.kv_block_bytes(), 1) if args.host_tier_mb else 0
        if args.host_tier_mb and host_blocks == 0:
            parser.error(
                f"argument --host-tier-mb: {args.host_tier_mb} MiB holds no block of {config.kv_block_bytes()} bytes"
            )
        try:  # its device times copies apart from bookkeeping
            model = simulation_model(config, device, host_tier_blocks=host_blocks, store=args.store)
        except ConfigError as exc:
            _refuse_config(parser, exc, "--host-tier-mb" if args.host_tier_mb else "--store")
        if show_progress:
            result = _with_progress(
                lambda done: simulate(model, trace, options, seed=args.seed, on_request_done=done), len(trace)
            )
        else:
            result = simulate(model, trace, options, seed=args.seed)
    finally:
        device.close()

    if args.json:
        print(json.dumps({**result.to_json(), "memory_plan": plan_json(config)}, sort_keys=True))
    else:
        _print_summary(result)
        print(_groups_line(result.summary.kv_groups, config))
    if args.plot is not None:
        from lifecycle.simulate import plot

        plot(result, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0 if result.summary.leaked == 0 else 1




def plan_json(config: ModelConfig) -> dict[str, Any]:
    """The model's memory per group and its figures at ``max_model_len`` tokens, at its own budget
    and at the reference budget (half the all-full-attention footprint of 262,144 blocks)."""
    from lifecycle.presets import REFERENCE_BLOCKS, reference_kv_budget

    tokens = config.max_model_len
    plan = config.memory_plan().as_dict(tokens)
    if config.kv_groups:
        reference = config.replace(kv_budget_bytes=reference_kv_budget(config)).memory_plan()
        plan["reference"] = {
            "all_full_blocks": REFERENCE_BLOCKS,
            "budget_bytes": reference.budget_bytes,
            "num_blocks": [group.num_blocks for group in reference.groups],
            "concurrent_sequences": reference.concurrent_sequences(tokens),
            "ideal_sequences": reference.ideal_sequences(tokens),
            "padding_waste": round(reference.padding_waste(tokens), 6),
        }
    return plan


def _groups_line(groups: list[dict[str, Any]], config: ModelConfig) -> str:
    """One line naming each KV group's blocks and bytes, and what the replay left in it (free,
    cached; released from a window)."""
    parts = []
    for group, counts in zip(config.kv_groups, groups, strict=True):
        part = (
            f"group {group.index} {group.kind} ({len(group.layer_indices)} layers): {group.num_blocks:,} blocks of "
            f"{human_bytes(group.block_bytes)} = {human_bytes(group.num_blocks * group.block_bytes)}, "
            f"{counts['num_free']:,} free and {counts['num_cached']:,} cached at the end"
        )
        if group.kind != "full":
            part += f", {counts['blocks_released']:,} released from the window"
        parts.append(part)
    return "KV memory per group: " + ("; ".join(parts) if parts else "none (no KV layers)")


def _plan(config: ModelConfig, as_json: bool) -> int:
    plan = plan_json(config)
    if as_json:
        print(json.dumps({"model": config.name, "memory_plan": plan}))
        return 0
    tokens = plan["tokens"]
    row = "{:>5}  {:<14}  {:>6}  {:>6}  {:>11}  {:>10}  {:>11}  {:>10}"
    lines = [
        f"{config.name}: KV memory per group ({config.block_size}-token blocks)",
        row.format("group", "kind", "window", "layers", "bytes/token", "block", "blocks", "bytes"),
    ]
    for group in plan["groups"]:
        window = group["window"] + group["sink_tokens"]
        lines.append(
            row.format(
                group["index"], group["kind"], f"{window:,}" if window else "-", group["layers"],
                f"{group['bytes_per_token']:,}", human_bytes(group["block_bytes"]), f"{group['num_blocks']:,}",
                human_bytes(group["bytes"]),
            )
        )
    lines.append(
        f"budget {human_bytes(plan['budget_bytes'])}: {plan['concurrent_sequences']:,} concurrent sequences of "
        f"{tokens:,} tokens (ideal {plan['ideal_sequences']:,}), padding {100 * plan['padding_waste']:.2f}%"
    )
    reference = plan.get("reference")
    if reference is not None:
        lines.append(
            f"reference budget {human_bytes(reference['budget_bytes'])} (half the all-full-attention footprint of "
            f"{reference['all_full_blocks']:,} blocks): {reference['concurrent_sequences']:,} sequences "
            f"(ideal {reference['ideal_sequences']:,}), padding {100 * reference['padding_waste']:.2f}%"
        )
    print("\n".join(lines))
    return 0


def _with_progress(run: Any, total: int) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("[bold]simulate"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task("simulate", total=total)
        return run(lambda done: progress.update(task, completed=done))


def _print_summary(result: SimulationResult) -> None:
    from rich.console import Console
    from rich.table import Table

    from lifecycle.simulate import summary_rows

    s = result.summary
    table = Table(title=f"lifecycle simulate: {s.model} on {s.device}", show_header=True, header_style="bold")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for measure, value in summary_rows(result):
        table.add_row(measure, value)
    Console().print(table)


def _package_versions() -> dict[str, str | None]:
    """The installed version of each dependency that matters here (None: not installed)."""
    names = ("numpy", "cuda-bindings", "cuda-python", "xxhash", "rich", "matplotlib", "torch")
    return {name: installed_version(name) for name in names}


def _nvidia_kernel_driver() -> str | None:
    """The NVIDIA kernel module's version (e.g. 580.65.06), from /proc; None without one."""
    try:
        with open("/proc/driver/nvidia/version", encoding="ascii", errors="replace") as proc:
            match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", proc.read())
    except OSError:
        return None
    return match.group(1) if match else None


def _cuda_driver_version() -> tuple[int | None, str]:
    """``cuDriverGetVersion`` (13000 for CUDA 13.0), or None and why not. Loads the driver library
    only; initialises nothing."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return None, f"cuda-bindings is not installed ({exc})"
    try:
        err, version = driver.cuDriverGetVersion()
    except Exception as exc:  # the loader's errors (no libcuda.so.1): one line of them
        return None, (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if err:
        return None, f"cuDriverGetVersion failed ({err})"
    return int(version), ""


def _bindings_note(bindings: str | None, driver_version: int | None) -> str:
    """The driver the installed cuda-bindings needs, and a mismatch with this one, in words."""
    if bindings is None:
        return "cuda-bindings is not installed: pip install 'kv-lifecycle[cuda13]' (or [cuda12])"
    try:
        major = int(bindings.split(".")[0])
    except ValueError:
        return ""
    minimum = DRIVER_MINIMUM.get(major)
    note = f"CUDA {major} bindings" + (f", for NVIDIA drivers {minimum} or newer" if minimum else "")
    if driver_version is not None and driver_version // 1000 < major:
        older = driver_version // 1000
        hint = f"; pip install 'kv-lifecycle[cuda{older}]'" if older in DRIVER_MINIMUM else ""
        note += f"; this driver is CUDA {older}.{driver_version % 1000 // 10}: too old for them{hint}"
    return note


def collect_info() -> dict[str, Any]:
    """What ``lifecycle info`` prints, as one JSON-ready dict."""
    import platform

    from lifecycle._packaging import PACKAGE_DIR
    from lifecycle.device import open_device

    checkout = editable_checkout()
    if checkout is not None and (checkout / "lifecycle").resolve() != PACKAGE_DIR:
        checkout = None  # the editable install is of another checkout than the package running
    versions = _package_versions()
    driver_version, no_driver = _cuda_driver_version()
    info: dict[str, Any] = {
        "lifecycle": __version__,
        "package": str(PACKAGE_DIR),
        "editable_checkout": None if checkout is None else str(checkout),
        "python": f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})",
        "packages": versions,
        "cuda_bindings": _bindings_note(versions["cuda-bindings"], driver_version),
        "cuda_driver": None if driver_version is None else f"{driver_version // 1000}.{driver_version % 1000 // 10}",
        "cuda_driver_missing": no_driver or None,
        "nvidia_kernel_driver": _nvidia_kernel_driver(),
    }
    device = open_device("auto")
    try:
        info["auto_device"] = device.kind
        info["device"] = device.name
        if device.kind == "cuda":
            free, total = device.mem_info()
            info["device_memory"] = {"free": free, "total": total}
            info["auto_reason"] = "a CUDA driver and a GPU are present"
        else:
            try:
                open_device("cuda").close()
                info["auto_reason"] = "CUDA opened only on the second try"
            except DeviceError as exc:
                info["auto_reason"] = str(exc)
    finally:
        device.close()
    return info


def _version_line(name: str, version: str | None, info: dict[str, Any]) -> str:
    if version is None:
        return info["cuda_bindings"] if name == "cuda-bindings" else "not installed"
    return f"{version} ({info['cuda_bindings']})" if name == "cuda-bindings" else version


def _print_info(info: dict[str, Any]) -> None:
    where = info["package"]
    if info["editable_checkout"]:
        where += f" (editable install of {info['editable_checkout']})"
    lines = [
        ("lifecycle", f"{info['lifecycle']} at {where}"),
        ("python", info["python"]),
        *((name, _version_line(name, version, info)) for name, version in info["packages"].items()),
        ("CUDA driver", info["cuda_driver"] or f"none ({info['cuda_driver_missing']})"),
    ]
    if info["nvidia_kernel_driver"]:
        lines.append(("NVIDIA driver", info["nvidia_kernel_driver"]))
    device = info["device"]
    if "device_memory" in info:
        memory = info["device_memory"]
        device += f", {human_bytes(memory['free'])} free of {human_bytes(memory['total'])}"
    lines.append(("device", device))
    lines.append(('open_device("auto")', f"{info['auto_device']}: {info['auto_reason']}"))
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        print(f"{label:>{width}}  {value}")


def _info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, sort_keys=True))
    else:
        _print_info(info)
    return 0


class _InterruptedTeardown(logging.Filter):
    """Drops the teardown's report of live sequences while Ctrl-C unwinds the run: they were live
    because the run was interrupted, which the command's last line says."""

    def filter(self, record: logging.LogRecord) -> bool:
        interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
        return not (interrupted and record.name == "lifecycle.model" and str(record.msg).startswith("teardown"))


def _log_handler(level: str) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    handler.addFilter(_InterruptedTeardown())
    handler.setLevel(level.upper())
    return handler


def _wants_json(argv: Sequence[str]) -> bool:
    """Whether ``--json`` (or an abbreviation argparse would take for it) is among the options:
    an error found while parsing them is then printed as JSON too."""
    for arg in argv:
        if arg == "--":
            return False
        if len(arg) >= 3 and "--json".startswith(arg):
            return True
    return False


def _report(json_mode: bool, kind: str, message: str, status: int, option: str | None = None) -> int:
    """Print an error for a person (stderr) and, in JSON mode, as one JSON object (stdout)."""
    if json_mode:
        error = {"type": kind, "message": message, "option": option, "exit_status": status}
        print(json.dumps({"error": error}, sort_keys=True), flush=True)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a bad option, 1 for a failed run, 130
    when interrupted)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    json_mode = _wants_json(arguments)
    prog = "lifecycle"
    parser = _build_parser()
    logger = logging.getLogger(ROOT_LOGGER)
    handler: logging.Handler | None = None
    level = logger.level
    try:
        args = parser.parse_args(arguments)
        handler = _log_handler(args.log_level)
        logger.addHandler(handler)
        logger.setLevel(handler.level)
        json_mode = bool(getattr(args, "json", json_mode))
        prog = f"lifecycle {args.command}"
        command_parser: argparse.ArgumentParser = args.command_parser
        if args.command == "info":
            return _info(args)
        _validate(command_parser, args)
        if args.command == "simulate":
            return _simulate(command_parser, args)
    except _UsageError as exc:
        exc.parser.print_usage(sys.stderr)
        print(f"{exc.parser.prog}: error: {exc.message}", file=sys.stderr)
        match = _OPTION.match(exc.message)
        return _report(json_mode, "usage", exc.message, 2, match.group(1) if match else None)
    except LifecycleError as exc:
        print(f"{prog}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return _report(json_mode, type(exc).__name__, str(exc), 1)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return _report(json_mode, "interrupted", "interrupted (Ctrl-C)", EXIT_INTERRUPTED)
    except SystemExit as exc:  # --help and --version exit through argparse
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        if handler is not None:
            logger.removeHandler(handler)
            logger.setLevel(level)
    return 2
