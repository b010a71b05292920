"""The training case every framework test runs: a tiny Llama, `support.batch(s)`'s rows as the
dataset, one set of optimizer settings, and the one-process torch Muon + AdamW reference.

Frameworks deal batch k of a sequentially sampled dataset to rank k % world, so with a
per-rank batch of `GLOBAL_BATCH // world` rows, rank r's batch at step s is
`support.local_batch(s, r, world)`'s rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support import GLOBAL_BATCH, VOCAB, batch, rank_world, reference_run, run

transformers = pytest.importorskip("transformers")
hf_support = pytest.importorskip("hf_support")

STEPS = 4
CLIP = 0.05  # below every step's gradient norm (about 0.6): every step is clipped
MUON = dict(lr=0.01, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")  # torch's defaults else
ADAMW = dict(lr=0.01, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-4)
"""eps 1e-4, not torch's 1e-8: with every step clipped, some embedding element's gradient is a
cancellation near zero (-2.5e-7 at step 1 here, against a median of 5e-4), which AdamW turns
into a step of nearly +-lr; summed in another row order (a sampler dealing rows to ranks) its
sign can flip, 2 * lr off the reference. With eps 1e-4 a residue d moves the step by at most
2 * lr * d / eps, far inside the tolerance, while ordinary gradients keep most of Adam's scale."""


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hf_support.config("llama", VOCAB, 16))


def dataset(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """Every step's global batch, `SEQ + 1` tokens a row (the model shifts the labels)."""
    rows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in map(batch, range(steps))])
    return [{"input_ids": r, "labels": r} for r in rows]


def local_rows(step: int, interleaved: bool = False) -> torch.Tensor:
    """This rank's rows of `step`'s global batch: a contiguous block, or (`interleaved`, as a
    `DistributedSampler` deals them) every world-th row from the rank's."""
    rank, world = rank_world()
    n = GLOBAL_BATCH // world
    rows = torch.stack([d["input_ids"] for d in dataset(step + 1)[step * GLOBAL_BATCH :]])
    return rows[rank::world] if interleaved else rows[rank * n : (rank + 1) * n]


def reference(clip: float | None = None) -> dict[str, Any]:
    """The one-process reference on the full batches (`clip`: the norms it clips by)."""
    return reference_run(STEPS, make=llama, muon_kw=MUON, adamw_kw=ADAMW, clip=clip)


class Refusals(dict):
    """What each call raised (its type and message), by name; "no error" if nothing."""

    def check(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            self[name] = "no error"
        except Exception as e:
            self[name] = f"{type(e).__name__}: {e}"


def launch(tmp: Path, two_ranks: Callable, one_rank: Callable) -> dict[str, Any]:
    """`two_ranks(tmp)` on 2 processes, then `one_rank(tmp)` on 1 (it resumes what they
    saved): `{"ranks": their results, "one": its result, "tmp": tmp}`."""
    outs = run(two_ranks, 2, tmp)
    (one,) = run(one_rank, 1, tmp)
    return {"ranks": outs, "one": one, "tmp": tmp}


def own_step(ddp: Any, opt: Any, x: torch.Tensor, clip: float) -> tuple[float, float]:
    """One step of wholeshard's own loop on this rank's rows `x`: (its loss, the global norm
    before clipping to `clip`)."""
    loss = ddp(input_ids=x, labels=x).loss
    loss.backward()
    norm = opt.clip_grad_norm_(clip).item()
    opt.step()
    opt.zero_grad()
    return loss.item(), norm


@contextlib.contextmanager
def clipping_replaced(*places: tuple[Any, str]) -> Iterator[None]:
    """Each `(owner, name)` of a framework's norm clipping that this release has (accelerate
    1.16's `_clip_grad_norm_dtensor_aware` is newer than 1.10), and torch's `clip_grad_norm_`,
    replaced by a function that clips nothing and returns 0, as a framework release that
    changed its internals could: an integration that clips through its own code clips alike."""
    from unittest import mock

    def nothing(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(())

    torch_clip = [
        (torch.nn.utils, "clip_grad_norm_"),
        (torch.nn.utils.clip_grad, "clip_grad_norm_"),
    ]
    with contextlib.ExitStack() as stack:
        for owner, name in [*places, *torch_clip]:
            if hasattr(owner, name):
                stack.enter_context(mock.patch.object(owner, name, nothing))
        yield
