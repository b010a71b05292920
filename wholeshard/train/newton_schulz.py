"""How the train job's `muon` rule runs Newton-Schulz (`--newton-schulz`), chosen by default by
what the machine is, never by a timing.

Which implementation is fastest depends on the machine: torch's Muon orthogonalizes one matrix
at a time with bf16 products, which x86 CPUs without bf16 matmul units (neither AVX512-BF16 nor
AMX) run ~35x slower than fp32 ones; `BatchedMuon` stacks same-shape matrices, with bf16
products or fp32 ones (the bf16 values summed by fp32 GEMMs, rounded to bf16 as torch rounds).
All three give Muon's update (torch's bits for `torch_bf16`, and for `batched_bf16` on CPU; a
few bf16 roundings apart otherwise: `optim/batched_muon.py`). The library's own default stays
torch's Muon.

[Note: a reproducible auto]
`auto` is a pure function of the device type and the CPU's bf16 matmul units
(`capacity.cpu.cpu_bf16_matmul`, read from the CPU's feature flags): `batched_fp32` on an x86
CPU without bf16 matmul units, torch's Muon everywhere else. So the same command on the same
machine and software runs the same arithmetic, whatever else the machine is doing. A choice by
timing could not promise that: on an AVX512-BF16 EPYC torch's Muon and `batched_fp32` are close
(23 and 16 ms a step of the default job's matrices, quiet), load flipped the choice from run to
run, and two runs of one command parted at step 2 (so did a run restarted before its first
checkpoint). `auto` still times one step of each on a sample of this rank's matrices (a second or
two at most) for the run's header and `summary.json`: the figures show what the choice
costs on this machine, and never change it. Rank 0's choice holds on every rank (a job whose
nodes differ runs one arithmetic).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..capacity.cpu import FAST_BF16, SLOW_BF16, cpu_bf16_matmul
from ..optim import BatchedMuon
from ..optim.rules import matrix_rule

IMPLEMENTATIONS = ("torch_bf16", "batched_bf16", "batched_fp32")
"""The implementations `--newton-schulz` names, in the order `auto` times them."""
SAMPLE_PER_SHAPE = 4
"""At most this many matrices of each shape are timed (enough to show what batching gains)."""
BUDGET_S = 0.25
"""`auto` times torch's Muon on the sample's groups until it has taken this long (on a CPU
without bf16 matmul units, its first group: one matrix), the others on the same groups."""
SLOWER = 10.0
"""Another implementation's timing stops once it has taken this many times torch's Muon's: its
figure is then a bound."""


@dataclass(frozen=True)
class Measured:
    """What `auto` timed (rank 0's): `seconds` of one step of each implementation on the same
    sample; those in `stopped` were stopped past `SLOWER` times torch's Muon's (at least that)."""

    seconds: dict[str, float]
    stopped: tuple[str, ...] = ()

    def describe(self) -> str:
        """`torch_bf16 23.0 ms, batched_fp32 > 160.0 ms` (a stopped one's time as a bound)."""
        return ", ".join(
            f"{n} {'> ' if n in self.stopped else ''}{s * 1e3:.1f} ms"
            for n, s in self.seconds.items()
        )


@dataclass(frozen=True)
class NewtonSchulz:
    """The implementation the job's muon rule steps with: `rule(params, **kwargs, ...)`.
    `why`: for `auto`, why this one (the machine's features); `measured`: what `auto` timed;
    `resumed`: `auto` took the choice of the run a checkpoint continues."""

    name: str
    rule: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    why: str = ""
    measured: Measured | None = None
    resumed: bool = False

    def describe(self) -> str:
        """One line for the job's header: which, and why."""
        if self.resumed:
            return (
                f"newton-schulz {self.name}: the resumed run's choice, so it continues bit for "
                f"bit (--newton-schulz to choose another)"
            )
        if not self.why:
            return f"newton-schulz {self.name} (--newton-schulz)"
        line = f"newton-schulz {self.name} (auto): {self.why}"
        if self.measured is not None:
            line += f"; one step timed, which does not decide it: {self.measured.describe()}"
        return line

    def figures(self) -> dict[str, Any] | None:
        """What `summary.json` records of `auto`'s choice (`newton_schulz_auto`); None when the
        flag named the implementation or a resumed run's choice held."""
        if not self.why:
            return None
        measured = self.measured or Measured({})
        return {"why": self.why, "seconds": measured.seconds, "stopped": list(measured.stopped)}


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


def candidates(ns_coefficients: str = "quintic", ns_algorithm: str = "standard") -> list[str]:
    """The implementations that run these Newton-Schulz choices: only torch's Muon runs a
    schedule other than the quintic, and with `gram` products are bf16 whatever the
    implementation (so there is no fp32 one)."""
    if ns_coefficients != "quintic":
        return ["torch_bf16"]
    return ["torch_bf16", "batched_bf16"] + (["batched_fp32"] if ns_algorithm == "standard" else [])


def machine_choice(
    device: torch.device, ns_coefficients: str = "quintic", ns_algorithm: str = "standard"
) -> tuple[str, str]:
    """`auto`'s implementation on `device` for these Newton-Schulz choices, and why: a pure
    function of them, the device type and the CPU's bf16 matmul units ([Note: a reproducible
    auto])."""
    if len(candidates(ns_coefficients, ns_algorithm)) == 1:
        return "torch_bf16", f"only torch's Muon runs --ns-coefficients {ns_coefficients}"
    if device.type != "cpu":
        return "torch_bf16", f"torch's Muon on {device.type}"
    units = cpu_bf16_matmul()
    if units in FAST_BF16:
        return "torch_bf16", f"this CPU's {units} runs bf16 products at full rate: torch's Muon"
    if units != SLOW_BF16:
        return "torch_bf16", (
            "this CPU's bf16 matmul units are unknown (not x86): torch's Muon; --newton-schulz "
            "batched_fp32 where its bf16 products are slow"
        )
    if ns_algorithm != "standard":
        return "torch_bf16", (
            f"with --ns-algorithm {ns_algorithm} every implementation multiplies in bf16: "
            f"torch's Muon"
        )
    return "batched_fp32", (
        "this x86 CPU has neither AVX512-BF16 nor AMX, so bf16 products take a slow path (~35x "
        "fp32's): the bf16 values multiplied by fp32 GEMMs"
    )


def choose(
    setting: str,
    shapes: list[tuple[int, int]],
    device: torch.device,
    ns_coefficients: str = "quintic",
    ns_algorithm: str = "standard",
    resumed: str | None = None,
) -> NewtonSchulz:
    """The implementation `setting` names, or for `auto`: the implementation `resumed` (the
    choice of the run a checkpoint continues) where `auto` could choose it, so a resumed run
    keeps its bits; else `machine_choice`'s, with one step of each candidate timed on `shapes`
    (the matrices this rank will step) on `device` (`measure`)."""
    if setting != "auto":
        return implementation(setting, ns_coefficients, ns_algorithm)
    names = candidates(ns_coefficients, ns_algorithm)
    if resumed in names:
        return replace(implementation(resumed, ns_coefficients, ns_algorithm), resumed=True)
    name, why = machine_choice(device, ns_coefficients, ns_algorithm)
    found = [implementation(n, ns_coefficients, ns_algorithm) for n in names]
    measured = measure(found, shapes, device) if len(found) > 1 and shapes else None
    return replace(implementation(name, ns_coefficients, ns_algorithm), why=why, measured=measured)


def measure(
    found: list[NewtonSchulz], shapes: list[tuple[int, int]], device: torch.device
) -> Measured:
    """One step of each of `found` on a sample of `shapes`: the first (torch's Muon) on the
    sample's groups until it has taken `BUDGET_S`, the others on those groups, each stopped
    once it has taken `SLOWER` times the first's."""
    groups = sample_groups(shapes)
    first, ran = step_seconds(found[0], groups, device, BUDGET_S)
    seconds, groups, stopped = {found[0].name: first}, groups[:ran], []
    for ns in found[1:]:
        seconds[ns.name], ran = step_seconds(ns, groups, device, SLOWER * first)
        if ran < len(groups):
            stopped.append(ns.name)
    return Measured(seconds, tuple(stopped))


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
