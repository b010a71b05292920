"""`wholeshard.optim.NorMuon` against the equations of the authors' reference, in one process
and on N ranks through `LayerwiseOptimizer(matrix_optimizer=NorMuon)`; Newton-Schulz schedules.

The reference is `SingleDeviceNorMuon` (github.com/zichongli5/NorMuon, `normuon.py`), restated
below from its equations (`reference_update`): in the reference's dtypes (bf16 Newton-Schulz)
a step is NorMuon's bit for bit; in fp64 throughout, NorMuon's step differs by the bf16
rounding of Newton-Schulz. Measured over 6 seeds x 7 shapes x 4 steps (weight decay 0.1, one
param without a grad at step 2): the largest |NorMuon step - fp64 step| was 0.071 of the
largest element of the fp64 step (worst: 96x32, then 1x32), no more than bf16 Newton-Schulz
alone moves its output on the same shapes (up to 0.085 of its largest element against an fp64
iteration: the quintic's a x + B x cancels about 5x per iteration); `STEP_BOUND` allows 0.1.

Polar Express (Amsel et al. 2025, Algorithm 1) against the fixed quintic, max |sigma - 1| of the
output over random matrices (fp64 iteration / bf16 iteration), measured:

    steps   gaussian rectangular        singular values 1 .. 1e-2   singular values 1 .. 1e-3
            quintic      polar express  quintic      polar express  quintic      polar express
    5       0.318/0.327  0.126/0.135    0.318/0.324  0.130/0.129    0.786/0.845  0.583/0.733
    7       0.318/0.328  4e-6/0.011     0.318/0.326  5e-6/0.011     0.318/0.326  0.059/0.238
    10      0.318/0.328  9e-16/0.007    0.318/0.328  7e-16/0.008    0.318/0.325  7e-16/0.007

The quintic plateaus at 0.318 (it does not converge); Polar Express converges, to the bf16
rounding floor (about 0.01) in bf16. Before 5 steps the quintic is ahead on the gaussian
matrices: the first Polar Express polynomials lift singular values down to 1e-3 first.
"""

from __future__ import annotations

import math

import pytest
import support
import torch
from rule_harness import (
    distributed,
    one_process,
    saved_and_loaded,
    stacked_state_survives,
)
from support import (
    assert_bitwise_equal,
    assert_matches,
    assert_same_params,
    run,
)

from wholeshard.optim import Muon, NorMuon
from wholeshard.optim.normuon import (
    POLAR_EXPRESS,
    POLAR_EXPRESS_RAW,
    QUINTIC,
    ns_schedule,
    orthogonalize,
)

SHAPES = [(24, 24), (40, 12), (12, 40), (1, 32), (32, 1), (64, 128), (96, 32)]
STEPS = 4
STEP_BOUND = 0.1
"""Largest allowed |NorMuon step - fp64 restatement's step| / max |fp64 step|, per param/step."""


# -- the reference's equations, restated ------------------------------------------------------


def reference_ns(x: torch.Tensor, dtype: torch.dtype, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz as the reference writes it: in `dtype` (bf16 there), transposed when tall,
    divided by its Frobenius norm + 1e-7, then `steps` quintic iterations."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = x.to(dtype)
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + (c * gram) @ gram) @ x
    return x.mT if tall else x


def reference_update(
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    ns_dtype: torch.dtype,
    beta: float = 0.95,
    beta2: float = 0.95,
) -> torch.Tensor:
    """The reference's `normuon_update` (Nesterov), m and v advancing in place:
    m = lerp(m, g, 1 - beta); u = lerp(g, m, beta); o = NS(u); v = lerp(v, rowmean(o^2), 1 - beta2);
    o' = o / (sqrt(v) + 1e-10); o' *= |o| / (|o'| + 1e-10); o' *= sqrt(max(1, rows / cols)).
    With `ns_dtype=torch.bfloat16`, every value the reference holds in bf16 is rounded here."""
    m.lerp_(g, 1 - beta)
    o = reference_ns(g.lerp(m, beta), ns_dtype)
    norm = o.norm(dim=(-2, -1), keepdim=True)
    v.lerp_((o * o).mean(dim=-1, keepdim=True).to(v.dtype), 1 - beta2)
    o = (o * (1 / (v.sqrt() + 1e-10))).to(ns_dtype)  # in place there: o stays bf16
    o = o * (norm / (o.norm(dim=(-2, -1), keepdim=True) + 1e-10))
    return o * max(1, g.size(-2) / g.size(-1)) ** 0.5


def reference_steps(init, grads, ns_dtype, dtype, lr=0.02, wd=0.1):
    """Each step's param changes under the restated reference (params and state in `dtype`);
    a param without a grad steps on zeros without weight decay, as the reference does."""
    params = [x.to(dtype).clone() for x in init]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p[..., 0:1]) for p in params]
    changes = []
    for step_grads in grads:
        before = [p.clone() for p in params]
        for i, g in enumerate(step_grads):
            grad = torch.zeros_like(params[i]) if g is None else g.to(dtype)
            update = reference_update(grad, ms[i], vs[i], ns_dtype)
            if g is not None:
                params[i] = params[i] * (1 - lr * wd)
            params[i] = params[i].add(update, alpha=-lr)  # the reference's op
        changes.append([p - b for p, b in zip(params, before, strict=True)])
    return changes, params, ms, vs


def problem(seed: int = 0):
    """Initial params and per-step grads; the first param has no grad at step 2."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(STEPS)]
    grads[1][0] = None
    return init, grads


def normuon_steps(init, grads, dtype=torch.float32, **kw):
    params = [torch.nn.Parameter(x.to(dtype).clone()) for x in init]
    opt = NorMuon(params, lr=0.02, weight_decay=0.1, **kw)
    changes = []
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else g.to(dtype).clone()
        before = [p.detach().clone() for p in params]
        opt.step()
        changes.append([p.detach() - b for p, b in zip(params, before, strict=True)])
    return changes, params, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_is_the_reference_equations_bit_for_bit(dtype: torch.dtype) -> None:
    """In the reference's dtypes (bf16 Newton-Schulz and normalisation, state in the param's
    dtype): the same bits, a grad-less param included (stepped on zeros, no weight decay)."""
    init, grads = problem()
    _, ref_params, ms, vs = reference_steps(init, grads, torch.bfloat16, dtype)
    _, params, opt = normuon_steps(init, grads, dtype)
    for p, want, m, v in zip(params, ref_params, ms, vs, strict=True):
        assert torch.equal(p.detach(), want)
        assert torch.equal(opt.state[p]["momentum_buffer"], m)
        assert torch.equal(opt.state[p]["second_momentum_buffer"], v)
        assert v.shape == (p.shape[0], 1)


def test_step_is_the_fp64_equations_within_bf16_newton_schulz_rounding() -> None:
    worst = 0.0
    for seed in range(3):
        init, grads = problem(seed)
        ref, _, _, _ = reference_steps(init, grads, torch.float64, torch.float64)
        out, _, _ = normuon_steps(init, grads)
        for ref_step, out_step in zip(ref, out, strict=True):
            for a, b in zip(ref_step, out_step, strict=True):
                worst = max(worst, ((a - b.double()).abs().max() / a.abs().max()).item())
    assert 1e-4 < worst <= STEP_BOUND  # bf16 rounding is there, and bounded


def test_update_keeps_the_orthogonalized_norm_and_equalizes_rows() -> None:
    """After many steps on one gradient the second moment is the rows' mean square, so every
    row of the update has the same norm, and the update's norm is Newton-Schulz's."""
    g = torch.randn(16, 48, generator=torch.Generator().manual_seed(3))
    p = torch.nn.Parameter(torch.zeros(16, 48))
    opt = NorMuon([p], lr=1.0, momentum=0.0, beta2=0.0)
    p.grad = g.clone()
    opt.step()
    step = -p.detach()
    o = orthogonalize(g).float()
    assert step.norm().item() == pytest.approx(o.norm().item(), rel=2e-2)
    rows = step.norm(dim=1)
    assert (rows.max() / rows.min()).item() < 1.02
    assert (o.norm(dim=1).max() / o.norm(dim=1).min()).item() > 1.1  # it did equalize


def test_rejects_bad_settings() -> None:
    p = [torch.nn.Parameter(torch.randn(4, 4))]
    with pytest.raises(ValueError, match="ns_coefficients"):
        NorMuon(p, ns_coefficients="cubic")
    with pytest.raises(ValueError, match="matrices"):
        NorMuon([torch.nn.Parameter(torch.randn(4))])
    with pytest.raises(ValueError, match="beta2"):
        NorMuon(p, beta2=1.0)


# -- Newton-Schulz schedules --------------------------------------------------------------------


PAPER_POLAR_EXPRESS = """
    8.28721201814563    -23.595886519098837   17.300387312530933
    4.107059111542203   -2.9478499167379106   0.5448431082926601
    3.9486908534822946  -2.908902115962949    0.5518191394370137
    3.3184196573706015  -2.488488024314874    0.51004894012372
    2.300652019954817   -1.6689039845747493   0.4188073119525673
    1.891301407787398   -1.2679958271945868   0.37680408948524835
    1.8750014808534479  -1.2500016453999487   0.3750001645474248
    1.875               -1.25                 0.375
"""
"""The (a, b, c) of each polynomial in the paper's Algorithm 1, one per row, as printed."""


def test_polar_express_coefficients_are_the_papers() -> None:
    """Algorithm 1 of arXiv 2505.16932, as printed; safety 1.01 on all but the last."""
    paper = [tuple(map(float, row.split())) for row in PAPER_POLAR_EXPRESS.strip().splitlines()]
    assert list(POLAR_EXPRESS_RAW) == paper
    for (a, b, c), (pa, pb, pc) in zip(POLAR_EXPRESS[:-1], paper[:-1], strict=True):
        assert (a, b, c) == pytest.approx((pa / 1.01, pb / 1.01**3, pc / 1.01**5), rel=1e-15)
    assert POLAR_EXPRESS[-1] == paper[-1]
    # The last polynomial is the degree-5 Newton-Schulz (15x - 10x^3 + 3x^5) / 8: p(1) = 1.
    assert sum(POLAR_EXPRESS[-1]) == 1.0
    schedule, safety = ns_schedule("polar_express", 10)
    assert schedule == list(POLAR_EXPRESS) + [POLAR_EXPRESS[-1]] * 2 and safety == 1.01
    assert ns_schedule("quintic", 3) == ([QUINTIC] * 3, 1.0) and QUINTIC == (3.4445, -4.775, 2.0315)


def fp64_ns(x: torch.Tensor, name: str, steps: int) -> torch.Tensor:
    schedule, safety = ns_schedule(name, steps)
    x = x.double()
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x
    x = x / (x.norm() * safety + 1e-7)
    for a, b, c in schedule:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def with_spectrum(g: torch.Generator, m: int, n: int, smallest: float) -> torch.Tensor:
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    k = min(m, n)
    s = torch.logspace(0, math.log10(smallest), k, dtype=torch.float64)
    return u[:, :k] @ torch.diag(s) @ v[:, :k].T


def sigma_error(mats: list[torch.Tensor], ortho, sched: str, steps: int) -> float:
    """max |sigma - 1| over the singular values of `ortho(m, sched, steps)` for m in `mats`."""
    out = (torch.linalg.svdvals(ortho(m, sched, steps).double()) for m in mats)
    return max((s - 1).abs().max().item() for s in out)


def test_polar_express_approaches_one_faster_than_the_quintic() -> None:
    g = torch.Generator().manual_seed(0)
    sets = {
        "gaussian": [
            torch.randn(s, generator=g, dtype=torch.float64) for s in [(128, 32), (48, 96)]
        ],
        "1e-2": [with_spectrum(g, 64, 64, 1e-2), with_spectrum(g, 128, 32, 1e-2)],
        "1e-3": [with_spectrum(g, 64, 64, 1e-3), with_spectrum(g, 128, 32, 1e-3)],
    }
    for name, mats in sets.items():
        err = {}
        for steps in (5, 7, 10):
            for sched in ("quintic", "polar_express"):
                err[sched, steps, "fp64"] = sigma_error(mats, fp64_ns, sched, steps)
                err[sched, steps, "bf16"] = sigma_error(mats, orthogonalize, sched, steps)
        for prec in ("fp64", "bf16"):
            for steps in (7, 10):
                assert err["polar_express", steps, prec] < err["quintic", steps, prec], (name, err)
            if name != "1e-3":  # five steps suffice when the smallest singular value is >= 1e-2
                assert err["polar_express", 5, prec] < 0.6 * err["quintic", 5, prec], (name, err)
            assert err["quintic", 10, prec] > 0.3  # the fixed quintic plateaus
        assert err["polar_express", 10, "fp64"] < 1e-6  # Polar Express converges
        assert err["polar_express", 10, "bf16"] < 0.02  # to bf16's rounding


def test_normuon_runs_polar_express() -> None:
    init, grads = problem()
    pe, _, opt = normuon_steps(init, grads, ns_coefficients="polar_express")
    quintic, _, _ = normuon_steps(init, grads)
    assert opt.param_groups[0]["ns_coefficients"] == "polar_express"
    assert all(torch.isfinite(c).all() for step in pe for c in step)
    assert not torch.equal(pe[-1][1], quintic[-1][1])


# -- the Muon variant -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nesterov, adjust_lr_fn", [(True, None), (False, "original"), (True, "match_rms_adamw")]
)
def test_quintic_muon_is_torch_muon_bit_for_bit(nesterov: bool, adjust_lr_fn: str | None) -> None:
    init, grads = problem()
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    runs = []
    for rule, extra in [(torch.optim.Muon, {}), (Muon, {}), (Muon, dict(ns_coefficients=QUINTIC))]:
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = rule(params, **kw, **extra)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = None if g is None else g.clone()
            opt.step()
        runs.append((params, opt))
    (ref, ref_opt), *others = runs
    for params, opt in others:
        for p, q in zip(ref, params, strict=True):
            assert torch.equal(p, q)
            assert torch.equal(ref_opt.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"])


def test_polar_express_muon_step_is_the_papers_iteration() -> None:
    """One step from zero momentum without Nesterov, weight decay or lr scaling: the change is
    -lr * PolarExpress(grad), within bf16 rounding of the fp64 Algorithm 1 (measured over 8
    seeds of these shapes: up to 0.055 of the largest element), and not the quintic's."""
    g = torch.Generator().manual_seed(4)
    worst = 0.0
    for shape in [(24, 24), (40, 12), (12, 40), (64, 128)]:
        grad = torch.randn(shape, generator=g)
        p = torch.nn.Parameter(torch.zeros(shape))
        opt = Muon(
            [p],
            lr=1.0,
            weight_decay=0.0,
            momentum=0.0,
            nesterov=False,
            ns_coefficients="polar_express",
            adjust_lr_fn=None,
        )
        p.grad = grad
        opt.step()
        scale = max(1, shape[0] / shape[1]) ** 0.5
        want = -scale * fp64_ns(grad, "polar_express", 5)
        worst = max(worst, ((p.detach().double() - want).abs().max() / want.abs().max()).item())
        quintic = -scale * fp64_ns(grad, "quintic", 5)
        assert (quintic - want).abs().max() > 0.05 * want.abs().max()
    assert 1e-4 < worst < 0.08


@pytest.mark.parametrize("nproc", [1, 2])
def test_polar_express_muon_through_layerwise_optimizer(nproc: int) -> None:
    kw = dict(
        lr=0.02,
        weight_decay=0.01,
        momentum=0.9,
        ns_coefficients="polar_express",
        adjust_lr_fn="match_rms_adamw",
    )
    ref = one_process(4, Muon, kw)
    for out in run(distributed, nproc, 4, Muon, kw):
        if nproc == 1:
            for name, want in ref["params"].items():
                assert torch.equal(out["params"][name], want), name
        assert_matches(out, ref)


# -- distributed: N ranks equal one process ------------------------------------------------------

NORMUON_KW = dict(lr=0.02, weight_decay=0.01, momentum=0.9, beta2=0.95)
RULE = (NorMuon, NORMUON_KW)


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_n_ranks_equal_one_process(nproc: int) -> None:
    """One rank does the reference's arithmetic: the same bits. On 2 and 3 ranks the gradient's
    sum order differs, which bf16 Newton-Schulz amplifies: measured max |param diff| 1.2e-3 (2
    ranks) and 1.4e-3 (3), RMS 3.5e-4, within `support.TOL` (3e-3; without the row
    normalisation the params would differ by 5.6e-3)."""
    ref = one_process(5, *RULE)
    outs = run(distributed, nproc, 5, *RULE)
    for out in outs:
        if nproc == 1:
            for name, want in ref["params"].items():
                assert torch.equal(out["params"][name], want), name
            assert out["losses"] == ref["losses"]
        assert_matches(out, ref)
        second = [v for e in out["opt_state"].values() for k, v in e.items() if "second" in k]
        assert second and all(v.shape[-1] == 1 for v in second)
    assert_same_params(outs)


MODES = {
    "overlap": support.OVERLAP,
    "fully_sharded": dict(reshard_after_forward=True),
    "pipelined": dict(pipelined_step=True, **support.OVERLAP),
    "pipelined_sync": dict(pipelined_step=True),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_is_bitwise_sync(mode: str) -> None:
    sync = run(distributed, 2, 4, *RULE)
    outs = run(distributed, 2, 4, *RULE, MODES[mode])
    for a, b in zip(sync, outs, strict=True):
        assert_bitwise_equal(a, b)


def test_shard_groups_match_one_process() -> None:
    """shard_group_size=1: each rank owns every param (replicas), so every rank steps NorMuon on
    every matrix; the gradient is all-reduced instead of reduce-scattered (another sum order)."""
    ref = one_process(4, *RULE)
    outs = run(distributed, 2, 4, *RULE, dict(shard_group_size=1))
    for out in outs:
        assert_matches(out, ref)
    assert_same_params(outs)


# -- checkpoints: the per-row second moment travels whole with its matrix --------------------------

SAVE_AT, MORE = 3, 3


@pytest.mark.parametrize("load_at", [2, 3])
def test_checkpoint_at_2_ranks_loads_and_continues(tmp_path, load_at: int) -> None:
    saved, loaded, outs = saved_and_loaded(str(tmp_path), load_at, SAVE_AT, MORE, *RULE)
    assert loaded.keys() == saved.keys() and saved
    for name, entry in saved.items():
        assert (
            entry.keys()
            == loaded[name].keys()
            == {"value", "momentum_buffer", "second_momentum_buffer"}
        )
        for k, v in entry.items():
            assert torch.equal(loaded[name][k], v), (name, k)
    ref = one_process(SAVE_AT + MORE, *RULE)
    for out in outs:
        assert_matches(out, {"params": ref["params"], "losses": ref["losses"][SAVE_AT:]})
    if load_at == 2:  # the same plan and world size: as if never interrupted, to the bit
        straight = run(distributed, 2, SAVE_AT + MORE, *RULE)
        for out, want in zip(outs, straight, strict=True):
            for k, v in want["params"].items():
                assert torch.equal(out["params"][k], v), k


def test_stacked_matrices_keep_their_own_second_moment_through_a_checkpoint(tmp_path) -> None:
    same = stacked_state_survives(str(tmp_path), *RULE)
    assert same["routers.0"] and same["experts.0.down_proj[0]"]  # whole matrices do travel
    assert all(same.values()), sorted(k for k, ok in same.items() if not ok)
