"""The work every configuration runs: model, Muon routing, data and loss.

`gpt` is the training job's model (`wholeshard.models.gpt.GPT`) on bytes from a random Markov
chain; `mlp` is a stack of square linear layers regressing a fixed random teacher, where
Newton–Schulz dominates the step. Both learn visibly within a benchmark's few steps, so the
final-loss agreement check would catch a configuration that does not train. Each workload is seeded:
every configuration starts from the same weights and sees the same global batches, and rank r
of n takes the r-th contiguous 1/n of each global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.gpt import GPT, GPTConfig, model_config
from ..planning.routing import UseMuon
from .configs import WORKLOADS

SEED = 0


@dataclass(frozen=True)
class Workload:
    """One benchmark problem, sized for a normal or a `--quick` run."""

    name: str
    make_model: Callable[[], nn.Module]
    """Builds the model with the workload's fixed seed (same weights on every call)."""
    use_muon: UseMuon | None
    """Which params Muon updates (None: `routing.route_params`' default rule); every
    configuration uses this same routing."""
    shard_units: Callable[[nn.Module], list[nn.Module]]
    """The submodules FSDP2 shards one by one (the root is sharded after them)."""
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    """(step, world size) -> the global batch (inputs, targets) of that step."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(model output, targets) -> scalar loss, a mean over this rank's examples."""
    per_rank_batch: int

    def local_batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's contiguous slice of the global batch of `step`."""
        x, y = self.make_batch(step, world)
        n = self.per_rank_batch
        return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def get_workload(name: str, quick: bool = False) -> Workload:
    """The workload called `name` (one of WORKLOADS); `quick` shrinks it to seconds."""
    builders = {"gpt": _gpt, "mlp": _mlp}
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {tuple(WORKLOADS)}")
    return builders[name](quick)


# -- gpt --------------------------------------------------------------------------------------

MARKOV_BRANCHING = 4


def markov_bytes(rows: int, length: int, step: int) -> torch.Tensor:
    """`rows` byte sequences from a fixed random Markov chain in which every byte has
    `MARKOV_BRANCHING` equally likely successors: learnable structure (the loss can fall from
    ln 256 toward ln 4), so a configuration that fails to train shows in its final loss."""
    successors = torch.randint(0, 256, (256, MARKOV_BRANCHING), generator=_gen(SEED))
    g = _gen(SEED * 1_000_003 + step)
    picks = torch.randint(0, MARKOV_BRANCHING, (rows, length), generator=g)
    out = torch.empty(rows, length, dtype=torch.long)
    out[:, 0] = torch.randint(0, 256, (rows,), generator=g)
    for t in range(1, length):
        out[:, t] = successors[out[:, t - 1], picks[:, t]]
    return out


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gpt(quick: bool) -> Workload:
    if quick:
        cfg = GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=32)
        batch = 2
    else:
        cfg = model_config("tiny", seq_len=128)
        batch = 8

    def make_model() -> nn.Module:
        torch.manual_seed(SEED)
        return GPT(cfg)

    def make_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = markov_bytes(batch * world, cfg.seq_len + 1, step)
        return data[:, :-1], data[:, 1:]

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return Workload(
        name="gpt",
        make_model=make_model,
        use_muon=None,  # the default rule: the blocks' matrices; embeddings, head, norms AdamW
        shard_units=lambda model: list(model.blocks),
        make_batch=make_batch,
        loss=loss,
        per_rank_batch=batch,
    )


# -- mlp --------------------------------------------------------------------------------------


class MLP(nn.Module):
    """`layers` bias-free `dim x dim` linear layers: `h = W0 x`, then `h = h + Wi relu(h)`.

    The residual form keeps the signal alive through the stack, so the loss falls steadily
    (a plain stack of 8 layers at default init barely trains in a benchmark's few steps)."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](x)
        for layer in self.layers[1:]:
            h = h + layer(F.relu(h))
        return h


def _mlp(quick: bool) -> Workload:
    dim, layers, batch = (64, 3, 8) if quick else (1024, 8, 64)

    def make_model() -> nn.Module:
        torch.manual_seed(SEED)
        return MLP(dim, layers)

    def make_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        teacher = torch.randn(dim, dim, generator=_gen(SEED)) / dim**0.5
        x = torch.randn(batch * world, dim, generator=_gen(SEED * 1_000_003 + step))
        return x, torch.tanh(x @ teacher)

    return Workload(
        name="mlp",
        make_model=make_model,
        use_muon=lambda name, p: p.ndim == 2,
        shard_units=lambda model: list(model.layers),
        make_batch=make_batch,
        loss=F.mse_loss,
        per_rank_batch=batch,
    )
