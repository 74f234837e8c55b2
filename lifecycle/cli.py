"""The ``lifecycle`` command line.

``lifecycle simulate`` replays a synthetic multi-turn serving trace through the whole lifecycle API
(see :mod:`lifecycle.simulate`) and prints a summary: a progress bar on stderr while it runs, then a
table (or, with ``--json``, one JSON object) on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from lifecycle._packaging import plot_install_hint, shadowed_checkout_warning
from lifecycle.config import ModelConfig
from lifecycle.errors import ConfigError, DeviceError, LifecycleError
from lifecycle.presets import preset, preset_names

if TYPE_CHECKING:
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
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


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


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lifecycle", description="Memory lifecycle for LLM serving.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
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
    trace.add_argument("--requests", type=_count(1), default=DEFAULT_REQUESTS, help="requests to serve (default: %(default)s)")
    trace.add_argument("--turns", type=_count(1), default=DEFAULT_TURNS, help="most turns per chat (default: %(default)s)")
    trace.add_argument("--seed", type=_count(0), default=0, help="trace seed (default: %(default)s)")
    model = sim.add_argument_group("model")
    model.add_argument(
        "--model", default=DEFAULT_MODEL, metavar="PRESET",
        help=f"model preset: {', '.join(preset_names())} (default: %(default)s)",
    )
    model.add_argument("--device", choices=("host", "cuda"), default="host", help="device memory (default: %(default)s)")
    sizing = model.add_mutually_exclusive_group()
    sizing.add_argument("--blocks", type=_count(1),
                        help="KV blocks in the pool (default: 2048 for small-hybrid, else the preset's)")
    sizing.add_argument("--kv-budget", type=_byte_size, metavar="BYTES", help="KV pool size, e.g. 64M (instead of --blocks)")
    model.add_argument("--snapshots", type=_count(0), metavar="N", help="SSM snapshot pool size of a hybrid model (default: 128 for small-hybrid, else the preset's)")
    sched = sim.add_argument_group("scheduler")
    sched.add_argument("--max-live", type=_count(1), help="most sequences decoding at once (default: the preset's max_seqs)")
    sched.add_argument("--snapshot-every", type=_count(0), default=16, metavar="BLOCKS",
                       help="hybrid models: snapshot SSM state every BLOCKS blocks (prefill chunks, decode) "
                       "besides each prompt's end; 0: prompt ends only (default: %(default)s)")
    sched.add_argument("--swap-host-mb", type=_count(0), default=256, metavar="MB", help="host memory of the swap tier (default: %(default)s)")
    sched.add_argument("--spill-dir", type=Path, metavar="DIR", help="directory for swap spill files once host memory is full")
    sched.add_argument("--no-swap", action="store_true", help="preempt by recompute instead of swap")
    sched.add_argument("--check-every", type=_count(0), default=100, metavar="STEPS",
                       help="check every invariant each STEPS steps; 0: only at the end (default: %(default)s)")
    out = sim.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of the table (no progress bar)")
    out.add_argument("--plot", type=Path, metavar="FILE.png", help="draw pool occupancy and hit rate over time (needs matplotlib)")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
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
        parser.error(f"--model {args.model}: {exc}")


def _simulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from lifecycle.simulate import SimulationOptions, simulate, simulation_model, trace_for_model

    warning = shadowed_checkout_warning(Path.cwd())
    if warning is not None:
        print(warning, file=sys.stderr)

    config = _config(parser, args)
    options = SimulationOptions(
        max_live=args.max_live if args.max_live is not None else config.max_seqs,
        check_every=args.check_every,
        snapshot_interval_blocks=args.snapshot_every,
        swap=not args.no_swap,
        swap_host_bytes=args.swap_host_mb << 20,
        spill_dir=args.spill_dir,
    )
    try:
        trace = trace_for_model(config, seed=args.seed, num_requests=args.requests, turns=args.turns)
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        model = simulation_model(config, args.device)  # its device times copies apart from bookkeeping
    except DeviceError as exc:
        parser.error(f"argument --device: {args.device} is not available here: {exc}")

    show_progress = not (args.json or args.quiet)
    try:
        if show_progress:
            result = _with_progress(
                lambda done: simulate(model, trace, options, seed=args.seed, on_request_done=done), len(trace)
            )
        else:
            result = simulate(model, trace, options, seed=args.seed)
    except LifecycleError as exc:
        print(f"lifecycle simulate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1

    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    else:
        _print_summary(result)
    if args.plot is not None:
        from lifecycle.simulate import plot

        plot(result, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0 if result.summary.leaked == 0 else 1


def _with_progress(run: Any, total: int) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a bad option, 1 for a failed run)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        command_parser: argparse.ArgumentParser = args.command_parser
        _validate(command_parser, args)
        if args.command == "simulate":
            return _simulate(command_parser, args)
    except SystemExit as exc:  # argparse's exits (--help, bad options) become the return value
        return exc.code if isinstance(exc.code, int) else 1
    return 2
