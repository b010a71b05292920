"""FP8 param gather (`DataParallel(..., fp8_param_gather=True)`): the same training as quantizing
at every forward (bitwise), FP8 bytes on the wire for tensorwise, and the staging-order trap."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support import (
    DIM,
    MUON_KW,
    OVERLAP,
    assert_bitwise_equal,
    data_parallel,
    fp8_model,
    local_loss,
    make_model,
    mp,
    run,
    run_detail,
    train_steps,
    wholeshard_run,
    wrapped,
)
from torch import nn

import wholeshard
from wholeshard import fp8
from wholeshard.distributed import collectives
from wholeshard.engine._fp8_storage import Fp8Storage as Fp8Unit
from wholeshard.engine._schedule import Scheduler
from wholeshard.engine._storage import InFlight

STEPS = 5
BUCKETS = dict(bucket_size=3000)
MODES = {
    "zero": {},
    "fully_sharded": dict(reshard_after_forward=True),
    "owners": dict(strategy="owners", reshard_after_forward=True),  # reduce/broadcast per owner
}


def _on_and_off(mode: dict, make: Callable[[str], Callable[[], nn.Module]] = fp8_model) -> dict:
    """For both recipes, sync and overlapped: the run with FP8 param gather and without, of the
    model `make(recipe)` makes."""
    out = {}
    for recipe in fp8.RECIPES:
        for overlap in (False, True):
            kw = dict(BUCKETS, **mode, **(OVERLAP if overlap else {}))
            common = dict(make=make(recipe), param_dtype=torch.bfloat16, evaluate=True)
            off = wholeshard_run(STEPS, ddp_kw=kw, **common)
            on = wholeshard_run(
                STEPS, ddp_kw=dict(kw, fp8_param_gather=True), keep_ddp=True, **common
            )
            ddp = on.pop("ddp")
            on["fp8_units"] = sum(isinstance(b, Fp8Unit) for b in ddp.units)
            on["spanning"] = sum(  # FP8 weights whose shards two ranks hold
                b.buckets[0].owner(p.start) != b.buckets[0].owner(p.end - 1)
                for b in ddp.units
                if isinstance(b, Fp8Unit)
                for _, p in b.params
            )
            out[recipe, overlap] = (off, on)
    return out


@pytest.mark.parametrize(
    "mode", ["zero", *(pytest.param(m, marks=pytest.mark.slow) for m in MODES if m != "zero")]
)  # fully sharded FP8 gathers stay fast in test_fp8_param_gather_on_the_exchange_strategy
@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_fp8_param_gather_is_bitwise_equal_to_quantizing_every_forward(
    nproc: int, mode: str
) -> None:
    for rank_out in run(_on_and_off, nproc, MODES[mode]):
        for (recipe, overlap), (off, on) in rank_out.items():
            assert on["fp8_units"] > 0, (recipe, overlap)
            assert_bitwise_equal(on, off)
            assert on["evals"] == off["evals"], (recipe, overlap)


class PlainBlock(nn.Module):
    """Bias-free linears only: on the exchange strategy the bucket of its layer holds FP8
    weights alone, and its matrices span shards."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, 4 * DIM, bias=False)
        self.out = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(nn.functional.gelu(self.fc(x)))


def plain_blocks(recipe: str) -> Callable[[], nn.Module]:
    """Makes `make_model()` with `PlainBlock`s, converted to FP8 `recipe`: units of FP8
    weights alone (the blocks') and a unit mixing them with other params (the head's)."""

    def make() -> nn.Module:
        model = make_model()
        model.blocks = nn.ModuleList(PlainBlock() for _ in range(2))
        return fp8.convert(model, recipe)

    return make


@pytest.mark.parametrize("reshard", [False, True], ids=["zero", "fully_sharded_pipelined"])
def test_fp8_param_gather_on_the_exchange_strategy(reshard: bool) -> None:
    """Exchange units: the owners quantize whole matrices from their owned copies and send the
    holders their pieces' bytes (units of FP8 weights alone), or every rank quantizes the
    gathered bf16 values (mixed units); bitwise the same training as quantizing every forward.
    Fully sharded and pipelined, every rank's collectives are checked in order (`run_detail`)."""
    mode = dict(strategy="exchange", reshard_after_forward=reshard, pipelined_step=reshard)
    for rank_out in (run_detail if reshard else run)(_on_and_off, 3, mode, plain_blocks):
        for (recipe, overlap), (off, on) in rank_out.items():
            assert on["fp8_units"] > 0 and on["spanning"] > 0, (recipe, overlap)
            assert_bitwise_equal(on, off)
            assert on["evals"] == off["evals"], (recipe, overlap)


def _gathered_vs_local(recipe: str) -> list[bool]:
    model = fp8_model(recipe)()
    ddp, opt = wrapped(model, **BUCKETS, mp_policy=mp(torch.bfloat16), fp8_param_gather=True)
    local_loss(ddp).backward()
    opt.step()
    held = {name: m.fp8_weight for name, m in fp8.fp8_modules(model)}
    same = []
    with ddp.full_params():  # the bf16 values, gathered; quantized here, locally
        for name, m in fp8.fp8_modules(model):
            local = fp8.quantize_weight(m.weight, recipe)
            for a, b in zip(held[name], local, strict=True):
                same.append(torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)))
                same.append(torch.equal(a.scale.float(), b.scale.float()))
    return same


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_weights_equal_a_bf16_gather_then_a_local_quantize(recipe: str) -> None:
    for same in run(_gathered_vs_local, 3, recipe):
        assert same and all(same)


class Deep(nn.Module):
    """Only converted weights: every byte of the param sync is theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _sent_bytes(fp8_param_gather: bool, **ddp_kw) -> dict[str, int]:
    """Bytes this rank sends in the param sync of one step: by all-gathers, and by all-to-alls
    (the exchange strategy's) by dtype."""
    torch.manual_seed(0)
    model = fp8.convert(Deep(), "tensorwise", matrix_params=lambda name, p: True)
    ddp = data_parallel(
        model,
        bucket_size=8192,
        mp_policy=mp(torch.bfloat16),
        fp8_param_gather=fp8_param_gather,
        **ddp_kw,
    )
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW)
    sent = {"all_gather": 0}
    all_gather, all_to_all = collectives.all_gather, collectives.all_to_all

    def gathering(full, shard, group):
        sent["all_gather"] += shard.numel() * shard.element_size()
        return all_gather(full, shard, group)

    def exchanging(sends, into, send_splits, recv_splits, group, *, like):
        key = f"all_to_all {like.dtype}"
        sent[key] = sent.get(key, 0) + sum(send_splits) * like.element_size()
        return all_to_all(sends, into, send_splits, recv_splits, group, like=like)

    ddp(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    collectives.all_gather, collectives.all_to_all = gathering, exchanging
    try:
        opt.step()
    finally:
        collectives.all_gather, collectives.all_to_all = all_gather, all_to_all
    return sent


def test_tensorwise_sends_fp8_bytes() -> None:
    bf16 = run(_sent_bytes, 2, False)[0]["all_gather"]
    tensorwise = run(_sent_bytes, 2, True)[0]["all_gather"]
    assert 0 < tensorwise <= 0.52 * bf16, (tensorwise, bf16)


def test_tensorwise_on_the_exchange_strategy_sends_fp8_bytes() -> None:
    """The all-gathers ship FP8 bytes; the owners send the holders each piece's bytes, half the
    bf16 pieces the param exchange sends back (which the shards keep for `full_params()`)."""
    exchange = dict(strategy="exchange")
    outs = run(_sent_bytes, 3, False, **exchange), run(_sent_bytes, 3, True, **exchange)
    for bf16, tensorwise in zip(*outs, strict=True):
        assert 0 < tensorwise["all_gather"] <= 0.52 * bf16["all_gather"], (tensorwise, bf16)
        pieces = bf16["all_to_all torch.bfloat16"]
        assert tensorwise["all_to_all torch.bfloat16"] == pieces
        assert tensorwise["all_to_all torch.uint8"] * 2 == pieces
    assert sum(out["all_to_all torch.uint8"] for out in outs[1]) > 0


def _element_wise_fp8_weights(strategy: str, fp8_param_gather: bool) -> dict:
    """Converted linears that the wrapper routes to AdamW (all but the first): element-wise
    params that span shards, so no one rank holds such a weight whole to quantize it."""
    torch.manual_seed(0)
    model = fp8.convert(Deep(), "tensorwise", matrix_params=lambda name, p: True)
    ddp, opt = wrapped(
        model,
        bucket_size=8192,
        mp_policy=mp(torch.bfloat16),
        fp8_param_gather=fp8_param_gather,
        matrix_params=lambda name, p: name.startswith("layers.0."),
        strategy=strategy,
    )
    x = torch.randn(4, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        loss = ddp(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "units": sorted({type(b).__name__ for b in ddp.units})}


@pytest.mark.parametrize("strategy", ["balanced", "exchange"])
def test_fp8_weights_no_rank_holds_whole_are_quantized_after_a_bf16_gather(strategy: str) -> None:
    off = run(_element_wise_fp8_weights, 3, strategy, False)
    on = run(_element_wise_fp8_weights, 3, strategy, True)
    assert "MixedFp8Storage" in on[0]["units"], on[0]["units"]
    assert [out["losses"] for out in on] == [out["losses"] for out in off]


def _staged_at_step() -> list:
    """The seed's trap: stage bf16(master) at the step and let `zero_grad` clear the (grad-
    aliased) staging before the deferred gathers of the next forward ship it."""
    updated, gather, zero = Scheduler.params_updated, Fp8Unit._gather_mxfp8, Fp8Unit.zero_grads

    def stage_at_step(self) -> None:
        for b in self.units:
            if isinstance(b, Fp8Unit):
                b.grad.untyped_storage().resize_(b.grad.numel() * b.grad.element_size())
                for i, part in enumerate(b.buckets):
                    b._shard_range(b._staging(), part, b.groups.rank).copy_(
                        b._own_shard(b.param, b.param_shard, i)
                    )
        updated(self)

    def gather_what_is_staged(self):
        staging = self._staging()
        handles = [
            collectives.all_gather(
                self._bucket_range(staging, p),
                self._shard_range(staging, p, self.groups.rank),
                self.groups.gather_group,
            )
            for p in self.buckets
        ]
        return InFlight(handles)

    def zero_like_megatron(self) -> None:  # zero the grad buffer in place, staging included
        self.open_window()
        self.grad_shard.zero_()
        if self.grad.untyped_storage().size():
            self.grad.zero_()

    Scheduler.params_updated = stage_at_step
    Fp8Unit._gather_mxfp8 = gather_what_is_staged
    Fp8Unit.zero_grads = zero_like_megatron
    try:
        return _on_and_off_mxfp8_overlap()
    finally:
        Scheduler.params_updated, Fp8Unit._gather_mxfp8, Fp8Unit.zero_grads = (
            updated,
            gather,
            zero,
        )


def _on_and_off_mxfp8_overlap() -> list:
    kw = dict(BUCKETS, **OVERLAP)
    common = dict(make=fp8_model("mxfp8"), param_dtype=torch.bfloat16)
    off = wholeshard_run(STEPS, ddp_kw=kw, **common)
    on = wholeshard_run(STEPS, ddp_kw=dict(kw, fp8_param_gather=True), **common)
    return [off["losses"], on["losses"]]


def test_staging_at_the_step_would_ship_zeros_and_staging_at_dispatch_does_not() -> None:
    off, on = run(_on_and_off_mxfp8_overlap, 2)[0]
    assert on == off
    off, buggy = run(_staged_at_step, 2)[0]
    assert buggy != off, "the trap must show: deferred gathers shipped a cleared staging buffer"


def test_fp8_param_gather_needs_fp8_layers_and_the_whole_scheme() -> None:
    with pytest.raises(ValueError, match="convert it first"):
        wholeshard.DataParallel(make_model(), fp8_param_gather=True)
    with pytest.raises(ValueError, match="layout='ping_pong' cannot take fp8_param_gather"):
        data_parallel(fp8_model("mxfp8")(), layout="ping_pong", fp8_param_gather=True)


def _across_a_checkpoint(root: str, save_on: bool) -> tuple[list[float], list[float]]:
    """Train with FP8 param gather on (or off), save, go on; load into a run with it off (or
    on) and go on: the same losses."""

    def setup(on: bool):
        model = fp8_model("mxfp8")()
        return wrapped(model, **BUCKETS, mp_policy=mp(torch.bfloat16), fp8_param_gather=on)

    ddp, opt = setup(save_on)
    train_steps(ddp, opt, range(3))
    wholeshard.save_checkpoint(root, ddp, opt, extra={"step": 3})
    straight = [x.item() for x in train_steps(ddp, opt, range(3, 6))]
    ddp, opt = setup(not save_on)
    wholeshard.load_checkpoint(root, ddp, opt)
    return straight, [x.item() for x in train_steps(ddp, opt, range(3, 6))]


@pytest.mark.parametrize("save_on", [True, False], ids=["saved-fp8", "saved-bf16"])
def test_checkpoints_hold_masters_and_load_either_way(tmp_path, save_on: bool) -> None:
    for straight, resumed in run(_across_a_checkpoint, 2, str(tmp_path), save_on):
        assert resumed == straight


def _mixed_on_and_off() -> dict:
    """`pos` (8 x 32, a bare param) routed to Muon lands in buckets with converted weights."""
    kw = dict(make=fp8_model("mxfp8"), param_dtype=torch.bfloat16, matrix_params=_muon_with_pos)
    mixing = dict(BUCKETS, strategy="balanced", **OVERLAP)  # equal shards pack `pos` with others
    off = wholeshard_run(3, ddp_kw=mixing, **kw)
    on = wholeshard_run(3, ddp_kw=dict(mixing, fp8_param_gather=True), keep_ddp=True, **kw)
    kinds = {type(b).__name__ for b in on.pop("ddp").units}
    return {"off": off, "on": on, "kinds": kinds}


def _muon_with_pos(name: str, param: torch.nn.Parameter) -> bool:
    return param.ndim == 2 and not name.startswith(("emb", "head"))


def test_buckets_mixing_converted_and_other_params_sync_once_correctly() -> None:
    for out in run(_mixed_on_and_off, 2):
        assert "MixedFp8Storage" in out["kinds"]
        assert_bitwise_equal(out["on"], out["off"])
