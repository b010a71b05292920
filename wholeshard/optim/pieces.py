"""The optimizer's pieces, and the contract between an optimizer and checkpoints.

`OwnedPiece` is what the optimizer steps, with its fp32 master (`pieces_of` makes them from the
engine's `OwnedRange`s). `Checkpointable` is the whole contract between checkpoints and an
optimizer: `LayerwiseOptimizer` satisfies it; so can any optimizer whose pieces are `OwnedPiece`s.
`install_state` is the single path by which loaded values replace the live ones
(`LayerwiseOptimizer.load_state_dict`, same plan; `wholeshard.checkpoint.load_checkpoint`, any).

[Note: what Muon sees]
Muon's update depends on the matrix's orientation (`adjust_lr_fn` scales by its shape) and only
works on 2-D tensors, so every Muon piece is one matrix in (out, in) orientation:
- a stacked param (more than 2 dims: fused MoE experts) is stepped as one piece per matrix, each
  its own `torch.optim.Muon` param, exactly as if each expert's slice were a separate param;
- a weight stored (in, out) (`Route.transposed`: transformers' `Conv1D`) is stepped on a
  contiguous (out, in) fp32 master, exactly as the same layer stored as `nn.Linear` would be;
- a matrix split into row blocks (`LayerwiseOptimizer(ns_split=)`) is stepped as one piece per
  block, exactly as if each block were a separate layer's weight ([Note: row blocks]).
`OwnedPiece.oriented` maps between the storage orientation and the optimizer's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from ..distributed.dtensor import is_tensor_parallel, shard_place

if TYPE_CHECKING:
    from ..engine.data_parallel import DataParallel
    from ..engine.step_protocol import OwnedRange

MATRIX, ADAMW = "matrix", "adamw"


@dataclass
class OwnedPiece:
    """A piece of one param that this rank updates: the whole tensor, one matrix of a stacked
    param, a row block of one ([Note: row blocks] in `wholeshard.optim.ns_split`), or a flat
    slice.

    The piece covers elements `[offset, offset + param.numel())` of the flattened param, except
    a row block of a matrix stored (in, out) (`transposed`): its columns `rows` of the matrix
    starting at `offset`.
    `master` is in the optimizer's orientation ([Note: what Muon sees]), `param` and `grad` in the
    storage orientation.
    """

    name: str
    kind: str  # "matrix" or "adamw"
    full_shape: tuple[int, ...]
    offset: int
    param: torch.Tensor  # view into the param buffer (param dtype)
    grad: torch.Tensor  # view into the reduced grad shard (grad-reduce dtype)
    master: torch.Tensor  # fp32; the param view itself when the param is fp32 and not transposed
    matrix: int | None = None  # index of the matrix within a stacked param
    transposed: bool = False  # stored (in, out): the master is the (out, in) transpose
    rows: tuple[int, int] | None = None  # a row block [a, b) of its (out, in) matrix (ns_split)
    tp_param: torch.Tensor | None = None  # tensor parallel: a DTensor over `master` (and grad)
    replica: torch.Tensor | None = None  # tensor parallel, other rules: the logical matrix

    @property
    def key(self) -> str:
        """Unique among this rank's pieces: the param name, with `[i]` for matrix i of a stack
        and `[a:b]` for a row block."""
        key = self.name if self.matrix is None else f"{self.name}[{self.matrix}]"
        return key if self.rows is None else f"{key}[{self.rows[0]}:{self.rows[1]}]"

    @property
    def stepped(self) -> torch.Tensor:
        """What the torch optimizer steps (and keys its state by): `replica`, else `tp_param`,
        else `master` ([Note: tensor-parallel Muon], [Note: replicas of tensor-parallel
        matrices] in `optim.tensor_parallel`)."""
        if self.replica is not None:
            return self.replica
        return self.master if self.tp_param is None else self.tp_param

    def as_stepped(self, value: Any) -> Any:
        """A state value as the optimizer keeps it: for a slice of a tensor-parallel matrix,
        one shaped like `master` becomes a DTensor laid out like `tp_param`."""
        sliced = self.tp_param is not None and self.replica is None
        if sliced and torch.is_tensor(value) and value.shape == self.master.shape:
            return _laid_out_like(value, self.tp_param, tuple(self.tp_param.shape))
        return value

    @property
    def separate_master(self) -> bool:
        return self.master is not self.param

    def value(self) -> torch.Tensor:
        """The param's value (storage orientation, param dtype): where the piece has a master of
        its own, its cast, which the param always equals (`params_from_masters`) but may lack
        storage for between steps ([Note: owned copies] in `engine._owned_copies`)."""
        if not self.separate_master:
            return self.param
        return self.oriented(self.master).to(self.param.dtype)

    def oriented(self, t: torch.Tensor) -> torch.Tensor:
        """`t` moved between the storage and the optimizer's orientation (its own inverse)."""
        return t.T if self.transposed else t

    @property
    def matrices(self) -> int:
        """Matrices of the param this piece is one of: its stack's count, else 1."""
        return math.prod(self.full_shape[:-2]) if self.matrix is not None else 1


class Checkpointable(Protocol):
    """An optimizer that updates `OwnedPiece`s of `DataParallel`'s params.

    Every element of every routed param is in exactly one piece across the ranks of a shard
    group; `piece_state(piece)` is the live (mutable) torch optimizer state of `piece`, whose
    tensors are either shaped like `piece.master` (elementwise, in the optimizer's orientation) or
    the same on every piece of one param (AdamW's scalar `step`).

    Optional: an int attribute `steps`, the step() calls taken (`LayerwiseOptimizer.steps`). A
    checkpoint saves it, names itself `step-<steps>` unless told otherwise, and restores it.
    Optional: a method `state_installed()`, which `install_state` calls once loaded values are
    live (`LayerwiseOptimizer` moves offloaded state back to host memory).
    """

    param_groups: list[dict[str, Any]]

    def owned_pieces(self) -> list[OwnedPiece]: ...

    def piece_state(self, piece: OwnedPiece) -> dict[str, Any]: ...


def step_count(optimizer: Checkpointable) -> int | None:
    """The optimizer's `steps` (step() calls taken), or None if it keeps no int count."""
    steps = getattr(optimizer, "steps", None)
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


class LoadedPiece(NamedTuple):
    """New values for one piece: its master in the optimizer's orientation (None: keep the live one)
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
    steps: int | None = None,
) -> None:
    """Make loaded values live, then gather every param from its owner.

    `param_groups` are the saved groups' hyperparameters, one per group of `optimizer` (a
    `params` key is ignored); `steps`, if not None, becomes the optimizer's step count (when
    it keeps one, `step_count`). Every rank of `ddp`'s group must call it; afterwards every
    rank holds every param it keeps between steps (all of them unless fully sharded).
    """
    ddp.finish_param_sync()  # a gather still in flight must land before params are written
    for group, saved in zip(optimizer.param_groups, param_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for piece, master, state in pieces:
        if master is not None:
            piece.master.copy_(master)
        live = optimizer.piece_state(piece)
        live.clear()
        group = group_of.get(id(piece.stepped), {})
        live.update(
            {k: piece.as_stepped(_placed(k, v, piece.master, group)) for k, v in state.items()}
        )
    ddp.step_protocol.hold_owned_params()  # their copies may have no storage between steps
    params_from_masters(optimizer.owned_pieces())
    installed = getattr(optimizer, "state_installed", None)
    if callable(installed):
        installed()
    if steps is not None and step_count(optimizer) is not None:
        optimizer.steps = steps  # type: ignore[attr-defined]  # the optional attribute
    ddp.step_protocol.start_param_sync()
    ddp.step_protocol.finish_param_sync()


def params_from_masters(pieces: Iterable[OwnedPiece]) -> None:
    """Write the param of each of `pieces` that has a master of its own from it (cast to the
    param dtype, in the storage orientation): at every update, stepped or not, and every load,
    so a param is always its master's bits, and fully sharded on the exchange an owned param
    copy needs no storage between steps ([Note: owned copies] in `engine._owned_copies`)."""
    separate = [o for o in pieces if o.separate_master]
    if separate:
        torch._foreach_copy_([o.param for o in separate], [o.oriented(o.master) for o in separate])


def _placed(key: str, value: Any, master: torch.Tensor, group: dict[str, Any]) -> Any:
    """A loaded state value where torch's `Optimizer.load_state_dict` puts it: `step` stays
    where it is (the CPU) unless the group is fused or capturable, which need it as float32 on
    the param's device; other floating tensors take the master's dtype and device."""
    if not torch.is_tensor(value):
        return value
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=master.device)
        return value
    if value.is_floating_point():
        return value.to(dtype=master.dtype, device=master.device)
    return value.to(device=master.device)


def elementwise(value: torch.Tensor, piece: OwnedPiece) -> bool:
    """Whether a state tensor of `piece` holds one value per element (else one per param)."""
    return tuple(value.shape) == tuple(piece.master.shape)


def pieces_of(owned: OwnedRange, bounds: tuple[int, ...] | None = None) -> list[OwnedPiece]:
    """The optimizer's pieces of one owned range: one per matrix of a Muon stack, else one; with
    row-block `bounds` `(0, b1, ..., out)` ([Note: row blocks]), one per block of each matrix."""
    route, full_shape = owned.route, owned.route.shape
    if not route.matrix:
        return [_piece(route.name, ADAMW, full_shape, owned.offset, owned.param, owned.grad)]
    rows, cols = owned.param.shape[-2:]
    first = owned.offset // (rows * cols)
    params = owned.param.reshape(-1, rows, cols).unbind()
    grads = owned.grad.reshape(-1, rows, cols).unbind()
    stacked = len(full_shape) > 2
    sliced = is_tensor_parallel(route.param)  # each piece a tensor-parallel matrix of its own
    if sliced:
        if route.transposed or stacked:
            raise NotImplementedError(
                f"{route.name}: weights stored (in, out) and stacked matrices are not supported "
                f"with tensor parallelism yet"
            )
        place = shard_place(route.param)
        if bounds and (place is None or place[0] != 1):  # columns whole (not RowwiseParallel):
            # the row blocks within this rank's rows, stepped here alone as plain matrices
            first_row = 0 if place is None else place[1]
            bounds = tuple(b - first_row for b in bounds if first_row <= b <= first_row + rows)
            sliced = False
    blocks = list(zip(bounds[:-1], bounds[1:], strict=True)) if bounds else [None]
    pieces = []
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        base = owned.offset + i * rows * cols
        for block in blocks:
            offset, cut = base, slice(None)
            if block is not None:  # rows of the (out, in) matrix: columns when stored (in, out)
                cut = (slice(None), slice(*block)) if route.transposed else slice(*block)
                offset += 0 if route.transposed else block[0] * cols
            pieces.append(
                _piece(
                    route.name,
                    MATRIX,
                    full_shape,
                    offset,
                    param[cut],
                    grad[cut],
                    matrix=first + i if stacked else None,
                    transposed=route.transposed,
                    rows=block,
                )
            )
    return [tensor_parallel(piece, route.param) for piece in pieces] if sliced else pieces


def tensor_parallel(piece: OwnedPiece, param: torch.Tensor) -> OwnedPiece:
    """`piece` (one rank's slice of a DTensor `param`, or of its `rows` when its columns are
    sliced) with a DTensor over its master and one over the master's grad, laid out like
    `param` (that matrix of `rows`)."""
    rows = piece.rows
    shape = tuple(param.shape) if rows is None else (rows[1] - rows[0], *param.shape[1:])
    piece.tp_param = _laid_out_like(piece.master, param, shape)
    piece.tp_param.grad = _laid_out_like(piece.master.grad, param, shape)
    return piece


def _laid_out_like(t: torch.Tensor, dtensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A DTensor over `t` (this rank's slice, no copy) of logical `shape`, laid out like the
    DTensor `dtensor`."""
    from torch.distributed.tensor import DTensor

    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(
        t, dtensor.device_mesh, dtensor.placements, shape=shape, stride=stride
    )


def _piece(
    name: str,
    kind: str,
    full_shape: tuple[int, ...],
    offset: int,
    param: torch.Tensor,
    grad: torch.Tensor,
    *,
    matrix: int | None = None,
    transposed: bool = False,
    rows: tuple[int, int] | None = None,
) -> OwnedPiece:
    """A piece with its fp32 master: the param view itself when fp32 and not transposed."""
    if param.dtype == torch.float32 and not transposed:
        master = param
    else:
        master = (param.detach().T if transposed else param.detach()).float().contiguous()
        if master.data_ptr() == param.data_ptr():  # .float() of fp32 returns the same tensor
            master = master.clone()
    direct = grad.dtype == torch.float32 and not transposed
    master.grad = grad if direct else torch.zeros_like(master)
    return OwnedPiece(name, kind, full_shape, offset, param, grad, master, matrix, transposed, rows)


def restored(value: Any, master: torch.Tensor) -> Any:
    """A private copy of one saved state value; tensors shaped like the param go to its device."""
    if not torch.is_tensor(value):
        return value
    value = value.detach().clone()
    return value.to(master.device) if value.shape == master.shape else value
