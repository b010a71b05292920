"""Building from the meta device (`DataParallelConfig(param_init=fn)`, [Note: meta-device
construction]): the params do not depend on the world size or the mode, and training from them
is bitwise training from the same values built the ordinary way."""

from __future__ import annotations

import zlib

import pytest
import torch
from support import (
    ADAMW_KW,
    MAIN_MODES,
    MUON_KW,
    OVERLAP,
    data_parallel,
    full_params,
    make_model,
    run,
    train_steps,
)
from torch import nn

import wholeshard
from wholeshard.distributed.launch import WorkerFailed
from wholeshard.engine import _resize, _storage
from wholeshard.fp8 import convert

STEPS = 2


def init(name: str, t: torch.Tensor) -> None:
    """Draws from torch's global generator, as `nn.init` does."""
    if t.dim() > 1:
        t.normal_(0.0, 0.05)
    else:
        t.uniform_(-0.5, 0.5)


def _model(meta: bool, fp8: bool = False) -> nn.Module:
    if meta:
        with torch.device("meta"):
            model = make_model(tied=True)
    else:
        model = make_model(tied=True)
    if fp8:
        model = convert(model, "tensorwise")
    model.register_buffer("table", torch.arange(4.0, device="meta" if meta else "cpu"))
    model.ln.weight.requires_grad_(False)  # frozen: filled on every rank
    return model


def expected() -> dict[str, torch.Tensor]:
    """One process, no DataParallel: `init` on every param under the documented seed."""
    model = _model(meta=False)
    for name, p in model.named_parameters():
        with torch.random.fork_rng():
            torch.manual_seed(zlib.crc32(name.encode()))
            init(name, p.data)
    return full_params(model)


def _train(meta: bool, ddp_kw: dict) -> dict:
    fp8 = ddp_kw.get("fp8_param_gather", False)
    if meta:
        ddp = data_parallel(_model(meta=True, fp8=fp8), param_init=init, **ddp_kw)
    else:
        model, want = _model(meta=False, fp8=fp8), expected()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(want[name])
        ddp = data_parallel(model, **ddp_kw)
    module = ddp.module
    with ddp.full_params():
        built = full_params(module)
    tied = module.head.weight is module.emb.weight
    on_meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    train_steps(ddp, opt, range(STEPS))
    with ddp.full_params():
        trained = full_params(module)
    return {"built": built, "trained": trained, "tied": tied, "on_meta": on_meta}


MODES = MAIN_MODES | {
    "ping-pong": dict(layout="ping_pong_broadcasts"),
    "fp8-gather": dict(fp8_param_gather=True, **OVERLAP),
    "owners-fully-sharded": dict(strategy="owners", reshard_after_forward=True, **OVERLAP),
    "exchange": dict(strategy="exchange", **OVERLAP),
    "exchange-fully-sharded": dict(strategy="exchange", reshard_after_forward=True, **OVERLAP),
    "exchange-fp8-gather": dict(strategy="exchange", fp8_param_gather=True, **OVERLAP),
}


def _every_mode() -> dict[tuple[str, bool], dict]:
    """One launch: every mode trained from the meta device (True) and the ordinary way."""
    return {
        (mode, meta): _train(meta, dict(bucket_size=3000, **MODES[mode]))
        for mode in MODES
        for meta in (True, False)
    }


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest) -> list[dict]:
    """Each rank's `_every_mode()` at `request.param` ranks."""
    return run(_every_mode, request.param)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("trained", [pytest.param(2, marks=pytest.mark.slow), 3], indirect=True)
def test_meta_construction_matches_one_process_and_trains_alike(
    trained: list[dict], mode: str
) -> None:
    want = expected()
    for out in trained:
        a, b = out[mode, True], out[mode, False]
        assert a["tied"] and not a["on_meta"], a["on_meta"]
        assert a["built"].keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(a["built"][name], value), name
        for name, value in b["trained"].items():
            assert torch.equal(a["trained"][name], value), name


def test_meta_model_without_param_init_is_refused_with_the_fix() -> None:
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(WorkerFailed, match="is on the meta device .*param_init=fn"):
        run(lambda: wholeshard.DataParallel(model), 1)


def test_param_init_must_be_a_function() -> None:
    with pytest.raises(ValueError, match="param_init must be None or a function"):
        wholeshard.DataParallelConfig(param_init="normal")


def _full_units_alive_while_building(ddp_kw: dict) -> list[int]:
    """How many storage units hold their full param storage each time a new one is made, and
    after the wrapper is built (fully sharded: only the unit being filled)."""
    alive: list[int] = []
    built: list[_storage.StorageUnit] = []
    original = _storage.StorageUnit.__init__

    def init_and_count(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        built.append(self)
        alive.append(sum(_resize.allocated(b.param) for b in built))

    _storage.StorageUnit.__init__ = init_and_count
    try:
        data_parallel(_model(meta=True), param_init=init, **ddp_kw)
    finally:
        _storage.StorageUnit.__init__ = original
    return [*alive, sum(_resize.allocated(b.param) for b in built)]


@pytest.mark.parametrize("strategy", ["balanced", "owners", "exchange"])
def test_fully_sharded_construction_holds_one_full_unit_beside_the_shards(strategy: str) -> None:
    """Issue 20: peak memory during construction is at most one unit beside the owned shards."""
    ddp_kw = dict(bucket_size=3000, strategy=strategy, reshard_after_forward=True, **OVERLAP)
    for alive in run(_full_units_alive_while_building, 2, ddp_kw):
        assert len(alive) > 4 and max(alive) == 1 and alive[-1] == 0, alive
