"""Bring your own matrix rule: `LayerwiseOptimizer(matrix_optimizer=cls)` with a test-only rule
written here from its paper's equations, whose state is not shaped like its param.

`FactoredRMS` is Adafactor's factored second moment (Shazeer & Stern 2018, "Adafactor:
Adaptive Learning Rates with Sublinear Memory Cost", Algorithm 4 without update clipping and
relative step sizes), for a matrix G (out, in):

    R <- beta R + (1 - beta) mean_j(G² + eps)       per row, shape (out,)
    C <- beta C + (1 - beta) mean_i(G² + eps)       per column, shape (in,)
    V  = R Cᵀ / mean(R)                              the rank-1 estimate of E[G²]
    W <- W - lr G / sqrt(V)

Its state, `row` (out,) and `col` (in,), holds one value per row and per column: checkpoints
move it whole with its matrix. It runs on N ranks like one process, in every mode, and a
checkpoint saved at 2 ranks loads at 3 and continues.
"""

from __future__ import annotations

import pytest
import torch
from rule_harness import distributed, one_process, saved_and_loaded
from support import assert_bitwise_equal, assert_matches, fp8_model, run, wholeshard_run
from test_normuon import MODES

from wholeshard.engine._fp8_storage import Fp8Storage
from wholeshard.optim import SOAP, NorMuon


class FactoredRMS(torch.optim.Optimizer):
    """Adafactor's factored second moment on 2-D params; see the module docstring."""

    def __init__(self, params, lr: float = 1e-2, beta: float = 0.9, eps: float = 1e-30) -> None:
        super().__init__(params, dict(lr=lr, beta=beta, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, beta, eps = group["lr"], group["beta"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    raise ValueError(f"FactoredRMS steps matrices, got shape {tuple(p.shape)}")
                state = self.state[p]
                if not state:
                    state["row"] = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                    state["col"] = torch.zeros(p.shape[1], dtype=p.dtype, device=p.device)
                sq = p.grad.square() + eps
                state["row"].lerp_(sq.mean(dim=1), 1 - beta)
                state["col"].lerp_(sq.mean(dim=0), 1 - beta)
                v = torch.outer(state["row"], state["col"]) / state["row"].mean()
                p.sub_(p.grad / v.sqrt(), alpha=lr)
        return None


KW = dict(lr=5e-3, beta=0.9)


def test_one_process_is_the_equations() -> None:
    """Two steps of the rule against the equations restated by hand."""
    torch.manual_seed(0)
    w = torch.randn(6, 4)
    grads = [torch.randn(6, 4), torch.randn(6, 4)]
    p = w.clone().requires_grad_(True)
    opt = FactoredRMS([p], **KW)
    want, row, col = w.clone(), torch.zeros(6), torch.zeros(4)
    for g in grads:
        p.grad = g
        opt.step()
        row = 0.9 * row + 0.1 * (g * g + 1e-30).mean(1)
        col = 0.9 * col + 0.1 * (g * g + 1e-30).mean(0)
        want -= 5e-3 * g / (torch.outer(row, col) / row.mean()).sqrt()
    torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
    assert opt.state[p]["row"].shape == (6,) and opt.state[p]["col"].shape == (4,)


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_n_ranks_equal_one_process(nproc: int) -> None:
    ref = one_process(4, FactoredRMS, KW)
    outs = run(distributed, nproc, 4, FactoredRMS, KW)
    for out in outs:
        if nproc == 1:  # the same arithmetic: the same bits
            for name, want in ref["params"].items():
                assert torch.equal(out["params"][name], want), name
        assert_matches(out, ref)
        shapes = {k: v.shape for e in out["opt_state"].values() for k, v in e.items()}
        assert {k for k in shapes if k in ("row", "col")} == {"row", "col"}
        assert all(len(s) == 1 for k, s in shapes.items() if k in ("row", "col"))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_is_bitwise_sync(mode: str) -> None:
    sync = run(distributed, 2, 3, FactoredRMS, KW)
    outs = run(distributed, 2, 3, FactoredRMS, KW, MODES[mode])
    for a, b in zip(sync, outs, strict=True):
        assert_bitwise_equal(a, b)


SAVE_AT, MORE = 2, 2


def test_checkpoint_at_2_ranks_loads_at_3_and_continues(tmp_path) -> None:
    saved, loaded, outs = saved_and_loaded(str(tmp_path), 3, SAVE_AT, MORE, FactoredRMS, KW)
    assert loaded.keys() == saved.keys() and saved
    for name, entry in saved.items():  # the row and column vectors, whole with their matrix
        assert entry.keys() == loaded[name].keys() == {"value", "row", "col"}
        for k, v in entry.items():
            assert torch.equal(loaded[name][k], v), (name, k)
    ref = one_process(SAVE_AT + MORE, FactoredRMS, KW)
    for out in outs:
        assert_matches(out, {"params": ref["params"], "losses": ref["losses"][SAVE_AT:]})


RULES = {  # every rule, with its own keyword arguments
    "factored_rms": (FactoredRMS, KW),
    "normuon": (NorMuon, dict(lr=0.02, weight_decay=0.01, momentum=0.9, beta2=0.95)),
    "soap": (SOAP, dict(lr=3e-3, precondition_frequency=2, max_precond_dim=32)),
}


def fp8_on_and_off(rule: type, kw: dict) -> tuple[dict, dict]:
    """The rule's training with FP8 param gather (tensorwise) and with a bf16 gather of the
    same FP8 layers, fully sharded and overlapped."""
    ddp_kw = dict(bucket_size=3000, reshard_after_forward=True)
    ddp_kw |= dict(overlap_grad_reduce=True, overlap_param_gather=True)
    common = dict(make=fp8_model("tensorwise"), param_dtype=torch.bfloat16, evaluate=True)
    common |= dict(muon_kw=kw, matrix_optimizer=rule)
    off = wholeshard_run(3, ddp_kw=ddp_kw, **common)
    on = wholeshard_run(3, ddp_kw=dict(ddp_kw, fp8_param_gather=True), keep_ddp=True, **common)
    on["fp8_units"] = sum(isinstance(b, Fp8Storage) for b in on.pop("ddp").units)
    return off, on


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_with_fp8_param_gather_is_bitwise_a_bf16_gather(name: str) -> None:
    """FP8 param gather ships the FP8 weights each forward would quantize to anyway: with any
    rule, the same training to the bit (FP8 layers compute in FP8 either way)."""
    for off, on in run(fp8_on_and_off, 2, *RULES[name]):
        assert on.pop("fp8_units") > 0
        assert_bitwise_equal(on, off)
        assert on["evals"] == off["evals"]
