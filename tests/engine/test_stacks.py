"""Stacked Muon params (fused MoE experts): planning, training and checkpoints.

A 3-D Muon param is a stack of matrices: the planner spreads its matrices over ranks (each
matrix whole in one shard), and the optimizer steps each matrix as `torch.optim.Muon` would step
that expert's 2-D slice as a param of its own (the reference in `support.reference_run`).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import (
    DIM,
    VOCAB,
    assert_bitwise_equal,
    assert_matches,
    assert_overlap_equals_sync,
    mp,
    reference_run,
    run,
    train_part,
    wholeshard_run,
)
from torch import nn

from wholeshard.planning import ONE_BUCKET, Buffer, ParamSpec, plan_exactly
from wholeshard.planning.specs import Bucket, Placement, matrices, ns_cost

EXPERTS, HIDDEN = 4, 16


class Experts(nn.Module):
    """Fused experts as transformers 5 stores them: (E, 2H, D) and (E, D, H), (out, in) each."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * HIDDEN, DIM) / math.sqrt(DIM))
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / math.sqrt(HIDDEN))

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("btd,ehd->bteh", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("bteh,edh->bted", nn.functional.silu(gate) * up, self.down_proj)
        return torch.einsum("bted,bte->btd", y, weights)


class MoELM(nn.Module):
    """Embedding, dense-gated MoE blocks (the router is a bare 2-D param), norm, head."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.routers = nn.ParameterList(
            nn.Parameter(torch.randn(EXPERTS, DIM) * 0.1) for _ in range(layers)
        )
        self.experts = nn.ModuleList(Experts() for _ in range(layers))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for router, experts in zip(self.routers, self.experts, strict=True):
            # sigmoid gates: a softmax router's gradient has a null direction (rows sum to 0)
            # whose rounding noise Newton-Schulz amplifies, so summation order would show
            x = x + experts(x, torch.sigmoid(x @ router.T))
        return self.head(self.ln(x))


def make_moe() -> nn.Module:
    torch.manual_seed(0)
    return MoELM()


def test_routing_sends_stacks_and_router_to_muon() -> None:
    from wholeshard import route_params

    muon = {r.name for r in route_params(make_moe()) if r.matrix}
    assert muon == {
        "routers.0",
        "routers.1",
        *(f"experts.{i}.{n}" for i in range(2) for n in ("gate_up_proj", "down_proj")),
    }


@pytest.mark.parametrize("nproc", [0, 2, 3])
def test_stacked_experts_match_per_expert_muon(nproc: int) -> None:
    ref = reference_run(4, make=make_moe)
    out = run(wholeshard_run, nproc, 4, make=make_moe, ddp_kw=dict(bucket_size=1500))[0]
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_overlap_equals_sync_bitwise(dtype: torch.dtype) -> None:
    assert_overlap_equals_sync(2, 3, dict(bucket_size=1500), make=make_moe, param_dtype=dtype)


def _zero_and_fully_sharded(dtype: torch.dtype) -> dict:
    import wholeshard

    kw = dict(make=make_moe, param_dtype=dtype, evaluate=True)
    zero = wholeshard_run(3, ddp_kw=dict(bucket_size=1500), **kw)
    fs = wholeshard_run(3, ddp_kw=dict(bucket_size=1500, reshard_after_forward=True), **kw)
    ddp = wholeshard.DataParallel(make_moe(), bucket_size=1500, reshard_after_forward=True)
    return {"zero": zero, "fs": fs, "parts": max(len(b.buckets) for b in ddp.units)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_fully_sharded_equals_zero_bitwise(dtype: torch.dtype) -> None:
    for out in run(_zero_and_fully_sharded, 2, dtype):
        assert out["parts"] > 1, "a stack spans planned buckets: they share one storage unit"
        assert_bitwise_equal(out["fs"], out["zero"])
        assert out["fs"]["evals"] == out["zero"]["evals"]


def test_stacks_spread_over_ranks_in_engine() -> None:
    def owners() -> list[str]:
        import torch.distributed as dist

        import wholeshard

        ddp = wholeshard.DataParallel(make_moe(), bucket_size=1500)
        opt = wholeshard.LayerwiseOptimizer(ddp)
        assert dist.get_world_size() == 2
        return [p.key for p in opt.owned_pieces() if p.matrix is not None]

    mine = run(owners, 2)
    assert not set(mine[0]) & set(mine[1])
    assert len(mine[0]) + len(mine[1]) == 4 * EXPERTS
    for keys in mine:  # every stack has matrices on both ranks
        assert {k.split("[")[0] for k in keys} == {
            f"experts.{i}.{n}" for i in range(2) for n in ("gate_up_proj", "down_proj")
        }


# -- planning ----------------------------------------------------------------------------------


def _place(name: str, start: int, end: int) -> Placement:
    return Placement(name, (end - start,), 0, start, end, None)


def storage_units(buckets: list[Bucket], placements: list[Placement]) -> tuple[range, ...]:
    return Buffer("stacked", 2, 1, tuple(buckets), tuple(placements)).storage_units()


def test_storage_units_join_buckets_a_placement_crosses() -> None:
    buckets = [Bucket(i, 10 * i, 10 * i + 10, 5) for i in range(5)]
    singles = tuple(range(i, i + 1) for i in range(5))
    assert storage_units(buckets, []) == singles
    assert storage_units([], []) == ()
    on_edges = [_place("a", 0, 10), _place("b", 10, 20), _place("c", 20, 25), _place("d", 30, 40)]
    assert storage_units(buckets, on_edges) == singles  # touching a boundary is not crossing
    crossing = [_place("a", 5, 15), _place("b", 25, 45)]  # b spans three buckets
    assert storage_units(buckets, crossing) == (range(0, 2), range(2, 5))
    assert storage_units(buckets, [_place("a", 19, 21)]) == (
        range(0, 1),
        range(1, 3),
        range(3, 4),
        range(4, 5),
    )


def qwen3_moe_layer(i: int, experts: int = 128, hidden: int = 2048, inter: int = 768) -> list:
    p = f"model.layers.{i}."
    return [
        ParamSpec(p + "self_attn.q_proj.weight", (4096, hidden), True),
        ParamSpec(p + "mlp.experts.gate_up_proj", (experts, 2 * inter, hidden), True),
        ParamSpec(p + "mlp.experts.down_proj", (experts, hidden, inter), True),
        ParamSpec(p + "mlp.gate.weight", (experts, hidden), True),
        ParamSpec(p + "input_layernorm.weight", (hidden,), False),
    ]


@pytest.mark.parametrize("dp", [8, 64, 256])
def test_fused_experts_of_qwen3_moe_tile_shards_without_padding(dp: int) -> None:
    specs = [s for i in range(4) for s in qwen3_moe_layer(i)]
    plan = plan_exactly(specs, dp, bucket_size=40_000_000)
    stacked = next(b for b in plan.buffers if b.kind == "stacked")
    assert stacked.used == stacked.numel  # gate_up (2IH) and down (IH) share shards exactly
    costs = [0] * dp
    for p in stacked.placements:
        for m in matrices(p, stacked.buckets):
            costs[m.owner] += ns_cost(p.shape[1:])
    assert max(costs) == min(costs)  # every rank gets the same share of every layer


stack_shapes = st.lists(
    st.tuples(st.integers(1, 6), st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=6
)


@settings(max_examples=60, deadline=None)
@given(
    shapes=stack_shapes,
    k=st.integers(1, 5),
    bucket_size=st.one_of(st.just(ONE_BUCKET), st.integers(1, 20_000)),
    align=st.sampled_from([1, 16, 64]),
)
def test_stacked_plans_keep_invariants(shapes, k, bucket_size, align) -> None:
    specs = [ParamSpec(f"s{i}", shape, True) for i, shape in enumerate(shapes)]
    specs.append(ParamSpec("norm", (8,), False))
    plan = plan_exactly(specs, k, bucket_size=bucket_size, align=align)
    plan.check(specs)  # includes: every matrix inside one shard, stacks contiguous, ordered
    stacked = next(b for b in plan.buffers if b.kind == "stacked")
    owned = [(p.name, offset) for r in range(k) for p, offset, _ in stacked.owned(r)]
    every = [(s.name, i * s.shape[1] * s.shape[2]) for s in specs[:-1] for i in range(s.shape[0])]
    assert sorted(owned) == sorted(every)  # every matrix owned exactly once
    assert len(plan.rank_costs()) == k


def test_stack_bucket_membership_and_order() -> None:
    specs = [ParamSpec("a", (6, 8, 8), True), ParamSpec("b", (2, 8, 8), True)]
    plan = plan_exactly(specs, 2, bucket_size=256)
    stacked = plan.buffers[0]
    a, b = stacked.placements
    assert b.start == 0 and a.start == b.end  # backprop order: the later param first
    assert len(stacked.buckets_of(a)) > 1  # a stack spread over several buckets
    # two matrices per shard: b fills shard 0, then a goes on shard by shard
    assert [m.owner for m in matrices(a, stacked.buckets)] == [1, 1, 0, 0, 1, 1]


# -- checkpoints -------------------------------------------------------------------------------


@pytest.mark.parametrize(("save_at", "load_at"), [(2, 3), (3, 0)])
def test_stacked_checkpoint_reshards_across_world_sizes(tmp_path, save_at, load_at) -> None:
    path = str(tmp_path / "ckpt")
    kw = dict(bucket_size=1500, mp_policy=mp(torch.float32))
    run(train_part, save_at, path, range(0, 2), False, make_moe, **kw)
    out = run(train_part, load_at, path, range(2, 4), True, make_moe, **kw)[0]
    ref = reference_run(4, make=make_moe)
    for name, want in ref["params"].items():
        torch.testing.assert_close(out["params"][name], want, atol=3e-3, rtol=0)
