"""dp x tp: `DataParallel(model, mesh=mesh)` over a model `parallelize_module` made tensor
parallel on `mesh["tp"]`: each DTensor param's local shard lives in the buffers, and
`LayerwiseOptimizer` steps Muon on the logical matrices ([Note: tensor-parallel Muon]).

Against one process running `torch.optim.Muon` + `torch.optim.AdamW` on the unsharded model,
full batch, at dp x tp = 2 x 2 and 1 x 2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import ADAMW_KW, MUON_KW, TOL, batch, data_parallel, local_batch, run
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import wholeshard
from wholeshard.models.gpt import GPT, GPTConfig, parallelize_blocks
from wholeshard.optim import SOAP, NorMuon
from wholeshard.planning.routing import route_params

STEPS, BATCH = 3, 8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(16, 32)  # its bias: sliced like the weight's rows (1-D, AdamW)
        self.down = nn.Linear(32, 16)  # its bias: replicated
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(F.gelu(self.up(x))))


def data(step: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch, 16, generator=g), torch.randn(batch, 16, generator=g)


def logical_params(ddp: wholeshard.DataParallel) -> dict[str, torch.Tensor]:
    """Every param of the wrapped model, whole (a DTensor's full tensor: collective over tp)."""
    with ddp.full_params():
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in ddp.module.named_parameters()
        }


class SubclassedMuon(torch.optim.Muon):
    """torch's Muon under another class: `LayerwiseOptimizer` steps it on replicas."""


RULES = {  # matrix rules, each with its kwargs
    "muon": (torch.optim.Muon, MUON_KW),
    "subclassed": (SubclassedMuon, MUON_KW),
    "normuon": (NorMuon, dict(lr=0.02, weight_decay=0.01, beta2=0.95)),  # per-row moments
    # Kronecker factors, of the 16-long sides only: a factor of rank below its size (a 32-long
    # side's, or any from fewer than 16 samples) has a degenerate eigenspace whose basis comes
    # from rounding (tests/optim/test_soap.py), hence SOAP's batch of 32 below
    "soap": (SOAP, dict(lr=3e-3, precondition_frequency=2, max_precond_dim=16)),
}


def reference(
    clip: float | None = None, rule: str = "muon", batch: int = BATCH
) -> dict[str, torch.Tensor]:
    model = MLP()
    matrices = [model.up.weight, model.down.weight]
    others = [p for p in model.parameters() if p.ndim < 2]
    cls, kw = RULES[rule]
    opts = [cls(matrices, **kw), torch.optim.AdamW(others, **ADAMW_KW)]
    norms = []
    for step in range(STEPS):
        x, y = data(step, batch)
        F.mse_loss(model(x), y).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out | ({"norms": torch.stack(norms)} if norms else {})


def tensor_parallel(
    dp: int,
    tp_mode: str,
    ddp_kw: dict,
    clip: float | None = None,
    hybrid: bool = False,
    rule: str = "muon",
    batch: int = BATCH,
) -> dict[str, torch.Tensor]:
    """Train on `dp` data-parallel ranks (`hybrid`: dp_replicate 2 x dp_shard 2) x tp 2 with
    `RULES[rule]`, on global batches of `batch`."""
    if hybrid:
        names = ("dp_replicate", "dp_shard", "tp")
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
    else:
        mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    model = MLP()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    ddp = data_parallel(model, mesh=mesh, **ddp_kw)
    cls, kw = RULES[rule]
    opt = wholeshard.LayerwiseOptimizer(
        ddp, matrix=kw, adamw=ADAMW_KW, tp_mode=tp_mode, matrix_optimizer=cls
    )
    rank = (
        mesh["dp_replicate", "dp_shard"]._flatten().get_local_rank()
        if hybrid
        else mesh.get_local_rank("dp")
    )
    rows = slice(rank * batch // dp, (rank + 1) * batch // dp)
    norms = []
    for step in range(STEPS):
        x, y = data(step, batch)
        F.mse_loss(ddp(x[rows]), y[rows]).backward()
        if clip is not None:
            norms.append(opt.clip_grad_norm_(clip))
        opt.step()
        opt.zero_grad()
    return logical_params(ddp) | ({"norms": torch.stack(norms)} if norms else {})


MODES = {"zero": {}, "fully_sharded": dict(reshard_after_forward=True, overlap_grad_reduce=True)}


def worst_diff(outs: list[dict], ref: dict[str, torch.Tensor]) -> float:
    """Every rank's params are the same model, each within the reference bounds of `ref`;
    returns the largest difference."""
    worst = 0.0
    for out in outs:
        for name, want in ref.items():
            assert torch.equal(out[name], outs[0][name]), name
            assert torch.allclose(out[name], want, atol=TOL[torch.float32]["atol"], rtol=0), name
            worst = max(worst, (out[name] - want).abs().max().item())
    return worst


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("tp_mode", ["duplicated", "distributed"])
@pytest.mark.parametrize("dp", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_dp_x_tp_steps_like_one_process(dp: int, tp_mode: str, mode: str) -> None:
    ref = reference()
    outs = run(tensor_parallel, 2 * dp, dp, tp_mode, MODES[mode])
    worst = worst_diff(outs, ref)
    print(f"dp {dp} x tp 2, {tp_mode}, {mode}: max |param diff| vs one process {worst:.3g}")


MORE = {
    "pipelined": dict(pipelined_step=True, overlap_grad_reduce=True),
    "overlapped_gathers": dict(overlap_grad_reduce=True, overlap_param_gather=True),
    "owners": dict(strategy="owners", bucket_size=1),
    "exchange": dict(strategy="exchange", bucket_size=1),
    "exchange-pipelined": dict(strategy="exchange", pipelined_step=True, exchange_every=1),
}


@pytest.mark.parametrize("mode", sorted(MORE))
def test_dp_x_tp_in_other_modes(mode: str) -> None:
    ref = reference()
    for out in run(tensor_parallel, 4, 2, "duplicated", MORE[mode]):
        for name, want in ref.items():
            assert torch.allclose(out[name], want, atol=TOL[torch.float32]["atol"], rtol=0), name


def test_hybrid_dp_x_tp_on_8_ranks() -> None:
    """dp_replicate 2 x dp_shard 2 x tp 2: hybrid sharding of the slices."""
    ref = reference()
    kw = dict(reshard_after_forward=True)
    for out in run(tensor_parallel, 8, 4, "duplicated", kw, hybrid=True):
        for name, want in ref.items():
            assert torch.allclose(out[name], want, atol=TOL[torch.float32]["atol"], rtol=0), name


def test_two_level_groups_of_the_data_parallel_dim_on_8_ranks() -> None:
    """dp 4 in two levels of 2 ([Note: two-level groups]) x tp 2: the data-parallel group is a
    strict subgroup, whose node and cross groups its ranks make alone."""
    ref = reference()
    kw = dict(MORE["exchange"], node_size=2)
    for out in run(tensor_parallel, 8, 4, "duplicated", kw):
        for name, want in ref.items():
            assert torch.allclose(out[name], want, atol=TOL[torch.float32]["atol"], rtol=0), name


@pytest.mark.parametrize("mode", sorted(MODES))
def test_clipping_counts_each_slice_once(mode: str) -> None:
    """The global norm sums the slices of sharded params over tp and counts replicated ones
    once: `clip_grad_norm_` returns torch's total norm and clips (max_norm below it)."""
    ref = reference(clip=0.5)
    assert (ref["norms"] > 0.5).all()
    for out in run(tensor_parallel, 4, 2, "duplicated", MODES[mode], clip=0.5):
        assert torch.allclose(out["norms"], ref["norms"], rtol=1e-5, atol=0), out["norms"]
        for name, want in ref.items():
            assert torch.allclose(out[name], want, atol=TOL[torch.float32]["atol"], rtol=0), name


@pytest.mark.parametrize(
    ("rule", "mode"),
    [("normuon", "zero"), ("soap", "fully_sharded"), ("normuon", "pipelined")],
)
def test_other_rules_step_replicas_of_the_logical_matrices(rule: str, mode: str) -> None:
    """NorMuon (per-row moments) and SOAP (Kronecker factors) at dp 2 x tp 2: every tp rank
    steps a replica of each logical matrix ([Note: replicas of tensor-parallel matrices]); the
    update is one process's with the same rule, within the reference bounds."""
    batch = 32 if rule == "soap" else BATCH
    ref = reference(rule=rule, batch=batch)
    outs = run(tensor_parallel, 4, 2, "duplicated", (MODES | MORE)[mode], rule=rule, batch=batch)
    worst = worst_diff(outs, ref)
    print(f"{rule} dp 2 x tp 2, {mode}: max |param diff| vs one process {worst:.3g}")


def _refusals(tmp: str) -> list[str]:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))

    def parallel() -> MLP:
        model = MLP()
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        return parallelize_module(model, mesh["tp"], plan)

    said = []
    for attempt in (
        lambda: wholeshard.DataParallel(parallel()),  # no mesh
        lambda: wholeshard.LayerwiseOptimizer(
            wholeshard.DataParallel(parallel(), mesh=mesh),
            matrix_optimizer=NorMuon,
            tp_mode="distributed",
        ),
        lambda: wholeshard.LayerwiseOptimizer(
            wholeshard.DataParallel(parallel(), mesh=mesh), offload_state=True
        ),
    ):
        try:
            attempt()
            said.append("accepted")
        except (ValueError, NotImplementedError) as e:
            said.append(f"{type(e).__name__}: {e}")
    return said


def test_what_tensor_parallelism_does_not_support_yet_is_refused(tmp_path) -> None:
    for said in run(_refusals, 2, str(tmp_path)):
        assert "ValueError: 'up.weight' is a DTensor" in said[0] and "mesh=mesh" in said[0]
        assert "NotImplementedError: tp_mode='distributed' with NorMuon" in said[1]
        assert "NotImplementedError: offload_state=True does not support tensor-par" in said[2]


# -- the byte GPT: attention and MLP in torch's TP styles ----------------------------------------

GPT_CFG = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=8)


def gpt_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))


def gpt_reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    routes = route_params(model)
    opts = [
        torch.optim.Muon([r.param for r in routes if r.matrix], **MUON_KW),
        torch.optim.AdamW([r.param for r in routes if not r.matrix], **ADAMW_KW),
    ]
    for step in range(STEPS):
        gpt_loss(model, *batch(step)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def gpt_tensor_parallel(ddp_kw: dict) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    parallelize_blocks(model, mesh["tp"])  # models.gpt.BLOCK_TP_STYLES
    ddp = data_parallel(model, mesh=mesh, **ddp_kw)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    for step in range(STEPS):
        gpt_loss(ddp, *local_batch(step, mesh.get_local_rank("dp"), 2)).backward()
        opt.step()
        opt.zero_grad()
    return logical_params(ddp)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_gpt_attention_and_mlp_in_tp_styles(mode: str) -> None:
    """The byte GPT (rotary attention, tied embedding) at dp 2 x tp 2: each rank computes its
    heads and its slice of the MLP; the update is one process's."""
    ref = gpt_reference()
    for out in run(gpt_tensor_parallel, 4, MODES[mode]):
        worst = 0.0
        for name, want in ref.items():
            assert torch.allclose(out[name], want, atol=TOL[torch.float32]["atol"], rtol=0), name
            worst = max(worst, (out[name] - want).abs().max().item())
    print(f"GPT dp 2 x tp 2, {mode}: max |param diff| vs one process {worst:.3g}")


# -- checkpoints across meshes ---------------------------------------------------------------


def mesh_run(
    dp: int, tp: int, save: str | None = None, load: str | None = None, rule: str = "muon"
) -> dict[str, torch.Tensor] | None:
    """The MLP at dp x tp (tp 1: a plain model) with `RULES[rule]`: with `save`, 2 steps then
    a checkpoint there (returns None); with `load`, that checkpoint then the last step; else
    every step."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = MLP()
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    ddp = wholeshard.DataParallel(model, mesh=mesh)
    cls, kw = RULES[rule]
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=kw, adamw=ADAMW_KW, matrix_optimizer=cls)
    start = 0
    if load is not None:
        wholeshard.load_checkpoint(load, ddp, opt)
        start = opt.steps
    rank = mesh.get_local_rank("dp")
    rows = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp)
    for step in range(start, STEPS):
        if save is not None and step == STEPS - 1:
            wholeshard.save_checkpoint(save, ddp, opt)
            return None
        x, y = data(step)
        F.mse_loss(ddp(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    return logical_params(ddp)


@pytest.mark.parametrize(
    "saved, loaded", [((2, 2), (4, 1)), ((2, 2), (1, 2)), ((4, 1), (2, 2)), ((2, 2), (2, 2))]
)
def test_checkpoint_loads_at_another_mesh(tmp_path, saved, loaded) -> None:
    """Each element is written once, at its place in the logical tensor (a tensor-parallel
    slice shifted by its offset, replicated params by tp rank 0), so any (dp, tp) reads it."""
    path = str(tmp_path / "ckpt")
    run(mesh_run, saved[0] * saved[1], *saved, save=path)
    outs = run(mesh_run, loaded[0] * loaded[1], *loaded, load=path)
    ref = reference()
    for out in outs:
        for name, want in ref.items():
            assert torch.allclose(out[name], want, atol=TOL[torch.float32]["atol"], rtol=0), name
    if saved == loaded:  # the same mesh resumes bit for bit
        straight = run(mesh_run, 4, *saved)
        for name, want in straight[0].items():
            assert torch.equal(outs[0][name], want), name


@pytest.mark.parametrize("saved, loaded", [((2, 2), (4, 1)), ((4, 1), (2, 2)), ((2, 2), (2, 2))])
def test_replica_state_loads_at_another_mesh(tmp_path, saved, loaded) -> None:
    """NorMuon's per-row moments of a tensor-parallel matrix are the logical matrix's, written
    once, whole ([Note: replicas of tensor-parallel matrices]): a checkpoint from (2, 2) loads
    in a plain model and back, within the reference bounds; at (2, 2) bit for bit."""
    path = str(tmp_path / "ckpt")
    run(mesh_run, saved[0] * saved[1], *saved, save=path, rule="normuon")
    outs = run(mesh_run, loaded[0] * loaded[1], *loaded, load=path, rule="normuon")
    ref = reference(rule="normuon")
    for out in outs:
        for name, want in ref.items():
            assert torch.allclose(out[name], want, atol=TOL[torch.float32]["atol"], rtol=0), name
    if saved == loaded:
        straight = run(mesh_run, 4, *saved, rule="normuon")
        for name, want in straight[0].items():
            assert torch.equal(outs[0][name], want), name


def test_replicas_do_the_sliced_muons_arithmetic() -> None:
    """torch's Muon stepping replicas of the logical matrices takes the same bits as
    `wholeshard.optim.Muon` orthogonalizing the gathered slices ("duplicated"): the replicas'
    gathers, the update and the slices kept back add nothing of their own."""
    replicas = run(tensor_parallel, 4, 2, "duplicated", {}, rule="subclassed")
    sliced = run(tensor_parallel, 4, 2, "duplicated", {})
    for a, b in zip(replicas, sliced, strict=True):
        for name in b:
            assert torch.equal(a[name], b[name]), name


def _skip_on_one_tp_rank() -> tuple[int, int]:
    """An inf in the averaged gradient of one tensor-parallel slice only (tp rank 0's)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = MLP()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    ddp = wholeshard.DataParallel(model, mesh=mesh)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW, nonfinite="skip")
    for step in range(2):
        x, y = data(step)
        F.mse_loss(ddp(x[:4]), y[:4]).backward()
        ddp.step_protocol.finish_grad_sync()
        if step == 0 and mesh.get_local_rank("tp") == 0:
            for piece in opt.owned_pieces():
                if piece.name == "up.weight":
                    piece.grad.view(-1)[0] = float("inf")
        opt.step()
        opt.zero_grad()
    return opt.skipped_steps, opt.steps


def test_a_nonfinite_slice_skips_the_step_on_every_tp_rank() -> None:
    """The step check spans dp x tp: the tp peer whose slice is finite skips too (stepping
    alone, its Newton–Schulz all-gather would wait for a peer that never comes)."""
    assert run(_skip_on_one_tp_rank, 4) == [(1, 2)] * 4


# -- row blocks (ns_split) of tensor-parallel matrices --------------------------------------------


def blocks_reference(name: str = "up") -> dict[str, torch.Tensor]:
    """One process: `<name>.weight` stepped as 8-row matrices (row views of it), the rest as in
    `reference`."""
    model = MLP()
    weight = getattr(model, name).weight
    blocks = list(weight.detach().split(8))  # leaf views of the param's rows
    others = [p for p in model.parameters() if p.ndim < 2]
    whole = [p for p in (model.up.weight, model.down.weight) if p is not weight]
    opts = [
        torch.optim.Muon([*blocks, *whole], **MUON_KW),
        torch.optim.AdamW(others, **ADAMW_KW),
    ]
    for step in range(STEPS):
        x, y = data(step)
        F.mse_loss(model(x), y).backward()
        for view, grad in zip(blocks, weight.grad.split(8), strict=True):
            view.grad = grad
        weight.grad = None
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _blocks(sizes: dict[str, list[int]]) -> dict[str, torch.Tensor] | str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = MLP()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    ddp = wholeshard.DataParallel(model, mesh=mesh)
    try:
        opt = wholeshard.LayerwiseOptimizer(
            ddp, matrix=MUON_KW, adamw=ADAMW_KW, ns_split=lambda name, p: sizes.get(name)
        )
    except NotImplementedError as e:
        return str(e)
    rank = mesh.get_local_rank("dp")
    for step in range(STEPS):
        x, y = data(step)
        F.mse_loss(ddp(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]).backward()
        opt.step()
        opt.zero_grad()
    return logical_params(ddp)


@pytest.mark.parametrize("name", ["up", "down"], ids=["colwise", "rowwise"])
def test_row_blocks_of_tensor_parallel_matrices(name: str) -> None:
    """8-row blocks: of a ColwiseParallel weight (16 rows a rank), each rank steps its own
    blocks alone; of a RowwiseParallel one (all rows, half the columns a rank), each block is
    a tensor-parallel matrix of its own (a block TP-sharded). Against one process stepping the
    blocks as separate params."""
    ref = blocks_reference(name)
    rows = {"up": 32, "down": 16}[name]
    worst = 0.0
    for out in run(_blocks, 4, {f"{name}.weight": [8] * (rows // 8)}):
        for key, want in ref.items():
            assert torch.allclose(out[key], want, atol=TOL[torch.float32]["atol"], rtol=0), key
            worst = max(worst, (out[key] - want).abs().max().item())
    whole = reference()[f"{name}.weight"]
    assert not torch.allclose(ref[f"{name}.weight"], whole, atol=TOL[torch.float32]["atol"], rtol=0)
    print(f"8-row blocks of {name}.weight at dp 2 x tp 2: max |param diff| {worst:.3g}")


def test_row_blocks_across_slices_are_refused_on_every_rank() -> None:
    for said in run(_blocks, 4, {"up.weight": [12, 20]}):
        assert isinstance(said, str) and "must each lie within one rank's slice of rows" in said
