"""A small byte-level GPT: pre-norm blocks of causal self-attention and an MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 256  # bytes
_SCORES_AT_ONCE = 2**24  # attention scores a max-logit recording holds at a time (64 MiB fp32)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    n_layer: int
    n_head: int
    d_model: int
    seq_len: int
    """Longest context; sizes the learned position table (rotary needs none)."""
    pos: str = "rope"
    """`rope` (rotary on queries and keys) or `learned` (an added position embedding)."""
    tie: bool = True
    """Share the byte embedding with the output head."""
    mlp_ratio: int = 4


SIZES = {
    "micro": GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=128),  # smoke tests, CI
    "tiny": GPTConfig(n_layer=4, n_head=4, d_model=192, seq_len=128),
    "small": GPTConfig(n_layer=6, n_head=8, d_model=512, seq_len=256),
}


def model_config(
    size: str, seq_len: int, pos: str | None = None, tie: bool | None = None
) -> GPTConfig:
    """The model of `size` (`SIZES`) with `seq_len` and the given overrides."""
    cfg = replace(SIZES[size], seq_len=seq_len)
    if pos is not None:
        cfg = replace(cfg, pos=pos)
    if tie is not None:
        cfg = replace(cfg, tie=tie)
    return cfg


class Rotary(nn.Module):
    """Rotary position embedding applied to `[batch, head, time, head_dim]` tensors."""

    def __init__(self, head_dim: int, seq_len: int, base: float = 10000.0):
        super().__init__()
        freqs = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-2]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal multi-head self-attention with separate query/key/value/output matrices.

    It takes part in QK-clip ([Note: qk-clip] in `wholeshard.optim.qk_clip`): with
    `record_max_logits` set, each training forward folds its largest pre-softmax logit per head
    into the fp32 buffer `max_logits` (a running max; -inf when nothing was recorded)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.record_max_logits = False
        """Record `max_logits` in training forwards (off: the forward pays nothing)."""
        self.register_buffer("max_logits", torch.full((cfg.n_head,), -math.inf), persistent=False)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.rotary = Rotary(d // cfg.n_head, cfg.seq_len) if cfg.pos == "rope" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:  # the heads y holds: all, or this rank's
            return y.view(b, t, -1, d // self.n_head).transpose(1, 2)  # under ColwiseParallel

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        if self.record_max_logits and self.training:
            self._record(q, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))

    def qk_clip_targets(self) -> list[tuple[nn.Parameter, nn.Parameter, int, int, torch.Tensor]]:
        """(query weight, key weight, heads, head_dim, max_logits): QK-clip's protocol."""
        return [
            (
                self.q.weight,
                self.k.weight,
                self.n_head,
                self.q.out_features // self.n_head,
                self.max_logits,
            )
        ]

    @torch.no_grad()
    def _record(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Fold the largest causal logit q.k / sqrt(head_dim) (the scale SDPA uses) of each head
        into `max_logits`, in fp32, a bounded number of scores at a time."""
        b, h, t, e = q.shape
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        rows = max(1, _SCORES_AT_ONCE // (h * t * t))
        for i in range(0, b, rows):
            scores = q[i : i + rows].float() @ k[i : i + rows].float().transpose(-2, -1)
            peak = scores.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3)) * e**-0.5
            torch.maximum(self.max_logits, peak, out=self.max_logits)


class MLP(nn.Module):
    """Two matrices with a GELU between."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Byte-level decoder-only transformer; `forward(idx)` returns logits `[B, T, 256]`."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head or (cfg.d_model // cfg.n_head) % 2:
            raise ValueError(f"d_model={cfg.d_model} must split into {cfg.n_head} even-sized heads")
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)
        if cfg.tie:
            self.head.weight = self.embed.weight
        self.checkpoint_blocks = False
        """Recompute each block's activations in backward (non-reentrant checkpointing)."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output matrices scaled by 1/sqrt(2 * n_layer)."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # LayerNorm weights and biases keep their 1 / 0 init
            std = 0.02
            if name.endswith(("attn.o.weight", "mlp.down.weight")):
                std /= math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.norm(x))


def num_params(model: nn.Module) -> int:
    """Number of distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


BLOCK_TP_STYLES = {
    "attn.q": "colwise",
    "attn.k": "colwise",
    "attn.v": "colwise",
    "attn.o": "rowwise",
    "mlp.up": "colwise",
    "mlp.down": "rowwise",
}
"""Each block's layers in torch's tensor-parallel styles (Megatron's split): heads and the MLP's
hidden units divide over the ranks; the embedding, norms and head stay replicated."""


def parallelize_blocks(model: GPT, tp_mesh: Any) -> GPT:
    """Make every block of `model` tensor parallel on the 1-D mesh `tp_mesh` (in place), by
    `BLOCK_TP_STYLES`; each rank's attention then computes its own heads."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[style]() for name, style in BLOCK_TP_STYLES.items()}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    return model
