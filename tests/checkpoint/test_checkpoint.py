"""Checkpoints: bitwise resume, resharding across world sizes and modes, format, export."""

from __future__ import annotations

import argparse
import json
import math
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support import (
    ADAMW_KW,
    DTYPES,
    MUON_KW,
    assert_matches,
    batch,
    data_parallel,
    full_params,
    grid,
    lm_loss,
    make_model,
    mp,
    reference_run,
    run,
    train_steps,
)

import wholeshard
from wholeshard.checkpoint import (
    CheckpointError,
    export_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from wholeshard.checkpoint._chunks import Chunks, ChunkSavePlanner, flat_range_boxes
from wholeshard.cli import export as export_cli
from wholeshard.optim import OwnedPiece
from wholeshard.planning.routing import route_params

SAVE_AT, MORE = 4, 3


def setup(seed: int = 0, dtype=torch.float32, ddp_kw=None, muon_lr=None, model=None):
    model = model if model is not None else make_model(seed)
    ddp = data_parallel(model, mp_policy=mp(dtype), **(ddp_kw or {}))
    muon = dict(MUON_KW, lr=muon_lr) if muon_lr is not None else MUON_KW
    return model, ddp, wholeshard.LayerwiseOptimizer(ddp, matrix=muon, adamw=ADAMW_KW)


def owned_state(opt) -> dict[str, dict[str, torch.Tensor]]:
    """Each owned piece's fp32 value and optimizer state, keyed "name@offset" (clones)."""
    out = {}
    for piece in opt.owned_pieces():
        entry = {k: v.clone() for k, v in opt.piece_state(piece).items()}
        out[f"{piece.name}@{piece.offset}"] = entry | {"value": piece.master.detach().clone()}
    return out


def merge_states(states: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Full per-param tensors (by name) from the pieces of `owned_state` on every rank;
    asserts every element is owned exactly once."""
    shapes = {r.name: tuple(r.param.shape) for r in route_params(make_model())}
    flat: dict[str, dict[str, torch.Tensor]] = {}
    count: dict[str, torch.Tensor] = {}
    for state in states:
        for key, entry in state.items():
            name, offset = key.rsplit("@", 1)
            lo = int(offset)
            n = entry["value"].numel()
            count.setdefault(name, torch.zeros(math.prod(shapes[name]), dtype=torch.int))[
                lo : lo + n
            ] += 1
            dst = flat.setdefault(name, {})
            for k, v in entry.items():
                if v.dim() == 0:  # a scalar like AdamW's step: the same on every piece
                    assert k not in dst or torch.equal(dst[k], v), (name, k)
                    dst[k] = v
                    continue
                whole = dst.setdefault(k, torch.zeros(math.prod(shapes[name]), dtype=v.dtype))
                whole[lo : lo + n] = v.reshape(-1)
    for name, c in count.items():
        assert torch.equal(c, torch.ones_like(c)), f"{name}: each element has one owner"
    return {
        name: {k: v if v.dim() == 0 else v.view(shapes[name]) for k, v in entry.items()}
        for name, entry in flat.items()
    }


def assert_pieces_match(pieces: dict, full: dict) -> None:
    """Every piece of `owned_state` equals its slice of the full per-param state."""
    for key, entry in pieces.items():
        name, offset = key.rsplit("@", 1)
        lo = int(offset)
        for k, v in entry.items():
            want = full[name][k]
            if v.dim() == 0:
                assert torch.equal(v, want), (key, k)
            else:
                assert torch.equal(v.reshape(-1), want.reshape(-1)[lo : lo + v.numel()]), (key, k)


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k], f"{what}.{k}")
        else:
            assert torch.equal(a[k], b[k]), f"{what}.{k} differs"


# -- the box decomposition of flat slices --------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4), (2, 1, 3, 2), (0, 3)])
def test_flat_range_boxes_cover_each_range_exactly_in_order(shape: tuple[int, ...]) -> None:
    numel = math.prod(shape)
    index = torch.arange(numel).reshape(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            boxes = flat_range_boxes(shape, start, stop)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            got = [
                index[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].reshape(-1)
                for off, size in boxes
            ]
            flat = torch.cat(got).tolist() if got else []
            assert flat == list(range(start, stop)), (shape, start, stop, boxes)
    with pytest.raises(ValueError, match="outside"):
        flat_range_boxes(shape, 0, numel + 1)


def test_two_ranks_writing_one_chunk_is_refused() -> None:
    """DCP keeps one of two same-key chunks silently; the planner must refuse."""
    planner = ChunkSavePlanner()
    t = torch.ones(2, 3)
    planner.set_up_planner({"model/w": Chunks(t.shape, [((0, 0), t)])})
    plan = planner.create_local_plan()
    with pytest.raises(AssertionError, match="both write model/w"):
        planner.create_global_plan([plan, plan])


# -- same world size: resume is bitwise --------------------------------------------------------


def _resume_bitwise(root: str, ddp_kw: dict, dtype: torch.dtype) -> dict:
    model, ddp, opt = setup(dtype=dtype, ddp_kw=ddp_kw)
    train_steps(ddp, opt, range(SAVE_AT))
    rng = torch.get_rng_state()
    save_checkpoint(root, ddp, opt, extra={"step": SAVE_AT, "rng": rng, "data": [SAVE_AT, 7]})
    with ddp.full_params():  # params are read outside a forward
        saved = full_params(model)
    train_steps(ddp, opt, range(SAVE_AT, SAVE_AT + MORE))
    with ddp.full_params():
        straight = (full_params(model), owned_state(opt), [dict(g) for g in opt.param_groups])

    # A different init and lr: everything must come from the checkpoint.
    model, ddp, opt = setup(seed=123, dtype=dtype, ddp_kw=ddp_kw, muon_lr=1.0)
    extra = load_checkpoint(root, ddp, opt)
    with ddp.full_params():
        loaded = full_params(model)
    train_steps(ddp, opt, range(SAVE_AT, SAVE_AT + MORE))
    with ddp.full_params():
        resumed = (full_params(model), owned_state(opt), [dict(g) for g in opt.param_groups])
    assert_same(loaded, saved, "params right after load")
    assert_same(resumed[0], straight[0], "params")
    assert_same(resumed[1], straight[1], "optimizer state")
    for a, b in zip(resumed[2], straight[2], strict=True):
        assert {k: v for k, v in a.items() if k != "params"} == {
            k: v for k, v in b.items() if k != "params"
        }
    assert extra["step"] == SAVE_AT and extra["data"] == [SAVE_AT, 7]
    assert torch.equal(extra["rng"], rng)
    return {
        "owned": sorted(straight[1]),
        "state_keys": {k: sorted(v) for k, v in straight[1].items()},
    }


MODES = {
    "sync": {},
    "overlap": dict(overlap_grad_reduce=True, overlap_param_gather=True),
    "fully_sharded": dict(reshard_after_forward=True, bucket_size=3000),
    "pipelined": dict(overlap_grad_reduce=True, overlap_param_gather=True, pipelined_step=True),
    "owners": dict(strategy="owners", reshard_after_forward=True, bucket_size=3000),
    "exchange": dict(strategy="exchange", reshard_after_forward=True, bucket_size=3000),
}


@pytest.mark.parametrize(("dtype", "ddp_kw"), grid(DTYPES, MODES, core="fp32-sync"))
def test_resume_at_same_world_size_is_bitwise(tmp_path: Path, ddp_kw: dict, dtype) -> None:
    outs = run(_resume_bitwise, 2, str(tmp_path), ddp_kw, dtype)
    assert all(out["owned"] for out in outs), "both ranks own state, so both write some"
    muon_state = {k for out in outs for k in out["state_keys"].values() for k in k}
    assert {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"} <= muon_state


# -- resharding: save at 2 ranks, load at 1, 3, 4 -------------------------------------------------


def _train_and_save(root: str, ddp_kw: dict) -> dict:
    model, ddp, opt = setup(ddp_kw=ddp_kw)
    losses = train_steps(ddp, opt, range(SAVE_AT))
    save_checkpoint(root, ddp, opt, extra={"step": SAVE_AT})
    with ddp.full_params():
        params = full_params(model)
    return {"state": owned_state(opt), "params": params, "losses": losses}


def _saved_at_2(root: Path, ddp_kw: dict) -> dict:
    """A 2-rank fp32 checkpoint after SAVE_AT steps and the owners' full state at that point."""
    outs = run(_train_and_save, 2, str(root), ddp_kw)
    assert all(out["state"] for out in outs)
    state = merge_states([out["state"] for out in outs])
    return {"root": root, "state": state, "params": outs[0]["params"]}


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _saved_at_2(tmp_path_factory.mktemp("ckpt2"), {})


@pytest.fixture(scope="module")
def saved_fully_sharded_at_2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _saved_at_2(tmp_path_factory.mktemp("ckpt2fs"), {"reshard_after_forward": True})


def _load_and_train(root: str, ddp_kw: dict) -> dict:
    model, ddp, opt = setup(seed=7, ddp_kw=ddp_kw, muon_lr=1.0)
    extra = load_checkpoint(root, ddp, opt)
    with ddp.full_params():
        loaded = full_params(model)
    losses = train_steps(ddp, opt, range(extra["step"], extra["step"] + MORE))
    if dist.is_initialized():
        for loss in losses:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    with ddp.full_params():
        params = full_params(model)
    return {"loaded": loaded, "params": params, "losses": [x.item() for x in losses]}


FULLY_SHARDED = {"reshard_after_forward": True, "bucket_size": 3000}


@pytest.mark.parametrize(
    "nproc,ddp_kw",
    [
        (1, {}),
        pytest.param(3, {}, marks=pytest.mark.core),
        (3, {"bucket_size": 3000}),
        (4, {}),
        (3, FULLY_SHARDED),
        (3, dict(FULLY_SHARDED, strategy="owners")),
        (3, dict(FULLY_SHARDED, strategy="exchange")),
    ],
    ids=[
        "1",
        "3",
        "3-small-buckets",
        "4",
        "3-fully-sharded",
        "3-owners-fully-sharded",
        "3-exchange-fully-sharded",
    ],
)
def test_reshard_2_ranks_to_n(saved_at_2: dict, nproc: int, ddp_kw: dict) -> None:
    _assert_loads_and_continues(saved_at_2, nproc, ddp_kw)


@pytest.fixture(scope="module")
def saved_exchange_at_2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Fully sharded on the exchange strategy: the owners' matrices are saved from their owned
    copies, which the shards do not hold whole."""
    kw = dict(FULLY_SHARDED, strategy="exchange")
    return _saved_at_2(tmp_path_factory.mktemp("ckpt2exchange"), kw)


@pytest.mark.parametrize(
    "saved,nproc,ddp_kw",
    [
        ("saved_fully_sharded_at_2", 3, {}),
        ("saved_fully_sharded_at_2", 2, FULLY_SHARDED),
        ("saved_exchange_at_2", 1, {}),
        ("saved_exchange_at_2", 3, {}),
        ("saved_exchange_at_2", 4, {"shard_group_size": 2}),
    ],
    ids=["fully-sharded-3", "fully-sharded-2", "exchange-1", "exchange-3", "exchange-4-hybrid"],
)
def test_a_fully_sharded_or_exchange_checkpoint_loads_in_any_mode_and_world_size(
    request: pytest.FixtureRequest, saved: str, nproc: int, ddp_kw: dict
) -> None:
    _assert_loads_and_continues(request.getfixturevalue(saved), nproc, ddp_kw)


@pytest.fixture(scope="module")
def saved_hybrid_at_4(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """4 ranks in shard groups of 2: every element is owned twice, once per replica, and the
    checkpoint holds it once (DCP refused two ranks writing the same chunk)."""
    root = tmp_path_factory.mktemp("ckpt4hybrid")
    outs = run(_train_and_save, 4, str(root), {"shard_group_size": 2})
    for replica, first in zip(outs[2:], outs[:2], strict=True):
        assert replica["state"].keys() == first["state"].keys()
    state = merge_states([out["state"] for out in outs[:2]])  # the first replica: ranks 0, 1
    return {"root": root, "state": state, "params": outs[0]["params"]}


@pytest.mark.parametrize(
    "nproc,ddp_kw", [(2, {}), (4, {"shard_group_size": 2})], ids=["2", "4-hybrid"]
)
def test_a_hybrid_checkpoint_loads_at_any_world_size(
    saved_hybrid_at_4: dict, nproc: int, ddp_kw: dict
) -> None:
    _assert_loads_and_continues(saved_hybrid_at_4, nproc, ddp_kw)


def _assert_loads_and_continues(saved: dict, nproc: int, ddp_kw: dict) -> None:
    ref = reference_run(MORE, start=SAVE_AT, state=saved["state"])
    outs = run(_load_and_train, nproc, str(saved["root"]), ddp_kw)
    for out in outs:
        # Every rank holds every param right after the load, not only the ones it owns.
        assert_same(out["loaded"], saved["params"], "params right after load")
        if nproc == 1:  # one rank does the reference's arithmetic
            assert_same(out["params"], ref["params"], "params")
            assert out["losses"] == ref["losses"]
            continue
        assert_matches(out, ref, torch.float32)
    for out in outs[1:]:
        assert_same(out["params"], outs[0]["params"], "params across ranks")


def _load_state(root: str) -> dict:
    _, ddp, opt = setup(seed=7, muon_lr=1.0)
    load_checkpoint(root, ddp, opt)
    return owned_state(opt)


@pytest.mark.core
def test_one_process_load_gets_every_owners_values(saved_at_2: dict) -> None:
    """Each value comes from its owner on either rank (not only rank 0's: DCP silently keeps one
    of several same-key chunks, so a shared key would lose the others)."""
    (state,) = run(_load_state, 0, str(saved_at_2["root"]))
    assert_same(merge_states([state]), saved_at_2["state"], "state")


# -- a changed set of frozen params (freezing after pre-training, progressive unfreezing) ------

FC = ("blocks.0.fc.bias", "blocks.0.fc.weight")


def frozen_fc(model: torch.nn.Module) -> torch.nn.Module:
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FC)
    return model


def _global_losses(losses: list[torch.Tensor]) -> list[float]:
    for loss in losses:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return [x.item() for x in losses]


def _freeze_then_unfreeze(root: str) -> dict:
    """Train all params, save; resume with FC frozen, train, save; resume with all trainable."""
    out = {}
    model, ddp, opt = setup()
    train_steps(ddp, opt, range(2))
    save_checkpoint(f"{root}/all", ddp, opt)
    with ddp.full_params():
        out["saved_all"] = full_params(model)
    out["state_all"] = owned_state(opt)

    model, ddp, opt = setup(model=frozen_fc(make_model(seed=5)))
    with pytest.warns(UserWarning, match=r"frozen now, .*: blocks\.0\.fc\.bias, blocks\.0\.fc\.w"):
        load_checkpoint(f"{root}/all", ddp, opt)
    with ddp.full_params():
        out["loaded_frozen"] = full_params(model)
    out["losses_frozen"] = _global_losses(train_steps(ddp, opt, range(2, 4)))
    save_checkpoint(f"{root}/frozen", ddp, opt)
    with ddp.full_params():
        out["saved_frozen"] = full_params(model)
    out["state_frozen"] = owned_state(opt)

    model, ddp, opt = setup(seed=6)
    with pytest.warns(
        UserWarning, match=r"trainable now .*: blocks\.0\.fc\.bias, blocks\.0\.fc\.w"
    ):
        load_checkpoint(f"{root}/frozen", ddp, opt)
    with ddp.full_params():
        out["loaded_all"] = full_params(model)
    out["fc_state"] = [dict(opt.piece_state(p)) for p in opt.owned_pieces() if p.name in FC]
    out["losses_all"] = _global_losses(train_steps(ddp, opt, range(4, 6)))
    with ddp.full_params():
        out["trained_all"] = full_params(model)
    return out


def test_resume_with_a_changed_set_of_frozen_params(tmp_path: Path) -> None:
    outs = run(_freeze_then_unfreeze, 2, str(tmp_path))
    out = outs[0]
    for o in outs:  # every param gets its saved value, frozen or not, on every rank
        assert_same(o["loaded_frozen"], out["saved_all"], "params loaded with FC frozen")
        assert_same(o["loaded_all"], out["saved_frozen"], "params loaded with FC trainable")
    assert [s for o in outs for s in o["fc_state"]] == [{}, {}], "FC's optimizer state is fresh"

    # The reference: one process resuming from the saved state, FC frozen, then trainable.
    def saved_model_with_fc_frozen() -> torch.nn.Module:
        model = frozen_fc(make_model())
        model.load_state_dict(out["saved_all"])
        return model

    state = merge_states([o["state_all"] for o in outs])
    ref = reference_run(
        2,
        start=2,
        make=saved_model_with_fc_frozen,
        state={n: v for n, v in state.items() if n not in FC},
    )
    assert_matches({"params": out["saved_frozen"], "losses": out["losses_frozen"]}, ref)
    assert all(torch.equal(out["saved_frozen"][n], out["saved_all"][n]) for n in FC)

    state = merge_states([o["state_frozen"] for o in outs])
    state |= {n: {"value": out["saved_frozen"][n]} for n in FC}  # no optimizer state
    ref = reference_run(2, start=4, state=state)
    assert_matches({"params": out["trained_all"], "losses": out["losses_all"]}, ref)


# -- flat slices (element-wise sharded AdamW) ---------------------------------------------------


class SlicedAdamW:
    """Test double for element-wise AdamW sharding: Muon pieces whole, as `opt` owns them; each
    AdamW param cut into flat slices at `cuts` (fractions), this rank owning slice `rank`."""

    def __init__(self, opt, ddp, cuts: list[float]) -> None:
        rank = ddp.rank
        self.param_groups = opt.param_groups
        self._opt = opt
        self._state: dict[int, dict] = {}
        self.pieces = [p for p in opt.owned_pieces() if p.kind == "matrix"]
        for r in ddp.routes:
            if r.matrix:
                continue
            n = r.param.numel()
            bounds = [0, *(int(c * n) for c in cuts), n]
            lo, hi = bounds[rank], bounds[rank + 1]
            master = torch.zeros(hi - lo)
            piece = OwnedPiece(r.name, "adamw", tuple(r.param.shape), lo, master, master, master)
            self.pieces.append(piece)
            self._state[id(master)] = {}

    def owned_pieces(self) -> list[OwnedPiece]:
        return list(self.pieces)

    def piece_state(self, piece: OwnedPiece) -> dict:
        if piece.kind == "matrix":
            return self._opt.piece_state(piece)
        return self._state[id(piece.master)]


def _sliced_view(state: dict, piece: OwnedPiece) -> dict:
    """What a piece should hold, cut from the full state."""
    if tuple(piece.master.shape) == piece.full_shape:
        return dict(state[piece.name])
    lo, hi = piece.offset, piece.offset + piece.master.numel()
    return {
        k: v.reshape(-1)[lo:hi] if v.shape == piece.full_shape else v
        for k, v in state[piece.name].items()
    }


def _save_sliced(src: str, dst: str, state: dict) -> None:
    _, ddp, opt = setup(seed=7)
    load_checkpoint(src, ddp, opt)  # the Muon pieces; the AdamW slices come from `state`
    sliced = SlicedAdamW(opt, ddp, cuts=[0.37])
    for piece in sliced.owned_pieces():
        if piece.kind == "adamw":
            want = _sliced_view(state, piece)
            piece.master.copy_(want.pop("value"))
            sliced.piece_state(piece).update({k: v.clone() for k, v in want.items()})
    save_checkpoint(dst, ddp, sliced, extra={"step": SAVE_AT})


def _load_sliced(root: str, state: dict) -> int:
    _, ddp, opt = setup(seed=7)
    sliced = SlicedAdamW(opt, ddp, cuts=[0.21, 0.5 + 1 / 7])
    load_checkpoint(root, ddp, sliced)
    for piece in sliced.owned_pieces():
        want = _sliced_view(state, piece)
        got = {k: v for k, v in sliced.piece_state(piece).items()}
        assert_same(got | {"value": piece.master}, want, piece.name)
    return len(sliced.owned_pieces())


def test_flat_slices_reshard_both_ways(saved_at_2: dict, tmp_path: Path) -> None:
    state, src = saved_at_2["state"], str(saved_at_2["root"])
    run(_save_sliced, 2, src, str(tmp_path), state)  # flat slices at 2 ranks -> whole at 3
    loaded = run(_load_state, 3, str(tmp_path))
    assert_same(merge_states(loaded), state, "state")
    for got in loaded:
        assert_pieces_match(got, state)
    assert all(n > 0 for n in run(_load_sliced, 3, src, state))  # whole at 2 -> slices at 3


# -- the directory protocol ----------------------------------------------------------------------


def test_step_numbers_latest_and_keep_last(tmp_path: Path) -> None:
    model, ddp, opt = setup()
    for _ in range(3):  # named by the optimizer's step count
        train_steps(ddp, opt, range(1))
        save_checkpoint(tmp_path, ddp, opt, extra={"note": "counter"}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2", "step-3"]
    assert resolve_checkpoint(tmp_path) == tmp_path / "step-3"
    assert resolve_checkpoint(tmp_path / "latest") == tmp_path / "step-3"
    assert resolve_checkpoint(tmp_path / "step-2") == tmp_path / "step-2"

    with pytest.raises(CheckpointError, match="latest checkpoint; refusing"):
        save_checkpoint(tmp_path, ddp, opt)
    now = full_params(model)
    save_checkpoint(tmp_path, ddp, opt, extra={"step": 2})  # replaces the older step-2
    assert (tmp_path / "latest").read_text() == "step-2\n"
    with pytest.raises(CheckpointError, match="weights_only"):
        save_checkpoint(tmp_path, ddp, opt, extra={"step": 9, "bad": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2", "step-3"]

    model, ddp, opt = setup(seed=3)
    assert load_checkpoint(tmp_path, ddp, opt) == {"step": 2}
    assert_same(full_params(model), now, "params")
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        load_checkpoint(tmp_path / "nothing", ddp, opt)


def test_load_across_param_dtypes_uses_the_fp32_master(tmp_path: Path) -> None:
    model, ddp, opt = setup(dtype=torch.bfloat16)
    train_steps(ddp, opt, range(2))
    masters = {p.name: p.master.clone().view(p.full_shape) for p in opt.owned_pieces()}
    save_checkpoint(tmp_path / "bf16", ddp, opt)
    model32, ddp32, opt32 = setup(seed=5)
    load_checkpoint(tmp_path / "bf16", ddp32, opt32)
    assert_same(full_params(model32), masters, "fp32 params from bf16 masters")

    save_checkpoint(tmp_path / "fp32", ddp32, opt32)
    model16, ddp16, opt16 = setup(seed=5, dtype=torch.bfloat16)
    load_checkpoint(tmp_path / "fp32", ddp16, opt16)
    got = {p.name: p.master.view(p.full_shape) for p in opt16.owned_pieces()}
    assert_same(got, masters, "masters")
    assert_same(full_params(model16), full_params(model), "bf16 params")


# -- export --------------------------------------------------------------------------------------


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A reader written from the format description, independent of the writer."""
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    data = raw[8 + n :]
    assert sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values()) == len(data)
    return {
        name: torch.frombuffer(bytearray(data[slice(*e["data_offsets"])]), dtype=dtypes[e["dtype"]])
        .reshape(e["shape"])
        .clone()
        for name, e in header.items()
    }


def _export_cli(ckpt: Path, out: Path, *flags: str) -> int:
    parser = argparse.ArgumentParser()
    export_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["export", str(ckpt), str(out), *flags])
    return args.run(args)


def test_export_reloads_into_a_plain_model_with_the_same_loss(saved_at_2: dict, tmp_path) -> None:
    out = tmp_path / "model.safetensors"
    assert _export_cli(saved_at_2["root"], out) == 0
    plain = make_model(seed=99)
    plain.load_state_dict(read_safetensors(out), strict=True)
    want = make_model(seed=99)
    want.load_state_dict(saved_at_2["params"])
    x, y = batch(SAVE_AT)
    assert lm_loss(plain, x, y).item() == lm_loss(want, x, y).item()


def test_export_is_read_by_safetensors_itself(saved_at_2: dict, tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    out = tmp_path / "model.safetensors"
    export_checkpoint(saved_at_2["root"], out)
    assert_same(safetensors.load_file(out), read_safetensors(out), "safetensors' own reader")


def test_export_tied_bf16_model_with_buffer(tmp_path: Path) -> None:
    model = make_model(tied=True)
    model.register_buffer("scale", torch.tensor([1.5, 2.5]))
    model.to(torch.bfloat16)
    _, ddp, opt = setup(dtype=torch.bfloat16, model=model)
    train_steps(ddp, opt, range(1))
    save_checkpoint(tmp_path, ddp, opt)
    masters = {p.name: p.master.clone().view(p.full_shape) for p in opt.owned_pieces()}

    assert _export_cli(tmp_path, tmp_path / "w.safetensors") == 0
    got = read_safetensors(tmp_path / "w.safetensors")
    assert got.keys() == model.state_dict().keys()  # tied alias and buffer included
    assert_same(got, {k: v.detach() for k, v in model.state_dict().items()}, "bf16 export")
    plain = make_model(seed=1, tied=True)
    plain.register_buffer("scale", torch.zeros(2))
    plain.to(torch.bfloat16).load_state_dict(got, strict=True)

    assert _export_cli(tmp_path / "step-1", tmp_path / "w32.safetensors", "--dtype", "float32") == 0
    got32 = read_safetensors(tmp_path / "w32.safetensors")
    assert torch.equal(got32["head.weight"], masters["emb.weight"])
    assert got32["scale"].dtype == torch.float32
    assert _export_cli(tmp_path / "missing", tmp_path / "x.safetensors") == 1
