"""What saving and loading ask of a sharded optimizer, and the one way loaded state goes live.

`Checkpointable` is the whole contract between checkpoints and an optimizer: the pieces of
params this rank updates, each piece's torch optimizer state, and the param groups' hyperparameters.
`LayerwiseOptimizer` satisfies it; so can any optimizer whose pieces are `OwnedPiece`s.

`install_state` is the single path by which loaded values replace the live ones, used by
`LayerwiseOptimizer.load_state_dict` (same layout) and `wholeshard.checkpoint.load_checkpoint`
(any layout): masters, then params from the masters, then optimizer state, then param-group
hyperparameters, then every rank gathers every param from its owner.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from ..data_parallel import DataParallel
    from .layerwise import OwnedPiece


class Checkpointable(Protocol):
    """An optimizer that updates `OwnedPiece`s of `DataParallel`'s params.

    Every element of every routed param is in exactly one piece across the ranks of a shard
    group; `piece_state(piece)` is the live (mutable) torch optimizer state of `piece`, whose
    tensors are either shaped like `piece.master` (elementwise, in the optimizer's layout) or
    the same on every piece of one param (AdamW's scalar `step`).
    """

    param_groups: list[dict[str, Any]]

    def owned_pieces(self) -> list[OwnedPiece]: ...

    def piece_state(self, piece: OwnedPiece) -> dict[str, Any]: ...


class LoadedPiece(NamedTuple):
    """New values for one piece: its master in the optimizer's layout (None: keep the live one)
    and its optimizer state, whose tensors `install_state` takes over (pass private copies)."""

    piece: OwnedPiece
    master: torch.Tensor | None
    state: dict[str, Any]


@torch.no_grad()
def install_state(
    ddp: DataParallel,
    optimizer: Checkpointable,
    pieces: Iterable[LoadedPiece],
    param_groups: list[dict[str, Any]],
) -> None:
    """Make loaded values live, then gather every param from its owner.

    `param_groups` are the saved groups' hyperparameters, one per group of `optimizer` (a
    `params` key is ignored). Every rank of `ddp`'s group must call it; afterwards every rank
    holds every param it keeps between steps (all of them unless fully sharded).
    """
    ddp.finish_param_sync()  # a gather still in flight must land before params are written
    for piece, master, state in pieces:
        if master is not None:
            piece.master.copy_(master)
            if piece.separate_master:
                piece.param.copy_(piece.oriented(piece.master))
        live = optimizer.piece_state(piece)
        live.clear()
        live.update(state)
    for group, saved in zip(optimizer.param_groups, param_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    ddp.start_param_sync()
    ddp.finish_param_sync()


def elementwise(value: torch.Tensor, piece: OwnedPiece) -> bool:
    """Whether a state tensor of `piece` holds one value per element (else one per param)."""
    return tuple(value.shape) == tuple(piece.master.shape)
