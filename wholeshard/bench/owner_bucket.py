"""One owner bucket's reduction and gather, timed: the engine's coalesced groups of reduces and
broadcasts ([Note: owner collectives] in `wholeshard.distributed.collectives`) on one bucket of
fp32 grads and bf16 params, the largest that fits, in the process group of the caller.

`owner_bucket_row` runs on every rank of a group (`launch` it; on CUDA each rank on its current
device) and returns the same row on every rank: the bucket, its owners, the seconds of each
direction (median of `repeats`, after one warm-up; CUDA events on a GPU), the bytes one rank
sends under the ring model, and whether the reduced and gathered values are exact (integers,
summed in any order to the same float). The GPU tier (`tests/gpu/test_cuda_bench.py`) runs it at
the largest size one GPU holds for its ranks; a multi-GPU run on NCCL is what measures the
coalesced launch itself.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import collectives
from ..planning.sync import ring_bytes
from .timing import Timer

GRAD_BYTES, PARAM_BYTES = 4, 2  # fp32 grads reduced, bf16 params gathered


def largest_numel(device: torch.device, ranks_on_device: int, fraction: float = 0.5) -> int:
    """The most elements of one bucket `ranks_on_device` ranks sharing `device` can each hold as
    fp32 grads and bf16 params, with a gloo copy of each, in `fraction` of the free memory of a
    GPU (on CPU: 64 MiB of grads, as large as the measurement script's)."""
    if device.type != "cuda":
        return 16 * 2**20
    free, _ = torch.cuda.mem_get_info(device)
    per_element = 2 * (GRAD_BYTES + PARAM_BYTES) * ranks_on_device
    return int(fraction * free // per_element) // 1024 * 1024


def owner_bucket_row(
    numel: int, device: str = "cpu", owners: str = "every", repeats: int = 5
) -> dict[str, Any]:
    """Time one bucket of `numel` elements on `device` ("cuda": the current GPU) reduced to its
    owners and gathered back over the default group: `owners="every"` (one equal shard per
    rank) or `"one"` (all of it rank 0's)."""
    k, me = dist.get_world_size(), dist.get_rank()
    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
    device = where or torch.device("cpu")
    sizes = [numel] + [0] * (k - 1) if owners == "one" else _equal(numel, k)
    starts = [sum(sizes[:r]) for r in range(k)]
    grad = torch.empty(numel, device=device)
    param = torch.empty(numel, dtype=torch.bfloat16, device=device)
    clock = Timer(device)
    reduce_s, gather_s, exact = [], [], True
    for i in range(repeats + 1):
        grad.fill_(me + 1)
        param.fill_(me)
        g_parts = [(r, grad.narrow(0, starts[r], n)) for r, n in enumerate(sizes) if n]
        p_parts = [(r, param.narrow(0, starts[r], n)) for r, n in enumerate(sizes) if n]
        dist.barrier()
        t0 = clock.stamp()
        collectives.wait(collectives.reduce_to_owners(g_parts, None))
        t1 = clock.stamp()
        collectives.wait(collectives.broadcast_from_owners(p_parts, None))
        t2 = clock.stamp()
        if i:  # the first is a warm-up
            reduce_s.append(clock.seconds(t0, t1))
            gather_s.append(clock.seconds(t1, t2))
        mine = grad[starts[me] : starts[me] + sizes[me]]
        exact &= bool((mine == k * (k + 1) / 2).all())
        exact &= all(
            bool((param.narrow(0, at, n) == r).all())
            for r, at, n in zip(range(k), starts, sizes, strict=True)
            if n
        )
    return {
        "ranks": k,
        "owners": owners,
        "numel": numel,
        "device": device.type,
        "backend": dist.get_backend(),
        "reduce_s": statistics.median(reduce_s),
        "gather_s": statistics.median(gather_s),
        "bytes_sent": ring_bytes("reduce_coalesced", numel * GRAD_BYTES, k)
        + ring_bytes("broadcast_coalesced", numel * PARAM_BYTES, k),
        "exact": exact,
    }


def _equal(numel: int, k: int) -> list[int]:
    return [numel // k] * (k - 1) + [numel - numel // k * (k - 1)]
