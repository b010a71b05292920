"""How the global batch splits over the world the job finds: `BatchSplit`.

The global batch (`data.batch_size` sequences per optimizer step) and its order
(`data.train_batch`, [Note: batches]) belong to the job, not to the world that runs it: a job
that restarts at another world size (torchrun's elastic `--nnodes=MIN:MAX`) steps on the same
batches. What follows the world is how a step's batch is cut: each of `dp` data-parallel ranks
takes a contiguous `batch_size / dp` slice, and runs it through forward and backward in
`accumulation` equal micro-batches of at most `data.micro_batch_size` sequences (gradients
accumulated locally, reduced once per step). Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

LISTED_DP = 1024
"""The most data-parallel ranks the refusal of a world lists world sizes for."""


@dataclass(frozen=True)
class BatchSplit:
    """One step's global batch on `dp` data-parallel ranks: `per_rank` sequences each, in
    `accumulation` micro-batches of `micro` (`per_rank == micro * accumulation`,
    `batch_size == dp * per_rank`)."""

    batch_size: int
    dp: int
    per_rank: int
    micro: int
    accumulation: int

    def describe(self) -> str:
        """`32 sequences per step = 2 ranks x 16 (2 micro-batches of 8)`."""
        ranks = f"{self.dp} rank{'s' if self.dp > 1 else ''}"
        text = f"{self.batch_size} sequences per step = {ranks} x {self.per_rank}"
        if self.accumulation > 1:
            text += f" ({self.accumulation} micro-batches of {self.micro})"
        return text


def fits(batch_size: int, micro_batch_size: int | None, dp: int) -> bool:
    """Whether `dp` ranks split `batch_size` sequences evenly, and each rank's share into equal
    micro-batches of at most `micro_batch_size` (None: no limit)."""
    if batch_size % dp:
        return False
    per_rank = batch_size // dp
    return (
        micro_batch_size is None
        or per_rank <= micro_batch_size
        or (per_rank % micro_batch_size == 0)
    )


def split_batch(batch_size: int, micro_batch_size: int | None, dp: int, tp: int = 1) -> BatchSplit:
    """The split of `batch_size` sequences over `dp` data-parallel ranks (world = dp x tp);
    ValueError naming the world sizes that can split it where `dp` cannot."""
    if not fits(batch_size, micro_batch_size, dp):
        micro = "" if micro_batch_size is None else f" in micro-batches of {micro_batch_size}"
        top = min(batch_size, LISTED_DP)
        can = [tp * d for d in range(1, top + 1) if fits(batch_size, micro_batch_size, d)]
        ranks = f"{dp} data-parallel ranks" + (f" ({dp * tp} ranks / tp {tp})" if tp > 1 else "")
        upto = f" (up to {LISTED_DP * tp})" if top < batch_size else ""
        raise ValueError(
            f"batch_size={batch_size} sequences{micro} do not split evenly over the {ranks}; "
            f"world sizes that can{upto}: {', '.join(map(str, can))}; or use a batch_size that "
            f"is a multiple of {dp * (micro_batch_size or 1)}"
        )
    per_rank = batch_size // dp
    micro = per_rank if micro_batch_size is None else min(per_rank, micro_batch_size)
    return BatchSplit(batch_size, dp, per_rank, micro, per_rank // micro)
