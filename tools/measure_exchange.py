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
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from result_file import write_measured  # noqa: E402

from wholeshard.bench.exchange_bucket import SHAPES, exchange_bucket_row, layer  # noqa: E402
from wholeshard.bench.report import machine  # noqa: E402
from wholeshard.distributed import collectives  # noqa: E402
from wholeshard.distributed.launch import launch  # noqa: E402
from wholeshard.planning import ONE_BUCKET, plan_exactly  # noqa: E402


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
        owners = plan_exactly(layer(mb), k, bucket_size=ONE_BUCKET, strategy="owners")
        seconds = []
        for i in range(repeats + 1):  # the first is a warm-up
            grad = torch.full((owners.buffers[0].numel,), float(me + 1))  # the Muon bucket
            dist.barrier()
            t0 = time.perf_counter()
            mine = _owner_groups(grad, owners)
            if i:
                seconds.append(time.perf_counter() - t0)
            total = k * (k + 1) / 2
            assert all(torch.equal(m, torch.full_like(m, total)) for m in mine.values())
            assert torch.equal(grad, torch.full_like(grad, total))
        ex = exchange_bucket_row(mb, repeats=repeats)
        assert ex["exact"], ex
        rs, a2a = (
            ex["reduce_scatter_s"] + ex["all_gather_s"],
            ex["to_owners_s"] + ex["from_owners_s"],
        )
        rows.append({
            "ranks": k, "mb": mb, "matrices": len(SHAPES), "numel": ex["numel"],
            "owner_group_ms": 1e3 * statistics.median(seconds), "exchange_ms": 1e3 * (rs + a2a),
            "reduce_scatter_ms": 1e3 * rs, "all_to_all_ms": 1e3 * a2a,
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
