"""`LayerwiseOptimizer.state`: torch's per-param state of every owned piece, read-only."""

from __future__ import annotations

from support import ADAMW_KW, MUON_KW, make_model, run, train_steps

import wholeshard
from wholeshard.optim.pieces import ADAMW, MATRIX


def _state_view() -> dict:
    ddp = wholeshard.DataParallel(make_model())
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    train_steps(ddp, opt, range(1))
    sizes = {kind: len(opt._inner[kind].state) for kind in (MATRIX, ADAMW)}
    keys = {o.kind: sorted(opt.state[o.master]) for o in opt.owned_pieces()}
    return {
        "keys": keys,
        "len": len(opt.state),
        "pieces": len(opt.owned_pieces()),
        "unchanged": sizes == {kind: len(opt._inner[kind].state) for kind in (MATRIX, ADAMW)},
    }


def test_state_holds_each_pieces_torch_state_and_lookups_add_nothing() -> None:
    for out in run(_state_view, 2):
        adamw = ["exp_avg", "exp_avg_sq", "step"]
        assert out["keys"] == {MATRIX: ["momentum_buffer"], ADAMW: adamw}
        assert out["len"] == out["pieces"] and out["unchanged"]
