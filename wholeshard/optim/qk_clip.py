"""QK-clip (MuonClip, Kimi K2): after a step, shrink the query and key weights of every
attention head whose largest pre-softmax logit exceeded `tau`.

[Note: qk-clip]
The protocol a model implements to take part: every attention module has
- `record_max_logits: bool`, False by default; `QKClip` sets it True. While True, each forward
  in training mode folds its largest pre-softmax logit per head into `max_logits`: the max over
  batch, query and key positions (causally unmasked ones only) of q.k times the scale the
  attention really uses (1/sqrt(head_dim) for SDPA's default), computed under no_grad from the
  q and k the attention already has (after rotary), as a running max (`torch.maximum(..., out=)`);
- `qk_clip_targets()`: a list of `(query, key, n_heads, head_dim, max_logits)`, one per
  attention it computes: the query and key weight params (`nn.Linear` weights, (out, in), head h
  being rows [h * head_dim, (h + 1) * head_dim)), and its float32 buffer `max_logits`, shape
  `(n_heads,)`, -inf when nothing was recorded. `QKClip` reads it and resets it to -inf.
Supported: multi-head attention, query and key with n_heads * head_dim rows each, no query or
key bias, and any position map applied within a head that is linear in q and k (rotary). Not
supported (raises): grouped-query or multi-query attention (fewer key heads), stacked (3-D)
q/k params. The byte GPT (`wholeshard.models.gpt.Attention`) implements it.

The clip: with m_h the max logit of head h over the step's forwards on every rank (an all-reduce
MAX over the data-parallel group), the rows of head h in W_q and in W_k are multiplied by
sqrt(tau / m_h) where m_h > tau, so the head's logits scale by tau / m_h and its max becomes tau;
the other heads' rows are multiplied by exactly 1.0 (bitwise untouched), so no step reads a
value back to the host. The rank that owns a matrix clips its fp32 master inside
`LayerwiseOptimizer.step`, after the update and before the master is written to the param and
gathered (`register_update_hook`), so the next gather hands every rank the clipped weights in
every mode (overlapped, fully sharded, pipelined: there per bucket). A matrix-routed matrix is
clipped row-wise on its (out, in) master; an AdamW-routed one on whichever flat element range
each rank owns. A step that updates nothing (skipped for a non-finite gradient) clips nothing;
a q/k matrix that got no gradient on any rank is not stepped and not clipped.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import collectives
from ..engine.data_parallel import DataParallel
from ..planning.routing import Route, route_params
from .layerwise import LayerwiseOptimizer
from .pieces import MATRIX, OwnedPiece


class QKTarget(NamedTuple):
    """One attention's part in QK-clip ([Note: qk-clip])."""

    query: nn.Parameter
    key: nn.Parameter
    n_heads: int
    head_dim: int
    max_logits: torch.Tensor  # float32, (n_heads,), running max since the last reset


def qk_clip_targets(model: nn.Module) -> list[QKTarget]:
    """Every attention's target, from the modules of `model` with `qk_clip_targets()`."""
    return [
        QKTarget(*t)
        for m in model.modules()
        if callable(getattr(m, "qk_clip_targets", None))
        for t in m.qk_clip_targets()
    ]


def head_scales(max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """sqrt(tau / m) for each head whose max logit m exceeds `tau`, else exactly 1 (float32)."""
    m = max_logits.float()
    return torch.where(m > tau, (tau / m).sqrt(), torch.ones_like(m))


class QKClip:
    """QK-clip at threshold `tau` for the attentions of `model` (default: `ddp.module`); its
    records start empty (-inf).

    With a `DataParallel`, `attach(optimizer)` makes every `optimizer.step()` clip ([Note:
    qk-clip]). With `ddp=None` (one process, any optimizer), call `apply()` after each step.
    Either way the same float32 scales multiply the same rows, so N ranks clip as one process
    does. Constructing it turns on the model's recording.
    """

    def __init__(self, ddp: DataParallel | None, tau: float, model: nn.Module | None = None):
        if not tau > 0:
            raise ValueError(f"QK-clip's tau must be positive, got {tau}")
        if model is None:
            if ddp is None:
                raise ValueError("QKClip(None, tau) needs the model: QKClip(None, tau, model)")
            model = ddp.module
        self.ddp, self.tau, self.model = ddp, float(tau), model
        self.targets = qk_clip_targets(model)
        if not self.targets:
            raise ValueError(
                f"{type(model).__name__} reports no attention logits: QK-clip needs attention "
                f"modules with qk_clip_targets() ([Note: qk-clip] in wholeshard.optim.qk_clip)"
            )
        routes = ddp.routes if ddp is not None else route_params(model)
        by_param = {id(r.param): r for r in routes}
        self._roles: dict[str, tuple[int, Route]] = {}  # route name -> (target index, route)
        for i, t in enumerate(self.targets):
            for param in (t.query, t.key):
                route = by_param.get(id(param))
                if route is None:
                    raise ValueError("a query/key weight of the model is not a trainable param")
                _check_shape(route, t)
                self._roles[route.name] = (i, route)
        with torch.no_grad():  # uninitialised after meta-device construction, say
            for t in self.targets:
                t.max_logits.fill_(-math.inf)
        self._recording(True)
        self.last_max_logits: torch.Tensor | None = None
        """Each head's max logit as the last clip saw it (all-reduced), concatenated."""
        self._scales: list[torch.Tensor] | None = None
        self._handles: list = []

    def attach(self, optimizer: LayerwiseOptimizer) -> QKClip:
        """Clip inside every `optimizer.step()` from now on (every rank must attach)."""
        if self.ddp is None or optimizer.ddp is not self.ddp:
            raise ValueError("attach the LayerwiseOptimizer of the DataParallel given to QKClip")
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_update_hook(self._clip_pieces),
            optimizer.register_step_post_hook(lambda *_: self._forget()),
        ]
        return self

    def detach(self) -> None:
        """Stop clipping in the attached optimizer's steps, and the model's recording."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._recording(False)

    def _recording(self, on: bool) -> None:
        for m in self.model.modules():
            if hasattr(m, "qk_clip_targets"):
                m.record_max_logits = on

    @torch.no_grad()
    def apply(self) -> torch.Tensor:
        """One process: clip the model's q/k params now (after the optimizer step); returns the
        max logits it saw."""
        if self.ddp is not None:
            raise RuntimeError(
                "with a DataParallel, QK-clip runs inside the optimizer step, before the param "
                "gather: call attach(optimizer) once instead of apply()"
            )
        scales = self._reduce()
        for i, route in self._roles.values():
            rows = scales[i].repeat_interleave(self.targets[i].head_dim)
            param = route.param
            param.mul_((rows[None, :] if route.transposed else rows[:, None]).to(param.dtype))
        self._forget()
        return self.last_max_logits  # type: ignore[return-value]

    __call__ = apply

    def _before_step(self, *_: object) -> None:
        self._reduce()

    @torch.no_grad()
    def _reduce(self) -> list[torch.Tensor]:
        """Take every head's max logit (resetting the records), all-reduce MAX over the
        data-parallel group (one collective of the same size on every rank), and turn it into
        per-head scales."""
        peaks = torch.cat([t.max_logits.detach().float().reshape(-1) for t in self.targets])
        for t in self.targets:
            t.max_logits.fill_(-math.inf)
        ddp = self.ddp
        if ddp is not None and ddp.dp_size > 1:
            with collectives.naming("QK-clip's all-reduce of the max logits"):
                collectives.all_reduce(peaks, _group(ddp), op=dist.ReduceOp.MAX)
        self.last_max_logits = peaks
        sizes = [t.n_heads for t in self.targets]
        self._scales = list(head_scales(peaks, self.tau).split(sizes))
        return self._scales

    @torch.no_grad()
    def _clip_pieces(self, pieces: list[OwnedPiece]) -> None:
        """Scale the rows of clipped heads in the fp32 masters of the q/k pieces among
        `pieces` (called between the update and the write-back of the masters)."""
        for piece in pieces:
            role = self._roles.get(piece.name)
            if role is None:
                continue
            i, route = role
            assert self._scales is not None  # taken by the step's pre-hook
            rows = self._scales[i].repeat_interleave(self.targets[i].head_dim)
            rows = rows.to(device=piece.master.device)
            if piece.kind == MATRIX:  # the matrix, or a row block of it, (out, in)
                piece.master.mul_(rows[slice(*piece.rows) if piece.rows else slice(None), None])
                continue
            flat = piece.master.view(-1)  # elements [offset, offset + n) of the stored param
            index = torch.arange(piece.offset, piece.offset + flat.numel(), device=flat.device)
            cols = route.shape[1]
            flat.mul_(rows[index % cols] if route.transposed else rows[index // cols])

    def _forget(self) -> None:
        self._scales = None


def _check_shape(route: Route, t: QKTarget) -> None:
    """A q/k weight QK-clip can scale by head: 2-D, n_heads * head_dim output rows."""
    shape = route.shape
    out = shape[1] if route.transposed else shape[0]
    if len(shape) != 2 or out != t.n_heads * t.head_dim:
        raise ValueError(
            f"QK-clip needs {route.name} to be a matrix with n_heads * head_dim = "
            f"{t.n_heads} * {t.head_dim} output rows, got shape {shape} (grouped-query and "
            f"multi-query attention and stacked q/k params are not supported)"
        )
    if t.max_logits.shape != (t.n_heads,):
        raise ValueError(f"max_logits of {route.name} must have shape ({t.n_heads},)")


def _group(ddp: DataParallel):
    """The group spanning every data-parallel rank where the max logits reduce: the separate
    all-gather group when it spans them (it does not queue behind reductions in flight), else
    the data-parallel group."""
    spans = ddp.shard_group_size == ddp.dp_size and ddp.gather_group is not ddp.shard_group
    return ddp.gather_group if spans else ddp.process_group
