"""`wholeshard bench`: every configuration on the same work, one after another, side by side.

Each configuration runs in its own `launch` (fresh processes, a fresh gloo group) with the same
model init, data, seed and world size. Workers are spawned (a clean interpreter each, so memory
figures are the worker's own); `--quick` forks them instead, to start in milliseconds. Progress
goes to stderr; stdout carries the markdown table. The `DataParallelConfig` flags
(`--reshard-after-forward`, `--[no-]overlap-grad-reduce`, `--bucket-size`, ...) set that
field on every wholeshard (ws_*) configuration of the run; the line under the table names them.

`--device cuda` runs every rank on a GPU (rank r on GPU r mod the GPU count), spawned even with
`--quick`: NCCL when every rank has a GPU of its own (world size 1 on one GPU), else gloo with
ranks sharing GPUs. Step times then come from CUDA events, and rows add
`torch.cuda.max_memory_allocated` and the Newton–Schulz TFLOP/s against the GPU's bf16 peak.
`--count-launches` profiles one more step per configuration and adds its kernel launches.
On a CPU without fast bf16 matmuls (no AVX512-BF16, no AMX) the run first says so, and what to
run instead where a workload's bf16 Newton-Schulz cannot finish (`bench.slow_bf16`).

`--matrix-optimizer`, `--ns-algorithm` and `--ns-coefficients` (each taking one or more values)
bench every combination as a matrix rule (`bench.rule_optimizers`): each wholeshard configuration
and `ddp_kj_rule` (the rule run KJ-style, round-robin over DDP's replicated params) runs once per
rule, its rows labelled `config[rule]` unless the rule is the default (torch's Muon, standard
quintic), with `vs ddp_kj_rule` and the optimizer's share; the other peers run once.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Any

from ..bench import report, slow_bf16
from ..bench.configs import (
    CONFIGS,
    MATRIX_RULES,
    NS_ALGORITHMS,
    NS_COEFFICIENTS,
    WORKLOADS,
    Rule,
    rule_sensitive,
    with_overrides,
)
from ..bench.machine import SLOW_BF16
from ..engine.config import DataParallelConfig
from . import MAX_NPROC, interrupt, positive_int
from .flags import add_flags

DEVICES = ("cpu", "cuda")
DEFAULT_STEPS = 10
WARMUP = 2
QUICK_STEPS = 2
QUICK_WARMUP = 1


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload", choices=(*WORKLOADS, "all"), default="all", help="what to train (all)"
    )
    p.add_argument(
        "--nproc",
        type=positive_int(MAX_NPROC),
        default=2,
        help=f"local ranks, at most {MAX_NPROC} (2)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the ranks compute: cpu (gloo), or cuda (NCCL at one rank per GPU, else gloo; "
        "CUDA-event times, GPU memory, Newton-Schulz TFLOP/s) (cpu)",
    )
    p.add_argument(
        "--count-launches",
        action="store_true",
        help="profile one more step per configuration and report its kernel launches, the "
        "optimizer step's among them (torch.profiler)",
    )
    p.add_argument(
        "--steps",
        type=positive_int(),
        default=None,
        help=f"timed steps per configuration, after {WARMUP} warm-up steps and one "
        f"traffic-counting step ({DEFAULT_STEPS}; {QUICK_STEPS} with --quick)",
    )
    p.add_argument(
        "--repeat",
        type=positive_int(),
        default=1,
        metavar="R",
        help="run every configuration R times, interleaved, and report medians over the rounds "
        "(evens out load that drifts on a shared machine; 1)",
    )
    p.add_argument(
        "--config",
        action="append",
        choices=tuple(CONFIGS),
        help="run only this configuration (repeatable; default: all)",
    )
    rules = p.add_argument_group(
        "matrix rules (every combination of the values given; default: muon standard quintic)",
        "each runs every wholeshard configuration and ddp_kj_rule once",
    )
    for flag, choices, what in (
        ("--matrix-optimizer", MATRIX_RULES, "the optimizer stepping the matrices"),
        ("--ns-algorithm", NS_ALGORITHMS, "Newton-Schulz iteration (gram: fewer flops)"),
        ("--ns-coefficients", NS_COEFFICIENTS, "Newton-Schulz coefficient schedule"),
    ):
        rules.add_argument(
            flag, nargs="+", choices=choices, default=[choices[0]], help=f"{what} ({choices[0]})"
        )
    overrides = p.add_argument_group(
        "overrides of every wholeshard (ws_*) configuration",
        "DataParallelConfig fields; a flag not given leaves each configuration's own setting",
    )
    add_flags(overrides, DataParallelConfig, dest=OVERRIDE, skip=NOT_OVERRIDABLE, overrides=True)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--png", metavar="FILE", help="write a bar chart of step time and memory")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, 2 steps, forked workers (spawned on cuda): a smoke test, not a benchmark",
    )


def _epilog() -> str:
    width = max(len(name) for name in CONFIGS)
    lines = [f"  {c.name:<{width}}  {c.description}" for c in CONFIGS.values()]
    return "configurations, run in this order:\n" + "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` on the `wholeshard` command's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark wholeshard against torch DDP/FSDP2 Muon setups",
        description=__doc__,
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    p.set_defaults(run=main)
    return p


OVERRIDE = "override."
NOT_OVERRIDABLE = frozenset({"matrix_params", "mp_policy", "fp8_param_gather"})
"""Fields each configuration decides for itself: the workload's routing, its dtypes, FP8 with
its recipe."""


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `DataParallelConfig` fields the parsed flags impose on every wholeshard
    configuration (a flag not given imposes nothing)."""
    return {k[len(OVERRIDE) :]: v for k, v in vars(args).items() if k.startswith(OVERRIDE)}


def _flag(keyword: str, value: Any) -> str:
    name = "--" + keyword.replace("_", "-")
    if isinstance(value, bool):
        return name if value else name.replace("--", "--no-", 1)
    return f"{name} {value}"


def _error_line(text: str) -> str:
    """The exception line of a traceback (its last non-empty line)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "failed without a message"


def _run_one(
    workload: str,
    config: str,
    nproc: int,
    steps: int,
    warmup: int,
    quick: bool,
    overrides: dict[str, Any],
    device: str,
    backend: str,
    count_launches: bool,
    rule: Rule,
    yardstick: bool = True,
) -> tuple[report.Row, list[str]]:
    """One configuration (wholeshard keywords replaced by `overrides`, matrices under `rule`) on
    fresh workers: its row, and any collectives the traffic model could not charge. A
    configuration that cannot run or fails gets a row carrying the reason. Without
    `yardstick`, the row has no torch-Muon yardstick (`Job.yardstick`)."""
    from ..bench.builders import unavailable
    from ..bench.worker import Job, run_rank
    from ..bench.workloads import get_workload
    from ..distributed.launch import WorkerFailed, launch

    label = rule.label
    try:
        overridden = with_overrides(config, overrides)
        reason = unavailable(overridden, get_workload(workload, quick), rule)
    except ValueError as e:  # overrides no DataParallelConfig accepts
        reason = str(e)
    if reason is not None:
        return report.Row(workload, config, error=reason, rule=label), []
    timeout = 120 + 30 * (warmup + 1 + steps)
    job = Job(
        workload,
        config,
        steps,
        warmup,
        quick,
        overrides,
        device,
        count_launches,
        vars(rule),
        yardstick,
    )
    try:
        ranks = launch(
            run_rank,
            nproc,
            (job,),
            start_method="fork" if quick and device == "cpu" else "spawn",
            timeout=timeout,
            collective_timeout_s=timeout,
            backend=backend,
            device=device,
        )
    except WorkerFailed as e:
        error = f"rank {e.rank}: {_error_line(e.traceback)}"
        return report.Row(workload, config, error=error, rule=label), []
    except TimeoutError:
        return report.Row(workload, config, error=f"timed out after {timeout} s", rule=label), []
    return report.from_ranks(workload, config, ranks, label), ranks[0]["unmodelled"]


def _backend(device: str, nproc: int) -> str | None:
    """The process group's backend for `nproc` ranks on `device`; None when that is CUDA and
    this machine has none."""
    if device == "cpu":
        return "gloo"
    import torch

    if not torch.cuda.is_available():
        return None
    return "nccl" if nproc <= torch.cuda.device_count() else "gloo"


def _rules(args: argparse.Namespace, config: str) -> list[Rule]:
    """The rules `config` runs under: every combination of the rule flags' values for a
    rule-sensitive configuration, the default rule alone for the others."""
    if not rule_sensitive(CONFIGS[config]):
        return [Rule()]
    values = (args.matrix_optimizer, args.ns_algorithm, args.ns_coefficients)
    return list(dict.fromkeys(Rule(*combo) for combo in itertools.product(*values)))


def _make_parent(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed `args`; returns the exit code."""
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    warmup = QUICK_WARMUP if args.quick else WARMUP
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    configs = [c for c in CONFIGS if not args.config or c in args.config]
    imposed = flag_overrides(args)
    if imposed and all(CONFIGS[c].parallel is None for c in configs):
        flags = " ".join(_flag(k, v) for k, v in imposed.items())
        print(
            f"error: {flags}: overrides wholeshard (ws_*) configurations only, and --config "
            f"selects none",
            file=sys.stderr,
        )
        return 2
    backend = _backend(args.device, args.nproc)
    if backend is None:
        print(
            "error: --device cuda: CUDA is not available here (no GPU, or a CPU-only torch); "
            "run on a GPU machine or use --device cpu",
            file=sys.stderr,
        )
        return 2
    from ..bench.worker import preload

    forked = args.quick and args.device == "cpu"
    machine = report.machine(args.nproc, forked=forked, device=args.device, backend=backend)
    slow = args.device == "cpu" and machine["cpu_bf16_matmul"] == SLOW_BF16
    if slow:
        for line in slow_bf16.header(machine["cpu"], workloads, configs, args.quick):
            print(f"[bench] note: {line}", file=sys.stderr)
    if forked:
        preload()  # forked workers inherit it

    runs = [(w, c, r) for w in workloads for c in configs for r in _rules(args, c)]
    rounds: dict[tuple[str, str, Rule], list[report.Row]] = {run: [] for run in runs}
    for round_ in range(args.repeat):
        for workload, config, rule in runs:
            name = f"{config}[{rule.label}]" if rule.label else config
            where = f"{workload} / {name}" + (f" (round {round_ + 1})" if args.repeat > 1 else "")
            print(f"[bench] {where} on {args.nproc} {backend} ranks ...", file=sys.stderr)
            start = time.monotonic()
            with interrupt.raises():  # the launcher stops its workers on the way out
                row, unmodelled = _run_one(
                    workload,
                    config,
                    args.nproc,
                    steps,
                    warmup,
                    args.quick,
                    imposed,
                    args.device,
                    backend,
                    args.count_launches,
                    rule,
                    not (slow and slow_bf16.cannot_finish(workload, args.quick)),
                )
            took = time.monotonic() - start
            result = row.error or f"{row.step_s:.3f} s/step"
            print(f"[bench]   {result} ({took:.0f} s)", file=sys.stderr)
            if unmodelled:
                print(f"[bench]   bytes leave out unmodelled {unmodelled}", file=sys.stderr)
            rounds[workload, config, rule].append(row)
    rows = [report.merge_rounds(rounds[run]) for run in runs]
    machine["load_average_end"] = list(os.getloadavg())

    report.fill_ratios(rows, machine.get("gpu_bf16_peak_tflops"))
    flagged = report.disagreements(rows)
    print(report.markdown(rows, flagged, args.device))
    print("\n" + report.footer(machine, args.nproc, steps, warmup, args.repeat, imposed))
    for message in flagged:
        print(f"WARNING: {message}")
    if args.json:
        _make_parent(args.json)
        with open(args.json, "w") as f:
            measured = {
                "date": time.strftime("%Y-%m-%d"),
                "command": " ".join(["wholeshard", *sys.argv[1:]]),
                "steps": steps,
                "warmup": warmup,
                "repeat": args.repeat,
            }
            f.write(report.to_json(machine, args.nproc, rows, imposed, measured) + "\n")
    if args.png:
        from ..bench.plot import write_png

        _make_parent(args.png)
        title = f"wholeshard bench: {args.nproc} {backend} ranks, torch {machine['torch']}"
        write_png(rows, args.png, title)
    return 0
