"""How the train job's `muon` rule runs Newton-Schulz (`--newton-schulz`), chosen by
measurement by default.

Which implementation is fastest depends on the machine: torch's Muon orthogonalizes one matrix
at a time with bf16 products, which CPUs without bf16 matmul units (AVX2-only) run ~35x slower
than fp32 ones; `BatchedMuon` stacks same-shape matrices, with bf16 products or fp32 ones (the
bf16 values summed by fp32 GEMMs, rounded to bf16 as torch rounds). All three give Muon's update
(torch's bits for `torch_bf16`, and for `batched_bf16` on CPU; a few bf16 roundings apart
otherwise: `optim/batched_muon.py`). `auto` times a step of each on a sample of the matrices
this rank will own, at start (about a second at most), and takes the fastest where it beats
torch's Muon clearly (`MARGIN`); rank 0's choice holds on every rank. The library's own default
stays torch's Muon.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..optim import BatchedMuon
from ..optim.rules import matrix_rule

IMPLEMENTATIONS = ("torch_bf16", "batched_bf16", "batched_fp32")
"""The implementations `auto` chooses among, in the order it times them."""
SAMPLE_PER_SHAPE = 4
"""At most this many matrices of each shape are timed (enough to show what batching gains)."""
BUDGET_S = 0.25
"""torch's Muon is timed on the sample's groups until it has taken this long; the others on the
same groups, each stopped once it cannot win."""
MARGIN = 1.5
"""`auto` leaves torch's Muon only for an implementation this many times faster, so that a
close call (which timing noise could flip from run to run, and with it a few bf16 roundings)
keeps torch's bits."""


@dataclass(frozen=True)
class NewtonSchulz:
    """The implementation the job's muon rule steps with: `rule(params, **kwargs, ...)`.
    `seconds`: what `auto` measured per implementation (empty when the flag named one);
    `resumed`: `auto` took the choice of the run a checkpoint continues, without measuring."""

    name: str
    rule: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)
    resumed: bool = False

    def describe(self) -> str:
        """One line for the job's header: which, and why."""
        if self.resumed:
            return (
                f"newton-schulz {self.name}: the resumed run's choice, so it continues bit for "
                f"bit (auto measured it at that run's start; --newton-schulz to choose again)"
            )
        if not self.seconds:
            return f"newton-schulz {self.name} (--newton-schulz)"
        times = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in self.seconds.items())
        return (
            f"newton-schulz {self.name}: torch's Muon unless another is {MARGIN}x faster (one "
            f"step on a sample, each stopped once it could not win: {times})"
        )


def implementation(
    name: str, ns_coefficients: str = "quintic", ns_algorithm: str = "standard"
) -> NewtonSchulz:
    """The implementation `name` (one of `IMPLEMENTATIONS`) of the `muon` rule with these
    Newton-Schulz choices. The batched ones take torch's (a, b, c) quintic only."""
    if name == "torch_bf16":
        return NewtonSchulz(name, matrix_rule("muon", ns_coefficients, ns_algorithm), {})
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"newton_schulz must be 'auto' or one of {IMPLEMENTATIONS}, got {name!r}")
    if ns_coefficients != "quintic":
        raise ValueError(
            f"--newton-schulz {name} runs torch's quintic only, not {ns_coefficients!r}: use "
            f"--newton-schulz torch_bf16 (or auto) with --ns-coefficients {ns_coefficients}"
        )
    dtype = torch.float32 if name == "batched_fp32" else torch.bfloat16
    kwargs: dict[str, Any] = {"matmul_dtype": dtype}
    if ns_algorithm != "standard":
        kwargs["ns_algorithm"] = ns_algorithm
    return NewtonSchulz(name, BatchedMuon, kwargs)


def choose(
    setting: str,
    shapes: list[tuple[int, int]],
    device: torch.device,
    ns_coefficients: str = "quintic",
    ns_algorithm: str = "standard",
    resumed: str | None = None,
) -> NewtonSchulz:
    """The implementation `setting` names, or for `auto` the one to run on `shapes` (the
    matrices this rank will step) on `device`: the implementation `resumed` (the choice of the
    run a checkpoint continues) where `auto` could choose it, so a resumed run keeps its bits;
    else torch's Muon unless another is at least `MARGIN` times faster (then the fastest). Only
    torch's Muon runs a schedule other than the quintic, and with `gram` products are bf16
    whatever the implementation (so fp32 is not tried)."""
    if setting != "auto":
        return implementation(setting, ns_coefficients, ns_algorithm)
    names = ["torch_bf16"]
    if ns_coefficients == "quintic":
        names += ["batched_bf16"] + (["batched_fp32"] if ns_algorithm == "standard" else [])
    if resumed in names:
        kept = implementation(resumed, ns_coefficients, ns_algorithm)
        return NewtonSchulz(kept.name, kept.rule, kept.kwargs, resumed=True)
    found = [implementation(n, ns_coefficients, ns_algorithm) for n in names]
    if len(found) == 1 or not shapes:
        return found[0]
    groups = sample_groups(shapes)
    default, ran = step_seconds(found[0], groups, device, BUDGET_S)
    seconds, groups = {found[0].name: default}, groups[:ran]
    for ns in found[1:]:  # each stopped once it cannot win
        limit = min([default / MARGIN, *(seconds[n] for n in seconds if n != found[0].name)])
        seconds[ns.name], _ = step_seconds(ns, groups, device, limit)
    best = min(found[1:], key=lambda ns: seconds[ns.name])
    if seconds[best.name] * MARGIN > default:
        best = found[0]
    return NewtonSchulz(best.name, best.rule, best.kwargs, seconds)


def sample_groups(shapes: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """What `auto` times, in order: one matrix of the cheapest shape (a probe that stops a slow
    implementation early), then the rest of at most `SAMPLE_PER_SHAPE` of each shape, one shape
    at a time, cheapest first."""
    counts = Counter(shapes)
    order = sorted(counts, key=lambda s: max(s) * min(s) ** 2)
    groups = [[s] * min(counts[s], SAMPLE_PER_SHAPE) for s in order]
    return [groups[0][:1], groups[0][1:], *groups[1:]] if len(groups[0]) > 1 else groups


def step_seconds(
    ns: NewtonSchulz,
    groups: list[list[tuple[int, int]]],
    device: torch.device,
    limit: float,
) -> tuple[float, int]:
    """Wall seconds of one step of `ns` (with momentum, as the job's) on fp32 matrices of each
    of `groups` in turn (the faster of two steps: the first also warms kernels up), summed, and
    how many groups ran: all, or those until the sum passed `limit`."""
    generator = torch.Generator(device=device).manual_seed(0)

    def optimizer(shapes: list[tuple[int, int]]) -> torch.optim.Optimizer:
        params = [torch.zeros(s, device=device) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, device=device, generator=generator)
        return ns.rule(params, lr=1e-3, **ns.kwargs)

    def seconds(step: Callable[[], Any]) -> float:
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        return time.perf_counter() - start

    total, ran = 0.0, 0
    while ran < len(groups) and total <= limit:
        step = optimizer(groups[ran]).step
        total, ran = total + min(seconds(step), seconds(step)), ran + 1
    return total, ran


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
