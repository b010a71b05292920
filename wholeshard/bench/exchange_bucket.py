"""One exchange bucket's reduction and gather, timed: the reduce-scatter of the bucket (what
FSDP2's equal shards issue, `reduce_scatter_tensor`), the all-to-all that moves each reduced
shard's matrix pieces to the matrices' owners ([Note: exchange buffers] in `planning._exchange`),
the all-to-all back and the all-gather, in the process group of the caller.

The bucket is one layer the planning core plans with `strategy="exchange"`: four matrices of
differing shapes (owners of differing cost) and a norm, about `mb` MB of fp32. Pieces are packed
per peer in buffer order, as the engine's `Exchange` packs them; the owners' matrices are whole
copies, as fully sharded keeps them (their own shard's part copied in; ZeRO-1/2 reads the bucket in
place). `exchange_bucket_row` runs on
every rank (`launch` it; on CUDA each rank on its current device) and returns this rank's row:
the seconds of each phase (median of `repeats` after one warm-up; CUDA events on a GPU) and
whether the owners' whole matrices and the gathered bucket are exact (integers summed in any
order to the same float). `tools/measure_exchange.py` runs it on gloo beside today's owner
groups; the GPU tier (`tests/gpu/test_cuda_bench.py`) runs it on CUDA tensors.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import collectives
from ..planning import ONE_BUCKET, Buffer, ParamSpec, placement_matrices, plan_exactly, segments
from .timing import Timer

SHAPES = ((3, 1), (2, 1), (1, 1), (1, 2))
"""The four matrices' shapes in units of d (rows, cols): 7 d^2 elements."""

PHASES = ("reduce_scatter_s", "to_owners_s", "from_owners_s", "all_gather_s")


def layer(mb: float) -> list[ParamSpec]:
    """One layer of about `mb` MB of fp32: the four matrices of `SHAPES` and a norm."""
    d = max(8, round(math.sqrt(mb * 2**20 / 4 / 7) / 8) * 8)
    specs = [ParamSpec("layers.0.norm.weight", (d,), matrix=False)]
    specs += [ParamSpec(f"layers.0.w{i}", (r * d, c * d), matrix=True)
              for i, (r, c) in enumerate(SHAPES)]  # fmt: skip
    return specs


def exchange_bucket_row(mb: float, device: str = "cpu", repeats: int = 3) -> dict[str, Any]:
    """Time one exchange bucket of about `mb` MB on `device` ("cuda": the current GPU) over the
    default group; see the module docstring. `exchange_over_reduce_scatter` is the grads'
    direction (reduce-scatter + exchange) over the reduce-scatter alone."""
    k = dist.get_world_size()
    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
    device_ = where or torch.device("cpu")
    plan = plan_exactly(layer(mb), k, bucket_size=ONE_BUCKET, strategy="exchange")
    (buffer,) = plan.buffers
    clock = Timer(device_)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    exact = True
    for i in range(repeats + 1):  # the first is a warm-up
        grad = torch.full((buffer.numel,), float(dist.get_rank() + 1), device=device_)
        dist.barrier()
        stamps, mine = _exchange(grad, buffer, clock)
        if i:
            for p, a, b in zip(PHASES, stamps, stamps[1:], strict=False):
                times[p].append(clock.seconds(a, b))
        total = k * (k + 1) / 2
        exact &= all(bool((m == total).all()) for m in mine.values())
        exact &= bool((grad == total).all())
    row: dict[str, Any] = {
        "ranks": k,
        "mb": mb,
        "numel": buffer.numel,
        "matrices": len(SHAPES),
        "device": device_.type,
        "backend": dist.get_backend(),
        "moved": sum(s.numel for s in segments(buffer)),
    }
    row |= {p: statistics.median(t) for p, t in times.items()}
    row["exchange_over_reduce_scatter"] = (row["reduce_scatter_s"] + row["to_owners_s"]) / row[
        "reduce_scatter_s"
    ]
    row["exact"] = exact
    return row


def _exchange(grad: torch.Tensor, buffer: Buffer, clock: Timer) -> tuple[list, dict]:
    """Reduce-scatter `grad`, exchange to the owners, exchange back, all-gather; the five stamps
    around the four phases, and the owners' whole matrices (summed grads) by start."""
    k, me = dist.get_world_size(), dist.get_rank()
    (bucket,) = buffer.buckets
    segs = segments(buffer)
    lo, hi = bucket.shard(me)
    shard = grad[lo:hi]
    sends = [[s for s in segs if s.holder == me and s.owner == r] for r in range(k)]
    recvs = [[s for s in segs if s.owner == me and s.holder == r] for r in range(k)]
    send_splits = [sum(s.numel for s in r) for r in sends]
    recv_splits = [sum(s.numel for s in r) for r in recvs]
    mine = {}
    for p in buffer.placements:
        for m_lo, m_hi, owner in placement_matrices(p):
            if owner == me:
                mine[m_lo] = grad.new_zeros(m_hi - m_lo)

    def piece(s):  # the part of its owner's whole matrix that segment s is
        m_lo = max(start for start in mine if start <= s.start)
        return mine[m_lo][s.start - m_lo : s.end - m_lo]

    stamps = [clock.stamp()]
    collectives.wait(collectives.reduce_scatter_sum(shard, grad, None))
    stamps.append(clock.stamp())
    for m_lo, whole in mine.items():  # the owner's own shard's part of its matrices
        a, b = max(m_lo, lo), min(m_lo + whole.numel(), hi)
        if a < b:
            whole[a - m_lo : b - m_lo] = grad[a:b]
    out = grad.new_empty(sum(recv_splits))
    send = torch.cat([grad[s.start : s.end] for r in sends for s in r] or [grad[:0]])
    dist.all_to_all_single(out, send, recv_splits, send_splits)
    at = 0
    for s in (s for r in recvs for s in r):
        piece(s).copy_(out[at : at + s.numel])
        at += s.numel
    stamps.append(clock.stamp())
    back = torch.cat([piece(s) for r in recvs for s in r] or [grad[:0]])
    landed = grad.new_empty(send.numel())
    dist.all_to_all_single(landed, back, send_splits, recv_splits)
    at = 0
    for s in (s for r in sends for s in r):
        grad[s.start : s.end] = landed[at : at + s.numel]
        at += s.numel
    stamps.append(clock.stamp())
    collectives.wait(collectives.all_gather(grad, shard.clone(), None))
    stamps.append(clock.stamp())
    return stamps, mine
