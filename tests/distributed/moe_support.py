"""A tiny MoE language model whose experts can be split over an expert-parallel group.

Each ep rank holds E / ep experts (a stack, or `experts.<i>` modules) and dispatches tokens by
all-gather (Megatron's all-gather dispatcher): every ep rank sees its peers' tokens and routing
weights, runs its own experts on the tokens routed to them, and the partial outputs are summed
back to the tokens' ranks. Built with `ep_group=None` it is the whole MoE in one process, with
the same initial values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from support import DIM, VOCAB
from torch import nn

EXPERTS, HIDDEN, TOP_K = 4, 16, 2


class Dispatch(torch.autograd.Function):
    """Forward: every ep rank's rows, concatenated in ep rank order, on every ep rank.
    Backward: each rank's rows' gradients summed over the ep ranks (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        mine = grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)]
        return mine.contiguous(), None


class Combine(torch.autograd.Function):
    """Forward: the ep ranks' partial outputs summed, this rank's rows kept. Backward: every
    rank's rows' gradients, concatenated (an all-gather)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class StackedExperts(nn.Module):
    """Experts as transformers 5 stores them: one (n, out, in) stack per projection; with
    `ep_mesh`, torchtitan's layout: every expert's stack, a DTensor `Shard(0)` over it."""

    def __init__(self, up: torch.Tensor, down: torch.Tensor, ep_mesh=None) -> None:
        super().__init__()
        if ep_mesh is None:
            self.up, self.down = nn.Parameter(up.clone()), nn.Parameter(down.clone())
        else:
            from torch.distributed.tensor import Shard, distribute_tensor

            self.up = nn.Parameter(distribute_tensor(up, ep_mesh, [Shard(0)]))
            self.down = nn.Parameter(distribute_tensor(down, ep_mesh, [Shard(0)]))

    def forward(self, k: int, x: torch.Tensor) -> torch.Tensor:  # a forward: fully sharded
        up, down = (getattr(w, "to_local", lambda w=w: w)() for w in (self.up, self.down))
        return F.gelu(x @ up[k].T) @ down[k].T


class Expert(nn.Module):
    def __init__(self, up: torch.Tensor, down: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.up = nn.utils.skip_init(nn.Linear, DIM, HIDDEN, bias=False, device=up.device)
        self.down = nn.utils.skip_init(nn.Linear, HIDDEN, DIM, device=up.device)
        with torch.no_grad():
            self.up.weight.copy_(up)
            self.down.weight.copy_(down)
            self.down.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class ModuleExperts(nn.ModuleList):
    """Experts as separate modules (`experts.<i>.up.weight`), with an AdamW-routed bias each."""

    def forward(self, k: int, x: torch.Tensor) -> torch.Tensor:
        return self[k](x)


class MoE(nn.Module):
    """Top-2 of sigmoid scores. Not a softmax: its scores' gradient sums to zero over the
    experts, so the router's gradient is rank-deficient and bf16 Newton-Schulz fills the null
    direction with amplified rounding noise; runs that sum gradients in another order (hybrid
    meshes) then part by ~4e-3 in 3 steps, more than the reference bound, for no fault of theirs.
    """

    def __init__(self, layout: str, ep, unused: int | None):
        """`ep`: the expert-parallel group (a DeviceMesh for the "dtensor" layout) or None."""
        super().__init__()
        dtensor = layout == "dtensor" and ep is not None
        ep_mesh, ep_group = (ep, ep.get_group()) if dtensor else (None, ep)
        self.unused = unused  # an expert the router never chooses
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        up = torch.randn(EXPERTS, HIDDEN, DIM) * DIM**-0.5
        down = torch.randn(EXPERTS, DIM, HIDDEN) * HIDDEN**-0.5
        bias = torch.randn(EXPERTS, DIM) * 0.02
        self.group = ep_group
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        n = EXPERTS // ep
        self.first = n * (0 if ep_group is None else dist.get_rank(ep_group))
        mine = slice(self.first, self.first + n)
        if layout == "stacked":
            self.experts: nn.Module = StackedExperts(up[mine], down[mine])
        elif layout == "dtensor":
            self.experts = StackedExperts(up, down, ep_mesh)
        else:
            self.experts = ModuleExperts(
                Expert(u, d, b) for u, d, b in zip(up[mine], down[mine], bias[mine], strict=True)
            )
        self.local = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(self.router(x))  # as DeepSeek-V3 scores: see the docstring
        if self.unused is not None:
            scores = scores.index_fill(1, torch.tensor([self.unused]), 0.0)
        top, index = scores.topk(TOP_K, dim=-1)
        gates = torch.zeros_like(scores).scatter(1, index, top)
        if self.group is not None:
            x, gates = Dispatch.apply(x, self.group), Dispatch.apply(gates, self.group)
        y = torch.zeros_like(x)
        for k in range(self.local):
            rows = gates[:, self.first + k].nonzero().squeeze(1)
            if not len(rows):  # no token chose it: no gradient, as with torch's MoEs
                continue
            out = self.experts(k, x[rows]) * gates[rows, self.first + k, None]
            y = y.index_add(0, rows, out)
        return y if self.group is None else Combine.apply(y, self.group)


class MoELM(nn.Module):
    """Embedding, a dense projection, one MoE layer (residual), final norm, head."""

    def __init__(
        self,
        layout: str = "stacked",
        ep_group=None,
        unused: int | None = None,
    ) -> None:
        """`layout`: "stacked", "modules" or "dtensor" (stacked, the whole stacks as DTensors
        over `ep_group`, then a DeviceMesh); without `ep_group` every layout is the one process
        model with the same values (as "stacked" for "dtensor")."""
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.moe = MoE(layout, ep_group, unused)  # last: the same draws before it at any ep

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.emb(idx))
        x = x + self.moe(self.norm(x).reshape(-1, DIM)).view_as(x)
        return self.head(self.ln(x))


def global_names(model: MoELM) -> dict[str, str]:
    """Each param's name in the whole MoE (`experts.<i>` renumbered from this rank's first)."""
    first, out = model.moe.first, {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if isinstance(model.moe.experts, ModuleExperts) and parts[:2] == ["moe", "experts"]:
            parts[2] = str(first + int(parts[2]))
        out[name] = ".".join(parts)
    return out
