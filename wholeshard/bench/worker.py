"""What each rank runs for one configuration: build, warm up, count traffic, time the steps.

Step sequence on every rank: `warmup` untimed steps (lazy optimizer state, DDP's bucket rebuild),
one untimed step under the `TrafficCounter`, then `steps` timed steps. A step is forward +
backward + optimizer step + zero_grad; batches are made before the loop.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from .configs import CONFIGS
from .memory import optimizer_state_bytes, peak_rss_bytes
from .traffic import TrafficCounter
from .waits import WaitClock
from .workloads import get_workload


def run_rank(workload_name: str, config_name: str, steps: int, warmup: int, quick: bool) -> dict:
    """Benchmark one configuration on this rank; returns this rank's figures (medians in s)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = get_workload(workload_name, quick)
    clock = WaitClock()
    setup = CONFIGS[config_name].build(workload, clock)
    batches = [workload.local_batch(s, rank, world) for s in range(warmup + 1 + steps)]
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
    final = loss.detach().float().reshape(1)
    dist.all_reduce(final, op=dist.ReduceOp.AVG)
    return {
        "step_s": statistics.median(step_s),
        "optimizer_s": statistics.median(optimizer_s),
        "comm_wait_s": statistics.median(wait_s),
        "bytes_sent_per_rank": counter.bytes,
        "unmodelled": sorted(counter.unmodelled),
        "peak_rss_bytes": peak_rss_bytes(),
        "optimizer_state_bytes": optimizer_state_bytes(setup.optimizers),
        "final_loss": final.item(),
    }
