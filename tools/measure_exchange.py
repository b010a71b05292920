"""One bucket's reduction and gather on gloo, k local processes: reduce-scatter + exchange (the
exchange strategy, [Note: exchange buffers]) against today's owner groups ([Note: owner
collectives]); write docs/results/exchange-gloo.json.

    python tools/measure_exchange.py [--ranks 4] [--mb 1 16 64] [--repeats 3] [--json FILE]

The bucket is one layer the planning core plans both ways: four Muon matrices of differing
shapes and a norm, about B MB of fp32. Exchange (`plan_exactly(..., strategy="exchange")`): the
engine's reduce-scatter of the bucket (`collectives.reduce_scatter_sum`), one
`all_to_all_single` with split sizes moving each reduced shard's matrix pieces to their owners
(`planning._exchange.segments`, the owners' whole matrices filled from their own shard and the
pieces received), then the owners' matrices back the same way and the all-gather of the shards.
Owner groups (`strategy="owners"`): the engine's coalesced reduces to each owner
(`collectives.reduce_to_owners`) and coalesced broadcasts back (`broadcast_from_owners`).
Both directions in fp32, nothing else in the step (no Newton-Schulz). Median milliseconds of
`--repeats` after one warm-up; each form's owners' matrices are checked against the sum, and
the gathered bucket against the owners' params.
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
from result_file import write_measured  # noqa: E402

from wholeshard.bench.report import machine  # noqa: E402
from wholeshard.distributed import collectives  # noqa: E402
from wholeshard.distributed.launch import launch  # noqa: E402
from wholeshard.planning import ONE_BUCKET, ParamSpec, plan_exactly  # noqa: E402
from wholeshard.planning._exchange import matrix_ranges, segments  # noqa: E402

SHAPES = ((3, 1), (2, 1), (1, 1), (1, 2))
"""The four matrices' shapes in units of d (rows, cols): 7 d^2 elements, owners of differing
cost."""


def layer(mb: int) -> list[ParamSpec]:
    """One layer of about `mb` MB of fp32: the four matrices of `SHAPES` and a norm."""
    d = max(8, round(math.sqrt(mb * 2**20 / 4 / 7) / 8) * 8)
    specs = [ParamSpec("layers.0.norm.weight", (d,), matrix=False)]
    specs += [ParamSpec(f"layers.0.w{i}", (r * d, c * d), matrix=True)
              for i, (r, c) in enumerate(SHAPES)]  # fmt: skip
    return specs


def _exchange(grad: torch.Tensor, plan, timings: list[float]) -> dict[int, torch.Tensor]:
    """Reduce-scatter, exchange to the owners, exchange back, all-gather; the owners' whole
    matrices (summed grads) by start; appends the phases' seconds to `timings`."""
    k, me = dist.get_world_size(), dist.get_rank()
    (buffer,) = plan.buffers
    (bucket,) = buffer.buckets
    segs = segments(buffer)
    lo, hi = bucket.shard(me)
    shard = grad[lo:hi]
    sends = [[s for s in segs if s.holder == me and s.owner == r] for r in range(k)]
    recvs = [[s for s in segs if s.owner == me and s.holder == r] for r in range(k)]
    t0 = time.perf_counter()
    collectives.wait(collectives.reduce_scatter_sum(shard, grad, None))
    t1 = time.perf_counter()
    out = grad.new_empty(sum(s.numel for r in recvs for s in r))
    send = torch.cat([grad[s.start : s.end] for r in sends for s in r] or [grad[:0]])
    dist.all_to_all_single(out, send, [sum(s.numel for s in r) for r in recvs],
                           [sum(s.numel for s in r) for r in sends])  # fmt: skip
    mine = {}
    for _, m_lo, m_hi, owner in matrix_ranges(buffer):
        if owner == me:  # the owner's whole matrix: its own shard's part, then the pieces
            whole = grad.new_zeros(m_hi - m_lo)
            a, b = max(m_lo, lo), min(m_hi, hi)
            if a < b:
                whole[a - m_lo : b - m_lo] = grad[a:b]
            mine[m_lo] = whole

    def piece(s):  # the part of its owner's whole matrix that segment s is
        m_lo = max(start for start in mine if start <= s.start)
        return mine[m_lo][s.start - m_lo : s.end - m_lo]

    at = 0
    for s in (s for r in recvs for s in r):
        piece(s).copy_(out[at : at + s.numel])
        at += s.numel
    t2 = time.perf_counter()
    back = torch.cat([piece(s) for r in recvs for s in r] or [grad[:0]])
    landed = grad.new_empty(send.numel())
    dist.all_to_all_single(landed, back, [sum(s.numel for s in r) for r in sends],
                           [sum(s.numel for s in r) for r in recvs])  # fmt: skip
    at = 0
    for s in (s for r in sends for s in r):
        grad[s.start : s.end] = landed[at : at + s.numel]
        at += s.numel
    t3 = time.perf_counter()
    collectives.wait(collectives.all_gather(grad, shard.clone(), None))
    t4 = time.perf_counter()
    timings += [(t1 - t0) + (t4 - t3), (t2 - t1) + (t3 - t2)]
    return mine


def _owner_groups(grad: torch.Tensor, plan) -> dict[int, torch.Tensor]:
    """Today's owner bucket: coalesced reduces to the owners, coalesced broadcasts back."""
    me = dist.get_rank()
    buffer = plan.buffers[0]  # the matrices' (the norm has an element-wise buffer of its own)
    parts = [(r, grad[lo:hi]) for r, lo, hi in buffer.buckets[0].shards()]
    collectives.wait(collectives.reduce_to_owners(parts, None))
    mine = {p.start: grad[p.start : p.end].clone() for p in buffer.placements if p.owner == me}
    collectives.wait(collectives.broadcast_from_owners(parts, None))
    return mine


def _worker(mbs: list[int], repeats: int) -> list[dict]:
    k, me = dist.get_world_size(), dist.get_rank()
    rows = []
    for mb in mbs:
        specs = layer(mb)
        exchanged = plan_exactly(specs, k, bucket_size=ONE_BUCKET, strategy="exchange")
        owners = plan_exactly(specs, k, bucket_size=ONE_BUCKET, strategy="owners")
        times: dict[str, list[float]] = {"exchange": [], "owners": [], "rs": [], "a2a": []}
        for i in range(repeats + 1):  # the first is a warm-up
            for name, plan in (("exchange", exchanged), ("owners", owners)):
                grad = torch.full((plan.buffers[0].numel,), float(me + 1))  # the Muon bucket
                dist.barrier()
                phases: list[float] = []
                t0 = time.perf_counter()
                if name == "exchange":
                    mine = _exchange(grad, plan, phases)
                else:
                    mine = _owner_groups(grad, plan)
                seconds = time.perf_counter() - t0
                total = k * (k + 1) / 2
                assert all(torch.equal(m, torch.full_like(m, total)) for m in mine.values())
                assert torch.equal(grad, torch.full_like(grad, total)), name
                if i:
                    times[name].append(seconds)
                    if phases:
                        times["rs"].append(phases[0])
                        times["a2a"].append(phases[1])
        ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
        rows.append({
            "ranks": k, "mb": mb, "matrices": len(SHAPES), "numel": exchanged.numel,
            "owner_group_ms": ms["owners"], "exchange_ms": ms["exchange"],
            "reduce_scatter_ms": ms["rs"], "all_to_all_ms": ms["a2a"],
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mb", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "exchange-gloo.json"))
    args = ap.parse_args(argv)
    rows = launch(_worker, args.ranks, (args.mb, args.repeats))[0]
    for r in rows:
        print(f"{r['ranks']} ranks {r['mb']:3d} MB: owner groups {r['owner_group_ms']:.1f} ms, "
              f"reduce-scatter + exchange {r['exchange_ms']:.1f} ms", file=sys.stderr)  # fmt: skip
    write_measured(
        args.json,
        machine(nproc=args.ranks),
        "measure_exchange: written to",
        repeats=args.repeats,
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
