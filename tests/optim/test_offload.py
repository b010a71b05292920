"""`LayerwiseOptimizer(offload_state=True)`: masters and optimizer state in host memory, each
unit's copied to the device for its update ([Note: optimizer-state offload] in
`wholeshard/optim/_offload.py`).

On the CPU the host is the device, so the tests set `StateOffload.force_copies` (forked workers
inherit it): every master and state tensor then goes through the copies into separate tensors,
which each run checks (the tensors the rule updates are never the ones kept between steps).
The claim: the same bits as without offload, in every mode and rule, and checkpoints unchanged.
"""

from __future__ import annotations

import pytest
import torch
from support import (
    ADAMW_KW,
    MUON_KW,
    OVERLAP,
    SYNC,
    assert_bitwise_equal,
    data_parallel,
    full_params,
    make_model,
    mp,
    run,
    train_steps,
)

import wholeshard
from wholeshard.checkpoint import load_checkpoint, save_checkpoint
from wholeshard.optim import BatchedMuon, NorMuon
from wholeshard.optim._offload import StateOffload, offloaded
from wholeshard.optim.soap import SOAP

BF16 = torch.bfloat16
FULLY = dict(reshard_after_forward=True)
PIPELINED = dict(pipelined_step=True, **OVERLAP)
MODES = {
    "zero": dict(SYNC),
    "fully-sharded": dict(FULLY, **OVERLAP),
    "pipelined": dict(PIPELINED),
    "pipelined-fully-sharded": dict(PIPELINED, **FULLY),
}
RULES = {
    "muon": (torch.optim.Muon, MUON_KW),
    "batched-muon": (BatchedMuon, MUON_KW),
    "normuon": (NorMuon, dict(lr=0.02, weight_decay=0.01, momentum=0.9, beta2=0.95)),
    "soap": (SOAP, dict(lr=3e-3, weight_decay=0.01, precondition_frequency=2, max_precond_dim=32)),
}
STEPS = 4


@pytest.fixture(autouse=True)
def _forced_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StateOffload, "force_copies", True)


def _addresses(opt, pieces, into: dict[tuple[str, str], set[int]]) -> dict:
    """Add the address of each separate master and offloadable state tensor of `pieces` now to
    `into`, by piece and role (a freed copy's address may be reused by another tensor)."""
    for piece in pieces:
        state = opt._inner[piece.kind].state.get(piece.stepped, {})  # no wait inside a step
        held = {k: v for k, v in state.items() if offloaded(v)}
        if piece.separate_master:
            held["master"] = piece.master
        for role, t in held.items():
            into.setdefault((piece.key, role), set()).add(t.data_ptr())
    return into


def _build(rule: str, ddp_kw: dict, policy, offload: bool, seed: int = 0, **opt_kw):
    cls, kw = RULES[rule]
    ddp = data_parallel(make_model(seed), bucket_size=3000, mp_policy=policy, **ddp_kw)
    opt = wholeshard.LayerwiseOptimizer(
        ddp, matrix=kw, adamw=ADAMW_KW, matrix_optimizer=cls, offload_state=offload, **opt_kw
    )
    return ddp, opt


def _train(rule: str, ddp_kw: dict, policy, offload: bool, **opt_kw) -> dict:
    """This rank's run: params, losses and state; which tensors the rule updated and which are
    kept between steps; the memory report."""
    ddp, opt = _build(rule, ddp_kw, policy, offload, **opt_kw)
    stepped: dict[tuple[str, str], set[int]] = {}
    opt.register_update_hook(lambda pieces: _addresses(opt, pieces, stepped))
    losses = [loss.item() for loss in train_steps(ddp, opt, range(STEPS))]
    with ddp.full_params():
        params = full_params(ddp.module)
    state = {
        name: {k: v.clone() for k, v in entry.items() if torch.is_tensor(v)}
        for name, entry in opt.state_dict()["state"].items()
    }
    expected_host = 0
    for piece in opt.owned_pieces():
        expected_host += piece.master.nbytes if piece.separate_master else 0
        expected_host += sum(v.nbytes for v in opt.piece_state(piece).values() if offloaded(v))
    return {
        "params": params,
        "losses": losses,
        "opt_state": state,
        "stepped": stepped,
        "kept": _addresses(opt, opt.owned_pieces(), {}),
        "memory": ddp.memory(),
        "expected_host": expected_host,
    }


def _runs(rule: str, configs: list[tuple[dict, object, bool, dict]]) -> list[dict]:
    return [_train(rule, ddp_kw, policy, offload, **kw) for ddp_kw, policy, offload, kw in configs]


def _assert_offloaded(out: dict) -> None:
    """The copies happened: what the rule updated is not what is kept; memory says where."""
    stepped, kept = out["stepped"], out["kept"]
    assert stepped and all(not tensors & kept[k] for k, tensors in stepped.items())
    memory = out["memory"]
    assert memory["host"] == out["expected_host"] > 0
    kept = sum(memory[k] for k in ("params", "grads", "masters", "optimizer_state"))
    assert memory["device"] == kept + memory["frozen_params"] - memory["host"]


def _same_tensors(out: dict) -> bool:
    """Without copies: the rule updated the tensors kept between steps."""
    return all(tensors <= out["kept"][k] for k, tensors in out["stepped"].items())


def _check(rule: str, configs: list[tuple[dict, object, bool, dict]]) -> None:
    """Run `configs` (the first without offload) on 2 ranks: each offloaded one bitwise the
    first, its copies real."""
    for outs in run(_runs, 2, rule, configs):
        base, *others = outs
        assert _same_tensors(base) and base["memory"]["host"] == 0  # the check can fail
        for out in others:
            assert_bitwise_equal(base, out)
            _assert_offloaded(out)


POLICIES = {"bf16": mp(BF16), "fp32": mp(torch.float32), "bf16-grads": mp(None, BF16)}
"""Separate fp32 masters; masters that are the params; fp32 masters' grads cast from bf16."""


@pytest.mark.parametrize(
    "policy", [pytest.param("bf16", marks=pytest.mark.core), "fp32", "bf16-grads"]
)
def test_offloaded_muon_is_bitwise_in_every_mode(policy: str) -> None:
    configs = [(SYNC, POLICIES[policy], False, {})]
    configs += [(kw, POLICIES[policy], True, {}) for kw in MODES.values()]
    _check("muon", configs)


@pytest.mark.parametrize("rule", [r for r in RULES if r != "muon"])
def test_offloaded_rules_are_bitwise_in_every_mode(rule: str) -> None:
    configs = [(SYNC, mp(BF16), False, {})]
    configs += [(kw, mp(BF16), True, {}) for kw in MODES.values()]
    configs.append((PIPELINED, mp(BF16), True, dict(nonfinite=None)))  # overlaps reductions
    _check(rule, configs)


def test_offload_on_the_cpu_moves_nothing_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StateOffload, "force_copies", False)
    for out in run(_train, 2, "muon", SYNC, mp(BF16), True):
        assert _same_tensors(out) and out["memory"]["host"] == 0


# -- checkpoints --------------------------------------------------------------------------------


def _pieces_state(opt) -> dict:
    return {
        p.key: {k: v.clone() for k, v in opt.piece_state(p).items()}
        | {"master": p.master.detach().clone()}
        for p in opt.owned_pieces()
    }


def _across_a_checkpoint(root: str, save_offload: bool, load_offload: bool) -> dict:
    """Train 2 steps, save, load into another init and train 1 more on both: the state saved
    and loaded, and both runs' final params."""
    out = {}
    for name, offload, seed in (("saver", save_offload, 0), ("loader", load_offload, 5)):
        ddp, opt = _build("muon", dict(SYNC), mp(BF16), offload, seed=seed)
        if name == "saver":
            train_steps(ddp, opt, range(2))
            save_checkpoint(root, ddp, opt, extra={"step": 2})
        else:
            load_checkpoint(root, ddp, opt)
            out["host"] = ddp.memory()["host"]
        out[name] = _pieces_state(opt)
        train_steps(ddp, opt, range(2, 3))
        with ddp.full_params():
            out[f"{name}_params"] = full_params(ddp.module)
    return out


@pytest.mark.parametrize(("save_offload", "load_offload"), [(True, False), (False, True)])
def test_checkpoints_do_not_change(tmp_path, save_offload: bool, load_offload: bool) -> None:
    for out in run(_across_a_checkpoint, 2, str(tmp_path), save_offload, load_offload):
        saved, loaded = out["saver"], out["loader"]
        assert saved.keys() == loaded.keys()
        for key, entry in saved.items():
            assert entry.keys() == loaded[key].keys(), key
            for k, v in entry.items():
                assert torch.equal(v, loaded[key][k]), (key, k)
        assert (out["host"] > 0) == load_offload  # loaded state goes to the host
        for name, value in out["saver_params"].items():
            assert torch.equal(value, out["loader_params"][name]), name
