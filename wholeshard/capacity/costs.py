"""What a plan costs each rank in a training mode: bytes held, bytes alive at once, collectives
and bytes sent per step. From the plan, its specs and a `Mode` alone: no model, no torch.

[Note: plan costs]
The figures follow what `DataParallel` and `LayerwiseOptimizer` allocate and issue (the engine's
`_storage`, `_schedule` and `optim`), for one shard-group rank r:

- `params`, `grads` (what `DataParallel.memory()` calls them): every storage unit's full
  buffers (ZeRO-1/2), or only rank r's shard of each bucket when fully sharded, and then, of an
  exchange buffer, in float32 also a whole copy of the params of every matrix r owns (the
  optimizer's whole-matrix views and masters); in the param and grad-reduce dtypes. The grads'
  copy, and the params' where the masters are separate (`Mode.separate_masters`), live only
  through the step, in the peak ([Note: owned copies] in the engine's `_owned_copies`; a
  float32 unit whose owned pieces all have separate masters, all stored transposed, drops its
  copy too: not modelled). Fully sharded means `reshard_after_forward` with more than one rank
  per shard group (the engine ignores it otherwise).
- `masters`: an fp32 copy of every element r owns when the param dtype is not float32, else of
  the owned Muon weights stored transposed (`Mode.transposed`); `master_grads` (not in
  `memory()`): an fp32 grad for each such master, and for every owned piece when the
  grad-reduce dtype is not float32.
- `optimizer_state`, after the first step: torch's Muon keeps an fp32 momentum per owned
  element, AdamW two fp32 moments per owned element and a 4-byte `step` per owned piece (one
  piece per owned range of a param; amsgrad, fused and capturable AdamW are not modelled).
- with `Mode.offload_state` (`LayerwiseOptimizer(offload_state=True)`), `host` bytes: the
  masters and the optimizer state but the 0-d `step`s; a cast master grad exists only while its
  unit steps, so `master_grads` is 0. `device` bytes: the rest of `total` (`DataParallel.memory()`
  says the same).

Per step (steady state: one forward, backward, `clip_grad_norm_` and `step()`, dp > 1): per
storage unit the collectives its buckets' sync schemes describe ([Note: sync schemes] in
`planning.sync`, which the engine executes): its reduction (grad dtype: a reduce-scatter per
bucket, an owner bucket's `reduce_coalesced`, and with replicas an all-reduce of the rank's
shards across them) and, when k > 1, its gather (param dtype: an all-gather per bucket, an
owner bucket's `broadcast_coalesced`, or what a layout's scheme describes), twice when
fully sharded (forward and backward) except for the units kept gathered from forward to
backward: the first in reduce order and those holding params of the root module (names without a
dot); of an exchange buffer, per batch of its buckets (`sync.exchange_batches` of
`Mode.exchange_every`), one all-to-all of the reduced matrix pieces to their owners (grad dtype)
and one back (param dtype), whose sizes and peers differ from rank to rank (`exchange_slots`:
the buffer's `segments` grouped by rank once and cached, since a dp-1024 plan has about 100K of
them); fully sharded with `overlap_grad_reduce`, one int32 all-reduce over dp of a flag per unit
(which units every rank ran all the modules of: [Note: collective order] in the engine's
`_schedule`); one float64 step check of 4 + (number of params) values over dp ranks; one fp32
norm over the shard group when clipping and k > 1. `ring_bytes` charges each what a
bandwidth-optimal ring sends per rank (the table of `wholeshard.bench.traffic`; here over the
op's own group), and an all-to-all what the rank sends.

Not modelled: frozen params and module buffers (not in a plan), FP8 param gather, a layout's
own buffer kind ([Note: layouts] in `planning.layouts`; its sync schemes are), activation
checkpointing (re-gathers in backward), evaluation forwards, the gloo or NCCL library's own
scratch, and the runtime's (activations, workspace).
`tests/engine/test_plan_agrees.py` checks the figures against `memory()`, the optimizer's
master grads, a recorded collective log and the measured peak of real runs at 2-4 ranks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine.config import DataParallelConfig, Variant
from ..planning.buffer import KINDS
from ..planning.plan import Plan
from ..planning.specs import ParamSpec, is_int, matrices
from ..planning.sync import (
    ELEMENT_BYTES,
    dtype_name,
    exchange_batches,
    unit_gather,
    unit_reduce,
)
from ..planning.sync import OPS as OPS  # re-exported: the records costs are made of
from ..planning.sync import Collective as Collective
from ..planning.sync import ring_bytes as ring_bytes
from ..planning.units import Unit, storage_units
from . import _lifetimes
from ._exchange import exchange_slots, owned_by_batch


@dataclass(frozen=True)
class Mode:
    """The `DataParallelConfig` options that change what a plan costs (the shard group size is
    the plan's own). Dtypes are stored as names (`dtype_name`); `param_dtype` is the buffers'
    dtype (DataParallel's None means the model's own: give it here). `clip_grad_norm`: the
    step calls `clip_grad_norm_` (the train job always does). `transposed`: names of Muon
    weights stored (in, out), which keep fp32 masters even in float32. `offload_state`: the
    optimizer keeps masters and state in host memory (`LayerwiseOptimizer(offload_state=)`).
    `exchange_every`: an exchange buffer's buckets per all-to-all batch (None: one batch a
    step; the engine's `Variant.exchange_every`)."""

    reshard_after_forward: bool = False
    param_dtype: str = "float32"
    grad_reduce_dtype: str = "float32"
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    clip_grad_norm: bool = True
    transposed: frozenset[str] = field(default_factory=frozenset)
    offload_state: bool = False
    exchange_every: int | None = None

    @property
    def separate_masters(self) -> bool:
        """Every owned element has an fp32 master apart from its param (`OwnedPiece.master`)."""
        return self.param_dtype != "float32"

    def __post_init__(self) -> None:
        for name in ("param_dtype", "grad_reduce_dtype"):
            object.__setattr__(self, name, dtype_name(getattr(self, name)))
        every = self.exchange_every
        if every is not None and (not is_int(every) or every < 1):
            raise ValueError(f"exchange_every must be None or an int >= 1, got {every!r}")
        object.__setattr__(self, "transposed", frozenset(self.transposed))

    @classmethod
    def of(
        cls,
        config: DataParallelConfig,
        variant: Variant | None = None,
        model_dtype: Any = "float32",
        **rest: Any,
    ) -> Mode:
        """The mode of `DataParallel(model, config, _variant=variant)` for a model whose params
        are in `model_dtype`, read from the config as `DataParallel` reads it; `rest`: the
        options the config does not hold (`clip_grad_norm`, `transposed`, `offload_state`)."""
        policy = config.mp_policy
        param = getattr(policy, "param_dtype", None) or model_dtype
        return cls(
            reshard_after_forward=config.reshard_after_forward,
            param_dtype=param,
            grad_reduce_dtype=getattr(policy, "reduce_dtype", None) or param,
            overlap_grad_reduce=config.overlap_grad_reduce,
            overlap_param_gather=config.overlap_param_gather,
            exchange_every=getattr(variant, "exchange_every", None),
            **rest,
        )


@dataclass
class Owned:
    """What one shard-group rank owns: elements and pieces (optimizer steps) of each kind."""

    matrix: int = 0
    adamw: int = 0
    adamw_pieces: int = 0
    transposed: int = 0  # Muon elements of weights stored (in, out)
    exchanged: int = 0  # of `matrix`, an exchange buffer's (kept whole when fully sharded)


def owned(plan: Plan, transposed: frozenset[str] = frozenset()) -> list[Owned]:
    """Per shard-group rank, what it owns (as `Buffer.owned` deals it), in one pass over the
    placements (`Buffer.owned` walks them all once per rank: about 30 s for moe-256x at dp
    1024)."""
    out = [Owned() for _ in range(plan.shard_group_size)]
    for buffer in plan.buffers:
        for p in buffer.placements:
            if buffer.kind == "matrix":
                out[p.owner].matrix += p.numel
                out[p.owner].transposed += p.numel if p.name in transposed else 0
            elif buffer.kind == "stacked":
                for m in matrices(p, buffer.buckets):
                    out[m.owner].matrix += m.end - m.start
            elif buffer.kind == "exchange" and p.owners:  # each matrix whole by its owner
                unit = p.numel // len(p.owners)
                for rank in p.owners:
                    out[rank].matrix += unit
                    out[rank].exchanged += unit
                    out[rank].transposed += unit if p.name in transposed else 0
            elif buffer.kind in ("adamw", "exchange"):  # element-wise: what each shard holds
                b = buffer.buckets[p.bucket]
                for r in range(b.owner(p.start), b.owner(p.end - 1) + 1):
                    lo, hi = b.shard(r)
                    out[r].adamw += min(hi, p.end) - max(lo, p.start)
                    out[r].adamw_pieces += 1
            else:
                raise ValueError(_unmodelled(buffer.kind))
    return out


def _unmodelled(kind: str) -> str:
    return (
        f"the costs of a {kind!r} buffer (a layout's own kind, [Note: layouts] in "
        f"wholeshard.planning.layouts) are not modelled: costs model the kinds {KINDS}"
    )


def _units(plan: Plan, specs: Sequence[ParamSpec]) -> list[Unit]:
    """The plan's storage units, as the engine builds them; a layout's own kind is not
    modelled."""
    for b in plan.buffers:
        if b.kind not in KINDS:
            raise ValueError(_unmodelled(b.kind))
    return storage_units(plan, specs)


def fully_sharded(plan: Plan, mode: Mode) -> bool:
    """Whether `DataParallel` reshards: asked, and params need gathering (dp > 1, k > 1)."""
    return mode.reshard_after_forward and plan.dp_size > 1 and plan.shard_group_size > 1


def _kept(plan: Plan, mode: Mode) -> list[int]:
    """Per shard-group rank, the buffer elements it keeps between steps: all of them, or when
    fully sharded its shards, in one pass over the buckets (an owner bucket lists its owners)."""
    k = plan.shard_group_size
    if not fully_sharded(plan, mode):
        return [plan.numel] * k
    equal, kept = 0, [0] * k
    for buffer in plan.buffers:
        for b in buffer.buckets:
            if not b.owners:
                equal += b.shard_numel
                continue
            for r, lo, hi in b.shards():
                kept[r] += hi - lo
    return [n + equal for n in kept]


def _persistent(mode: Mode, mine: Owned, kept: int, copies: bool) -> dict[str, int]:
    """Bytes a rank owning `mine` and keeping `kept` buffer elements (and, with `copies`, the
    params of its exchanged matrices) holds between steps, by kind, and their `total` ([Note:
    plan costs])."""
    pb, gb = ELEMENT_BYTES[mode.param_dtype], ELEMENT_BYTES[mode.grad_reduce_dtype]
    elements = mine.matrix + mine.adamw
    masters = elements if mode.separate_masters else mine.transposed
    master_grads = elements if mode.grad_reduce_dtype != "float32" else mine.transposed
    master_grads *= not mode.offload_state  # made for a unit's update, then freed
    out = {
        "params": (kept + mine.exchanged * copies) * pb,
        "grads": kept * gb,
        "masters": 4 * masters,
        "optimizer_state": 4 * mine.matrix + 8 * mine.adamw + 4 * mine.adamw_pieces,
        "master_grads": 4 * master_grads,
    }
    out["total"] = sum(out.values())
    return out


def step_collectives(
    plan: Plan, specs: Sequence[ParamSpec], mode: Mode, rank: int = 0
) -> list[Collective]:
    """Every collective shard-group rank `rank` issues in one training step, as a multiset
    (within a step the order depends on the schedule); empty at dp 1 ([Note: plan costs]). Only
    the all-reduce across replicas of an owner bucket's shard and an exchange buffer's
    all-to-alls differ between ranks."""
    dp, k = plan.dp_size, plan.shard_group_size
    if dp == 1:
        return []
    units = _units(plan, specs)
    grad, param, node = mode.grad_reduce_dtype, mode.param_dtype, plan.node_size
    out = [c for u in units for c in unit_reduce(u.buckets, k, dp // k, rank, grad, node)]
    out += [slot[rank] for slot in exchange_slots(plan, mode)]
    if k > 1:  # fully sharded, a unit not kept from forward to backward is gathered twice
        kept = _lifetimes.kept_units(units) if fully_sharded(plan, mode) else range(len(units))
        for u in units:
            out += unit_gather(u.buckets, k, param, node) * (1 if u.index in kept else 2)
    if fully_sharded(plan, mode) and mode.overlap_grad_reduce:
        out.append(Collective("all_reduce", dp, len(units), "int32", "modules run", "dp"))
    out.append(Collective("all_reduce", dp, 4 + len(specs), "float64", "step check", "dp"))
    if mode.clip_grad_norm and k > 1:
        out.append(Collective("all_reduce", k, 1, "float32", "grad norm", "shard"))
    return out


@dataclass(frozen=True)
class Costs:
    """What `plan` costs in `mode` ([Note: plan costs]). `persistent[r]`: the bytes shard-group
    rank r holds between steps, by kind (`params`, `grads`, `masters` and `optimizer_state` are
    what `DataParallel.memory()` reports after a step), and their `total`; `transient_unit`: the
    largest unit's full params and grads (`memory()`'s `transient_unit`), `peak_transient`: the
    most bytes of full units, kept gradients ([Note: kept gradients] in the engine) and, of an
    exchange plan, the owned copies that live only through the step, alive at once in a step on
    the rank that holds the most (0 unless fully sharded), `rank_peaks` each shard-group rank's;
    `collectives`: one step's, of `worst_rank` (`step_collectives` of another rank differs only
    in the owner buckets' all-reduces across replicas and in the exchange's all-to-alls, which
    the projection prices at their busiest rank: `exchange_slots`); `host[r]`: of rank r's
    persistent bytes, those in host memory (`Mode.offload_state`; else 0), the rest on the
    device (`device_bytes`)."""

    plan: Plan
    mode: Mode
    persistent: tuple[dict[str, int], ...]
    transient_unit: int
    peak_transient: int
    collectives: tuple[Collective, ...]
    host: tuple[int, ...] = ()
    rank_peaks: tuple[int, ...] = ()

    def device_bytes(self, rank: int) -> int:
        """Shard-group rank `rank`'s persistent bytes on the device."""
        return self.persistent[rank]["total"] - self.host_bytes(rank)

    def host_bytes(self, rank: int) -> int:
        """Shard-group rank `rank`'s persistent bytes in host memory."""
        return self.host[rank] if self.host else 0

    @property
    def worst_rank(self) -> int:
        """The shard-group rank holding the most persistent bytes (the lowest of ties)."""
        return _worst(self.persistent)

    def counts(self) -> dict[str, int]:
        """Collectives per step by op."""
        return dict(Counter(c.op for c in self.collectives))

    @property
    def bytes_sent(self) -> int:
        """Bytes `worst_rank` sends per step (under the ring model every rank sends the same, but
        for an owner bucket's all-reduce across replicas, of that rank's shard)."""
        return sum(c.bytes_sent for c in self.collectives)

    def bytes_by_op(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for c in self.collectives:
            out[c.op] += c.bytes_sent
        return dict(out)


def plan_costs(plan: Plan, specs: Sequence[ParamSpec], mode: Mode | None = None) -> Costs:
    """The costs of `plan` (planned from `specs`, registration order) in `mode` (default:
    `Mode()`, ZeRO-1/2 in float32)."""
    mode = mode or Mode()
    units = _units(plan, specs)
    mine = owned(plan, mode.transposed)
    kept, copies = _kept(plan, mode), fully_sharded(plan, mode) and not mode.separate_masters
    per_rank = tuple(_persistent(mode, o, kept[r], copies) for r, o in enumerate(mine))
    host = tuple(
        p["masters"] + p["optimizer_state"] - 4 * o.adamw_pieces if mode.offload_state else 0
        for p, o in zip(per_rank, mine, strict=True)
    )
    pb, gb = ELEMENT_BYTES[mode.param_dtype], ELEMENT_BYTES[mode.grad_reduce_dtype]
    transient, peaks = 0, (0,) * plan.shard_group_size
    if fully_sharded(plan, mode):
        transient = max(u.numel for u in units) * (pb + gb)
        peaks = _peaks(plan, units, specs, mode)
    collectives = tuple(step_collectives(plan, specs, mode, _worst(per_rank)))
    return Costs(plan, mode, per_rank, transient, max(peaks), collectives, host, peaks)


def sharded_peak(plan: Plan, specs: Sequence[ParamSpec], mode: Mode) -> int:
    """`Costs.peak_transient` of `plan` in `mode` with `reshard_after_forward` (its dtypes and
    overlap), without the rest of the costs; 0 where nothing reshards (dp or k of 1)."""
    if not fully_sharded(plan, replace(mode, reshard_after_forward=True)):
        return 0
    return max(_peaks(plan, _units(plan, specs), specs, mode))


def _peaks(
    plan: Plan, units: Sequence[Unit], specs: Sequence[ParamSpec], mode: Mode
) -> tuple[int, ...]:
    """Each shard-group rank's peak, fully sharded (`_lifetimes.peak_bytes`)."""
    pb, gb = ELEMENT_BYTES[mode.param_dtype], ELEMENT_BYTES[mode.grad_reduce_dtype]
    overlap = (mode.overlap_grad_reduce, mode.overlap_param_gather)
    exchanged = [b for b in plan.buffers if b.kind == "exchange"]
    if not exchanged:  # the same on every rank
        return _lifetimes.peak_bytes(units, specs, pb, gb, *overlap) * plan.shard_group_size
    (buffer,) = exchanged  # its buckets are units, in reduce order ([Note: exchange buffers])
    unit_of = {(u.kind, u.buckets[0].start): u.index for u in units}
    batches = [
        [unit_of["exchange", buffer.buckets[b].start] for b in run]
        for run in exchange_batches(len(buffer.buckets), mode.exchange_every)
    ]
    copy = gb + pb * mode.separate_masters  # bytes per owned element alive from its exchange
    copies = [[n * copy for n in mine] for mine in owned_by_batch(buffer, mode.exchange_every)]
    return _lifetimes.peak_bytes(units, specs, pb, gb, *overlap, batches, copies)


def _worst(persistent: Sequence[dict[str, int]]) -> int:
    """The rank whose persistent bytes total the most (the lowest of ties)."""
    totals = [p["total"] for p in persistent]
    return totals.index(max(totals))
