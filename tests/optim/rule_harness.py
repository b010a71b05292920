"""Running a matrix rule (`LayerwiseOptimizer(matrix_optimizer=rule)`) against one process:
the shared harness of the rule tests (NorMuon, SOAP, bring-your-own).

`one_process` is the reference: the full batch, `rule` on the matrix-routed params (whole
matrices, fp32), torch's AdamW on the rest, the unsharded model. `distributed` is the same
training through `DataParallel(**ddp_kw)` on this rank's slice of every batch; a rule with a
`matrix_cost` is laid out for it (`DataParallel.balance_for`). `save_after` /
`load_and_continue` cut a run by a checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from support import (
    ADAMW_KW,
    _global_mean,
    batch,
    data_parallel,
    full_params,
    lm_loss,
    make_model,
    run,
    train_steps,
)

import wholeshard
from wholeshard.checkpoint import load_checkpoint, save_checkpoint
from wholeshard.planning.routing import route_params


def one_process(steps: int, rule: type, kw: dict) -> dict:
    """The reference run: params and losses."""
    model = make_model()
    routes = route_params(model)
    opts = [
        rule([r.param for r in routes if r.matrix], **kw),
        torch.optim.AdamW([r.param for r in routes if not r.matrix], **ADAMW_KW),
    ]
    losses = []
    for step in range(steps):
        loss = lm_loss(model, *batch(step))
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return {"params": full_params(model), "losses": losses}


def setup(rule: type, kw: dict, ddp_kw: dict | None = None, seed: int = 0):
    """(model, ddp, opt) on this rank, laid out for the rule's own `matrix_cost`."""
    model = make_model(seed)
    ddp = data_parallel(model, **(ddp_kw or {}))
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=kw, adamw=ADAMW_KW, matrix_optimizer=rule)
    return model, ddp, opt


def train(ddp, opt, steps) -> list[float]:
    """Train `steps` (batch indices) on this rank's slices; the global mean loss of each."""
    return [_global_mean(loss) for loss in train_steps(ddp, opt, steps)]


def distributed(steps: int, rule: type, kw: dict, ddp_kw: dict | None = None) -> dict:
    """This rank's run: the full params, the losses and its optimizer state's tensors."""
    model, ddp, opt = setup(rule, kw, ddp_kw)
    losses = train(ddp, opt, range(steps))
    with ddp.full_params():
        params = full_params(model)
    state = {
        name: {k: v.clone() for k, v in entry.items() if torch.is_tensor(v)}
        for name, entry in opt.state_dict()["state"].items()
    }
    return {"params": params, "losses": losses, "opt_state": state}


def gathered_state(opt) -> dict:
    """This rank's matrix-routed pieces (whole here): fp32 value and every state tensor."""
    return {
        piece.name: {k: v.clone() for k, v in opt.piece_state(piece).items()}
        | {"value": piece.master.detach().clone()}
        for piece in opt.owned_pieces()
        if piece.kind == "matrix"
    }


def save_after(root: str, steps: int, rule: type, kw: dict) -> dict:
    """Train `steps`, save a checkpoint to `root`; this rank's state as saved."""
    _, ddp, opt = setup(rule, kw)
    train(ddp, opt, range(steps))
    save_checkpoint(root, ddp, opt, extra={"step": steps})
    return gathered_state(opt)


def load_and_continue(root: str, more: int, rule: type, kw: dict) -> dict:
    """Load `root` into another init (seed 5) and train `more` steps: the state as loaded, the
    final params and the losses."""
    model, ddp, opt = setup(rule, kw, seed=5)
    extra = load_checkpoint(root, ddp, opt)
    loaded = gathered_state(opt)
    losses = train(ddp, opt, range(extra["step"], extra["step"] + more))
    with ddp.full_params():
        params = full_params(model)
    return {"loaded": loaded, "params": params, "losses": losses}


def saved_and_loaded(
    root: str, load_at: int, save_at: int, more: int, rule: type, kw: dict
) -> tuple[dict, dict, list[dict]]:
    """Save after `save_at` steps at 2 ranks, load at `load_at` ranks and train `more`: (every
    matrix's state as saved, as loaded, each loading rank's `load_and_continue` result)."""
    saved: dict = {}
    for part in run(save_after, 2, root, save_at, rule, kw):
        saved.update(part)
    outs = run(load_and_continue, load_at, root, more, rule, kw)
    loaded: dict = {}
    for out in outs:
        loaded.update(out["loaded"])
    return saved, loaded, outs


def stacked_round_trip(root: str, rule: type, kw: dict) -> dict[str, bool]:
    """Fused experts ((E, out, in) Muon stacks) trained 2 steps, saved to `root` and loaded
    back: for each owned matrix, whether every state tensor came back to the bit."""
    from test_stacks import make_moe  # tests/engine (on sys.path: see stacked_state_survives)

    ddp = wholeshard.DataParallel(make_moe(), bucket_size=1500)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=kw, adamw=ADAMW_KW, matrix_optimizer=rule)
    train(ddp, opt, range(2))
    before = {p.key: dict(opt.piece_state(p)) for p in opt.owned_pieces() if p.kind == "matrix"}
    save_checkpoint(root, ddp, opt, extra={"step": 2})
    load_checkpoint(root, ddp, opt)
    after = {p.key: dict(opt.piece_state(p)) for p in opt.owned_pieces() if p.kind == "matrix"}
    return {
        k: v.keys() == after[k].keys() and all(torch.equal(t, after[k][n]) for n, t in v.items())
        for k, v in before.items()
    }


def stacked_state_survives(root: str, rule: type, kw: dict) -> dict[str, bool]:
    """`stacked_round_trip` at 2 ranks: every rank's answers, merged."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # test_stacks
    same: dict[str, bool] = {}
    for part in run(stacked_round_trip, 2, root, rule, kw):
        same.update(part)
    return same
