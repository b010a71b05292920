"""Regenerate docs/layout-presets.md: `python docs/make_layout_presets.py > docs/layout-presets.md`.

Each row is `plan_buffers` on a preset, the numbers `wholeshard plan --preset P --dp N
--shard-group-size K --strategy S --json` prints. Plan times depend on the machine's load.
"""

import statistics
import time

from wholeshard.planning import plan_buffers
from wholeshard.planning.presets import PRESETS

DEFAULT_BUCKET_SIZE = 40_000_000

DPS = (8, 64, 256, 1024)
STRATEGIES = ("size_match", "balanced")
HEADER = """## `wholeshard plan` presets, bucket size 40M elements

Padding = padded / all buffer elements (Muon whole-tensor, stacked and AdamW element-wise
buffers). Imbalance = max / mean Newton–Schulz cost `max(m,n)·min(m,n)²` owned per shard-group
rank (every matrix of an expert stack counted on its own owner). ✗ = misses padding ≤ 1% or
imbalance ≤ 1.10. plan s = wall seconds of `plan_buffers` (2 shared cores; moe: median of 3).
"muon buckets" counts the buckets of the 2-D Muon buffer. Routing is the default
(`wholeshard.planning.routing.muon_by_name`): untied output heads (`lm_head.weight`) are AdamW's, and the
fused experts of qwen3-30b-a3b (`experts.gate_up_proj`, `experts.down_proj`) are stacks of
matrices in the stacked buffer, whatever the strategy (the strategy plans the 2-D Muon buffer).
Regenerate with `python docs/make_layout_presets.py > docs/layout-presets.md`.
"""
TABLE_HEAD = (
    "| preset | dp | {} | size_match: padding | imbalance | muon buckets | plan s "
    "| balanced: padding | imbalance | muon buckets | plan s |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)
_specs: dict = {}
_plans: dict = {}


def plan(preset: str, dp: int, k: int, strategy: str) -> tuple[float, float, int, float]:
    key = (preset, dp, k, strategy)
    if key not in _plans:
        specs = _specs.setdefault(preset, PRESETS[preset]())
        times = []
        for _ in range(3 if preset == "moe-256x" else 1):
            start = time.perf_counter()
            p = plan_buffers(
                specs, dp, bucket_size=DEFAULT_BUCKET_SIZE, strategy=strategy, shard_group_size=k
            )
            times.append(time.perf_counter() - start)
        muon = sum(len(b.buckets) for b in p.buffers if b.kind == "muon")
        _plans[key] = (p.padding_fraction, p.ns_cost_imbalance, muon, statistics.median(times))
    return _plans[key]


def ok(r: tuple) -> bool:
    return r[0] <= 0.01 and r[1] <= 1.10


def row(preset: str, dp: int, k_cell: str, k: int) -> str:
    cells = []
    for s in STRATEGIES:
        r = plan(preset, dp, k, s)
        cells.append(f"{r[0]:.2%} | {r[1]:.3f} | {r[2]} | {r[3]:.2f}{'' if ok(r) else ' ✗'}")
    return f"| {preset} | {dp} | {k_cell} | " + " | ".join(cells) + " |"


def main() -> None:
    out = [HEADER, "### At the recommended shard-group size k\n"]
    out.append(
        "k = the largest divisor of dp, at least min(dp, max(8, dp/8)), at which `balanced` "
        "meets both targets (else the smallest allowed k).\n"
    )
    out.append(TABLE_HEAD.format("shard group k"))
    for preset in PRESETS:
        for dp in DPS:
            allowed = [k for k in range(min(dp, max(8, dp // 8)), dp + 1) if dp % k == 0]
            good = [k for k in allowed if ok(plan(preset, dp, k, "balanced"))]
            if good:
                out.append(row(preset, dp, str(max(good)), max(good)))
            else:
                out.append(row(preset, dp, f"{allowed[0]} (targets unreachable)", allowed[0]))
    out += ["\n### Without shard groups (k = dp)\n", TABLE_HEAD.format("shard group k")]
    out += [row(preset, dp, str(dp), dp) for preset in PRESETS for dp in DPS]
    out += ["\n### Shard-group choices for the target rows\n", TABLE_HEAD.format("k")]
    for preset, dp, ks in (
        ("llama3-8b", 8, (8,)),
        ("llama3-8b", 64, (8, 16, 32)),
        ("llama3-70b", 64, (8, 16, 32, 64)),
        ("llama3-70b", 256, (32, 64, 128)),
        ("qwen3-30b-a3b", 256, (32, 64, 128, 256)),
    ):
        out += [row(preset, dp, str(k), k) for k in ks]
    print("\n".join(out))


if __name__ == "__main__":
    main()
