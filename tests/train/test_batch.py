"""The global batch and its order are the job's, whatever the world size
(`wholeshard.train.batch`): the per-rank slice and the micro-batches follow the world, a world
that cannot split the batch is refused naming the sizes that can, and accumulated micro-batches
train as the full batch at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import run, train_config

from wholeshard.engine.config import ConfigError
from wholeshard.train import data, outputs, trainer
from wholeshard.train.batch import BatchSplit, split_batch


@pytest.mark.parametrize(
    "batch,micro,dp,split",
    [
        (32, None, 2, BatchSplit(32, 2, 16, 16, 1)),
        (32, 8, 2, BatchSplit(32, 2, 16, 8, 2)),
        (32, 8, 1, BatchSplit(32, 1, 32, 8, 4)),
        (32, 8, 8, BatchSplit(32, 8, 4, 4, 1)),  # a share below the micro-batch: at once
    ],
)
def test_the_split_follows_the_world(
    batch: int, micro: int | None, dp: int, split: BatchSplit
) -> None:
    assert split_batch(batch, micro, dp) == split
    assert split.dp * split.micro * split.accumulation == batch


@pytest.mark.parametrize(
    "batch,micro,dp,tp,can",
    [
        (4, None, 3, 1, "sizes that can: 1, 2, 4; or use a batch_size that is a multiple of 3"),
        (32, 8, 3, 1, "world sizes that can: 1, 2, 4, 8, 16, 32;"),
        (24, 8, 2, 1, "world sizes that can: 1, 3, 4, 6, 8, 12, 24;"),  # not 2: 12 a rank
        (4, None, 3, 2, "over the 3 data-parallel ranks (6 ranks / tp 2); world sizes that can: 2, "
         "4, 8;"),
        (10**400, None, 3, 1, "world sizes that can (up to 1024): 1, 2, 4, 5, 8, 10, 16,"),
    ],
)  # fmt: skip
def test_a_world_that_cannot_split_the_batch_names_those_that_can(
    batch: int, micro: int | None, dp: int, tp: int, can: str
) -> None:
    with pytest.raises(ValueError) as e:
        split_batch(batch, micro, dp, tp)
    assert can in str(e.value) and "\n" not in str(e.value)


def test_the_config_refuses_the_world_on_its_batch_field() -> None:
    cfg = train_config(batch_size=4, micro_batch_size=2)
    assert cfg.batch_split(2) == BatchSplit(4, 2, 2, 2, 1)
    with pytest.raises(ConfigError) as e:
        cfg.data_parallel_size(3)
    assert e.value.field == "data.batch_size"
    assert "world sizes that can: 1, 2, 4;" in str(e.value)


def test_the_data_order_is_the_same_at_every_world_size() -> None:
    """Rank slices, and their micro-batches, laid end to end are the 1-rank batch, bitwise."""
    text = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    for step in (1, 7):
        whole = data.train_batch(text, step, 8, 16, seed=3, rank=0, world=1)
        for world, micro in ((2, None), (4, None), (8, None), (2, 2), (1, 4)):
            split = split_batch(8, micro, world)
            pieces = []
            for rank in range(world):
                x, y = data.train_batch(text, step, 8, 16, seed=3, rank=rank, world=world)
                pieces += zip(x.split(split.micro), y.split(split.micro), strict=True)
            assert len(pieces) == world * split.accumulation
            for got, want in zip(zip(*pieces, strict=True), whole, strict=True):
                assert torch.equal(torch.cat(got), want), (step, world, micro)


def _losses(tmp: str, name: str, **flags: object) -> tuple[list[float], set[int]]:
    """The run's training losses, and the batch sizes its training forwards saw."""
    out = Path(tmp) / name
    cfg = train_config(
        steps=4, batch_size=4, seq_len=16, data=str(Path(tmp) / "text.txt"), out=str(out),
        eval_every=2, eval_batches=1, progress=False, threads=1, param_dtype="float32",
        model="micro", **flags,
    )  # fmt: skip
    seen, loss = set(), trainer.Trainer.loss

    def counted(self: trainer.Trainer, x: torch.Tensor, *args: object, **kw: object):
        if self.module.training:
            seen.add(x.shape[0])
        return loss(self, x, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer.Trainer, "loss", counted)
        trainer.train(cfg)
    lines = (out / outputs.METRICS).read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r], seen


def test_accumulated_micro_batches_train_as_the_full_batch(tmp_path: Path, text_file: Path) -> None:
    """Against the reference (one process, the full batch at once): one process in 4
    micro-batches, and 2 ranks in 2 each (all but the last under `no_sync`)."""
    (tmp_path / "text.txt").write_bytes(text_file.read_bytes())
    full, full_seen = _losses(str(tmp_path), "full")
    alone, alone_seen = _losses(str(tmp_path), "alone", micro_batch_size=1)
    ranks, ranks_seen = run(_losses, 2, str(tmp_path), "ranks", micro_batch_size=1)[0]
    assert (full_seen, alone_seen, ranks_seen) == ({4}, {1}, {1})
    assert len(full) == len(alone) == len(ranks) == 4
    assert alone == pytest.approx(full, rel=2e-3) and ranks == pytest.approx(full, rel=2e-3)
