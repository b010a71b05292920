"""What each rank runs for one configuration: build, warm up, count traffic, time the steps.

Step sequence on every rank: `warmup` untimed steps (lazy optimizer state, DDP's bucket rebuild),
one untimed step under the `TrafficCounter`, then `steps` timed steps. A step is forward +
backward + optimizer step + zero_grad; batches are made before the loop. Then, once the
memory figures are read, with `count_launches` one more untimed step on the last batch under
`torch.profiler` (`launches.py`), and the floor (`floor.py`) on the same batches.

On `device="cuda"` the model and batches live on the rank's current GPU (`launch` sets it), times
come from CUDA events (`timing.Timer`: each step is waited for before the next starts), and the
rank also reports `torch.cuda.max_memory_allocated` after the timed steps.

Memory: the RSS delta is the peak resident set at the end minus the resident set just before
the configuration builds the model (batches are made and lazy imports done before that), so it
isolates the model, its optimizers and training from the interpreter and its imports.
Persistent bytes are what the setup reports holding between steps, read after the timed steps.
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import floor
from .builders import build, every_param
from .configs import with_overrides
from .launches import FIELDS, StepProfile
from .memory_figures import optimizer_state_bytes, peak_rss_bytes, persistent_bytes, rss_bytes
from .rule_optimizers import Rule
from .timing import Timer, max_memory_allocated
from .traffic import TrafficCounter
from .wait_clock import WaitClock
from .workloads import get_workload


def preload() -> None:
    """Import what the configurations import lazily (torch's optimizers pull in dynamo, ~3 s and
    ~30 MB), so it is neither in the RSS delta nor, for forked workers, paid per worker."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    from .. import optim  # noqa: F401
    from ..engine import data_parallel  # noqa: F401


@dataclass(frozen=True)
class Job:
    """One configuration for every rank to benchmark: `workload` (`quick`: its small version)
    under `config`, its wholeshard keywords replaced by `overrides` and its matrices under
    `rules.Rule(**rule)`; `warmup` untimed and `steps` timed steps on `device`, and with
    `count_launches` one more under the profiler; without `yardstick`, no torch-Muon yardstick
    (`floor.py`: its `torch_muon_owned_s` None)."""

    workload: str
    config: str
    steps: int
    warmup: int
    quick: bool
    overrides: dict[str, Any]
    device: str
    count_launches: bool
    rule: dict[str, str]
    yardstick: bool = True


def run_rank(job: Job) -> dict:
    """Benchmark `job` on this rank's `job.device`; returns this rank's figures (medians in s,
    sizes in bytes, None where unknown)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    steps, warmup = job.steps, job.warmup
    dev = torch.device(job.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())  # launch set it
    workload = get_workload(job.workload, job.quick).on(dev)
    config = with_overrides(job.config, job.overrides)
    timer = Timer(dev)
    clock = WaitClock()
    batches = [workload.local_batch(s, rank, world) for s in range(warmup + 1 + steps)]
    preload()
    rss_before_build = rss_bytes()
    setup = build(config, workload, clock, Rule(**job.rule))
    counter = TrafficCounter()
    step_s: list[float] = []
    optimizer_s: list[float] = []
    wait_s: list[float] = []
    loss = torch.zeros(())
    dist.barrier()
    with clock.watch():
        for s, (x, y) in enumerate(batches):
            blocked_before = clock.seconds
            t0 = timer.stamp()
            with counter if s == warmup else nullcontext():
                loss = workload.loss(setup.model(x), y)
                loss.backward()
                setup.after_backward()
                t1 = timer.stamp()
                setup.step()
                t2 = timer.stamp()
                setup.zero_grad()
            t3 = timer.stamp()
            step_s.append(timer.seconds(t0, t3))  # on a GPU, waits for the step
            optimizer_s.append(timer.seconds(t1, t2))
            wait_s.append(clock.seconds - blocked_before)
    del step_s[: warmup + 1], optimizer_s[: warmup + 1], wait_s[: warmup + 1]
    persistent = None if setup.memory is None else persistent_bytes(setup.memory())
    peak = peak_rss_bytes()
    max_allocated = max_memory_allocated(dev)
    launches = dict.fromkeys(FIELDS)
    if job.count_launches:
        x, y = batches[-1]
        with StepProfile(dev) as profiled:
            workload.loss(setup.model(x), y).backward()
            setup.after_backward()
            with profiled.optimizer():
                setup.step()
            setup.zero_grad()
        launches = profiled.counts
    floor_figures = floor.measure(
        (setup.bare_model or workload.make_model)(),
        workload,
        setup.owned_optimizers or every_param,
        batches,
        warmup,
        timer,
        job.yardstick,
    )
    final = loss.detach().float().reshape(1)
    dist.all_reduce(final, op=dist.ReduceOp.AVG)
    return {
        "step_s": statistics.median(step_s),
        "optimizer_s": statistics.median(optimizer_s),
        "comm_wait_s": statistics.median(wait_s),
        "bytes_sent_per_rank": counter.bytes,
        "gather_bytes_per_rank": counter.gather_bytes,
        "unmodelled": sorted(counter.unmodelled),
        "peak_rss_bytes": peak,
        "peak_rss_delta_bytes": None if rss_before_build is None else peak - rss_before_build,
        "persistent_bytes": persistent,
        "optimizer_state_bytes": optimizer_state_bytes(setup.optimizers),
        "max_memory_allocated_bytes": max_allocated,
        "final_loss": final.item(),
        **launches,
        **floor_figures,
    }
