"""FP8 param gather: a bucket whose params are all `Fp8Linear` weights of one recipe syncs them
as FP8 weights (`DataParallel(..., fp8_param_gather=True)`).

[Note: FP8 buckets]
Between steps each rank keeps, for such a bucket: its bf16 (param dtype) shard, which the
optimizer writes, and every converted layer's persistent FP8 weight (`Fp8Linear.fp8_weight`);
no full bf16 copy. The params' `.data` is a right-shaped placeholder (`Fp8Linear` never reads
it; autograd needs its shape); `full_params()` gathers the bf16 values transiently.
- mxfp8 (Megatron's way): at dispatch, this rank writes `bf16(shard)` into its slot of a bf16
  staging region aliased on the bucket's grad storage (the grads were consumed by the step), the
  all-gather ships bf16, and every rank, the owner included, quantizes the gathered values into
  its FP8 weights; the region is freed before the next backward. Staging at dispatch, not at the
  step, is what keeps a deferred gather (`overlap_param_gather`) from shipping a buffer that
  `zero_grad` cleared in between.
- tensorwise (FP8 on the wire): the owner, holding whole matrices, quantizes each with its exact
  amax into its slot of a persistent uint8 buffer; the all-gather ships those bytes and a second,
  small one the per-matrix scales, so every rank holds exactly the owner's bits.
Buckets that mix converted and other params gather bf16 as usual and quantize their converted
layers locally afterwards (`quantize_mixed`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .. import _collectives as collectives
from .._bucket import CommBucket, InFlight, _alloc, _allocated, _free, _nbytes
from ..planning import Bucket
from .formats import Fp8Tensorwise
from .linear import Fp8Linear, Fp8Weight, quantize_weight


class Fp8Bucket(CommBucket):
    """A bucket of `Fp8Linear` weights of one `recipe`, synced as FP8 ([Note: FP8 buckets])."""

    def __init__(self, *args, modules: Sequence[Fp8Linear], recipe: str, **kwargs) -> None:
        kwargs["reshard"] = True  # the full bf16 bucket is never kept: shards only
        super().__init__(*args, **kwargs)
        self.modules = list(modules)
        self.recipe = recipe
        self._placeholders = [self._empty.new_zeros(1).expand(p.shape) for _, p in self.params]
        self._bf16 = False  # the gather in flight is full_params()' bf16 one
        if recipe == "tensorwise":
            self._bytes = torch.zeros(
                self.end - self.start, dtype=torch.uint8, device=self.param.device
            )
            # Scale slots: per part, per rank, one per matrix of that rank's shard.
            self._shard_params = [
                [self._in_shard(b, r) for r in range(self.comm.size)] for b in self.parts
            ]
            self._scales = [
                torch.zeros(self.comm.size * max(1, *map(len, shards)), device=self.param.device)
                for shards in self._shard_params
            ]

    def _in_shard(self, b: Bucket, rank: int) -> list[int]:
        """Indices of the params in `rank`'s shard of part `b`, in buffer order."""
        lo, hi = b.shard(rank)
        inside = [n for n, (_, p) in enumerate(self.params) if lo <= p.start and p.end <= hi]
        return sorted(inside, key=lambda n: self.params[n][1].start)

    def keep_shards(self) -> None:
        super().keep_shards()
        self.fresh = False  # no FP8 weights yet

    def release_params(self) -> None:
        """Drop the bf16 values `full_params()` gathered; the FP8 weights stay (and stay fresh)."""
        assert self.gathering is None, "finish the gather before releasing its storage"
        for (param, _), placeholder in zip(self.params, self._placeholders, strict=True):
            param.data = placeholder
        _free(self.param)

    def zero_grads(self) -> None:
        assert self.reducing is None, "never zero under an in-flight reduction"
        self.reset_arrivals()
        self.grad_shard.zero_()
        if self.gathering is None:  # else the grad storage is a staging region in flight
            _free(self.grad)

    def persistent_bytes(self) -> tuple[int, int]:
        if self.recipe == "tensorwise":
            fp8 = _nbytes(self._bytes) + sum(_nbytes(s) for s in self._scales)
        else:
            fp8 = sum(_nbytes(t) for m in self.modules if m.fp8_weight for t in _tensors(m))
        return _nbytes(self.param_shard) + fp8, _nbytes(self.grad_shard)

    # -- gathers ----------------------------------------------------------------------------

    def start_gather(self, full: bool = False) -> None:
        """Dispatch the FP8 sync; `full`: gather the bf16 values instead (`full_params()`)."""
        self._bf16 = full
        if full:
            super().start_gather()
            return
        assert self.gathering is None
        self.gathering = self._gather_mxfp8() if self.recipe == "mxfp8" else self._gather_bytes()

    def _gathered(self) -> None:
        if self._bf16:  # full_params(): the FP8 weights are untouched, so is `fresh`
            self._point_params_at_full()
            return
        if self.recipe == "mxfp8":
            staging = self._staging()
            for (_, p), module in zip(self.params, self.modules, strict=True):
                view = self._local(staging, p).view(p.shape)
                module.fp8_weight = quantize_weight(view, "mxfp8")
            _free(self.grad)  # the staging region; the next backward starts from zeros
        else:
            self._set_tensorwise()
        self.fresh = True

    def _staging(self) -> torch.Tensor:
        """The bf16 staging region: the first half of the (fp32) grad storage, in bf16."""
        return self.grad.view(torch.bfloat16)[: self.end - self.start]

    def _gather_mxfp8(self) -> InFlight:
        if _allocated(self.grad):  # gathers run between a step and the next backward
            raise RuntimeError(
                "an FP8 param gather would overwrite gradients accumulated in its bucket: run "
                "optimizer.step() (and zero_grad()) before the next forward"
            )
        _alloc(self.grad)
        staging = self._staging()
        group, rank = self.comm.gather_group, self.comm.rank
        handles = []
        for i, b in enumerate(self.parts):
            mine = self._slot(staging, b, rank)
            mine.copy_(self._mine(self.param, self.param_shard, i))  # bf16(master), staged now
            handles.append(collectives.all_gather(self._part(staging, b), mine, group))
        return InFlight(handles)

    def _gather_bytes(self) -> InFlight:
        group, rank = self.comm.gather_group, self.comm.rank
        handles = []
        for i, b in enumerate(self.parts):
            mine = self._mine(self.param, self.param_shard, i)
            lo = b.shard(rank)[0]
            scales = self._scales[i].view(self.comm.size, -1)[rank]
            for j, n in enumerate(self._shard_params[i][rank]):
                p = self.params[n][1]
                q = quantize_weight(mine[p.start - lo : p.end - lo].view(p.shape), "tensorwise")
                self._local(self._bytes, p).copy_(q.rowwise.data.view(torch.uint8).reshape(-1))
                scales[j] = q.rowwise.scale
            handles.append(
                collectives.all_gather(
                    self._part(self._bytes, b), self._slot(self._bytes, b, rank), group
                )
            )
            handles.append(collectives.all_gather(self._scales[i], scales, group))
        return InFlight(handles)

    def _set_tensorwise(self) -> None:
        for i, shards in enumerate(self._shard_params):
            scales = self._scales[i].view(self.comm.size, -1)
            for r, members in enumerate(shards):
                for j, n in enumerate(members):
                    p = self.params[n][1]
                    data = self._local(self._bytes, p).view(torch.float8_e4m3fn).view(p.shape)
                    q = Fp8Tensorwise(data, scales[r, j].clone())
                    self.modules[n].fp8_weight = Fp8Weight(q, q)


class MixedFp8Bucket(CommBucket):
    """A bucket holding some `Fp8Linear` weights among other params: it gathers bf16 as usual,
    then each rank quantizes the converted layers from the gathered values."""

    def __init__(self, *args, fp8_members: Sequence[tuple[int, Fp8Linear]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fp8_members = list(fp8_members)

    def _gathered(self) -> None:
        super()._gathered()
        for n, module in self.fp8_members:
            module.fp8_weight = quantize_weight(self.params[n][0], module.recipe)


def bucket_factory(module: nn.Module) -> Callable[..., CommBucket]:
    """Builds `Fp8Bucket`s where every param is an `Fp8Linear` weight of one recipe,
    `MixedFp8Bucket`s where some are, plain `CommBucket`s elsewhere (`aligned_buckets`)."""
    owner = {id(m.weight): m for m in module.modules() if isinstance(m, Fp8Linear)}

    def make(kind: str, parts, params, comm, **kwargs) -> CommBucket:
        modules = [owner.get(id(param)) for param, _ in params]
        recipes = {m.recipe for m in modules if m is not None}
        if None not in modules and len(recipes) == 1:
            return Fp8Bucket(
                kind, parts, params, comm, modules=modules, recipe=recipes.pop(), **kwargs
            )
        members = [(n, m) for n, m in enumerate(modules) if m is not None]
        if members:
            return MixedFp8Bucket(kind, parts, params, comm, fp8_members=members, **kwargs)
        return CommBucket(kind, parts, params, comm, **kwargs)

    return make


def has_fp8_weights(module: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in module.modules())


def _tensors(module: Fp8Linear) -> list[torch.Tensor]:
    """The distinct tensors of a module's FP8 weight."""
    out: dict[int, torch.Tensor] = {}
    for q in module.fp8_weight:
        for t in q:
            out[id(t)] = t
    return list(out.values())
