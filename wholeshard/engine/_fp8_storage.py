"""FP8 param gather: a storage unit whose params are all `Fp8Linear` weights of one recipe syncs
them as FP8 weights (`DataParallelConfig(fp8_param_gather=True)`).

[Note: FP8 units]
Between steps each rank keeps, for such a unit: its bf16 (param dtype) shard, which the
optimizer writes, and every converted layer's persistent FP8 weight (`Fp8Linear.fp8_weight`);
no full bf16 copy. The params' `.data` is a right-shaped placeholder (`Fp8Linear` never reads
it; autograd needs its shape); `full_params()` gathers the bf16 values transiently.
- mxfp8 (Megatron's way): at dispatch, this rank writes `bf16(shard)` into its slot of a bf16
  staging region aliased on the unit's grad storage (the grads were consumed by the step), the
  all-gather ships bf16, and every rank, the owner included, quantizes the gathered values into
  its FP8 weights; the region is freed before the next backward. Staging at dispatch, not at the
  step, is what keeps a deferred gather (`overlap_param_gather`) from shipping a buffer that
  `zero_grad` cleared in between.
- tensorwise (FP8 on the wire): the owner, holding whole matrices, quantizes each with its exact
  amax into its slot of a persistent uint8 buffer; the all-gather ships those bytes and a second,
  small one the per-matrix scales, so every rank holds exactly the owner's bits. In an exchange
  unit a matrix may span shards ([Note: exchange buffers] in `planning._exchange`): its owner
  quantizes it whole from its owned copy ([Note: owned copies] in `_owned_copies`), and an
  all-to-all on the gather group, waited for at dispatch (so every rank issues it, and the
  all-gathers after it, in dispatch order), sends each piece's bytes to the shard holding it
  before the all-gathers; the scale slots are the owners'.
Units that mix converted and other params gather bf16 as usual and quantize their converted
layers locally afterwards (`MixedFp8Storage`), as do tensorwise units with a weight no one rank
holds whole (an element-wise one across shards: `quantizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..distributed import collectives
from ..fp8.formats import Fp8Tensorwise
from ..fp8.linear import Fp8Linear, Fp8Weight, quantize_weight
from ..planning import Bucket, Placement, placement_pieces
from . import _resize
from ._exchange import moves
from ._storage import StorageUnit, UnitState
from ._sync import InFlight, all_gather_shards


class Fp8Storage(StorageUnit):
    """A storage unit of `Fp8Linear` weights of one `recipe`, synced as FP8 ([Note: FP8 units]).

    Its state ([Note: unit states]) is the FP8 weights': STALE after an update, FRESH once
    gathered; the full bf16 storage exists only for `full_params()` (`params_materialised`)."""

    def __init__(self, *args, modules: Sequence[Fp8Linear], recipe: str, **kwargs) -> None:
        kwargs["reshard"] = True  # the full bf16 unit is never kept: shards only
        super().__init__(*args, **kwargs)
        if self.owned_copies is not None:  # each gather quantizes from them
            self.owned_copies.keep_params = True
        self.modules = list(modules)
        self.recipe = recipe
        self._placeholders = [self._empty.new_zeros(1).expand(p.shape) for _, p in self.params]
        self._state_before_bf16: UnitState | None = None  # set while full_params() gathers
        if recipe == "tensorwise":
            self._bytes = torch.zeros(
                self.end - self.start, dtype=torch.uint8, device=self.param.device
            )
            # Scale slots: per bucket, per rank, one per matrix that rank quantizes.
            self._quantized_by = [
                [self._quantizes(b, r) for r in range(self.groups.size)] for b in self.buckets
            ]
            self._scales = [
                torch.zeros(self.groups.size * max(1, *map(len, ranks)), device=self.param.device)
                for ranks in self._quantized_by
            ]
            if self.kind == "exchange":  # the owners' bytes that other ranks' shards hold
                at = {b.index: b for b in self.buckets}
                pieces = [s for _, p in self.params for s in placement_pieces(p, at[p.bucket])]
                pieces.sort(key=lambda s: s.start)
                rank, size = self.groups.rank, self.groups.size
                self._moves = moves(
                    (self,), pieces, lambda _: self, rank, size, self.groups.group_rank
                )

    def _quantizes(self, b: Bucket, rank: int) -> list[int]:
        """Indices of the params of bucket `b` that `rank` quantizes, in buffer order."""
        mine = [
            n
            for n, (_, p) in enumerate(self.params)
            if p.bucket == b.index and quantizer(self.kind, p, b) == rank
        ]
        return sorted(mine, key=lambda n: self.params[n][1].start)

    def keep_shards(self) -> None:
        super().keep_shards()
        self.state = UnitState.STALE  # no FP8 weights yet

    def release_params(self) -> None:
        """Drop the bf16 values `full_params()` gathered; the FP8 weights stay as they are."""
        self._expect(UnitState.FRESH, UnitState.STALE, UnitState.RELEASED)
        for (param, _), placeholder in zip(self.params, self._placeholders, strict=True):
            param.data = placeholder
        _resize.free(self.param)

    def zero_grads(self) -> None:
        if self.reducing is not None:
            raise AssertionError("never zero gradients under an in-flight reduction")
        self.open_window()
        self.grad_shard.zero_()
        if self.gathering is None:  # else the grad storage is a staging region in flight
            _resize.free(self.grad)

    def persistent_bytes(self) -> tuple[int, int]:
        if self.recipe == "tensorwise":
            fp8 = self._bytes.nbytes + sum(s.nbytes for s in self._scales)
        else:
            fp8 = sum(t.nbytes for m in self.modules if m.fp8_weight for t in _tensors(m))
        param, grad = super().persistent_bytes()
        return param + fp8, grad

    # -- gathers ----------------------------------------------------------------------------

    def start_gather(self, full: bool = False) -> None:
        """Dispatch the FP8 sync; `full`: gather the bf16 values instead (`full_params()`),
        which leaves the FP8 weights, and so the state, as they are."""
        if full:
            self._expect(UnitState.FRESH, UnitState.STALE)
            self._state_before_bf16 = self.state
            self.state = UnitState.STALE  # as the base class gathers from
            super().start_gather()
            return
        self._expect(UnitState.STALE)
        self._dispatched(self._gather_mxfp8() if self.recipe == "mxfp8" else self._gather_bytes())

    def _gathered(self) -> None:
        if self._state_before_bf16 is not None:  # full_params(): the FP8 weights are untouched
            self._point_params_at_full()
            self.state, self._state_before_bf16 = self._state_before_bf16, None
            return
        if self.recipe == "mxfp8":
            staging = self._staging()
            for (_, p), module in zip(self.params, self.modules, strict=True):
                view = self._param_range(staging, p).view(p.shape)
                module.fp8_weight = quantize_weight(view, "mxfp8")
            _resize.free(self.grad)  # the staging region; the next backward starts from zeros
        else:
            self._set_tensorwise()
        self.state = UnitState.FRESH

    def _staging(self) -> torch.Tensor:
        """The bf16 staging region: the first half of the (fp32) grad storage, in bf16."""
        return self.grad.view(torch.bfloat16)[: self.end - self.start]

    def _gather_mxfp8(self) -> InFlight:
        if _resize.allocated(self.grad):  # gathers run between a step and the next backward
            raise RuntimeError(
                "an FP8 param gather would overwrite gradients accumulated in its unit: run "
                "optimizer.step() (and zero_grad()) before the next forward"
            )
        _resize.alloc(self.grad)
        staging = self._staging()
        rank = self.groups.rank
        handles = []
        for i, b in enumerate(self.buckets):
            mine = self._shard_range(staging, b, rank)
            mine.copy_(self._own_shard(self.param, self.param_shard, i))  # bf16(master), staged now
            handles += self._share(staging, b, mine)
        return InFlight(handles)

    def _gather_bytes(self) -> InFlight:
        group, rank = self.groups.gather_on, self.groups.rank
        mine = [self._scales[i].view(self.groups.size, -1)[rank] for i in range(len(self.buckets))]
        for i, scales in enumerate(mine):
            for j, n in enumerate(self._quantized_by[i][rank]):
                p = self.params[n][1]
                q = quantize_weight(self.owned_param(p.start, p.end).view(p.shape), "tensorwise")
                self._param_range(self._bytes, p).copy_(
                    q.rowwise.data.view(torch.uint8).reshape(-1)
                )
                scales[j] = q.rowwise.scale
        if self.kind == "exchange":
            self._bytes_to_holders()
        handles = []
        for i, b in enumerate(self.buckets):
            handles += self._share(self._bytes, b, self._shard_range(self._bytes, b, rank))
            handles += all_gather_shards(self._scales[i], mine[i], group)
        return InFlight(handles)

    def _bytes_to_holders(self) -> None:
        """Send the bytes of the owned matrices' pieces that other shards hold to them, and
        receive this shard's pieces from their owners."""
        m = self._moves
        exchange = collectives.all_to_all(
            [self._elements(self._bytes, p.start, p.end) for p in m.owned],
            [self._elements(self._bytes, p.start, p.end) for p in m.held],
            m.owned_splits,
            m.held_splits,
            self.groups.gather_group,
            like=self._bytes,
        )
        with collectives.naming(f"the FP8 bytes of unit {self.index} to their holders"):
            exchange.wait()

    def _set_tensorwise(self) -> None:
        for i, ranks in enumerate(self._quantized_by):
            scales = self._scales[i].view(self.groups.size, -1)
            for r, members in enumerate(ranks):
                for j, n in enumerate(members):
                    p = self.params[n][1]
                    data = self._param_range(self._bytes, p).view(torch.float8_e4m3fn).view(p.shape)
                    q = Fp8Tensorwise(data, scales[r, j].clone())
                    self.modules[n].fp8_weight = Fp8Weight(q, q)


class MixedFp8Storage(StorageUnit):
    """A storage unit holding some `Fp8Linear` weights among other params: it gathers bf16 as
    usual, then each rank quantizes the converted layers from the gathered values."""

    def __init__(self, *args, fp8_members: Sequence[tuple[int, Fp8Linear]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fp8_members = list(fp8_members)

    def _gathered(self) -> None:
        super()._gathered()
        for n, module in self.fp8_members:
            module.fp8_weight = quantize_weight(self.params[n][0], module.recipe)


def quantizer(kind: str, p: Placement, b: Bucket) -> int | None:
    """The rank that quantizes FP8 weight `p` of bucket `b` of a `kind` buffer whole for a
    tensorwise FP8 gather: in an exchange buffer its matrix's owner, else the rank whose shard
    holds it whole; None if no rank holds it whole (an element-wise param across shards)."""
    if kind == "exchange" and p.owners:
        return p.owner
    first = b.owner(p.start)
    return first if b.owner(p.end - 1) == first else None


def fp8_storage_factory(module: nn.Module) -> Callable[..., StorageUnit]:
    """Builds `Fp8Storage` where every param is an `Fp8Linear` weight of one recipe (and for
    tensorwise, each weight has its `quantizer`), `MixedFp8Storage` where some are, plain
    `StorageUnit` elsewhere."""
    owner = {id(m.weight): m for m in module.modules() if isinstance(m, Fp8Linear)}

    def make(index: int, kind: str, buckets, params, groups, **kwargs) -> StorageUnit:
        modules = [owner.get(id(param)) for param, _ in params]
        recipes = {m.recipe for m in modules if m is not None}
        args = (index, kind, buckets, params, groups)
        at = {b.index: b for b in buckets}
        whole = all(quantizer(kind, p, at[p.bucket]) is not None for _, p in params)
        recipe = recipes.pop() if len(recipes) == 1 else None
        if None not in modules and (recipe == "mxfp8" or (recipe == "tensorwise" and whole)):
            return Fp8Storage(*args, modules=modules, recipe=recipe, **kwargs)
        members = [(n, m) for n, m in enumerate(modules) if m is not None]
        if members:
            return MixedFp8Storage(*args, fp8_members=members, **kwargs)
        return StorageUnit(*args, **kwargs)

    return make


def has_fp8_weights(module: nn.Module) -> bool:
    """Whether `module` holds an `Fp8Linear` (converted by `wholeshard.fp8.convert`)."""
    return any(isinstance(m, Fp8Linear) for m in module.modules())


def _tensors(module: Fp8Linear) -> list[torch.Tensor]:
    """The distinct tensors of a module's FP8 weight."""
    out: dict[int, torch.Tensor] = {}
    for q in module.fp8_weight:
        for t in q:
            out[id(t)] = t
    return list(out.values())
