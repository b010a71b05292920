"""Fingerprint the plans the planner makes, to prove a change to the planner changes no plan.

    python tools/plan_fingerprint.py [--quick]

Plans every preset at dp 8, 64, 256 and 1024 (both strategies; DataParallel's default bucket
size and 40M elements; shard groups of 8 at dp 64) and a few hundred random spec lists, and
prints one sha256 per group and one over all: equal hashes before and after a change mean every
plan (buffers, buckets, placements, owners) is unchanged. It also prints how long each preset
took to plan.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time

from wholeshard.capacity.presets import PRESETS
from wholeshard.planning import ParamSpec, default_bucket_size, plan_exactly


def canonical(plan) -> str:
    out = [f"{plan.dp_size} {plan.shard_group_size} {plan.strategy} {plan.align}"]
    for b in plan.buffers:
        out.append(f"buffer {b.kind} {b.shard_group_size} {b.align}")
        out += [f"b {c.index} {c.start} {c.end} {c.shard_numel}" for c in b.buckets]
        out += [
            f"p {p.name} {p.shape} {p.bucket} {p.start} {p.end} {p.owner}" for p in b.placements
        ]
    return "\n".join(out)


def preset_cases(specs: list[ParamSpec]):
    numel = sum(s.numel for s in specs)
    for dp in (8, 64, 256, 1024):
        for strategy in ("size_match", "balanced"):
            for bucket_size in (default_bucket_size(numel, dp), 40_000_000):
                yield dict(dp_size=dp, strategy=strategy, bucket_size=bucket_size)
    yield dict(dp_size=64, strategy="balanced", bucket_size=40_000_000, shard_group_size=8)


def random_specs(rng: random.Random, n: int) -> list[ParamSpec]:
    dims = [64, 96, 128, 192, 256, 384, 512, 1000]
    specs = []
    for i in range(n):
        r = rng.random()
        if r < 0.55:
            specs.append(ParamSpec(f"w{i}", (rng.choice(dims), rng.choice(dims)), matrix=True))
        elif r < 0.65:
            shape = (rng.choice([2, 4, 8]), rng.choice(dims), rng.choice(dims))
            specs.append(ParamSpec(f"s{i}", shape, matrix=True))
        elif r < 0.72:
            shape = (rng.choice(dims), rng.choice(dims))
            specs.append(ParamSpec(f"t{i}", shape, matrix=rng.random() < 0.5, tied=True))
        else:
            specs.append(ParamSpec(f"b{i}", (rng.choice(dims),), matrix=False))
    return specs


def plan_text(specs: list[ParamSpec], **kwargs) -> str:
    try:
        return canonical(plan_exactly(specs, **kwargs))
    except ValueError as e:
        return f"error {e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two presets, fewer random lists")
    args = parser.parse_args()
    total = hashlib.sha256()
    for name in ["gpt2-small", "llama3-8b"] if args.quick else sorted(PRESETS):
        specs = PRESETS[name]()
        h = hashlib.sha256()
        start = time.perf_counter()
        for case in preset_cases(specs):
            h.update(plan_text(specs, **case).encode())
        print(f"{name:<14} {h.hexdigest()[:16]}  {time.perf_counter() - start:6.1f} s", flush=True)
        total.update(h.digest())
    rng = random.Random(0)
    h = hashlib.sha256()
    for _ in range(50 if args.quick else 400):
        specs = random_specs(rng, rng.randint(1, 60))
        dp = rng.choice([1, 2, 3, 4, 6, 8, 16, 64])
        k = rng.choice([None, *(d for d in range(1, dp + 1) if dp % d == 0)])
        for strategy in ("size_match", "balanced"):
            bucket_size = rng.choice([None, 4096, 65536, 1 << 20])
            case = dict(dp_size=dp, bucket_size=bucket_size, strategy=strategy, shard_group_size=k)
            h.update(plan_text(specs, **case).encode())
    print(f"{'random':<14} {h.hexdigest()[:16]}", flush=True)
    total.update(h.digest())
    print(f"{'all':<14} {total.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
