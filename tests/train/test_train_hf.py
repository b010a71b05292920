"""`wholeshard train --model hf:DIR` end to end: tiny Llama, GPT-2 and Qwen3-MoE saved in a
temporary directory with a tokenizer trained offline, a JSONL corpus, 2 ranks with checkpoints,
a crash and a bitwise resume, `wholeshard export --format hf`, and the exported model loaded with
`from_pretrained` giving the run's own validation loss."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from unittest import mock

import hf_support
import pytest
import torch
import torch.nn.functional as F
from support import train_config
from train_faults import Fault, metrics, train_job

from wholeshard import cli
from wholeshard.distributed import launch
from wholeshard.train import data
from wholeshard.train.model import build_model
from wholeshard.train.sections import DataConfig
from wholeshard.train.tokens import load_data

transformers = hf_support.transformers
SEQ = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_support.jsonl(tmp_path_factory.mktemp("corpus") / "docs.jsonl", docs=80)


def train(model: str, corpus: Path, out: Path, *extra: str, fault: Fault | None = None) -> dict:
    argv = [
        "train", "--model", model, "--data", str(corpus), "--out", str(out), "--nproc", "2",
        "--steps", "6", "--batch-size", "4", "--seq-len", str(SEQ), "--eval-every", "3",
        "--eval-batches", "2", "--no-progress", "--param-dtype", "float32",
        "--checkpoint-every", "3", "--cache-dir", str(out.parent / "token-cache"), *extra,
    ]  # fmt: skip
    return train_job(argv, out, fault)


def val_loss_of(model: torch.nn.Module, tokenizer, corpus: Path, cache: Path) -> float:
    """The job's validation loss (its windows, its batches) of `model` in one process."""
    cfg = DataConfig(path=str(corpus), batch_size=4, seq_len=SEQ)
    text = load_data(cfg, tokenizer=tokenizer, vocab_size=model.config.vocab_size, cache_dir=cache)
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in data.val_batches(text.val, 2, 4, SEQ, 0, 1):
            logits = model(input_ids=x).logits.float()
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").double()
            count += y.numel()
    return float(total / count)


MODES = {  # each model in another of the job's modes
    "llama": ["--overlap"],
    "gpt2": ["--reshard-after-forward", "--overlap"],
    "qwen3_moe": ["--pipelined-step", "--bucket-size", "3000"],
}


def resume_after_a_kill(model_dir: Path, corpus: Path, tmp_path: Path) -> None:
    """Rank 1 SIGKILLed after step 5, then `--resume latest` at 2 ranks: bitwise the straight
    run. Its step-3 checkpoint resumed at 1 rank: the same batches (a function of the seed and
    the step), so the same losses up to the gradient sum's order."""
    model, mode, want = f"hf:{model_dir}", MODES["llama"], metrics(tmp_path / "straight")
    out = tmp_path / "crashed"
    assert train(model, corpus, out, *mode, fault=Fault(1, 5, "kill"))["code"] == 1
    assert train(model, corpus, out, *mode, "--resume", "latest")["code"] == 0
    got = metrics(out)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert [r["loss"] for r in got[1:]] == [r["loss"] for r in want[1:]]
    assert got[-1]["val_loss"] == want[-1]["val_loss"]
    step3 = tmp_path / "straight" / "checkpoints" / "step-3"
    one = tmp_path / "one-rank"
    resumed = train(model, corpus, one, *mode, "--resume", str(step3), "--nproc", "1")
    assert resumed["code"] == 0
    got = {r["step"]: r["loss"] for r in metrics(one) if "loss" in r}
    assert sorted(got) == [4, 5, 6]
    for r in want:
        if r["step"] in got:
            assert math.isclose(got[r["step"]], r["loss"], rel_tol=1e-5), (r["step"], got)


@pytest.mark.parametrize(  # one model in the default suite; the others in `make soak`
    "kind", ["gpt2", *(pytest.param(k, marks=pytest.mark.slow) for k in ("llama", "qwen3_moe"))]
)
def test_train_resume_export_load(kind: str, corpus: Path, tmp_path: Path) -> None:
    model_dir = hf_support.model_dir(tmp_path, kind)
    straight = train(f"hf:{model_dir}", corpus, tmp_path / "straight", *MODES[kind])
    assert straight["code"] == 0
    summary = straight["summary"]
    assert summary["final_loss"] < summary["first_val_loss"]
    if kind == "llama":
        resume_after_a_kill(model_dir, corpus, tmp_path)
    exported = tmp_path / "exported"
    ckpts = tmp_path / "straight" / "checkpoints"
    assert cli.main(["export", str(ckpts), str(exported), "--format", "hf"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported, local_files_only=True)
    model.eval()
    # The run's last validation loss came from 2 ranks' sums (another order): equal to 1e-6.
    got = val_loss_of(model, tokenizer, corpus, tmp_path / "token-cache")
    assert math.isclose(got, summary["final_val_loss"], rel_tol=1e-6), (got, summary)


def test_config_file_model_trains_on_bytes(text_file: Path, tmp_path: Path) -> None:
    """`hf-config:FILE` (random init) without a tokenizer reads bytes (its vocab is 300)."""
    config = hf_support.config_file(tmp_path, "llama")
    out = tmp_path / "run"
    argv = [
        "train", "--model", f"hf-config:{config}", "--data", str(text_file), "--out", str(out),
        "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
        "--no-progress", "--param-dtype", "float32", "--gradient-checkpointing",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    records = metrics(out)
    assert records[0]["val_loss"] == pytest.approx(math.log(300), rel=0.05)  # ~uniform
    assert math.isfinite(records[-1]["loss"])


@pytest.mark.slow
def test_gradient_checkpointing_changes_no_bit(text_file: Path, tmp_path: Path) -> None:
    """Recomputing the byte GPT's blocks in backward gives the same losses, bitwise."""
    runs = []
    for flags in ([], ["--gradient-checkpointing"]):
        out = tmp_path / f"run{len(runs)}"
        argv = [
            "train", "--model", "micro", "--data", str(text_file), "--out", str(out),
            "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
            "--no-progress", "--param-dtype", "float32", *flags,
        ]  # fmt: skip
        assert cli.main(argv) == 0
        runs.append([r.get("loss") for r in metrics(out)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("hf:{tmp}/missing", "is not a directory"),
        ("hf-config:{tmp}/missing.json", "no such file"),
        ("gpt-5", "model must be one of"),
        ("hf-config:{tmp}/llama.json --tokenizer {tmp}/none", "is not a directory"),
    ],
)
def test_bad_models_are_named(tmp_path: Path, capsys, model: str, message: str) -> None:
    hf_support.config_file(tmp_path, "llama")
    argv = ["train", "--model", *model.format(tmp=tmp_path).split(), "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--steps", "1", "--no-progress"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("package", ["transformers", "safetensors"])
def test_a_missing_hf_package_is_named_before_any_worker(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, package: str
) -> None:
    """safetensors too: without it transformers imports, then fails in every worker."""
    monkeypatch.setitem(sys.modules, package, None)  # not importable
    config = hf_support.config_file(tmp_path, "llama")
    argv = ["train", "--model", f"hf-config:{config}", "--out", str(tmp_path / "run")]
    with mock.patch.object(launch, "launch", side_effect=AssertionError("workers were started")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert f"needs {package!r}: pip install 'wholeshard[hf]'" in err, err


def test_router_loss_is_added_as_the_config_says(tmp_path: Path) -> None:
    """Qwen3-MoE with `output_router_logits`: the job's forward returns the router's
    load-balancing loss times `router_aux_loss_coef`, as transformers adds it to its own loss;
    without the flag, none."""
    for router in (True, False):
        config = hf_support.config("qwen3_moe")
        config.output_router_logits = router
        path = tmp_path / f"moe-{router}.json"
        config.to_json_file(path)
        job = build_model(train_config(model=f"hf-config:{path}", seq_len=16))
        x = torch.randint(0, 300, (2, 16))
        logits, aux = job.forward(job.module, x)
        out = job.module(input_ids=x, labels=x, output_router_logits=router)
        if not router:
            assert aux is None
            continue
        shifted = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
        torch.testing.assert_close(shifted + aux, out.loss)
        assert aux > 0
