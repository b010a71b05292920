"""Time `torch.optim.Muon` against `wholeshard.optim.batched_muon.BatchedMuon` on CPU.

    python tools/measure_batched_muon.py [--repeats 3] [--threads 1]

For each case (n same-shape fp32 matrices, each its own param with a fixed random grad), it
prints the median wall time of `step()` over `--repeats` timed steps after one warm-up step,
for torch's Muon, BatchedMuon with bf16 Newton-Schulz products (torch's kernels, the default)
and with fp32 products (`matmul_dtype=torch.float32`), and each one's time relative to torch's.
The three optimizers step in turn within each repeat, so machine load shifts them alike; they
start from the same params and take the same steps, so the last column is the max abs
difference of the final params from torch's. On the first case it also counts the `aten::` ops
of one more step with `torch.profiler`: all of them; the top-level ones (called by the
optimizer, not inside another aten op); and of those, the ones that run a kernel (no view,
allocation or no-op `to`), as `wholeshard bench --count-launches` counts them
(`wholeshard.bench.launches`): about the kernel launches of the step on CUDA. On CPU a bf16
`bmm` loops over its matrices in `addmm_` calls and a foreach op over its tensors, so "all"
counts those. Runs in under a minute on one thread of a 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from wholeshard.bench.launches import is_top_level, runs_kernel  # noqa: E402
from wholeshard.optim.batched_muon import BatchedMuon  # noqa: E402

CASES = [(512, (64, 64)), (256, (64, 64)), (64, (256, 64)), (8, (64, 64)), (1, (64, 64))]
OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "torch Muon": lambda ps: torch.optim.Muon(ps, lr=0.02),
    "BatchedMuon": lambda ps: BatchedMuon(ps, lr=0.02),
    "BatchedMuon fp32": lambda ps: BatchedMuon(ps, lr=0.02, matmul_dtype=torch.float32),
}


def make(n: int, shape: tuple[int, int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(shape, generator=g)
    return params


def timed(opt: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def measure(
    n: int, shape: tuple[int, int], repeats: int, count_ops: bool
) -> dict[str, tuple[float, float, tuple[int, ...]]]:
    """name -> (median step seconds, max abs param difference from torch's Muon, op counts of
    one more step if `count_ops`: all aten ops, top-level ones, top-level ones that run a
    kernel (not a view, an allocation or a no-op `to`))."""
    params = {name: make(n, shape) for name in OPTIMIZERS}
    opts = {name: build(params[name]) for name, build in OPTIMIZERS.items()}
    times: dict[str, list[float]] = {name: [] for name in OPTIMIZERS}
    counts: dict[str, tuple[int, ...]] = {name: () for name in OPTIMIZERS}
    for opt in opts.values():
        opt.step()  # warm-up; creates the momentum buffers
    for _ in range(repeats):
        for name, opt in opts.items():
            times[name].append(timed(opt))
    for name, opt in opts.items() if count_ops else ():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
        aten = [e for e in prof.events() if e.name.startswith("aten::")]
        top = [e for e in aten if is_top_level(e)]
        counts[name] = (len(aten), len(top), sum(map(runs_kernel, top)))
    ref = params["torch Muon"]
    return {
        name: (
            statistics.median(times[name]),
            max((p - r).abs().max().item() for p, r in zip(params[name], ref, strict=True)),
            counts[name],
        )
        for name in OPTIMIZERS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats} steps")
    print(f"{'case':<16}{'optimizer':<18}{'ms/step':>9}{'vs torch':>9}{'max|dparam|':>12}")
    seconds: dict[tuple[str, int], float] = {}
    ops: dict[str, tuple[int, ...]] = {}
    for i, (n, shape) in enumerate(CASES):
        results = measure(n, shape, args.repeats, count_ops=i == 0)
        case = f"{n} x {shape[0]}x{shape[1]}"
        for name, (t, diff, counts) in results.items():
            seconds[name, n] = t
            ratio = t / results["torch Muon"][0]
            print(f"{case:<16}{name:<18}{t * 1e3:>9.1f}{ratio:>9.2f}{diff:>12.2e}")
            if counts:
                ops[name] = counts
    n, shape = CASES[0]
    print(f"\naten ops per step on {n} x {shape[0]}x{shape[1]}: all, top-level, kernel-running")
    for name, (total, top, runs) in ops.items():
        print(f"  {name:<18}{total:>8}{top:>8}{runs:>8}")
    print("\ntarget: a rank's step on 256 of 512 x 64x64 at 2 ranks <= 0.6 x torch Muon on 256:")
    for name in ("BatchedMuon", "BatchedMuon fp32"):
        print(f"  {name:<18}{seconds[name, 256] / seconds['torch Muon', 256]:>8.2f}")
    print("(the optimizers alone; the whole distributed step, communication included, is the")
    print(" `opt vs torch Muon` column of `wholeshard bench --workload many-matrices`)")


if __name__ == "__main__":
    main()
