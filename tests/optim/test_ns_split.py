"""Row blocks (`LayerwiseOptimizer(ns_split=)`) step exactly like separate matrices.

A fused weight split into row blocks must train bit for bit like the same model with one layer
per block: Newton–Schulz, Muon's shape scaling and per-matrix state see each block alone. The
tests feed exact gradients (the gradient of `sum(W * G)` is `G`), so the fused and the separate
model get the same gradient bits, and compare the trained weights with `torch.equal`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import data_parallel, mp, run
from torch import nn

import wholeshard
from wholeshard.optim import NorMuon, split_heads, split_qkv
from wholeshard.optim.ns_split import row_blocks
from wholeshard.planning.routing import route_params

IN, HEADS, KV_HEADS, HEAD_DIM, STEPS = 32, 4, 2, 8, 4
QKV = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]  # GQA: q, k, v rows
MUON = dict(lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
SPLIT = split_qkv(HEADS, KV_HEADS, HEAD_DIM)


def conv1d():
    transformers = pytest.importorskip("transformers")
    return transformers.pytorch_utils.Conv1D


class Attn(nn.Module):
    """Holds the projection; `forward(grad)` is `sum(W * grad)` over its (..., out, in) weight
    (the params are used inside this module's forward, as fully sharded mode needs)."""

    def __init__(self, weight) -> None:
        super().__init__()
        self.weight = weight  # () -> the (..., out, in) weight

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        w = self.weight()
        return (w * grad.to(w.dtype)).sum()


class Fused(nn.Module):
    """One attention input projection `attn.<name>` holding every block's rows (stacked over
    `experts` matrices when given); `stored="in_out"` keeps it (in, out), as transformers'
    Conv1D does. `forward(grad)` is the loss `sum(W * grad)` (plus a norm's, for AdamW)."""

    def __init__(self, name: str, blocks: list[int], experts: int = 0, stored: str = "out_in"):
        super().__init__()
        torch.manual_seed(0)
        weight = torch.randn(*([experts] if experts else []), sum(blocks), IN) * 0.1
        self.attn = Attn(self.weight)
        if stored == "in_out":
            layer = conv1d()(sum(blocks), IN)
            layer.weight.data.copy_(weight.T)
            self.attn.add_module(name, layer)
        else:
            self.attn.register_parameter(name, nn.Parameter(weight))
        self.name, self.stored, self.norm = name, stored, nn.LayerNorm(IN)

    def weight(self) -> torch.Tensor:
        """The weight as (..., out, in)."""
        part = getattr(self.attn, self.name)
        return part.weight.T if self.stored == "in_out" else part

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        return self.attn(grad) + self.norm(torch.ones(1, IN, dtype=self.norm.weight.dtype)).sum()


class Separate(Fused):
    """The same rows as one param per block (`attn.part0`, `attn.part1`, ...)."""

    def __init__(self, blocks: list[int], experts: int = 0):
        nn.Module.__init__(self)
        torch.manual_seed(0)
        weight = torch.randn(*([experts] if experts else []), sum(blocks), IN) * 0.1
        self.attn = Attn(self.weight)
        for i, w in enumerate(weight.split(blocks, dim=-2)):
            self.attn.register_parameter(f"part{i}", nn.Parameter(w.clone()))
        self.blocks, self.norm = len(blocks), nn.LayerNorm(IN)

    def weight(self) -> torch.Tensor:
        return torch.cat([getattr(self.attn, f"part{i}") for i in range(self.blocks)], dim=-2)


def train(
    model: nn.Module,
    *,
    ns_split=None,
    optimizer=torch.optim.Muon,
    matrix=MUON,
    ckpt: str | None = None,
    load: bool = False,
    stop_after_save: bool = False,
    rank_scaled: bool = True,
    **config,
) -> torch.Tensor | None:
    """STEPS steps on gradients G_step * (rank + 1) (`rank_scaled=False`: G_step on every rank,
    whose average is G_step at any world size); returns the trained (..., out, in) weight.
    With `ckpt`: saved there halfway and reloaded into a fresh optimizer (`stop_after_save`:
    return None once saved; `load`: loaded from there halfway, without saving)."""
    ddp = data_parallel(model, **config)

    def optimizer_():
        kw = dict(matrix=matrix, ns_split=ns_split, matrix_optimizer=optimizer)
        return wholeshard.LayerwiseOptimizer(ddp, **kw)

    opt = optimizer_()
    rank = dist.get_rank() if dist.is_initialized() else 0
    with ddp.full_params():
        shape = model.weight().shape
    for step in range(STEPS):
        if ckpt is not None and step == STEPS // 2:
            if not load:
                wholeshard.save_checkpoint(ckpt, ddp, opt)
            if stop_after_save:
                return None
            opt = optimizer_()
            wholeshard.load_checkpoint(ckpt, ddp, opt)
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(step))
        grad = grad * (rank + 1) if rank_scaled else grad
        model(grad).backward()
        opt.step()
        opt.zero_grad()
    with ddp.full_params():
        return model.weight().detach().float().clone()


def _fused(name, blocks, split, experts=0, stored="out_in", **kw):
    return train(Fused(name, blocks, experts, stored), ns_split=split, **kw)


def _separate(blocks, experts=0, **kw):
    return train(Separate(blocks, experts), **kw)


@pytest.mark.parametrize("nproc", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qkv_steps_like_three_projections(nproc: int, dtype: torch.dtype) -> None:
    fused = run(_fused, nproc, "qkv_proj", QKV, SPLIT, mp_policy=mp(dtype))[0]
    separate = run(_separate, nproc, QKV, mp_policy=mp(dtype))[0]
    whole = run(_fused, nproc, "qkv_proj", QKV, None, mp_policy=mp(dtype))[0]
    assert torch.equal(fused, separate)
    assert not torch.equal(fused, whole)  # the split changed the update


def test_conv1d_fused_qkv_steps_like_three_linear_projections() -> None:
    """GPT-2's `c_attn`: stored (in, out), its (out, in) rows q | k | v (bf16, fp32 masters)."""
    blocks = [HEADS * HEAD_DIM] * 3
    split = split_qkv(HEADS, HEADS, HEAD_DIM)
    fused = run(_fused, 2, "c_attn", blocks, split, stored="in_out", mp_policy=mp(torch.bfloat16))
    assert torch.equal(fused[0], run(_separate, 2, blocks, mp_policy=mp(torch.bfloat16))[0])


@pytest.mark.parametrize("experts", [0, 3])
def test_per_head_steps_like_separate_heads(experts: int) -> None:
    """`split_heads` on a q projection, alone and as a stack of expert matrices (E, out, in)."""
    blocks = [HEAD_DIM] * HEADS
    split = split_heads(HEAD_DIM)
    fused = run(_fused, 2, "q", blocks, split, experts=experts)[0]
    assert torch.equal(fused, run(_separate, 2, blocks, experts=experts)[0])


MODES = {
    "fully_sharded": dict(reshard_after_forward=True),
    "overlap": dict(overlap_grad_reduce=True, overlap_param_gather=True),
    "pipelined": dict(pipelined_step=True, overlap_grad_reduce=True),
    "owners": dict(strategy="owners", bucket_size=1),
    "shard_groups": dict(shard_group_size=2),
    "legacy": dict(layout="ping_pong"),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_steps_blocks_like_separate_matrices(mode: str) -> None:
    nproc = 4 if mode == "shard_groups" else 3
    kw = dict(mp_policy=mp(torch.bfloat16), **MODES[mode])
    fused = run(_fused, nproc, "qkv_proj", QKV, SPLIT, **kw)
    separate = run(_separate, nproc, QKV, **kw)
    for got in fused:
        assert torch.equal(got, separate[0])


NORMUON = dict(lr=0.02, weight_decay=0.01)


def _resumed(nproc_save: int, path: str, split=SPLIT) -> torch.Tensor:
    """Save at `nproc_save` ranks halfway, then continue in one process from the checkpoint."""
    kw = dict(optimizer=NorMuon, matrix=NORMUON, ckpt=path, rank_scaled=False)
    run(_fused, nproc_save, "qkv_proj", QKV, SPLIT, stop_after_save=True, **kw)
    return run(_fused, 0, "qkv_proj", QKV, split, load=True, **kw)[0]


def test_checkpoint_of_blocks_loads_at_another_world_size(tmp_path) -> None:
    """NorMuon keeps a second moment per row block (not element-wise): saved per block at 2
    ranks, it resumes in one process bit for bit like an uninterrupted run."""
    kw = dict(optimizer=NorMuon, matrix=NORMUON, rank_scaled=False)
    straight = run(_fused, 0, "qkv_proj", QKV, SPLIT, **kw)[0]
    assert torch.equal(_resumed(2, str(tmp_path / "ckpt")), straight)
    separate = run(_separate, 0, QKV, **kw)[0]
    assert torch.equal(straight, separate)


def test_checkpoint_saved_with_blocks_needs_the_same_split(tmp_path) -> None:
    with pytest.raises(wholeshard.CheckpointError, match="saved with row blocks"):
        _resumed(2, str(tmp_path / "ckpt"), split=None)
    with pytest.raises(wholeshard.CheckpointError, match="saved with other row blocks"):
        _resumed(2, str(tmp_path / "ckpt2"), split=split_heads(HEAD_DIM))


def _momentum(path: str, split) -> dict[str, torch.Tensor]:
    ddp = wholeshard.DataParallel(Fused("qkv_proj", QKV))
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON, ns_split=split)
    wholeshard.load_checkpoint(path, ddp, opt)
    return {k: v["momentum_buffer"] for k, v in opt.state_dict()["state"].items() if "qkv" in k}


def test_muon_state_is_elementwise_and_loads_with_or_without_the_split(tmp_path) -> None:
    """Muon's momentum is element-wise: saved per block, it is the whole matrix's momentum."""
    path = str(tmp_path / "ckpt")
    run(_fused, 2, "qkv_proj", QKV, SPLIT, ckpt=path, stop_after_save=True)
    whole = _momentum(path + "/step-2", None)
    blocks = _momentum(path + "/step-2", SPLIT)
    assert list(blocks) == [f"attn.qkv_proj[{a}:{b}]" for a, b in ((0, 32), (32, 48), (48, 64))]
    assert torch.equal(whole["attn.qkv_proj"], torch.cat(list(blocks.values())))


# -- the helpers and bad input ------------------------------------------------------------------


def test_split_qkv_layouts() -> None:
    meta = torch.empty((4 + 2 * 2) * 8, 16, device="meta")
    qkv = split_qkv(4, 2, 8)
    assert qkv("h.0.attn.c_attn.weight", meta) == [32, 16, 16]
    assert qkv("layers.0.attention.query_key_value.weight", meta) == [16, 8, 8] * 2  # grouped
    assert qkv("h.0.mlp.c_fc.weight", meta) is None
    grouped = split_qkv(4, 2, 8, layout="grouped")
    assert grouped("x.qkv_proj.weight", meta) == [16, 8, 8, 16, 8, 8]
    neox = split_qkv(4, 4, 8)  # one query head per group: per-head q, k and v
    assert (
        neox(
            "gpt_neox.layers.0.attention.query_key_value.weight", torch.empty(96, 16, device="meta")
        )
        == [8] * 12
    )
    assert split_heads(8)("blocks.0.attn.q.weight", meta) == [8] * 8
    assert split_heads(8)("blocks.0.mlp.up.weight", meta) is None


def test_split_helpers_refuse_wrong_shapes_and_arguments() -> None:
    meta = torch.empty(50, 16, device="meta")
    with pytest.raises(ValueError, match="has 50 rows"):
        split_qkv(4, 2, 8)("attn.qkv_proj.weight", meta)
    with pytest.raises(ValueError, match="not a multiple of head_dim 8"):
        split_heads(8)("attn.q.weight", meta)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        split_qkv(4, 3, 8)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        split_heads(0)
    with pytest.raises(ValueError, match="layout"):
        split_qkv(4, 2, 8, layout="interleaved")


def test_row_blocks_are_checked_and_see_the_out_in_shape() -> None:
    model = Fused("c_attn", QKV, stored="in_out")
    routes = route_params(model)
    seen = {}

    def record(name, param):
        seen[name] = (tuple(param.shape), param.device.type)
        return [32, 32]

    assert row_blocks(routes, record) == {"attn.c_attn.weight": (0, 32, 64)}
    assert seen == {"attn.c_attn.weight": ((64, IN), "meta")}
    for bad in ([32, 31], [64, 0], [32.0, 32]):
        with pytest.raises(ValueError, match="positive ints summing to its 64 rows"):
            row_blocks(routes, lambda n, p, bad=bad: bad)
    with pytest.raises(TypeError, match="ns_split must be a function"):
        row_blocks(routes, [32, 32])
    assert row_blocks(routes, lambda n, p: [64]) == {}  # one block: whole


def test_bad_split_raises_on_every_rank() -> None:
    def build():
        ddp = wholeshard.DataParallel(Fused("qkv_proj", QKV))
        try:
            wholeshard.LayerwiseOptimizer(ddp, ns_split=lambda n, p: [1, 2])
        except ValueError as e:
            return str(e)
        return None

    assert all("positive ints summing" in (e or "") for e in run(build, 2))
