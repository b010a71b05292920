"""What each rank runs for one configuration: build, warm up, count traffic, time the steps.

Step sequence on every rank: `warmup` untimed steps (lazy optimizer state, DDP's bucket rebuild),
one untimed step under the `TrafficCounter`, then `steps` timed steps. A step is forward +
backward + optimizer step + zero_grad; batches are made before the loop. Then, once the
memory figures are read, the floor (`floor.py`) on the same batches.

Memory: the RSS delta is the peak resident set at the end minus the resident set just before
the configuration builds the model (batches are made and lazy imports done before that), so it
isolates the model, its optimizers and training from the interpreter and its imports.
Persistent bytes are what the setup reports holding between steps, read after the timed steps.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from . import floor
from .builders import build, every_param
from .configs import with_overrides
from .memory import optimizer_state_bytes, peak_rss_bytes, persistent_bytes, rss_bytes
from .traffic import TrafficCounter
from .waits import WaitClock
from .workloads import get_workload


def preload() -> None:
    """Import what the configurations import lazily (torch's optimizers pull in dynamo, ~3 s and
    ~30 MB), so it is neither in the RSS delta nor, for forked workers, paid per worker."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    from .. import optim  # noqa: F401
    from ..engine import data_parallel  # noqa: F401


def run_rank(
    workload_name: str,
    config_name: str,
    steps: int,
    warmup: int,
    quick: bool,
    overrides: dict[str, Any] | None = None,
) -> dict:
    """Benchmark one configuration (its wholeshard keywords replaced by `overrides`) on this
    rank; returns this rank's figures (medians in s, sizes in bytes, None where unknown)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = get_workload(workload_name, quick)
    config = with_overrides(config_name, overrides or {})
    clock = WaitClock()
    batches = [workload.local_batch(s, rank, world) for s in range(warmup + 1 + steps)]
    preload()
    rss_before_build = rss_bytes()
    setup = build(config, workload, clock)
    counter = TrafficCounter()
    step_s: list[float] = []
    optimizer_s: list[float] = []
    wait_s: list[float] = []
    loss = torch.zeros(())
    dist.barrier()
    with clock.watch():
        for s, (x, y) in enumerate(batches):
            blocked_before = clock.seconds
            t0 = time.perf_counter()
            with counter if s == warmup else nullcontext():
                loss = workload.loss(setup.model(x), y)
                loss.backward()
                setup.after_backward()
                t1 = time.perf_counter()
                setup.step()
                t2 = time.perf_counter()
                setup.zero_grad()
            t3 = time.perf_counter()
            if s > warmup:
                step_s.append(t3 - t0)
                optimizer_s.append(t2 - t1)
                wait_s.append(clock.seconds - blocked_before)
    persistent = None if setup.memory is None else persistent_bytes(setup.memory())
    peak = peak_rss_bytes()
    floor_figures = floor.measure(
        (setup.bare_model or workload.make_model)(),
        workload,
        setup.owned_optimizers or every_param,
        batches,
        warmup,
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
        "final_loss": final.item(),
        **floor_figures,
    }
