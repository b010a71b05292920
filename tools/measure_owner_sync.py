"""The candidate forms of an owner bucket's reduction and gather ([Note: owner collectives] in
wholeshard/distributed/collectives.py), measured two ways.

    python tools/measure_owner_sync.py [--ranks 2 4] [--mb 1 16 64] [--repeats 3] [--no-plans]

1. From the presets' plans (exact, no timing): how many owners an owner bucket has at dp
   8-1024, and what a direct all-to-all (each rank sends every owner its range, the owner sums
   the k copies) would cost there: the owner's inbound bytes per bucket over a ring's, and the
   all-to-alls a step would take to keep each receive buffer within its bucket.
2. On gloo, k local processes: one bucket of B MB fp32 with k equal owners (the all-to-all's
   best case) and with one owner, reduced and gathered by: the engine's coalesced groups of
   reduces and broadcasts; `all_to_all_single` with split sizes (and back, the owner's shard
   staged k times); `batch_isend_irecv` (grouped point-to-point). Median milliseconds of
   `--repeats`; each form's reduced values checked against the sum.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from wholeshard.capacity.presets import PRESETS  # noqa: E402
from wholeshard.distributed import collectives  # noqa: E402
from wholeshard.distributed.launch import launch  # noqa: E402
from wholeshard.planning.auto import plan_for  # noqa: E402

PRESET_NAMES = ("llama3-8b", "qwen3-30b-a3b", "llama3-70b", "moe-256x")


def plans() -> None:
    print("preset          dp  owner buckets  owners/bucket  a2a inbound/ring  a2a per step")
    for name in PRESET_NAMES:
        specs = PRESETS[name]()
        for dp in (8, 64, 256, 1024):
            plan = plan_for(specs, dp)
            k = plan.shard_group_size
            buckets = owners = chunks = 0
            ring = inbound = 0.0
            for b in (b for buf in plan.buffers for b in buf.buckets if b.owners):
                shards = [hi - lo for _, lo, hi in b.shards()]
                buckets, owners = buckets + 1, owners + len(shards)
                chunks += math.ceil(k * max(shards) / b.numel)
                ring += (k - 1) / k * b.numel
                inbound += (k - 1) * max(shards)
            if buckets:
                print(f"{name:14s} {dp:4d} {buckets:14,d} {owners / buckets:14.2f} "
                      f"{inbound / ring:17.1f} {chunks:13,d}")  # fmt: skip


def _sizes(numel: int, k: int, owners: str) -> list[int]:
    if owners == "one":
        return [numel] + [0] * (k - 1)
    return [numel // k] * (k - 1) + [numel - numel // k * (k - 1)]


def _coalesced(grad: torch.Tensor, param: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    me = dist.get_rank()
    parts = [(r, t) for r, t in enumerate(grad.split(sizes)) if t.numel()]
    collectives.wait(collectives.reduce_to_owners(parts, None))
    mine = grad.split(sizes)[me].clone()
    params = [(r, t) for r, t in enumerate(param.split(sizes)) if t.numel()]
    collectives.wait(collectives.broadcast_from_owners(params, None))
    return mine


def _all_to_all(grad: torch.Tensor, param: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    k, me = dist.get_world_size(), dist.get_rank()
    recv = grad.new_empty(k * sizes[me])
    dist.all_to_all_single(recv, grad, [sizes[me]] * k, sizes)
    mine = torch.zeros(sizes[me], dtype=grad.dtype)
    for r in range(k):  # a fixed order on every rank
        mine += recv[r * sizes[me] : (r + 1) * sizes[me]]
    staged = param.split(sizes)[me].repeat(k)  # what all_to_all_single sends: k copies
    dist.all_to_all_single(param, staged, sizes, [sizes[me]] * k)
    return mine


def _p2p(grad: torch.Tensor, param: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    k, me = dist.get_world_size(), dist.get_rank()
    recv = grad.new_empty(k, sizes[me])
    ops = []
    for r in range(k):
        if r == me:
            recv[r].copy_(grad.split(sizes)[r])
            continue
        if sizes[r]:
            ops.append(dist.P2POp(dist.isend, grad.split(sizes)[r], r))
        if sizes[me]:
            ops.append(dist.P2POp(dist.irecv, recv[r], r))
    for w in dist.batch_isend_irecv(ops) if ops else ():
        w.wait()
    mine = torch.zeros(sizes[me], dtype=grad.dtype)
    for r in range(k):
        mine += recv[r]
    ops = []
    for r in range(k):
        if r != me and sizes[me]:
            ops.append(dist.P2POp(dist.isend, param.split(sizes)[me], r))
        if r != me and sizes[r]:
            ops.append(dist.P2POp(dist.irecv, param.split(sizes)[r], r))
    for w in dist.batch_isend_irecv(ops) if ops else ():
        w.wait()
    return mine


FORMS = {"coalesced": _coalesced, "all_to_all": _all_to_all, "p2p": _p2p}


def _worker(mbs: list[int], repeats: int) -> list[tuple]:
    k, me = dist.get_world_size(), dist.get_rank()
    rows = []
    for mb in mbs:
        numel = mb * 2**20 // 4
        for owners in ("equal", "one"):
            sizes = _sizes(numel, k, owners)
            expected = sum(torch.full((sizes[me],), float(r + 1)) for r in range(k))
            for name, form in FORMS.items():
                times = []
                for _ in range(repeats):
                    grad = torch.full((numel,), float(me + 1))
                    param = torch.full((numel,), float(me))
                    dist.barrier()
                    t0 = time.perf_counter()
                    mine = form(grad, param, sizes)
                    times.append(time.perf_counter() - t0)
                    assert torch.equal(mine, expected), (name, owners)
                    gathered = [torch.full((n,), float(r)) for r, n in enumerate(sizes)]
                    assert torch.equal(param, torch.cat(gathered)), (name, owners)
                rows.append((k, mb, owners, name, 1e3 * statistics.median(times)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mb", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-plans", action="store_true")
    args = ap.parse_args()
    if not args.no_plans:
        plans()
    print("\nranks  MB  owners  form        ms (gloo, median)")
    for k in args.ranks:
        for row in launch(_worker, k, (args.mb, args.repeats))[0]:
            print("{:5d} {:3d}  {:6s}  {:10s} {:8.1f}".format(*row))


if __name__ == "__main__":
    main()
