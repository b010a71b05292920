"""dp x ep: `DataParallel(model, mesh=mesh)` over a MoE whose experts are split over
`mesh["ep"]` ([Note: expert parallelism] in `wholeshard.distributed.mesh`): dense params
synced over dp x ep, each expert over its expert-data-parallel ranks, averaged over dp x ep.

Against one process running `torch.optim.Muon` + `torch.optim.AdamW` on the whole MoE, full
batch, at dp x ep = 2 x 2 (and ep alone, hybrid, and beside "tp"), for stacked experts,
`experts.<i>` modules and torchtitan's DTensor stacks; FP8 gather and meta construction bit for
bit; checkpoints from ep 2 at ep 1 and back; refusals on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from moe_support import MoELM, StackedExperts, global_names
from support import (
    ADAMW_KW,
    MUON_KW,
    TOL,
    data_parallel,
    full_params,
    lm_loss,
    local_batch,
    mp,
    rank_world,
    reference_run,
    run,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import wholeshard
from wholeshard import fp8
from wholeshard.distributed.dtensor import is_tensor_parallel
from wholeshard.optim import NorMuon

STEPS, CLIP = 3, 0.5  # clipping: the norms see the gradients' scale, which Muon's update hides
DP_EP, EP_TP = {"dp": 2, "ep": 2}, {"dp": 1, "ep": 2, "tp": 2}


TP_STYLES = {  # on a "tp" dim: the dense params sliced, the experts replicated
    "proj": lambda: ColwiseParallel(output_layouts=Replicate()),
    "moe.router": lambda: RowwiseParallel(input_layouts=Replicate()),
}


def build(layout: str, dims: dict | None, ddp_kw: dict, unused: int | None = None):
    """(model, ddp, batch rank, batch world): the MoE on a mesh of `dims`, its dense params
    parallelized over a "tp" dim by `TP_STYLES` (tp peers see the same tokens); `dims` None:
    the whole MoE on the default group."""
    if dims is None:
        model = MoELM(layout, unused=unused)
        return model, data_parallel(model, **ddp_kw), *rank_world()
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    model = MoELM(layout, mesh["ep"] if layout == "dtensor" else mesh.get_group("ep"), unused)
    data = (dist.get_rank(), dist.get_world_size())
    if "tp" in dims:
        parallelize_module(model, mesh["tp"], {k: style() for k, style in TP_STYLES.items()})
        flat = mesh[tuple(n for n in dims if n != "tp")]._flatten()
        data = (flat.get_local_rank(), flat.size())
    return model, data_parallel(model, mesh=mesh, **ddp_kw), *data


def expert_parallel(
    layout: str, ddp_kw: dict, unused: int | None = None, mesh_dims: dict | None = None
) -> dict:
    """Train on a mesh of `mesh_dims` (default dp 2 x ep 2); this rank's params under their
    names in the whole MoE."""
    model, ddp, rank, world = build(layout, mesh_dims or DP_EP, ddp_kw, unused)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    norms = []
    for step in range(STEPS):
        lm_loss(ddp, *local_batch(step, rank, world)).backward()
        norms.append(opt.clip_grad_norm_(CLIP))
        opt.step()
        opt.zero_grad()
    return held(ddp, model) | {"norms": torch.stack(norms)}


def held(ddp: wholeshard.DataParallel, model: MoELM) -> dict[str, torch.Tensor]:
    """This rank's params by their names in the whole MoE (a tensor-parallel one whole); a
    stack of experts as `name@first`: its rows of the whole stack from `first`."""
    with ddp.full_params():
        params = {
            n: p.full_tensor() if is_tensor_parallel(p) else getattr(p, "_local_tensor", p)
            for n, p in full_params(model).items()
        }
    names = global_names(model)
    out = {names[n]: p for n, p in params.items()}
    if isinstance(model.moe.experts, StackedExperts):
        out = {(f"{n}@{model.moe.first}" if ".experts." in n else n): p for n, p in out.items()}
    return out


def whole(ref: dict[str, torch.Tensor], name: str, local: torch.Tensor) -> torch.Tensor:
    """The reference's value of `name` (`stack@first`: the rows held from `first`)."""
    if "@" not in name:
        return ref[name]
    stack, first = name.split("@")
    return ref[stack][int(first) : int(first) + local.shape[0]]


MODES = {
    "zero": {},
    "overlap": dict(overlap_grad_reduce=True, overlap_param_gather=True),
    "fully_sharded": dict(reshard_after_forward=True, overlap_grad_reduce=True),
    "pipelined": dict(pipelined_step=True, overlap_grad_reduce=True),
    "exchange": dict(strategy="exchange", bucket_size=1, overlap_grad_reduce=True),
}


@pytest.mark.parametrize(
    ("layout", "mode", "dims"),
    [
        ("stacked", "zero", DP_EP),
        ("stacked", "exchange", DP_EP),  # experts and dense params both exchanged
        ("dtensor", "exchange", EP_TP),
        pytest.param("stacked", "overlap", DP_EP, marks=pytest.mark.slow),
        ("modules", "fully_sharded", DP_EP),
        ("stacked", "pipelined", DP_EP),
        ("stacked", "zero", {"dp": 1, "ep": 2}),  # one rank per expert, averaged over 2
        ("modules", "fully_sharded", {"dp_replicate": 2, "dp_shard": 1, "ep": 2}),
        ("dtensor", "fully_sharded", DP_EP),  # torchtitan's experts: DTensors Shard(0) on "ep"
        ("stacked", "zero", EP_TP),  # dense params sliced over "tp", experts replicated on it
        ("dtensor", "pipelined", EP_TP),
        ("modules", "fully_sharded", {"dp": 2, "ep": 2, "tp": 2}),
        pytest.param(
            "stacked",
            "overlap",
            {"dp_replicate": 2, "dp_shard": 1, "ep": 2, "tp": 2},
            marks=pytest.mark.slow,
        ),
    ],
    ids=lambda v: "x".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else v,
)  # modules in ZeRO mode: the test below
def test_dp_x_ep_steps_like_one_process(layout: str, mode: str, dims: dict) -> None:
    done = reference_run(STEPS, make=lambda: MoELM(layout), clip=CLIP)
    ref = done["params"] | {"norms": torch.tensor(done["norms"])}
    outs = run(expert_parallel, math.prod(dims.values()), layout, MODES[mode], mesh_dims=dims)
    worst, seen = 0.0, set()
    for out in outs:
        for name, got in out.items():
            want = whole(ref, name, got)
            assert torch.allclose(got, want, atol=TOL[torch.float32]["atol"], rtol=0), name
            worst = max(worst, (got - want).abs().max().item())
            seen.add(name.split("@")[0])
    assert seen == set(ref)  # every param of the whole MoE is held by some rank
    print(f"{dims}, {layout}, {mode}: max |param diff| vs one process {worst:.3g}")


def test_two_level_groups_of_dp_4_x_ep_2() -> None:
    """The exchange in two levels of 2 ([Note: two-level groups]) at dp 4 x ep 2: the dense
    params' and the experts' groups each reduce within a node, then across nodes."""
    done = reference_run(STEPS, make=lambda: MoELM("stacked"), clip=CLIP, world=8)
    ref = done["params"]
    kw = dict(MODES["exchange"], node_size=2)
    for out in run(expert_parallel, 8, "stacked", kw, mesh_dims={"dp": 4, "ep": 2}):
        for name, got in out.items():
            if name != "norms":
                want = whole(ref, name, got)
                assert torch.allclose(got, want, atol=TOL[torch.float32]["atol"], rtol=0), name


def test_an_expert_no_token_reached_is_not_stepped() -> None:
    """`experts.<i>` modules, ZeRO: expert 3 (on ep rank 1 as `experts.1`) gets no token;
    `experts.1` of ep rank 0 (expert 1) does. Torch's rule, per expert: expert 3 keeps its
    initial values bit for bit; the rest within the reference bounds."""
    done = reference_run(STEPS, make=lambda: MoELM("modules", unused=3), clip=CLIP)
    ref = done["params"] | {"norms": torch.tensor(done["norms"])}
    initial = dict(MoELM("modules").named_parameters())
    outs = run(expert_parallel, 4, "modules", {}, unused=3)
    for out in outs:
        for name, got in out.items():
            assert torch.allclose(got, ref[name], atol=TOL[torch.float32]["atol"], rtol=0), name
            if name.startswith("moe.experts.3."):
                assert torch.equal(got, initial[name]) and torch.equal(ref[name], got), name


def _fp8(gather: bool) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = fp8.convert(MoELM("modules", mesh.get_group("ep")), "tensorwise")
    kw = dict(fp8_param_gather=gather, mp_policy=mp(torch.bfloat16))
    ddp = data_parallel(model, mesh=mesh, **kw)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    for step in range(STEPS):
        lm_loss(ddp, *local_batch(step, dist.get_rank(), dist.get_world_size())).backward()
        opt.step()
        opt.zero_grad()
    assert sum(isinstance(m, fp8.Fp8Linear) for m in model.moe.experts.modules()) == 4
    return held(ddp, model)


def test_fp8_param_gather_of_experts_is_bitwise_quantizing_every_forward() -> None:
    """FP8 linears among the dense params (proj, router) and the experts: gathering them as
    FP8, each over its own group, gives the bits of quantizing every forward."""
    for a, b in zip(run(_fp8, 4, True), run(_fp8, 4, False), strict=True):
        for name in b:
            assert torch.equal(a[name], b[name]), name


def _init(name: str, t: torch.Tensor) -> None:
    """A `param_init`: torch's global RNG (seeded from the name by `DataParallel`)."""
    torch.nn.init.normal_(t, std=0.02) if t.ndim > 1 else torch.nn.init.uniform_(t)


def _from_meta(layout: str, ddp_kw: dict) -> dict[str, torch.Tensor]:
    """The MoE built on the meta device and filled by `param_init`: at dp 2 x ep 2 under a
    process group, else the whole MoE in one process."""
    if not dist.is_initialized():
        with torch.device("meta"):
            model = MoELM(layout)
        return held(wholeshard.DataParallel(model, param_init=_init), model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    with torch.device("meta"):
        model = MoELM(layout, mesh.get_group("ep"))
    return held(data_parallel(model, mesh=mesh, param_init=_init, **ddp_kw), model)


@pytest.mark.parametrize(("layout", "mode"), [("stacked", "zero"), ("modules", "fully_sharded")])
def test_meta_construction_gives_every_expert_the_whole_moes_values(layout, mode) -> None:
    """`param_init` fills an `experts.<i>` module under its name in the whole MoE and a stack
    of experts as its rows of the whole stack: the same bits as one process at ep 1."""
    one = run(_from_meta, 0, layout, {})[0]
    one = {n.split("@")[0]: p for n, p in one.items()}
    for out in run(_from_meta, 4, layout, MODES[mode]):
        for name, got in out.items():
            assert torch.equal(got, whole(one, name, got)), name


NORMUON_KW = dict(lr=0.02, weight_decay=0.01, momentum=0.9, beta2=0.95)


def resumed(layout: str, dims: dict | None, root: str, steps: int, load: bool, save: bool) -> dict:
    """NorMuon (per-row second moments: state a stack keeps per matrix, and a tensor-parallel
    matrix's replica whole) on a mesh of `dims` (None: the whole MoE on 2 ranks); steps
    `[2 if load else 0, ... + steps)`, loading and saving."""
    model, ddp, rank, world = build(layout, dims, {})
    opt = wholeshard.LayerwiseOptimizer(
        ddp, matrix=NORMUON_KW, adamw=ADAMW_KW, matrix_optimizer=NorMuon
    )
    start = 2 if load else 0
    if load:
        wholeshard.load_checkpoint(root, ddp, opt)
    for step in range(start, start + steps):
        lm_loss(ddp, *local_batch(step, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    if save:
        wholeshard.save_checkpoint(root, ddp, opt)
    return held(ddp, model)


@pytest.mark.parametrize(
    ("layout", "dims"),
    [
        ("stacked", DP_EP),
        ("modules", DP_EP),
        pytest.param("dtensor", DP_EP, marks=pytest.mark.slow),
        ("stacked", EP_TP),  # every expert and replicated param written once, by tp rank 0
        pytest.param("modules", EP_TP, marks=pytest.mark.slow),
    ],
    ids=lambda v: "x".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else v,
)  # a DTensor's place: as tensor parallelism's (tests/distributed/test_tensor_parallel.py)
def test_a_checkpoint_from_ep_2_loads_at_ep_1(tmp_path, layout: str, dims: dict) -> None:
    """Saved at `dims` (ep 2) after 2 steps, loaded by the whole MoE on 2 ranks (names and
    stacks renumbered: `ExpertLayout`; tensor-parallel slices joined), one more step: within
    the reference bounds of 3 steps at `dims`; and resumed at `dims`, bitwise the
    uninterrupted run."""
    root = str(tmp_path / "ckpt")
    run(resumed, 4, layout, dims, root, 2, load=False, save=True)
    at_1 = run(resumed, 2, layout, None, root, 1, load=True, save=False)
    again = run(resumed, 4, layout, dims, root, 1, load=True, save=False)
    straight = run(resumed, 4, layout, dims, root, 3, load=False, save=False)
    for a, b in zip(again, straight, strict=True):
        for name in b:
            assert torch.equal(a[name], b[name]), name
    ref, worst = {n.split("@")[0]: p for n, p in at_1[0].items()}, 0.0
    for out in straight:
        for name, got in out.items():
            want = whole(ref, name, got)
            assert torch.allclose(got, want, atol=TOL[torch.float32]["atol"], rtol=0), name
            worst = max(worst, (got - want).abs().max().item())
    print(f"{layout}: {dims} -> ep 1 vs {dims} throughout: max |param diff| {worst:.3g}")


@pytest.mark.parametrize("layout", ["stacked", "dtensor"])
def test_a_checkpoint_of_the_whole_moe_loads_at_ep_2(tmp_path, layout: str) -> None:
    """The reverse: saved by the whole MoE on 2 ranks after 2 steps, loaded at dp 2 x ep 2
    (each rank reads its experts' rows of the whole stacks), one more step: within the
    reference bounds of 3 steps of the whole MoE (measured 6e-8)."""
    root = str(tmp_path / "ckpt")
    run(resumed, 2, layout, None, root, 2, load=False, save=True)
    at_2 = run(resumed, 4, layout, DP_EP, root, 1, load=True, save=False)
    straight = run(resumed, 2, layout, None, root, 3, load=False, save=False)
    ref = {n.split("@")[0]: p for n, p in straight[0].items()}
    for out in at_2:
        for name, got in out.items():
            want = whole(ref, name, got)
            assert torch.allclose(got, want, atol=TOL[torch.float32]["atol"], rtol=0), name


def _refusals() -> list[str]:
    dp_ep = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
    ep_tp = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp", "ep", "tp"))
    cases = [
        dict(mesh=ep_tp),  # an expert sliced by tensor parallelism (below)
        dict(mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_replicate", "ep"))),
        dict(
            mesh=init_device_mesh(
                "cpu", (2, 1, 1), mesh_dim_names=("ep", "dp_replicate", "dp_shard")
            )
        ),
        dict(mesh=dp_ep, param_init=lambda name, t: None),  # with a frozen expert (below)
        dict(mesh=dp_ep, expert_params=lambda name, p: True),
    ]
    said = []
    for case in cases:
        if case["mesh"] is ep_tp:
            model = MoELM("modules", ep_tp.get_group("ep"))
            parallelize_module(model, ep_tp["tp"], {"moe.experts.0.up": ColwiseParallel()})
        else:
            model = MoELM("stacked", dp_ep.get_group("ep"))
            model.moe.experts.down.requires_grad_("param_init" not in case)
        try:
            data_parallel(model, **case)
        except (ValueError, NotImplementedError) as e:
            said.append(f"{type(e).__name__}: {e}")
        else:
            said.append("accepted")
    return said


def test_unusable_expert_meshes_are_refused_on_every_rank() -> None:
    said = run(_refusals, 2)
    assert all(s == said[0] for s in said)
    expected = [
        "NotImplementedError: expert params ['moe.experts.0.up.weight'] are sliced by tensor "
        "parallelism: experts are split over 'ep' and replicated over 'tp'",
        "ValueError: the mesh ('dp_replicate', 'ep'): with 'ep' name 'dp'",
        "put 'ep' after 'dp_replicate'",
        "NotImplementedError: param_init (meta-device construction) with experts that are "
        "DTensors or frozen",
        "every trainable param is an expert's",
    ]
    for got, want in zip(said[0], expected, strict=True):
        assert want in got, (want, got)
