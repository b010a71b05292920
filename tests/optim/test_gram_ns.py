"""`ns_algorithm="gram"` (wholeshard/optim/gram_ns.py) against the standard Newton-Schulz.

The two are the same iterations in exact arithmetic and differ by bf16 rounding, which the
quintic amplifies for small singular values. Bounds are measured maxima with margin: over the
shapes and seeds below the relative Frobenius difference of the orthogonalized outputs peaked
at 0.100 (Polar Express, 512 x 96; quintic: 0.060, 64 x 64) and the singular values left the
standard form's band by at most 0.098 (Polar Express, 512 x 96; quintic: 0.021). For scale,
two forms of the standard iteration (`orthogonalize` and torch's addmm form) differ by up to
0.051 on the same 2-D inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from wholeshard.optim import BatchedMuon, Muon, NorMuon
from wholeshard.optim.gram_ns import gram_newton_schulz, gram_ns_flops, gram_plan, symmetric_gram
from wholeshard.optim.normuon import orthogonalize

REL_BOUND = 0.15
"""Relative Frobenius difference, gram vs standard (measured max 0.100)."""
BAND_MARGIN = 0.15
"""How far gram's singular values may leave [min, max] of the standard's (measured 0.098)."""
UPDATE_BOUND = 0.1
"""Relative difference of a param's movement over 3 steps, gram vs standard (measured max:
Muon 0.021, Muon Polar Express 0.036, NorMuon 0.048, BatchedMuon 0.021)."""

SHAPES = [(64, 64), (300, 300), (128, 512), (512, 96), (3, 96, 160), (2, 40, 40)]


def _pair(g: torch.Tensor, schedule: str) -> tuple[torch.Tensor, torch.Tensor]:
    standard = orthogonalize(g, schedule, 5).float()
    gram = orthogonalize(g, schedule, 5, ns_algorithm="gram").float()
    return standard, gram


@pytest.mark.parametrize("schedule", ["quintic", "polar_express"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gram_matches_the_standard_iteration_within_bf16_noise(shape, schedule) -> None:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    standard, gram = _pair(g, schedule)
    assert gram.shape == g.shape
    rel = (gram - standard).norm() / standard.norm()
    assert rel < REL_BOUND, f"relative difference {rel:.4f}"
    sv_standard, sv_gram = torch.linalg.svdvals(standard), torch.linalg.svdvals(gram)
    assert sv_gram.max() <= sv_standard.max() + BAND_MARGIN
    assert sv_gram.min() >= sv_standard.min() - BAND_MARGIN


def test_both_plans_are_exercised_and_symmetric_products_are_exactly_symmetric() -> None:
    assert gram_plan(64, 64, 5) == "syrk" and gram_plan(300, 300, 5) == "syrk"
    assert gram_plan(128, 512, 5) == "gram" and gram_plan(64, 4096, 5) == "gram"
    x = torch.randn(2, 600, 70).bfloat16()  # three row blocks, the last short
    gram = symmetric_gram(x)
    assert torch.equal(gram, gram.mT)
    torch.testing.assert_close(gram.float(), (x.float() @ x.float().mT), rtol=2e-2, atol=2e-1)
    with pytest.raises(ValueError, match="wide"):
        gram_newton_schulz(x, [(3.4445, -4.7750, 2.0315)])


@pytest.mark.parametrize("shape", [(128, 512), (64, 1024), (512, 512), (300, 300)], ids=str)
def test_gram_counts_fewer_flops_than_the_standard_form(shape) -> None:
    g = torch.randn(shape)
    counts = []
    for algorithm in ("standard", "gram"):
        with FlopCounterMode(display=False) as counter:
            orthogonalize(g, "quintic", 5, ns_algorithm=algorithm)
        counts.append(counter.get_total_flops())
    standard, gram = counts
    m, n = sorted(shape)
    assert standard == 5 * (4 * m * m * n + 2 * m**3)
    assert gram == gram_ns_flops(shape, 5)
    assert gram < standard
    if n >= 4 * m:
        assert gram < 0.7 * standard  # Q accumulation: the wide X is touched 4 times, not 15


def _train(cls, algorithm: str, steps: int = 3, **kwargs) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in [(96, 256), (256, 96)] * 2]
    start = [p.detach().clone() for p in params]
    opt = cls(params, lr=0.02, ns_algorithm=algorithm, **kwargs)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() - s for p, s in zip(params, start, strict=True)]


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (Muon, {}),
        (Muon, {"ns_coefficients": "polar_express"}),
        (NorMuon, {}),
        (BatchedMuon, {}),
    ],
    ids=["muon", "muon-polar", "normuon", "batched"],
)
def test_optimizer_updates_with_gram_stay_close_to_standard(cls, kwargs) -> None:
    standard = _train(cls, "standard", **kwargs)
    gram = _train(cls, "gram", **kwargs)
    for s, g in zip(standard, gram, strict=True):
        assert not torch.equal(s, g)  # not bitwise: a different order of roundings
        rel = (g - s).norm() / s.norm()
        assert rel < UPDATE_BOUND, f"relative update difference {rel:.4f}"


def test_ns_algorithm_is_validated_and_standard_is_the_default() -> None:
    p = [torch.zeros(4, 4, requires_grad=True)]
    for cls in (Muon, NorMuon, BatchedMuon):
        assert cls(p).ns_algorithm == "standard"
        with pytest.raises(ValueError, match="ns_algorithm"):
            cls(p, ns_algorithm="fast")
