"""DataParallel + LayerwiseOptimizer against the single-process reference, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import (
    ADAMW_KW,
    DTYPES,
    MUON_KW,
    OVERLAP,
    assert_matches,
    batch,
    grid,
    lm_loss,
    local_loss,
    make_model,
    mp,
    reference_run,
    run,
    wholeshard_run,
    wrapped,
)

import wholeshard
from wholeshard.distributed import collectives
from wholeshard.planning import ONE_BUCKET, ParamSpec, plan_exactly

STEPS = 5


@pytest.mark.parametrize(
    ("nproc", "dtype"), grid({n: n for n in (1, 2, 3, 4)}, DTYPES, core="2-fp32")
)
def test_matches_reference(nproc: int, dtype: torch.dtype) -> None:
    ref = reference_run(STEPS, param_dtype=dtype)
    outs = run(wholeshard_run, nproc, STEPS, param_dtype=dtype)
    for out in outs:
        assert_matches(out, ref, dtype)
    for out in outs[1:]:  # every rank ends with the same params, bit for bit
        assert all(torch.equal(out["params"][k], v) for k, v in outs[0]["params"].items())


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.float32, id="fp32", marks=pytest.mark.core), torch.bfloat16],
    ids=["fp32", "bf16"],
)
def test_single_process_is_the_reference_bitwise(dtype: torch.dtype) -> None:
    """Without a process group (and at one rank) the arithmetic is the reference's own."""
    ref = reference_run(STEPS, param_dtype=dtype)
    for out in run(wholeshard_run, 0, STEPS, param_dtype=dtype) + run(
        wholeshard_run, 1, STEPS, param_dtype=dtype
    ):
        assert all(torch.equal(out["params"][k], v) for k, v in ref["params"].items())
        assert out["losses"] == ref["losses"]


def test_tied_embedding_matches_reference() -> None:
    ref = reference_run(STEPS, model_kw={"tied": True})
    for out in run(wholeshard_run, 2, STEPS, model_kw={"tied": True}):
        assert_matches(out, ref, torch.float32)


def test_one_rank_issues_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("a collective was issued at dp_size 1")

    for name in ("reduce_scatter_sum", "all_gather", "all_reduce", "all_reduce_sum", "broadcast"):
        monkeypatch.setattr(collectives, name, forbidden)
    for ddp_dist in (dist.all_gather_object, dist.broadcast):
        monkeypatch.setattr(dist, ddp_dist.__name__, forbidden)
    run(wholeshard_run, 1, 2, clip=1.0)


def _grads_after_sync() -> dict:
    """After one backward and grad sync: what this rank owns and the gradients it holds."""
    ddp = wholeshard.DataParallel(make_model(), bucket_size=3000)
    local_loss(ddp).backward()
    ddp.step_protocol.finish_grad_sync()
    muon = next(b for b in ddp.plan.buffers if b.kind == "matrix")
    return {
        "rank": dist.get_rank(),
        "buckets": len(muon.buckets),
        # the one ownership rule of whole-tensor buffers, evaluated independently here
        "owner": {
            p.name: (p.start - muon.buckets[p.bucket].start) // muon.buckets[p.bucket].shard_numel
            for p in muon.placements
        },
        "owned": [(s.route.name, s.offset, s.grad.clone()) for s in ddp.step_protocol.owned()],
    }


@pytest.mark.core
def test_owner_from_the_plan_receives_the_reduced_gradient() -> None:
    model = make_model()
    lm_loss(model, *batch(0)).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    outs = run(_grads_after_sync, 3)
    assert outs[0]["buckets"] > 1
    owners = outs[0]["owner"]
    assert set(owners.values()) == {0, 1, 2}
    covered = {name: torch.zeros(g.numel(), dtype=torch.int) for name, g in want.items()}
    for out in outs:
        assert out["owner"] == owners
        for name, offset, grad in out["owned"]:
            flat = want[name].flatten()[offset : offset + grad.numel()]
            torch.testing.assert_close(grad.flatten(), flat, rtol=1e-5, atol=1e-7)
            covered[name][offset : offset + grad.numel()] += 1
            if name in owners:
                assert (
                    owners[name] == out["rank"] and offset == 0 and grad.shape == want[name].shape
                )
    for name, count in covered.items():
        assert torch.equal(count, torch.ones_like(count)), f"{name}: each element owned once"


def _state_report() -> dict:
    ddp, opt = wrapped(mp_policy=mp(torch.bfloat16))
    local_loss(ddp).backward()
    opt.step()
    state = opt.state_dict()["state"]
    return {
        "owned": {s.route.name: s.param.numel() for s in ddp.step_protocol.owned()},
        "numel": {r.name: r.param.numel() for r in ddp.routes},
        "muon": {r.name for r in ddp.routes if r.matrix},
        "state": {
            name: {k: (v.numel(), v.element_size()) for k, v in entry.items() if torch.is_tensor(v)}
            for name, entry in state.items()
        },
    }


@pytest.mark.core
def test_optimizer_state_covers_only_owned_params() -> None:
    outs = run(_state_report, 3)
    owned_elements = dict.fromkeys(outs[0]["numel"], 0)
    total_bytes = 0
    for out in outs:
        assert set(out["state"]) == set(out["owned"])
        for name, tensors in out["state"].items():
            n = out["owned"][name]
            owned_elements[name] += n
            if name in out["muon"]:  # momentum + fp32 master, whole tensors
                assert n == out["numel"][name]
                assert tensors == {"momentum_buffer": (n, 4), "master": (n, 4)}
            else:  # exp_avg + exp_avg_sq + fp32 master of the owned slice, plus the scalar step
                assert tensors == {
                    "step": (1, 4),
                    "exp_avg": (n, 4),
                    "exp_avg_sq": (n, 4),
                    "master": (n, 4),
                }
            total_bytes += sum(numel * size for numel, size in tensors.values())
    assert owned_elements == outs[0]["numel"], "every element is owned by exactly one rank"
    full = sum(outs[0]["numel"].values())
    assert total_bytes < 3.2 * 4 * full, "state is split, not replicated"


@pytest.mark.core
def test_clip_grad_norm_matches_reference() -> None:
    ref = reference_run(STEPS, clip=0.3)
    assert max(ref["norms"]) > 0.3, "clipping must be active for the test to mean anything"
    for out in run(wholeshard_run, 3, STEPS, clip=0.3):
        assert out["norms"] == pytest.approx(ref["norms"], rel=1e-4)
        assert_matches(out, ref, torch.float32)


def _round_trip(steps_before: int, steps_after: int, resume: bool) -> dict:
    model = make_model()
    ddp, opt = wrapped(model, mp_policy=mp(torch.bfloat16))

    def train(steps: range) -> None:
        for step in steps:
            local_loss(ddp, step).backward()
            opt.step()
            opt.zero_grad()

    train(range(steps_before))
    if resume:
        saved_model = {k: v.clone() for k, v in model.state_dict().items()}
        saved_opt = opt.state_dict()
        saved_opt = {
            "state": {
                n: {k: v.clone() for k, v in e.items()} for n, e in saved_opt["state"].items()
            },
            "param_groups": [dict(g) for g in saved_opt["param_groups"]],
        }
        model = make_model(seed=123)  # different init: everything must come from the save
        ddp = wholeshard.DataParallel(model, mp_policy=mp(torch.bfloat16))
        opt = wholeshard.LayerwiseOptimizer(ddp, matrix=dict(MUON_KW, lr=1.0), adamw=ADAMW_KW)
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved_opt)
    train(range(steps_before, steps_before + steps_after))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_state_dict_round_trip_is_bitwise() -> None:
    straight = run(_round_trip, 2, 3, 2, False)
    resumed = run(_round_trip, 2, 3, 2, True)
    for a, b in zip(straight, resumed, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_lr_scheduler_drives_both_groups() -> None:
    model = make_model()
    _, opt = wrapped(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    lm_loss(model, *batch(0)).backward()
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [MUON_KW["lr"] / 2, ADAMW_KW["lr"] / 2]
    assert opt._inner["matrix"].param_groups[0]["lr"] == MUON_KW["lr"] / 2


@pytest.mark.parametrize(
    "ddp_kw",
    [
        dict(shard_group_size=2),
        dict(shard_group_size=2, overlap_grad_reduce=True, overlap_param_gather=True),
        dict(shard_group_size=1),
        dict(strategy="size_match"),
        pytest.param(dict(strategy="owners"), marks=pytest.mark.core),
        dict(strategy="owners", shard_group_size=2, reshard_after_forward=True, **OVERLAP),
    ],
    ids=["k2", "k2-overlap", "k1", "size_match", "owners", "owners-k2-fully-sharded-overlap"],
)
def test_shard_groups_and_strategies_match_reference(ddp_kw: dict) -> None:
    """Owner buckets here hold one matrix each over 4 (or 2) ranks: buckets with fewer
    matrices than ranks, whose other ranks own nothing in them."""
    ref = reference_run(STEPS, clip=0.3)
    outs = run(wholeshard_run, 4, STEPS, clip=0.3, ddp_kw=dict(ddp_kw, bucket_size=3000))
    for out in outs:
        assert_matches(out, ref, torch.float32)
        assert out["norms"] == pytest.approx(ref["norms"], rel=1e-4)
    for out in outs[1:]:
        assert all(torch.equal(out["params"][k], v) for k, v in outs[0]["params"].items())


def test_tied_embedding_costs_no_padding() -> None:
    specs = [
        ParamSpec("emb", (50257, 768), matrix=False, tied=True),
        *(ParamSpec(f"l{i}.w", (768, 768), matrix=True) for i in range(8)),
        *(ParamSpec(f"l{i}.b", (768,), matrix=False) for i in range(8)),
    ]
    plan = plan_exactly(specs, 8, bucket_size=ONE_BUCKET)
    adamw = next(b for b in plan.buffers if b.kind == "adamw")
    assert adamw.numel - adamw.used < 8 * 64 * len(adamw.buckets) + 64 * len(adamw.placements)
    assert plan.padding_fraction < 0.001
