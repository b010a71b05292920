"""Job files (`wholeshard train --config job.toml`, `--print-config`): keys are the flags, the
flags given win over the file, the printed config reads back as the same `TrainConfig`, and a bad
file exits 2 naming the file and the key, before any worker starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from torch.distributed.fsdp import MixedPrecisionPolicy

from wholeshard import DataParallelConfig
from wholeshard.cli import build_parser, main
from wholeshard.cli.train import config_from_args
from wholeshard.engine.config import ConfigError
from wholeshard.train import jobfile, sections
from wholeshard.train.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent.parent

MANY = [
    "--seed", "7", "--threads", "3", "--model", "small", "--pos", "learned", "--no-tie",
    "--param-dtype", "bfloat16", "--fp8", "tensorwise", "--gradient-checkpointing",
    "--data-field", "body", "--val-fraction", "0.1", "--cache-dir", "tokens",
    "--data", 'dir with "quotes"\\back\tslash/ü', "--batch-size", "48", "--seq-len", "96",
    "--micro-batch-size", "12",
    "--steps", "90", "--lr", "3.5e-4", "--weight-decay", "0.1", "--warmup", "9",
    "--schedule", "wsd", "--min-lr-ratio", "0.1", "--clip-grad", "0.5", "--on-nonfinite", "skip",
    "--matrix-optimizer", "normuon", "--ns-coefficients", "polar_express", "--qk-clip", "50",
    "--ns-algorithm", "gram",
    "--bucket-size", "123456", "--shard-group-size", "2", "--node-size", "2",
    "--no-overlap-grad-reduce",
    "--overlap-param-gather", "--reshard-after-forward", "--pipelined-step",
    "--checkpoint-every", "30", "--keep-last", "1", "--resume", "auto", "--checkpoint-blocking",
    "--offload-state",
    "--collective-timeout", "12.25", "--max-restarts", "2",
    "--out", "runs/x", "--eval-every", "5", "--eval-batches", "2", "--log-every", "3",
    "--no-progress", "--trace", "t.json",
]  # fmt: skip
"""Flags that set every job-file key to a value other than its default, except those below."""
NOT_IN_MANY = {"data.tokenizer", "optim.name", "optim.newton_schulz", "tp"}
"""(A tokenizer needs a transformers model; `adamw` takes no DataParallel option; only `muon`
takes a Newton-Schulz implementation; tensor parallelism takes neither FP8 nor QK-clip.)"""
OTHERS = [
    ["--model", "hf-config:llama.json", "--tokenizer", "tok"],
    ["--optimizer", "adamw", "--bucket-size", "1000"],
    ["--newton-schulz", "batched_fp32"],
    ["--tp", "2"],
]


pytestmark = pytest.mark.usefixtures("no_launch")


def _config(*argv: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def _printed(capsys: pytest.CaptureFixture, *argv: str) -> str:
    assert main(["train", *argv, "--print-config"]) == 0
    return capsys.readouterr().out


def _error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err
    return err


def test_the_keys_are_the_flags() -> None:
    """Every field with a flag is a key, under its section, and nothing else is."""
    parser = next(
        p for a in build_parser()._subparsers._group_actions for n, p in a.choices.items()
        if n == "train"
    )  # fmt: skip
    dests = {a.dest for a in parser._actions} - {
        "help", "nproc", "config", "print_config", "overlap", "overwrite", "json",
    }  # fmt: skip
    paths = {key.path for table in jobfile.keys().values() for key in table.values()}
    assert paths == dests
    assert "parallel.shard_group_size" in paths and "parallel.param_dtype" not in paths


def test_every_key_of_many_is_not_its_default() -> None:
    cfg = _config(*MANY)
    for table, table_keys in jobfile.keys().items():
        obj = getattr(cfg, table) if table else cfg
        for name, key in table_keys.items():
            if key.path not in NOT_IN_MANY:
                assert getattr(obj, name) != key.field.default, key.path
    for path, argv in zip(sorted(NOT_IN_MANY), OTHERS, strict=True):
        table, _, name = path.rpartition(".")  # a top-level key: no table
        other = _config(*argv)
        theirs, ours = (getattr(other, table), getattr(cfg, table)) if table else (other, cfg)
        assert getattr(theirs, name) != getattr(ours, name)


@pytest.mark.parametrize(
    "argv",
    [[], MANY, ["--shard-group-size", "auto", "--lr", "1e-16"], *OTHERS],
    ids=["default", "many", "auto", "tokenizer", "adamw", "newton-schulz", "tp"],
)
def test_print_config_round_trips(capsys, tmp_path: Path, argv: list[str]) -> None:
    cfg = _config(*argv)
    text = _printed(capsys, *argv)
    assert text == jobfile.dumps(cfg)
    assert jobfile.make_config(jobfile.loads(text)) == cfg
    job = tmp_path / "job.toml"
    job.write_text(text)
    assert _config("--config", str(job)) == cfg
    assert jobfile.read(job) == cfg
    assert _printed(capsys, "--config", str(job)) == text  # fed back: the same file
    assert not (tmp_path / "runs").exists() and not Path("runs/x").exists()


def test_many_reads_back_as_its_values(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(jobfile.dumps(_config(*MANY)))
    cfg = jobfile.read(job)
    assert cfg.model.param_dtype == "bfloat16" and cfg.parallel.shard_group_size == 2
    assert cfg.data.path == 'dir with "quotes"\\back\tslash/ü'
    assert cfg.optim.lr == 3.5e-4 and cfg.reliability.collective_timeout == 12.25
    assert cfg.parallel.overlap_param_gather and not cfg.parallel.overlap_grad_reduce


def test_flags_given_override_the_file_and_only_they(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        "seed = 5\n[data]\nbatch_size = 64\nseq_len = 64\n[optim]\nsteps = 40\n"
        "[output]\nprogress = false\n[parallel]\noverlap_grad_reduce = false\n"
    )
    assert _config("--config", str(job)) == TrainConfig(
        seed=5,
        data=sections.DataConfig(batch_size=64, seq_len=64),
        optim=sections.OptimConfig(steps=40),
        output=sections.OutputConfig(progress=False),
        parallel=DataParallelConfig(overlap_grad_reduce=False),
    )
    cfg = _config("--config", str(job), "--batch-size", "32", "--progress", "--overlap")
    assert cfg.data.batch_size == 32  # given, though it is the flag's default
    assert cfg.output.progress is True and cfg.parallel.overlap_grad_reduce is True
    assert cfg.data.seq_len == 64 and cfg.seed == 5 and cfg.optim.steps == 40  # not given


def test_ints_are_floats_where_a_float_is_wanted() -> None:
    values = jobfile.loads("[optim]\nlr = 1\n[reliability]\ncollective_timeout = 60\n")
    assert values == {"optim.lr": 1.0, "reliability.collective_timeout": 60.0}
    assert all(type(v) is float for v in values.values())


BAD = [
    ("[dta]\nbatch_size = 1\n", "dta", "did you mean data"),
    ("[data]\nbatch = 64\n", "data.batch", "did you mean batch_size"),
    ("batch_size = 64\n", "batch_size", "belongs in [data]"),
    ("[data]\nbatch_size = \"64\"\n", "data.batch_size", "expected integer, got a string"),
    ("[data]\nbatch_size = 6.0\n", "data.batch_size", "got a float"),
    ("[data]\nbatch_size = true\n", "data.batch_size", "got a boolean"),
    ("[output]\nprogress = 1\n", "output.progress", "expected true | false"),
    ("[optim]\nlr = \"fast\"\n", "optim.lr", "expected float"),
    ("[model]\nname = \"huge\"\n", "model.name", "hf-config:FILE.json"),
    ("[parallel]\nshard_group_size = \"most\"\n", "parallel.shard_group_size", '"auto"'),
    ("[parallel]\nmp_policy = \"bfloat16\"\n", "parallel.mp_policy", "model.param_dtype"),
    ("[parallel]\ntimeout = 30\n", "parallel.timeout", "unknown key"),
    ("[parallel]\nmatrix_params = \"f\"\n", "parallel.matrix_params", "Python function"),
    ("data = 3\n", "data", "must be a table"),
    ("[checkpoint]\nresume = 2026-01-01\n", "checkpoint.resume", "got a date"),
    ("[data]\nbatch_size = 0\n", "data.batch_size", "must be >= 1"),
    ("[optim]\nlr = -1.0\n", "optim.lr", "lr must be > 0"),
    ("[parallel]\nbucket_size = 0\n", "parallel.bucket_size", "bucket_size must be"),
    ("[optim]\nname = \"adamw\"\n[parallel]\npipelined_step = true\n", "parallel.pipelined_step",
     "needs --optimizer muon"),
    ("[data]\nbatch_size = 5\n", "data.batch_size", "do not split evenly"),
    ("[data]\npath = \"no/such/file.txt\"\n", "data.path", "no such file"),
]  # fmt: skip


@pytest.mark.parametrize("text, key, why", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_a_bad_file_exits_2_naming_the_file_and_the_key(
    capsys, tmp_path: Path, text: str, key: str, why: str
) -> None:
    job = tmp_path / "job.toml"
    job.write_text(text)
    err = _error(capsys, "--config", str(job), "--out", str(tmp_path / "o"))
    assert f"argument --config: {job}: {key}: " in err and why in err, err
    assert not (tmp_path / "o").exists()


def test_an_unreadable_file_exits_2(capsys, tmp_path: Path) -> None:
    err = _error(capsys, "--config", str(tmp_path / "none.toml"))
    assert "none.toml: cannot read it" in err
    (tmp_path / "bad.toml").write_text("[data\n")
    assert "bad.toml: not valid TOML" in _error(capsys, "--config", str(tmp_path / "bad.toml"))


def test_an_error_names_where_the_value_came_from(capsys, tmp_path: Path) -> None:
    """A check of two fields names the one it reports, from the file or the command line."""
    job = tmp_path / "job.toml"
    job.write_text("[optim]\nwarmup = 50\n")
    err = _error(capsys, "--config", str(job), "--steps", "10")
    assert f"argument --config: {job}: optim.warmup: warmup must be in [0, steps=10]" in err
    job.write_text("[optim]\nsteps = 10\n")
    assert "argument --warmup: " in _error(capsys, "--config", str(job), "--warmup", "50")


def test_what_no_key_holds_is_not_written() -> None:
    with pytest.raises(ConfigError) as exc:
        jobfile.dumps(TrainConfig(parallel=DataParallelConfig(matrix_params=lambda n, p: True)))
    assert exc.value.field == "parallel.matrix_params"
    with pytest.raises(ConfigError, match="cannot be written") as exc:
        jobfile.dumps(TrainConfig(parallel=DataParallelConfig(mp_policy=MixedPrecisionPolicy())))
    assert exc.value.field == "parallel.mp_policy"
    with pytest.raises(ConfigError, match="TOML has no null") as exc:
        jobfile.dumps(TrainConfig(checkpoint=sections.CheckpointConfig(keep_last=None)))
    assert exc.value.field == "checkpoint.keep_last"


def test_strings_are_escaped_exactly() -> None:
    odd = 'a"b\\c\td\ne\x7ff\x00g\u00e9\U0001f600'
    cfg = TrainConfig(data=sections.DataConfig(path=odd), output=sections.OutputConfig(out="x'y"))
    assert jobfile.make_config(jobfile.loads(jobfile.dumps(cfg))) == cfg


def test_the_example_job_file() -> None:
    assert jobfile.read(ROOT / "examples" / "train_tiny.toml") == TrainConfig(
        model=sections.ModelConfig(name="tiny", param_dtype="auto"),
        data=sections.DataConfig(batch_size=32, seq_len=128),
        optim=sections.OptimConfig(
            name="muon", steps=300, lr=0.01, schedule="cosine", clip_grad=1.0
        ),
        parallel=DataParallelConfig(overlap_grad_reduce=True, overlap_param_gather=True),
        checkpoint=sections.CheckpointConfig(every=100, keep_last=3, resume="auto"),
        reliability=sections.ReliabilityConfig(collective_timeout=300.0, max_restarts=2),
        output=sections.OutputConfig(out="runs/tiny", eval_every=50),
    )


def test_the_docs_reference_is_the_default_job() -> None:
    """docs/train.md's generated job file reads back as the default config and names every key
    (set or commented out)."""
    page = (ROOT / "docs" / "train.md").read_text()
    block = re.search(r"make_docs: train-jobfile -->\n```toml\n(.*?)```", page, re.S)
    assert block is not None
    text = block.group(1)
    assert jobfile.make_config(jobfile.loads(text)) == TrainConfig()
    doc = jobfile.tomllib.loads(text)
    for table, table_keys in jobfile.keys().items():
        for name in table_keys:
            written = name in (doc.get(table, {}) if table else doc)
            assert written or re.search(rf"^# {name} = .*\(not set\)$", text, re.M), name
