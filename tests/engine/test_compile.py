"""torch.compile'd models under DataParallel: every mode trains like the eager model.

`DataParallel(torch.compile(model))`, `model.compile()` (in place, names unchanged) and
per-block `block.compile()` all work in every mode. Gradient hooks run in the autograd engine,
outside any graph. The forward pre-hooks that wait for overlapped param gathers cannot run
inside a graph: a compiled module is a leaf that gets one hook for all of its params (so a
whole compiled model waits for every bucket before its forward, and per-block compilation keeps
the gather overlapped block by block), and the hooks are `torch.compiler.disable`d, so a
compiled caller graph-breaks around them instead of tracing collectives.

One launch at 2 ranks runs every mode eagerly and compiled, once per backend: `aot_eager`
(dynamo and AOTAutograd, as inductor sees the model, without generating code: hooks, graph
breaks and names are decided there) in the default run, and CPU inductor under `slow` (its
first compile with an empty cache takes ~25 s on 2 cores).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch._dynamo
from support import (
    OVERLAP,
    SYNC,
    assert_bitwise_equal,
    assert_matches,
    local_loss,
    make_model,
    run,
    wholeshard_run,
    wrapped,
)
from torch import nn

import wholeshard
from wholeshard.engine._storage import UnitState

HAS_CXX = any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++"))
BACKENDS = [
    "aot_eager",
    pytest.param(
        "inductor",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(not HAS_CXX, reason="CPU inductor needs a C++ compiler"),
        ],
    ),
]
STEPS = 3
MODES = {
    "sync": SYNC,
    "overlap": OVERLAP,
    "broadcast-overlap": dict(layout="shard_broadcasts", **OVERLAP),
    "ping_pong": dict(layout="ping_pong"),
    "ping_pong-overlap": dict(layout="ping_pong", **OVERLAP),
    "ping_pong-broadcast": dict(layout="ping_pong_broadcasts"),
    "shard_group_size=1-overlap": dict(shard_group_size=1, **OVERLAP),
    "fully_sharded-overlap": dict(reshard_after_forward=True, **OVERLAP),
}
SMALL_BUCKETS = dict(bucket_size=3000)  # several buckets, so overlap has something to overlap
PREFIX = "_orig_mod."  # torch.compile(m) holds m under this attribute


def compiled(kind: str, backend: str) -> nn.Module:
    """TinyLM compiled as a whole (`torch.compile`), in place (`.compile()`) or per block."""
    model = make_model()
    if kind == "whole":
        return torch.compile(model, backend=backend)
    if kind == "in_place":
        model.compile(backend=backend)
    elif kind == "blocks":
        for block in model.blocks:
            block.compile(backend=backend)
    return model


def _train(kind: str | None, mode: dict, backend: str) -> dict:
    make = None if kind is None else lambda: compiled(kind, backend)
    out = wholeshard_run(STEPS, ddp_kw=dict(SMALL_BUCKETS, **mode), make=make, evaluate=True)
    out["params"] = {n.replace(PREFIX, ""): p for n, p in out["params"].items()}
    return out


def _hooks_fire(kind: str, backend: str) -> dict:
    """Overlap with a compiled model: grads reduced during backward, gathers deferred to the
    next forward, and that forward's pre-hook completes them before the compiled graph runs."""
    ddp, opt = wrapped(compiled(kind, backend), **SMALL_BUCKETS, **OVERLAP)
    local_loss(ddp).backward()
    reduced_in_backward = sum(b.reducing is not None for b in ddp.units)
    opt.step()
    opt.zero_grad()
    deferred = sum(b.state is not UnitState.FRESH for b in ddp.units)
    local_loss(ddp, 1).backward()
    left_after_forward = sum(b.state is not UnitState.FRESH for b in ddp.units)
    return {
        "buckets": len(ddp.units),
        "reduced_in_backward": reduced_in_backward,
        "deferred": deferred,
        "left_after_forward": left_after_forward,
        "names": [r.name for r in ddp.routes],
    }


def _everything(backend: str) -> dict:
    """One launch: every mode eager and compiled whole, the other two compile styles with
    overlap, and the hook checks. Every model is a new instance of one class: dynamo's guards
    pass, so the graphs compiled for the first run serve the rest (no recompiles; were there
    more than dynamo's limit, it raises instead of running the rest eagerly)."""
    torch._dynamo.reset()
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    out: dict = {}
    for name, mode in MODES.items():
        out["eager", name] = _train(None, mode, backend)
        out["whole", name] = _train("whole", mode, backend)
    for kind in ("in_place", "blocks"):
        out[kind, "overlap"] = _train(kind, OVERLAP, backend)
        out[kind, "fully_sharded-overlap"] = _train(kind, MODES["fully_sharded-overlap"], backend)
        out["hooks", kind] = _hooks_fire(kind, backend)
    out["hooks", "whole"] = _hooks_fire("whole", backend)
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def results(request: pytest.FixtureRequest) -> list[dict]:
    return run(_everything, 2, request.param)


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_matches_eager(results: list[dict], mode: str) -> None:
    for out in results:
        assert_matches(out["whole", mode], out["eager", mode])
        assert out["whole", mode]["evals"] == pytest.approx(out["eager", mode]["evals"], rel=1e-3)
    for out in results[1:]:
        for k, v in results[0]["whole", mode]["params"].items():
            assert torch.equal(out["whole", mode]["params"][k], v), k


@pytest.mark.parametrize("mode", ["overlap", "ping_pong-overlap"])
def test_compiled_overlap_is_bitwise_equal_to_compiled_sync(results: list[dict], mode: str) -> None:
    sync = mode.removesuffix("-overlap")
    for out in results:
        assert_bitwise_equal(out["whole", mode], out["whole", sync])


@pytest.mark.parametrize("kind", ["in_place", "blocks"])
def test_other_compile_styles(results: list[dict], kind: str) -> None:
    for out in results:
        assert_matches(out[kind, "overlap"], out["eager", "overlap"])
    if kind == "in_place":  # the same graph as torch.compile(m); per block, other fusions
        for out in results:
            assert_bitwise_equal(out[kind, "overlap"], out["whole", "overlap"])


@pytest.mark.parametrize("kind", ["whole", "in_place", "blocks"])
def test_compiled_fully_sharded_is_bitwise_equal_to_compiled_zero(
    results: list[dict], kind: str
) -> None:
    for out in results:
        assert_bitwise_equal(out[kind, "fully_sharded-overlap"], out[kind, "overlap"])


@pytest.mark.parametrize("kind", ["whole", "in_place", "blocks"])
def test_hooks_fire_around_compiled_graphs(results: list[dict], kind: str) -> None:
    hooks = results[0]["hooks", kind]
    assert hooks["buckets"] > 2
    assert hooks["reduced_in_backward"] == hooks["buckets"], "every bucket reduced in backward"
    assert hooks["deferred"] == hooks["buckets"], "gathers left for the next forward"
    assert hooks["left_after_forward"] == 0, "the forward pre-hooks completed every gather"


def test_names_of_a_compiled_model(results: list[dict]) -> None:
    """Routes (and so optimizer state and checkpoints) use the model's own names however it
    was compiled: the `_orig_mod.` that `torch.compile(m)` adds is dropped."""
    names = {kind: results[0]["hooks", kind]["names"] for kind in ("whole", "in_place", "blocks")}
    assert not any(PREFIX in n for n in names["whole"])
    assert names["whole"] == names["in_place"] == names["blocks"]


def test_checkpoint_of_a_compiled_model_loads_into_an_eager_one(tmp_path) -> None:

    compiled_model = torch.compile(make_model(seed=1))  # compiled lazily: nothing is traced here
    ddp = wholeshard.DataParallel(compiled_model)
    wholeshard.save_checkpoint(tmp_path, ddp, wholeshard.LayerwiseOptimizer(ddp))
    eager = wholeshard.DataParallel(make_model(seed=2))
    wholeshard.load_checkpoint(tmp_path, eager, wholeshard.LayerwiseOptimizer(eager))
    want = dict(compiled_model.named_parameters())
    for name, p in eager.module.named_parameters():
        assert torch.equal(p, want[PREFIX + name]), name
