"""What `WholeshardTrainer`, and the mixin on TRL's `SFTTrainer`, refuse or print when they
start, at 2 forked gloo ranks set up as torchrun sets up its workers (RANK, LOCAL_RANK,
WORLD_SIZE, the process group joined): `TrainingArguments` set up for one process (on CPU
without `use_cpu=True`, transformers 5 deals every rank the same batches), an `optim` they would
ignore, and the routing line on the world process zero.

One launch builds every trainer; the TRL cases run where TRL is installed.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
from support import GLOBAL_BATCH, rank_world

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from lm_case import Refusals, dataset, llama  # noqa: E402
from support import run  # noqa: E402

from wholeshard.integrations.start import check_process_count  # noqa: E402
from wholeshard.integrations.transformers import (  # noqa: E402
    WholeshardTrainer,
    WholeshardTrainerMixin,
)

try:
    import datasets
    import tokenizers
    import trl
except ImportError:
    trl = None

STEPS = 2
ROWS = len(dataset())  # 4 global batches: 2 steps are half an epoch when each rank reads its own
ARGS = dict(
    max_steps=STEPS,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    save_strategy="no",
    train_sampling_strategy="sequential",
)
ROUTING = "wholeshard routing: 14 matrices"
needs_trl = pytest.mark.skipif(trl is None, reason="TRL is not installed")

if trl is not None:

    class WholeshardSFTTrainer(WholeshardTrainerMixin, trl.SFTTrainer):
        """The mixin on TRL's `SFTTrainer`, as docs/integrations.md shows it."""


def trainer(out: Path, sft: bool = False, **kw: Any) -> Any:
    """A trainer of `llama()` on `dataset()`: `WholeshardTrainer`, or (`sft`) the mixin on
    `SFTTrainer` with the dataset pre-tokenized; `kw`: `TrainingArguments` (`SFTConfig`)."""
    args = dict(ARGS, output_dir=str(out), per_device_train_batch_size=GLOBAL_BATCH // 2) | kw
    if not sft:
        return WholeshardTrainer(
            model=llama(), args=transformers.TrainingArguments(**args), train_dataset=dataset()
        )
    rows = [{"input_ids": d["input_ids"].tolist()} for d in dataset()]
    vocab = tokenizers.Tokenizer(tokenizers.models.BPE())  # the rows come tokenized
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=vocab, eos_token="<eos>", pad_token="<eos>"
    )
    return WholeshardSFTTrainer(
        model=llama(),
        args=trl.SFTConfig(**args | dict(bf16=False)),  # SFTConfig's default: bf16 where it can
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )


def printed(fn: Any) -> tuple[Any, str]:
    """`fn()`'s value and what it printed to stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        value = fn()
    return value, out.getvalue()


def _starts(tmp: Path) -> dict[str, Any]:
    rank, _ = rank_world()
    cases = {
        "Trainer without use_cpu": dict(use_cpu=False),
        "Trainer optim=sgd": dict(optim="sgd"),
        "Trainer optim_args": dict(optim_args="foreach=False"),
        "Trainer optim=adamw_torch": dict(optim="adamw_torch"),  # torch's AdamW: accepted
        "Trainer optim default": {},
    }
    if trl is not None:
        cases |= {
            "SFTTrainer without use_cpu": dict(sft=True, use_cpu=False),
            "SFTTrainer optim=adafactor": dict(sft=True, optim="adafactor"),
            "SFTTrainer optim default": dict(sft=True),
        }
    refusals, world_sizes = Refusals(), {}
    for name, kw in cases.items():

        def start(name: str = name, kw: dict = kw) -> None:
            world_sizes[name] = trainer(tmp / f"refused-{rank}", **kw).args.world_size

        refusals.check(name, start)
    out: dict[str, Any] = {"refusals": dict(refusals), "world sizes": world_sizes}
    if trl is not None:
        sft = trainer(tmp / "sft", sft=True)
        _, out["sft printed"] = printed(sft.train)
        out["sft epoch"] = sft.state.epoch
    # `log_level` above WARNING silences the line with transformers' own output (last: it sets
    # transformers' verbosity for the process).
    quiet = trainer(tmp / "quiet", log_level="error")
    _, out["quiet printed"] = printed(quiet.create_optimizer)
    loud = trainer(tmp / "loud", log_level="info")
    _, out["loud printed"] = printed(loud.create_optimizer)
    transformers.logging.set_verbosity_warning()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(_starts, 2, tmp_path_factory.mktemp("setup"))


def test_trainer_set_up_for_one_process_under_two_is_refused_on_every_rank(
    ranks: list[dict],
) -> None:
    """transformers 5 on CPU without `use_cpu=True` sets `TrainingArguments` up as one process
    (`world_size=1`) under torchrun's 2: every rank would read the same batches."""
    for out in ranks:
        assert_own_batches_or_refused(out, "Trainer without use_cpu")


def assert_own_batches_or_refused(out: dict[str, Any], case: str) -> None:
    """`case` was refused on this rank naming `use_cpu=True`, or the transformers and Accelerate
    release set the Trainer up for torch.distributed's 2 processes itself (each rank reads its
    own batches: accelerate 1.10 finds the multi-process CPU run unasked)."""
    got = out["refusals"][case]
    if got == "no error":
        assert out["world sizes"][case] == 2
    else:
        assert got.startswith("ValueError: Trainer is set up for 1 process(es) but ")
        assert "torch.distributed has 2" in got and "use_cpu=True" in got


@needs_trl
def test_sft_trainer_with_the_mixin_is_refused_alike_and_trains_its_own_batches(
    ranks: list[dict],
) -> None:
    for out in ranks:
        assert_own_batches_or_refused(out, "SFTTrainer without use_cpu")
        # With `use_cpu=True` the ranks read their own rows: 2 steps of 2 x 6 are half of the
        # 48 (a quarter if both read the same 6).
        assert out["sft epoch"] == pytest.approx(STEPS * GLOBAL_BATCH / ROWS) == 0.5


def test_the_process_counts_are_compared_both_ways() -> None:
    """One process without a group passes, a framework set up for more processes than
    torch.distributed has is refused too. Where Trainer sees the real world size (`use_cpu=True`
    on CPU, torchrun's LOCAL_RANK on GPUs) the counts agree: every 2-rank run here and in
    test_transformers_trainer.py."""
    check_process_count("Trainer", 1, "unused")
    with pytest.raises(ValueError, match=r"set up for 2 process\(es\) but torch.distributed has 1"):
        check_process_count("Trainer", 2, "the fix")


def test_an_optim_the_trainer_would_ignore_is_refused_naming_the_fix(ranks: list[dict]) -> None:
    for out in ranks:
        got = out["refusals"]
        for name, given in {
            "Trainer optim=sgd": "optim='sgd'",
            "Trainer optim_args": "optim_args='foreach=False'",
        }.items():
            expected = f"ValueError: WholeshardTrainer got TrainingArguments({given}), "
            assert got[name].startswith(expected)
            assert "matrix=, adamw=, matrix_optimizer=" in got[name]
        assert got["Trainer optim=adamw_torch"] == "no error"
        assert got["Trainer optim default"] == "no error"


@needs_trl
def test_sft_configs_default_optim_passes_and_another_is_refused(ranks: list[dict]) -> None:
    for out in ranks:
        got = out["refusals"]
        assert got["SFTTrainer optim default"] == "no error"
        assert "TrainingArguments(optim='adafactor')" in got["SFTTrainer optim=adafactor"]


@needs_trl
def test_the_routing_line_is_printed_once_on_the_world_process_zero(ranks: list[dict]) -> None:
    """During a real `train()`, at transformers' default verbosity (WARNING), where a
    `logger.info` line is not shown."""
    zero, one = ranks
    lines = [line for line in zero["sft printed"].splitlines() if ROUTING in line]
    assert lines == [
        "wholeshard routing: 14 matrices (20,480 params) to Muon, 7 tensors (4,256 params) to AdamW"
    ]
    assert ROUTING not in one["sft printed"]


def test_the_routing_line_follows_transformers_log_level(ranks: list[dict]) -> None:
    zero, one = ranks
    assert zero["quiet printed"] == ""
    assert zero["loud printed"].count(ROUTING) == 1
    assert one["loud printed"] == ""  # `log_level` is the main process's; replicas: warning
