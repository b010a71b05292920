"""`BatchedMuon`: `torch.optim.Muon` whose step orthogonalizes same-shape matrices together.

torch's Muon runs Newton-Schulz one matrix at a time (about 23 kernel launches each), so a rank
owning many small matrices (the experts of an MoE layer) is launch-bound. `BatchedMuon` does the
maths of torch's `_single_tensor_muon`, but updates momentum and params with foreach ops and
runs Newton-Schulz on a stack of a group's matrices of one shape, dtype and device with
`torch.bmm` / `torch.baddbmm`.

Invariants:
- same constructor (plus keyword-only `batch_numel` and `matmul_dtype`), param groups and
  per-param state (`state[p]["momentum_buffer"]`, shaped like `p`) as `torch.optim.Muon`, so
  state dicts load into either class;
- a param without a grad is not touched (no momentum, no weight decay), as in torch;
- a matrix's bf16 roundings are torch's. With `matmul_dtype=torch.bfloat16` (default) on CPU
  its update is torch's bit for bit; on CUDA, and with `matmul_dtype=torch.float32` (products of
  the bf16 values summed by fp32 GEMMs, rounded to bf16 where torch's bf16 GEMMs round), the
  summation order differs, which moves updates by a few bf16 roundings (measured in
  tests/optim/test_batched_muon.py);
- on CPU a matrix's update does not depend on which other matrices share its batch (on CUDA
  the GEMM kernel cuBLAS picks may depend on the batch size);
- a step's temporaries take at most 10 bytes per element of one batch (fp32 grads; 16 with
  `matmul_dtype=torch.float32`), a batch holding at most max(`batch_numel`, one matrix's numel)
  elements.
With `ns_algorithm="gram"` the batch runs `gram_ns.gram_newton_schulz` (bf16, fewer flops, not
bit for bit the above; `matmul_dtype` unused) instead of the quintic loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr
from torch.optim.optimizer import ParamsT, _to_scalar

from .gram_ns import NsAlgorithm, gram_newton_schulz
from .matrix_rule import Group, MuonRule

DEFAULT_BATCH_NUMEL = 1 << 25
"""Elements per Newton-Schulz batch: a step's temporaries stay under 320 MiB (512 MiB with
`matmul_dtype=torch.float32`) unless a single matrix is larger."""


class BatchedMuon(MuonRule):
    """`torch.optim.Muon` with a batched step; see the module docstring.

    Args: those of `torch.optim.Muon`, and
        batch_numel: the most elements stacked into one Newton-Schulz batch (a matrix larger
            than that is a batch of its own); bounds the step's temporary memory.
        matmul_dtype: the dtype Newton-Schulz products are summed in: `torch.bfloat16` (torch's
            kernels; the fast choice on GPUs) or `torch.float32` (fp32 GEMMs on the bf16
            values, each result rounded to bf16: much faster on CPUs without bf16 matmul units).
        ns_algorithm: "standard" or "gram" (`gram_ns`; the same iterations in fewer flops).
    All three are attributes, not group settings, so state dicts stay those of `torch.optim.Muon`.
    """

    def __init__(
        self,
        params: ParamsT,
        *args: Any,
        batch_numel: int = DEFAULT_BATCH_NUMEL,
        matmul_dtype: torch.dtype = torch.bfloat16,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, *args, **kwargs)
        if batch_numel < 1:
            raise ValueError(f"batch_numel must be positive, got {batch_numel}")
        if matmul_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"matmul_dtype must be torch.bfloat16 or float32, not {matmul_dtype}")
        self.batch_numel = batch_numel
        self.matmul_dtype = matmul_dtype

    def _step_group(
        self, group: Group, params: list[Tensor], grads: list[Tensor], bufs: list[Tensor]
    ) -> None:
        """Per param, the operations of torch's `_single_tensor_muon`, issued for many at once
        (weight decay of every param before any update: each param sees the same sequence)."""
        if group["ns_steps"] >= 100:
            raise ValueError("Number of steps must be less than 100 for computational efficiency")
        lr = _to_scalar(group["lr"])
        torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
        if group["weight_decay"] != 0:  # else torch multiplies by exactly 1
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        for batch in _batches(params, self.batch_numel):
            self._update_batch(group, lr, *([xs[i] for i in batch] for xs in (params, grads, bufs)))

    def _update_batch(
        self,
        group: Group,
        lr: float | Tensor,
        params: list[Tensor],
        grads: list[Tensor],
        bufs: list[Tensor],
    ) -> None:
        """Nesterov, Newton-Schulz and the update of same-shape `params`, whose momentum buffers
        `bufs` hold this step's momentum. Its temporaries die with it."""
        sources = torch._foreach_lerp(grads, bufs, group["momentum"]) if group["nesterov"] else bufs
        # One cat and one cast (`stack(out=bf16)` would cast on CPU but copy each input on CUDA).
        stacked = torch.stack(sources).bfloat16()
        del sources
        update = _orthogonalize(stacked, group, self.matmul_dtype, self.ns_algorithm)
        # The cast `param.add_` would do, contiguous so that foreach ops take their fast path.
        update = update.to(params[0].dtype, memory_format=torch.contiguous_format)
        alpha = -_adjust_lr(lr, group["adjust_lr_fn"], params[0].shape)
        torch._foreach_add_(params, list(update.unbind(0)), alpha=alpha)


def _batches(params: list[Tensor], batch_numel: int) -> list[list[int]]:
    """Indices of `params` by (shape, dtype, device), in order of first appearance, each kind
    split into near-equal runs of at most `batch_numel` elements (at least one matrix)."""
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for i, p in enumerate(params):
        kinds.setdefault((p.shape, p.dtype, p.device), []).append(i)
    out = []
    for indices in kinds.values():
        per = max(1, batch_numel // params[indices[0]].numel())
        n, k = len(indices), -(-len(indices) // per)
        out += [indices[j * n // k : (j + 1) * n // k] for j in range(k)]
    return out


def _orthogonalize(
    x: Tensor, group: Group, matmul_dtype: torch.dtype, ns_algorithm: NsAlgorithm
) -> Tensor:
    """torch's `_zeropower_via_newtonschulz` with `group`'s settings on each matrix of the bf16
    stack `x` (n, A, B), which it may overwrite, every product rounded to bf16 ("gram": by
    `gram_newton_schulz`). Returns the (n, A, B) result in bf16."""
    coefficients, steps = group["ns_coefficients"], group["ns_steps"]
    a, b, c = coefficients
    tall = x.size(1) > x.size(2)
    if tall:
        x = x.mT
    x.div_(torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=group["eps"]))
    if ns_algorithm == "gram":
        x = gram_newton_schulz(x, [coefficients] * steps)
        return x.mT if tall else x
    x = x.to(matmul_dtype)

    def rounded(t: Tensor) -> Tensor:
        return t if matmul_dtype == torch.bfloat16 else t.copy_(t.bfloat16())

    for _ in range(steps):
        gram = rounded(torch.bmm(x, x.mT))
        gram_update = rounded(torch.baddbmm(gram, gram, gram, beta=b, alpha=c))
        del gram
        x = rounded(torch.baddbmm(x, gram_update, x, beta=a))
        del gram_update
    x = x.bfloat16()
    return x.mT if tall else x
