"""`LayerwiseOptimizer`: each rank runs torch's Muon and AdamW on the whole tensors it owns.

The maths is PyTorch's own (`torch.optim.Muon`, `torch.optim.AdamW`) applied to fp32 masters of
the owned params, so one process running those optimizers on every param on the averaged
gradient is the reference, and parity holds by construction.

Invariants:
- state (momentum, Adam moments, fp32 masters) exists only for params this rank owns;
- a master's `.grad` is (a cast of) the param's range of this rank's reduced grad shard;
- when `step()` returns, every rank's params are the updated ones.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.utils.hooks import RemovableHandle

from ..distributed import collectives
from ..engine.data_parallel import DataParallel
from ._clipping import ClippingRecord
from ._inner import States, holding
from ._offload import StateOffload
from ._step_check import NonfinitePolicy, StepCheck, peak_norms
from .matrix_rule import closure_loss
from .ns_split import NsSplit, row_blocks
from .pieces import (
    ADAMW,
    MATRIX,
    LoadedPiece,
    OwnedPiece,
    install_state,
    params_from_masters,
    pieces_of,
    restored,
)
from .rules import tensor_parallel_rule
from .tensor_parallel import TpMode, combined_norms, replicas_stepped, replicate, tp_slices


class LayerwiseOptimizer(torch.optim.Optimizer):
    """The matrix rule (Muon by default) on the matrix-routed params, AdamW on the rest, each
    only on this rank's owned params.

    Args:
        ddp: the `DataParallel` whose owned params this optimizer steps; it owns the step (the
            wrapped params' `.grad` stays None: gradients live in the units).
        matrix: keyword arguments of `matrix_optimizer` (of `torch.optim.Muon` by default: lr,
            weight_decay, momentum, nesterov, ns_steps, adjust_lr_fn, ...; NorMuon's or SOAP's
            where it is one of those).
        matrix_optimizer: the torch optimizer class stepping the owned matrix-routed matrices:
            `torch.optim.Muon`, or `wholeshard.optim.BatchedMuon` (the same maths and state,
            same-shape matrices orthogonalized together). Checkpoints reshard state shaped like
            the param, so an optimizer whose update of a param reads only that param, its grad
            and such state runs distributed unchanged. Its static `matrix_cost(rows, cols)`
            (Newton-Schulz's without one) is the work `ddp`'s layout evens out across ranks:
            `ddp.balance_for(matrix_optimizer)` lays it out again if planned for another.
        adamw: keyword arguments of `torch.optim.AdamW`.
        nonfinite: what an inf or nan in the averaged gradients does: "error" raises
            `FloatingPointError` on every rank naming the param and the step; "skip" leaves
            params and optimizer state untouched, zeroes the grads and counts `skipped_steps`;
            None does not look.
        ns_split: `fn(name, param) -> list[int] | None`: sizes of the row blocks of a Muon
            param's (out, in) matrix stepped as separate matrices, the layout unchanged
            (`wholeshard.optim.split_qkv`, `split_heads`; [Note: row blocks], `optim/ns_split.py`).
        tp_mode: how Newton–Schulz sees a tensor-parallel (DTensor) matrix whole: "duplicated"
            or "distributed" ([Note: tensor-parallel Muon] in `optim/tensor_parallel.py`).
        offload_state: keep the fp32 masters (where separate from the params) and the optimizer
            state in host memory (pinned), each unit's copied to the device for its update and
            back ([Note: optimizer-state offload] in `optim/_offload.py`): the same bits.

    `param_groups[0]` is the Muon group and `param_groups[1]` the AdamW group on every rank, so
    LR schedulers work unchanged. `zero_grad()` zeros the grad buffer. A param that got no
    gradient on any rank since `zero_grad()` is not stepped (no momentum, no weight decay, state
    untouched), as torch's optimizers skip a param whose `.grad` is None; one used on some ranks
    only is stepped on the average, the others counting zeros (as torch DDP). With
    `DataParallelConfig(pipelined_step=True)`, `step()` updates unit by unit as the reductions
    land (`StepProtocol.reduced_units`): the same per-param arithmetic, so the same bits.

    Before any update, every rank takes the step check, one small all-reduce (`_step_check`):
    `step()` raises on every rank if some rank's model changed after wrapping
    (`StepProtocol.model_changes`), ranks are at different steps, or (policy "error") an
    averaged gradient is not finite. It reuses the per-param norms `clip_grad_norm_` computed in
    the same step, else it takes one max-norm pass over the owned grads. It reads every reduced
    grad, so a pipelined step then overlaps only the gathers with the updates (as after
    clipping); with `nonfinite=None` the check reads no gradient and a pipelined step's updates
    overlap the reductions still in flight. With `nonfinite=None` a step does not wait for the
    device: when every param got a gradient on this rank, the check is read at the next step
    (or when state is read), so a changed model or a step mismatch raises one step later
    ([Note: host syncs in a step]).
    """

    def __init__(
        self,
        ddp: DataParallel,
        *,
        matrix: dict[str, Any] | None = None,
        adamw: dict[str, Any] | None = None,
        nonfinite: NonfinitePolicy | None = "error",
        matrix_optimizer: type[torch.optim.Optimizer] = torch.optim.Muon,
        ns_split: NsSplit | None = None,
        tp_mode: TpMode = "duplicated",
        offload_state: bool = False,
    ) -> None:
        if not isinstance(ddp, DataParallel):
            raise TypeError(f"LayerwiseOptimizer needs a wholeshard.DataParallel, got {type(ddp)}")
        StepCheck.policy(nonfinite)  # before the layout changes
        ddp.balance_for(matrix_optimizer)
        self.ddp = ddp
        self._protocol = ddp.step_protocol  # the step's verbs (`engine.step_protocol`)
        self.steps = self.skipped_steps = 0  # step() calls taken (skipped ones included), skipped
        self._piece_norms: torch.Tensor | None = None  # owned grads' norms, if clipped this step
        self._clipping = ClippingRecord()  # [Note: clipping the framework asked for]
        self._owned: list[OwnedPiece] = []
        self._by_unit: dict[int, list[OwnedPiece]] = {}  # unit index -> its owned pieces
        self._update_hooks: OrderedDict[int, Callable[[list[OwnedPiece]], None]] = OrderedDict()
        blocks = row_blocks(ddp.routes, ns_split)
        rule, matrix, replicas = tensor_parallel_rule(matrix_optimizer, matrix, tp_mode, ddp.routes)
        for owned in self._protocol.owned():
            pieces = pieces_of(owned, blocks.get(owned.route.name))
            if replicas:  # [Note: replicas of tensor-parallel matrices]
                replicate(pieces)
            self._owned += pieces
            self._by_unit.setdefault(owned.unit, []).extend(pieces)
        separate = (u for u, ps in self._by_unit.items() if all(o.separate_master for o in ps))
        self._protocol.masters_kept(self, separate, lambda o=self._owned: params_from_masters(o))
        self._check = StepCheck(ddp, [o.name for o in self._owned], nonfinite)
        self._tp_group, sliced = tp_slices(ddp.routes)  # for norms: slices sum over the group
        self._sliced = [o.name in sliced for o in self._owned]
        self._inner = {
            MATRIX: rule([{"params": self._masters(MATRIX)}], **matrix),
            ADAMW: torch.optim.AdamW([{"params": self._masters(ADAMW)}], **(adamw or {})),
        }
        super().__init__([{"params": self._masters(MATRIX)}, {"params": self._masters(ADAMW)}], {})
        # Share the inner optimizers' group dicts so schedulers and users edit the real thing.
        self.param_groups = [self._inner[kind].param_groups[0] for kind in (MATRIX, ADAMW)]
        self.state = States(self._inner[MATRIX].state, self._inner[ADAMW].state)  # type: ignore[assignment]
        offload = (self._inner, self._by_unit, ddp.device, offload_state, ddp.tensor_parallel)
        self._offload = StateOffload(*offload)
        self._protocol.attach_optimizer(self)

    @property
    def nonfinite(self) -> NonfinitePolicy | None:
        """What an inf or nan in the averaged gradients does (the constructor's argument)."""
        return self._check.nonfinite

    def _masters(self, kind: str) -> list[torch.Tensor]:
        return [o.stepped for o in self._owned if o.kind == kind]

    # -- the step -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        self._clipping.check(self.steps)
        pipelined = self.ddp.dp_config.pipelined_step
        if pipelined and self.nonfinite is None:  # the check reads no gradient: no wait
            self._protocol.start_grad_sync()  # [Note: step check order] in `_step_check`
        else:
            self._protocol.finish_grad_sync()
        self._check.judge_unread()  # the last step's check raises before this step counts
        norms, self._piece_norms = self._piece_norms, None  # clipped this step: its norms
        if norms is None and self.nonfinite is not None and self._owned:
            norms = peak_norms([o.grad for o in self._owned])
        step, self.steps = self.steps, self.steps + 1  # counted even where its check raises
        stepped = self._check.take(step, norms)
        if stepped is None:
            self.skipped_steps += 1
            self._protocol.zero_grad_buffer()
            return loss
        if pipelined:
            self._offload.walk(self._protocol.reduced_units(), stepped, self._update)
        else:
            self._protocol.finish_param_sync()  # a gather in flight lands before we write
            if self._offload.copies:  # unit by unit, each unit's state on the device in turn
                self._offload.walk(sorted(self._by_unit), stepped, self._update)
            else:
                self._update(self._owned, stepped)
            self._protocol.start_param_sync()
        if not self.ddp.dp_config.overlap_param_gather:
            self._protocol.finish_param_sync()
        return loss

    def _update(self, pieces: list[OwnedPiece], stepped: frozenset[str]) -> None:
        """Step those of `pieces` whose param is in `stepped` (per param: which step together
        changes no bit), then write all their params from their masters (`params_from_masters`)."""
        todo = [o for o in pieces if o.name in stepped]
        with record_function("wholeshard.optimizer_step"):
            cast = [o for o in todo if o.master.grad is not o.grad]
            if cast:
                torch._foreach_copy_(
                    [o.master.grad for o in cast], [o.oriented(o.grad) for o in cast]
                )
            with replicas_stepped(todo):
                for kind, opt in self._inner.items():
                    masters = [o.stepped for o in todo if o.kind == kind]
                    if masters:
                        with holding(opt.param_groups[0], masters):
                            opt.step()
            for hook in self._update_hooks.values() if todo else ():
                hook(todo)
            params_from_masters(pieces)

    def register_update_hook(self, hook: Callable[[list[OwnedPiece]], None]) -> RemovableHandle:
        """Call `hook(pieces)` after each update of owned `pieces` (all of a step's; pipelined or
        offloaded, one unit's), before their masters are written to the params and gathered: what it
        writes to the masters is what every rank gets (QK-clip, `wholeshard.optim.QKClip`)."""
        handle = RemovableHandle(self._update_hooks)
        self._update_hooks[handle.id] = hook
        return handle

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffer. `set_to_none` is accepted for API parity and ignored."""
        self._clipping.forget()
        self._protocol.zero_grad_buffer()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients so their global `norm_type`-norm is at most `max_norm`.

        Same result as `torch.nn.utils.clip_grad_norm_` over every param of the model on the
        averaged gradient; returns the total norm before clipping. Every rank must call it. It
        waits for every reduction, so a pipelined `step()` after it only overlaps the gathers.
        """
        self._protocol.finish_grad_sync()
        self._clipping.clipped(max_norm)
        norm_type = float(norm_type)
        device = self.ddp.device
        grads = [o.grad for o in self._owned]
        norms = list(torch._foreach_norm(grads, norm_type, dtype=torch.float32)) if grads else []
        self._piece_norms = torch.stack(norms) if norms else None
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        local = combined_norms(norms, self._sliced, norm_type, self._tp_group, device)
        if self.ddp.shard_group_size > 1:  # shard groups own everything; replicas agree
            collectives.all_reduce(local, self.ddp.shard_group, op=op)
        total = local[0] if math.isinf(norm_type) else local[0].pow(1.0 / norm_type)
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for dtype in {g.dtype for g in grads}:
            torch._foreach_mul_([g for g in grads if g.dtype == dtype], scale.to(dtype))
        return total

    def expect_clipping(self, max_norm: float | None, source: str = "") -> None:
        """Each `step()` raises unless `clip_grad_norm_` clipped to `max_norm` (`_clipping`)."""
        self._clipping.expected = None if max_norm is None else (float(max_norm), source)

    # -- state ----------------------------------------------------------------------------

    def owned_pieces(self) -> list[OwnedPiece]:
        """What this rank updates, in registration order (offloaded: their host values are the
        last step's)."""
        self._offload.wait()
        return list(self._owned)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the fp32 masters (separate ones; tp replicas, with grads) and the state,
        wherever they are, and `host`: those of them kept in host memory (offloaded)."""
        masters = sum(o.master.nbytes for o in self._owned if o.separate_master)
        masters += sum(2 * o.replica.nbytes for o in self._owned if o.replica is not None)
        state = sum(
            v.nbytes
            for opt in self._inner.values()
            for entry in opt.state.values()
            for v in entry.values()
            if torch.is_tensor(v)
        )
        return {"masters": masters, "optimizer_state": state, "host": self._offload.host_bytes()}

    def piece_state(self, piece: OwnedPiece) -> dict[str, Any]:
        """The torch optimizer's live state dict for `piece` (empty before the first step). A
        step check left unread is read first: state is never handed out past a failed check."""
        self._check.judge_unread()
        self._offload.wait()
        return self._inner[piece.kind].state[piece.stepped]

    def state_installed(self) -> None:
        """`install_state`'s hook once loaded values are live: offloaded, they go to the host."""
        self._offload.settle()

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, keyed by param name; loads at the same world size and plan only."""
        self._check.judge_unread()
        self._offload.wait()
        state: dict[str, dict[str, Any]] = {}
        for o in self._owned:
            entry = dict(self._inner[o.kind].state.get(o.stepped, {}))
            if o.separate_master:
                entry["master"] = o.master
            state[o.key] = entry
        groups = [
            {k: v for k, v in g.items() if k != "params"} | {"kind": kind}
            for kind, g in zip((MATRIX, ADAMW), self.param_groups, strict=True)
        ]
        return {"state": state, "param_groups": groups, "steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load `state_dict()` of an optimizer at the same world size and plan (any other:
        wholeshard checkpoints); every rank loads its own and all gather the params."""
        self._check.forget_unread()
        self._offload.wait()
        owned = {o.key: o for o in self._owned}
        saved = state_dict["state"]
        if set(saved) != set(owned):
            missing, extra = sorted(set(owned) - set(saved)), sorted(set(saved) - set(owned))
            raise ValueError(
                f"optimizer state does not match the params this rank owns (missing {missing[:5]}, "
                f"unexpected {extra[:5]}); it was saved at another world size or plan: use "
                f"wholeshard checkpoints to reshard"
            )
        self.steps = state_dict.get("steps", self.steps)
        pieces = []
        for key, entry in saved.items():
            o = owned[key]
            state = {k: restored(v, o.master) for k, v in entry.items() if k != "master"}
            pieces.append(LoadedPiece(o, entry.get("master"), state))
        groups = [{k: v for k, v in g.items() if k != "kind"} for g in state_dict["param_groups"]]
        install_state(self.ddp, self, pieces, groups)
