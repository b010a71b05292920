"""Planning: the two decisions made for every parameter, once: which optimizer updates it
(`routing.route_params`, the only module here that reads a model, importing torch only when it
does) and where it lives, and so which rank owns it (`plan_for` -> `Plan`, from `ParamSpec`s of
routes, a shapes file or a preset: the plan `DataParallel` makes with the same settings).
`plan_exactly` plans exactly the strategy, bucket size and shard-group size it is told. What a
plan costs is `wholeshard.capacity`'s, above the engine: nothing here imports it. The planners
are private (`_whole`, `_rows`, `_balanced`, `_packing`, `_owners`, `_stacked`,
`_elementwise`); `_invariants` checks them. `sync` describes the collectives each bucket's sync
scheme issues (what the engine executes and `capacity` prices). `layouts` is the one extension
point: a registered rewrite of the plan with its own sync schemes ([Note: layouts]).

[Note: wholeshard vocabulary]
One word, one meaning, everywhere in wholeshard (code, errors, docs):
- route: one trainable param and the optimizer that updates it, the matrix rule or AdamW
  (`routing.Route`, `Route.matrix`; `routing.route_params` is the one routing decision).
- plan: every buffer of a model for `dp` ranks in shard groups of `k` (`planning.Plan`).
- buffer: one flat tensor holding params of one kind (`planning.Buffer`): "matrix" (whole
  tensors), "stacked" (whole matrices of expert stacks), "exchange" (every param, matrices
  owned apart from the shards that hold them), "adamw" (element-wise), or a layout's own.
- bucket: a contiguous range of a buffer, cut into `k` shards (`planning.Bucket`): equal ones,
  reduce-scattered and all-gathered, or an owner bucket's, of any length, reduced to and
  broadcast from each owner; each bucket is reduced and gathered as one unit of collectives.
- shard: rank r's part of a bucket; rank r of a shard group owns shard r of every bucket.
- storage unit: the buckets one runtime storage object spans (`engine`'s `StorageUnit`; a
  plan's, `planning.units.Unit`); one bucket, or several where a stacked param runs across
  them. At runtime the engine counts units, not buckets (`DataParallel.units`,
  `OwnedRange.unit`); "bucket" means only the planned `Bucket`.
- received / final (a gradient): received, added into its unit's grad in this accumulation
  window (any backward); final, received in a synchronising backward, counting towards the
  unit's reduction. "Land" is said of collectives only (a reduction or gather completes).
- owned range: the elements of one param a rank updates, as the engine hands them to the
  optimizer (`engine.step_protocol.OwnedRange`): a whole tensor, a whole matrix of a stack,
  or a flat slice.
- piece: what the optimizer steps, one owned range or one matrix of it, with its fp32 master
  (`optim.OwnedPiece`).
- layout: a registered rewrite of the plan, with its own sync schemes and perhaps its own
  buffer kind (`layouts.Layout`; the bench's legacy baselines are layouts).
- sync scheme: how a bucket synchronizes (`Bucket.sync`): "equal_shards", "owners",
  "exchange", or one a layout registered; one description each in `sync`, of the collectives
  it issues.
- strategy: how the whole-tensor planner assigns params to shards: "size_match", "balanced"
  (equal shards), "owners" (owner buckets), "exchange" (`_exchange`), or "auto" (from 64
  ranks the exchange; below, balanced where it meets the plan targets, else owners: [Note:
  automatic strategy] in `auto`).
"""

from ._exchange import Segment, pieces, placement_matrices, placement_pieces, segments
from .auto import plan_for
from .buffer import KINDS, Buffer
from .plan import (
    DEFAULT_STRATEGY,
    ONE_BUCKET,
    STRATEGIES,
    Plan,
    default_bucket_size,
    plan_exactly,
    validate_specs,
)
from .specs import Bucket, ParamSpec, Placement

__all__ = [
    "Segment",
    "pieces",
    "placement_matrices",
    "placement_pieces",
    "segments",
    "DEFAULT_STRATEGY",
    "KINDS",
    "ONE_BUCKET",
    "STRATEGIES",
    "Bucket",
    "Buffer",
    "ParamSpec",
    "Placement",
    "Plan",
    "default_bucket_size",
    "plan_exactly",
    "plan_for",
    "validate_specs",
]
