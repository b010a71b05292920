"""The training job's pieces in one process: data, model, schedule, config, outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from support import train_config

from wholeshard import DataParallelConfig
from wholeshard.models.gpt import GPT, SIZES, model_config, num_params
from wholeshard.train import data, outputs
from wholeshard.train.config import ConfigError, TrainConfig
from wholeshard.train.lr_schedule import lr_factor
from wholeshard.train.sections import CheckpointConfig, OptimConfig
from wholeshard.train.trainer import train

TEXT = (Path(__file__).resolve().parents[2] / "wholeshard" / "train" / "trainer.py").read_bytes()


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(TEXT * 2)
    return path


# -- data ------------------------------------------------------------------------------------


def test_stdlib_corpus_is_sorted_sources_without_tests() -> None:
    files = data.stdlib_files()
    root = data.stdlib_root()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 100
    assert all(r.endswith(".py") for r in rel)
    assert not any(part in ("test", "tests", "site-packages") for r in rel for part in r.split("/"))


def test_split_is_deterministic_and_five_percent_validation() -> None:
    blob = bytes(range(256)) * 400
    train_a, val_a = data.split(blob)
    train_b, val_b = data.split(blob)
    assert (train_a, val_a) == (train_b, val_b)
    assert len(train_a) + len(val_a) == len(blob)
    assert abs(len(val_a) / len(blob) - 0.05) < 0.01


def test_ranks_read_disjoint_slices_of_the_same_global_batch() -> None:
    text = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8)
    x1, y1 = data.train_batch(text, 7, 8, 16, seed=3, rank=0, world=1)
    parts = [data.train_batch(text, 7, 8, 16, seed=3, rank=r, world=4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x1)
    assert torch.equal(torch.cat([p[1] for p in parts]), y1)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next bytes
    other_step, _ = data.train_batch(text, 8, 8, 16, seed=3, rank=0, world=1)
    assert not torch.equal(other_step, x1)
    vals = [data.val_batches(text, 2, 8, 16, rank=r, world=2) for r in range(2)]
    whole = data.val_batches(text, 2, 8, 16, rank=0, world=1)
    for b in range(2):
        assert torch.equal(torch.cat([vals[0][b][0], vals[1][b][0]]), whole[b][0])


def test_directory_data_skips_hidden_and_binary_files(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    (tmp_path / ".hidden").write_text("secret\n")
    files = data.text_files(tmp_path)
    assert [f.name for f in files] == ["a.txt", "b.txt", "blob.bin"]
    assert data.read_text_bytes(files) == (b"first\nsecond\n", 2)
    with pytest.raises(ValueError, match="no text"):
        data.load_corpus(tmp_path / "blob.bin")


# -- model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_model_is_causal(pos: str) -> None:
    torch.manual_seed(0)
    model = GPT(model_config("tiny", 16, pos=pos))
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256
    a, b = model(x), model(y)
    assert a.shape == (2, 16, 256)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_model_sizes_and_tying() -> None:
    tiny = GPT(model_config("tiny", 128))
    assert 1.5e6 < num_params(tiny) < 2.5e6
    assert tiny.head.weight is tiny.embed.weight
    untied = GPT(model_config("tiny", 128, tie=False))
    assert untied.head.weight is not untied.embed.weight
    assert set(SIZES) == {"micro", "tiny", "small"}
    assert 0.08e6 < num_params(GPT(model_config("micro", 128))) < 0.2e6
    small = SIZES["small"]
    assert 12 * small.n_layer * small.d_model**2 > 10e6


# -- schedule and config ---------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_schedule_warms_up_then_decays_to_the_floor(schedule: str) -> None:
    f = [lr_factor(s, 100, 10, schedule, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a <= b + 1e-12 for a, b in zip(f[:10], f[1:11], strict=True))
    assert all(a >= b - 1e-12 for a, b in zip(f[10:], f[11:], strict=False))
    assert f[-1] == pytest.approx(0.1, abs=0.02)
    if schedule == "wsd":
        assert f[10:80] == [1.0] * 70


def test_config_validation_names_the_field() -> None:
    TrainConfig().validate()
    for path, value, said in [
        ("optim.steps", 0, "steps"),
        ("optim.lr", -1.0, "lr"),
        ("model.name", "huge", "model"),
        ("optim.clip_grad", -1.0, "clip_grad"),
        ("optim.lr", math.nan, "lr"),
        ("model.pos", "alibi", "pos"),
        ("checkpoint.keep_last", 0, "keep_last"),
        ("seed", 2**31, "seed"),
    ]:
        section, _, name = path.rpartition(".")
        cfg = TrainConfig()
        setattr(getattr(cfg, section) if section else cfg, name, value)
        with pytest.raises(ConfigError, match=f"^{said} ") as e:
            cfg.validate()
        assert e.value.field == path
    with pytest.raises(ConfigError, match="need --optimizer muon") as e:
        TrainConfig(optim=OptimConfig(name="adamw"), checkpoint=CheckpointConfig(resume="latest"))
    assert e.value.field == "checkpoint.resume"
    with pytest.raises(ConfigError, match="needs --optimizer muon") as e:
        TrainConfig(
            optim=OptimConfig(name="adamw"), parallel=DataParallelConfig(pipelined_step=True)
        )
    assert e.value.field == "parallel.pipelined_step"
    cfg = TrainConfig()
    cfg.optim.warmup = cfg.optim.steps + 1  # a config changed after construction is checked again
    with pytest.raises(ConfigError, match="^warmup "):
        cfg.validate()


def test_out_dir_with_a_run_is_refused(tmp_path: Path) -> None:
    outputs.check_out_dir(tmp_path / "new")
    outputs.check_out_dir(tmp_path)  # exists but holds no run
    (tmp_path / outputs.SUMMARY).write_text("{}")
    with pytest.raises(ValueError, match="--overwrite"):
        outputs.check_out_dir(tmp_path)
    outputs.check_out_dir(tmp_path, overwrite=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        outputs.check_out_dir(tmp_path / "file")


# -- the loop, one process -------------------------------------------------------------------


def _tiny(text_file: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        steps=4, batch_size=4, seq_len=16, data=str(text_file), out=str(out), eval_every=2,
        eval_batches=1, progress=False, threads=1, model="micro",
    )  # fmt: skip
    return train_config(**(base | kw))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / outputs.METRICS).read_text().splitlines()]


@pytest.mark.parametrize("optimizer", [pytest.param("muon", marks=pytest.mark.slow), "adamw"])
def test_single_process_run_is_reproducible(tmp_path: Path, text_file: Path, optimizer) -> None:
    a = train(_tiny(text_file, tmp_path / "a", optimizer=optimizer, lr=1e-2))
    b = train(_tiny(text_file, tmp_path / "b", optimizer=optimizer, lr=1e-2))
    ra, rb = _records(tmp_path / "a"), _records(tmp_path / "b")
    assert [r.get("loss") for r in ra] == [r.get("loss") for r in rb]
    assert a["final_val_loss"] == b["final_val_loss"] < a["first_val_loss"]
    assert a["world_size"] == 1 and a["optimizer"] == optimizer and a["steps"] == 4
    for name in outputs.RUN_FILES:
        assert (tmp_path / "a" / name).is_file()
    steps = [r for r in ra if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert {"loss", "lr", "tokens_per_s", "step_s", "grad_norm"} <= set(r)
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert [r["step"] for r in ra if "val_loss" in r] == [0, 2, 4]
    other = train(_tiny(text_file, tmp_path / "c", optimizer=optimizer, lr=1e-2, seed=1))
    assert other["final_loss"] != a["final_loss"]


def test_bfloat16_params_train(tmp_path: Path, text_file: Path) -> None:
    s = train(_tiny(text_file, tmp_path, param_dtype="bfloat16", steps=3, lr=1e-2))
    assert math.isfinite(s["final_loss"]) and s["final_val_loss"] < s["first_val_loss"]


@pytest.mark.parametrize("pos", ["learned", "rope"])
@pytest.mark.parametrize("tie", [True, False])
def test_muon_gets_the_block_matrices_only(tie: bool, pos: str) -> None:
    """The default routing rule, as the train job uses it: the blocks' matrices to Muon; the
    embeddings, the head (tied or not) and the norms to AdamW."""
    import wholeshard

    model = GPT(model_config("tiny", 16, pos=pos, tie=tie))
    ddp = wholeshard.DataParallel(model)
    muon = {r.name for r in ddp.routes if r.matrix}
    assert muon == {
        n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2
    }
    assert not any(n.startswith(("embed", "pos", "head")) for n in muon)


def test_param_dtype_auto_resolves_to_a_supported_dtype() -> None:
    from wholeshard.train.env import resolve_param_dtype

    cpu = torch.device("cpu")
    assert resolve_param_dtype("float32", cpu) == torch.float32
    assert resolve_param_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_param_dtype("auto", cpu) in (torch.float32, torch.bfloat16)


@pytest.mark.parametrize(("amx", "avx512_bf16", "dtype"), [
    (True, False, torch.bfloat16), (False, True, torch.bfloat16), (False, False, torch.float32),
])  # fmt: skip
def test_param_dtype_auto_reads_the_cpus_bf16_units(monkeypatch, amx, avx512_bf16, dtype) -> None:
    import platform

    from wholeshard.train.env import resolve_param_dtype

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert resolve_param_dtype("auto", torch.device("cpu")) == dtype
