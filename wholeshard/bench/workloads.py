"""The work every configuration runs (`configs.WORKLOADS` says what each is): model, Muon
routing, data and loss.

Every workload learns visibly within a benchmark's few steps, so the final-loss agreement check
would catch a configuration that does not train. Each is seeded: every configuration starts from
the same weights and sees the same global batches, and rank r of n takes the r-th contiguous 1/n
of each global batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..models.gpt import GPT, GPTConfig, model_config
from ..planning.routing import MatrixParams
from .configs import WORKLOADS

SEED = 0


@dataclass(frozen=True)
class Workload:
    """One benchmark problem, sized for a normal or a `--quick` run."""

    name: str
    make_model: Callable[[], nn.Module]
    """Builds the model with the workload's fixed seed (same weights on every call)."""
    matrix_params: MatrixParams | None
    """Which params Muon updates (None: `routing.route_params`' default rule); every
    configuration uses this same routing."""
    shard_units: Callable[[nn.Module], list[nn.Module]]
    """The submodules FSDP2 shards one by one (the root is sharded after them)."""
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    """(step, world size) -> the global batch (inputs, targets) of that step."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(model output, targets) -> scalar loss, a mean over this rank's examples."""
    per_rank_batch: int
    stacked: bool = False
    """Whether a matrix-routed param has more than 2 dims (an expert stack), which
    `torch.optim.Muon` cannot step as one param."""

    def on(self, device: torch.device) -> Workload:
        """This workload with its model and batches on `device` (made as on CPU, then moved)."""
        if device.type == "cpu":
            return self
        make_model, make_batch = self.make_model, self.make_batch

        def moved_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = make_batch(step, world)
            return x.to(device), y.to(device)

        return dataclasses.replace(
            self, make_model=lambda: make_model().to(device), make_batch=moved_batch
        )

    def local_batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's contiguous slice of the global batch of `step`."""
        x, y = self.make_batch(step, world)
        n = self.per_rank_batch
        return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def get_workload(name: str, quick: bool = False) -> Workload:
    """The workload called `name` (one of WORKLOADS); `quick` shrinks it to seconds."""
    builders = {"gpt": _gpt, "mlp": _mlp, "many-matrices": _many_matrices, "experts": _experts}
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {tuple(WORKLOADS)}")
    return builders[name](quick)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seeded(module: Callable[..., nn.Module], *args: Any) -> Callable[[], nn.Module]:
    """A `Workload.make_model`: `module(*args)` built after seeding torch with `SEED`."""

    def make_model() -> nn.Module:
        torch.manual_seed(SEED)
        return module(*args)

    return make_model


def _teacher_batch(
    dim: int, rows: int, shape: tuple[int, ...], step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs of `shape` (last dim `dim`, first `rows`) and the fixed teacher's targets."""
    teacher = torch.randn(dim, dim, generator=_gen(SEED)) / dim**0.5
    x = torch.randn(rows, *shape, dim, generator=_gen(SEED * 1_000_003 + step))
    return x, torch.tanh(x @ teacher)


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


def _gpt(quick: bool) -> Workload:
    if quick:
        cfg = GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=32)
        batch = 2
    else:
        cfg = model_config("tiny", seq_len=128)
        batch = 8

    def make_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = markov_bytes(batch * world, cfg.seq_len + 1, step)
        return data[:, :-1], data[:, 1:]

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return Workload(
        name="gpt",
        make_model=_seeded(GPT, cfg),
        matrix_params=None,  # the default rule: the blocks' matrices; embeddings, head, norms AdamW
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
    return Workload(
        name="mlp",
        make_model=_seeded(MLP, dim, layers),
        matrix_params=lambda name, p: p.ndim == 2,
        shard_units=lambda model: list(model.layers),
        make_batch=lambda step, world: _teacher_batch(dim, batch * world, (), step),
        loss=F.mse_loss,
        per_rank_batch=batch,
    )


# -- many-matrices ----------------------------------------------------------------------------


class SideBySide(nn.Module):
    """`count` bias-free `dim x dim` linear layers side by side: layer i maps slice i of the
    input (batch, count, dim). Every matrix is its own param and every one is in the loss."""

    def __init__(self, dim: int, count: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each layer is called as a module: wholeshard's forward hooks see every one.
        return torch.stack([layer(x[:, i]) for i, layer in enumerate(self.layers)], dim=1)


def _many_matrices(quick: bool) -> Workload:
    dim, count, batch = (32, 16, 4) if quick else (64, 512, 8)  # FP8 (MXFP8) needs 32 | dim

    return Workload(
        name="many-matrices",
        make_model=_seeded(SideBySide, dim, count),
        matrix_params=lambda name, p: p.ndim == 2,
        shard_units=lambda model: list(model.layers),
        make_batch=lambda step, world: _teacher_batch(dim, batch * world, (count,), step),
        loss=F.mse_loss,
        per_rank_batch=batch,
    )


# -- experts ----------------------------------------------------------------------------------


class DenseMoE(nn.Module):
    """A residual MoE layer every token sends to every expert, weighted by a sigmoid gate of a
    router (E, dim), so every expert gets a gradient each step. The experts are two stacks,
    `up` (E, hidden, dim) and `down` (E, dim, hidden), (out, in) per matrix, as transformers 5
    stores fused experts."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.randn(experts, dim) / dim**0.5)
        self.up = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.sigmoid(x @ self.router.T) / self.router.size(0)  # (batch, E)
        h = F.relu(torch.einsum("bd,ehd->beh", x, self.up))
        y = torch.einsum("beh,edh->bed", h, self.down)
        return x + torch.einsum("bed,be->bd", y, gates)


def _experts(quick: bool) -> Workload:
    dim, hidden, experts, batch = (16, 16, 8, 4) if quick else (64, 64, 64, 16)

    return Workload(
        name="experts",
        make_model=_seeded(DenseMoE, dim, hidden, experts),
        matrix_params=lambda name, p: p.ndim >= 2,  # the stacks and the router
        shard_units=lambda model: [],  # one unit: the layer
        make_batch=lambda step, world: _teacher_batch(dim, batch * world, (), step),
        loss=F.mse_loss,
        per_rank_batch=batch,
        stacked=True,
    )
