"""`wholeshard export CKPT OUT --format hf`: a checkpoint of a transformers model as a transformers
model directory that `from_pretrained` loads with the trained logits, bit for bit in fp32.

One 2-rank launch trains tiny Llama, GPT-2 (head tied to the embedding) and Qwen3-MoE models
loaded from model directories (`hf_support`) two steps each and saves a checkpoint of each with
`extra={"hf": hf_extra(model, tokenizer)}`; the tests export those in the test process.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import ADAMW_KW, MUON_KW, data_parallel, make_model, mp, run

import wholeshard
from wholeshard import cli
from wholeshard.checkpoint import (
    CheckpointError,
    export_hf,
    hf_extra,
    load_consolidated,
    save_checkpoint,
)

hf_support = pytest.importorskip("hf_support")
transformers = hf_support.transformers

KINDS = ("llama", "gpt2", "qwen3_moe")
DDP_KW = {  # the save's plan must not matter: qwen3_moe is saved fully sharded
    "llama": {},
    "gpt2": {},
    "qwen3_moe": dict(bucket_size=4000, reshard_after_forward=True),
}
STEPS, BATCH, SEQ = 2, 4, 16


def tokens(step: int, batch: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, hf_support.VOCAB, (batch, SEQ + 1), generator=g)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Forward as the forked ranks do (one thread each), so sums run in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad(), one_thread():
        return model(tokens(99)[:, :-1]).logits.detach().clone()


def load(directory: Path, **kw) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, **kw)


def _train_and_save(dirs: dict[str, Path], root: Path) -> dict[str, torch.Tensor]:
    """On each rank: train each model two steps, save it; rank 0's logits after the last step."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for kind, directory in dirs.items():
        model = load(directory, dtype=torch.float32)
        tok = transformers.AutoTokenizer.from_pretrained(directory)
        ddp = data_parallel(model, mp_policy=mp(torch.float32), **DDP_KW[kind])
        opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
        for step in range(STEPS):
            data = tokens(step).tensor_split(world)[rank]
            out_logits = ddp(data[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                out_logits.reshape(-1, out_logits.shape[-1]), data[:, 1:].reshape(-1)
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
        save_checkpoint(root / kind, ddp, opt, extra={"hf": hf_extra(model, tok), "step": STEPS})
        with ddp.full_params():
            out[kind] = logits(model)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, torch.Tensor]]:
    """kind -> (its model directory, its checkpoints directory, the trained model's logits)."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {kind: hf_support.model_dir(root / "models", kind) for kind in KINDS}
    recorded = run(_train_and_save, 2, dirs, root / "ckpts")[0]
    return {kind: (dirs[kind], root / "ckpts" / kind, recorded[kind]) for kind in KINDS}


@pytest.fixture(scope="module")
def byte_model_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process checkpoint of a model that is not a transformers one (no extra["hf"])."""
    ddp = wholeshard.DataParallel(make_model())
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    return save_checkpoint(tmp_path_factory.mktemp("byte"), ddp, opt)


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_with_the_trained_logits(trained, tmp_path: Path, kind: str) -> None:
    source, ckpt, recorded = trained[kind]
    assert not torch.equal(logits(load(source)), recorded), "training changed nothing"
    tensors, _ = load_consolidated(ckpt)
    for out, shard_size, shards in ((tmp_path / "one", "5GB", 1), (tmp_path / "many", "20KB", 3)):
        assert export_hf(ckpt, out, max_shard_size=shard_size) == out
        weights = sorted(p.name for p in out.glob("*.safetensors"))
        assert len(weights) >= shards, weights
        assert (out / "model.safetensors.index.json").exists() == (shards > 1), weights
        model = load(out)
        assert model.dtype == torch.float32
        assert torch.equal(logits(model), recorded), f"{kind}: exported logits differ"
        state = model.state_dict()
        assert state.keys() == tensors.keys()
        assert all(torch.equal(state[k], t) for k, t in tensors.items())
        if kind == "gpt2":  # the head is tied to the embedding, as in the trained model
            assert model.lm_head.weight is model.transformer.wte.weight
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    original = transformers.AutoTokenizer.from_pretrained(source)
    exported = transformers.AutoTokenizer.from_pretrained(out)
    text = "def add(a, b): the quick brown fox"
    assert exported(text)["input_ids"] == original(text)["input_ids"]
    assert exported.eos_token == original.eos_token
    saved = json.loads((source / "generation_config.json").read_text())
    assert json.loads((out / "generation_config.json").read_text()) == saved


def test_export_in_bfloat16(trained, tmp_path: Path) -> None:
    _, ckpt, _ = trained["llama"]
    out = export_hf(ckpt, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = load(out)
    assert model.dtype == torch.bfloat16
    tensors, _ = load_consolidated(ckpt, dtype=torch.bfloat16)
    state = model.state_dict()
    assert all(torch.equal(state[k], t) for k, t in tensors.items())


def test_cli(trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, ckpt, recorded = trained["gpt2"]
    out = tmp_path / "gpt2"
    argv = ["export", str(ckpt), str(out), "--format", "hf", "--max-shard-size", "30KB"]
    assert cli.main(argv) == 0
    assert f"wrote a transformers model directory to {out}" in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").exists()
    assert torch.equal(logits(load(out)), recorded)
    capsys.readouterr()  # transformers' progress bars

    assert cli.main(argv) == 1  # exists
    err = capsys.readouterr().err
    assert err.startswith("wholeshard export: ") and "already exists" in err, err
    assert "--overwrite" in err and "export_hf(..., overwrite=True)" in err

    code = cli.main(
        ["export", str(ckpt), str(tmp_path / "m.safetensors"), "--max-shard-size", "1GB"]
    )
    err = capsys.readouterr().err
    assert code == 1 and "--max-shard-size needs --format hf" in err, err
    code = cli.main(
        ["export", str(ckpt), str(tmp_path / "bad"), "--format", "hf", "--max-shard-size", "lots"]
    )
    assert code == 1 and capsys.readouterr().err.startswith("wholeshard export: ")
    assert not (tmp_path / "bad").exists()


def test_overwrite_replaces_a_file_or_a_directory(trained, tmp_path: Path) -> None:
    _, ckpt, recorded = trained["llama"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("the user's own file")
    with pytest.raises(FileExistsError, match=r"overwrite=True"):
        export_hf(ckpt, out)
    assert (out / "mine.txt").read_text() == "the user's own file"
    export_hf(ckpt, out, overwrite=True)
    assert not (out / "mine.txt").exists() and torch.equal(logits(load(out)), recorded)
    export_hf(ckpt, out, overwrite=True, max_shard_size="20KB")  # over an export
    assert (out / "model.safetensors.index.json").exists()
    assert not (out / "model.safetensors").exists()  # nothing left of the one before
    file = tmp_path / "file"
    file.write_text("x")
    export_hf(ckpt, file, overwrite=True)
    assert torch.equal(logits(load(file)), recorded)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]  # no temp left


def test_a_checkpoint_without_hf_extra_is_refused(
    byte_model_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"--format safetensors exports its weights"):
        export_hf(byte_model_ckpt, out)
    assert cli.main(["export", str(byte_model_ckpt), str(out), "--format", "hf"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("wholeshard export: ") and "hf:DIR|hf-config:FILE" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temp directory


def test_a_damaged_checkpoint_is_refused_before_anything_is_written(
    trained, tmp_path: Path
) -> None:
    _, ckpt, _ = trained["llama"]
    copy = tmp_path / "step"
    shutil.copytree(ckpt / (ckpt / "latest").read_text().strip(), copy)
    trainer = copy / "trainer.pt"
    data = bytearray(trainer.read_bytes())
    data[-20] ^= 1
    trainer.write_bytes(bytes(data))
    (tmp_path / "exports").mkdir()
    with pytest.raises(CheckpointError, match="fails its checksum"):
        export_hf(copy, tmp_path / "exports" / "out")
    assert list((tmp_path / "exports").iterdir()) == []


@pytest.mark.parametrize(
    "missing", [["transformers"], ["safetensors"], ["safetensors", "transformers"]]
)
def test_without_the_hf_extra_the_error_says_what_to_install(
    trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, missing: list[str]
) -> None:
    """Naming the packages, the extra and what the checkpoint needs (`hf_extra`), in one line:
    safetensors missing used to surface as transformers' "Could not import module
    'LlamaConfig'"."""
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'wholeshard\[hf\]'"):
        export_hf(trained["llama"][1], tmp_path / "out")
    assert (
        cli.main(["export", str(trained["llama"][1]), str(tmp_path / "out"), "--format", "hf"]) == 1
    )
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(
        f"wholeshard export: export_hf (--format hf) needs {' and '.join(missing)} "
    )
    assert f"(or: pip install {' '.join(missing)})" in err
    assert "wholeshard.checkpoint.hf_extra(model, tokenizer)" in err
    assert list(tmp_path.iterdir()) == []
