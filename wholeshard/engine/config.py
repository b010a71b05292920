"""`DataParallelConfig`: every option of `DataParallel`, defined once.

A frozen dataclass with one docstring per field; `__post_init__` rejects bad values and
combinations (`ConfigError`, a ValueError naming the field and saying how to fix it), so a
config that exists is valid. The train job's parallelism flags and the bench's configurations
are made from these fields, and `docs/data_parallel.md` lists them from the docstrings. Neither
importing this module nor making a config imports torch (the CLI and the bench registry make
them before any worker starts).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..planning import STRATEGIES
from ..planning.layouts import layout_named
from ..planning.plan import Strategy
from ..planning.routing import MatrixParams
from ..planning.specs import is_int

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ParamInit = Callable[[str, torch.Tensor], None]


class ConfigError(ValueError):
    """An invalid config value; `field` names the field to fix (`section.field` in a
    `TrainConfig`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def literal_choices(hint: Any) -> tuple[Any, ...] | None:
    """The values a `Literal[...]` (or `Literal[...] | None`) type admits; None for other types.
    The one reading of a config field's choices (validation, flags, docs)."""
    for t in (hint, *typing.get_args(hint)):
        if typing.get_origin(t) is Literal:
            return typing.get_args(t)
    return None


@dataclass(frozen=True)
class DataParallelConfig:
    """How `DataParallel` plans, shards, syncs and schedules; see each field.

    Pass it as `DataParallel(module, config)`, or pass its fields as keywords:
    `DataParallel(module, reshard_after_forward=True)` builds `DataParallelConfig(
    reshard_after_forward=True)`. Whatever the options, every rank computes the same model as
    one process would (overlap, the pipelined step and fully sharded mode bitwise the same).
    The defaults are what a GPU user should run; each field says why one would change it.
    """

    bucket_size: int | None = None
    """Elements per bucket, at least; None takes `wholeshard.planning.default_bucket_size`
    (about 1/8 of the params, from 65,536 up to max(40M, 1M x k) for equal shards over k ranks,
    up to 40M for owner buckets). More, smaller buckets overlap more; each costs collectives."""
    shard_group_size: int | Literal["auto"] | None = None
    """Shard params within groups of this many consecutive ranks and replicate them across the
    dp / k groups (hybrid sharding); must divide the data-parallel size. None: one group, the
    default: it gives the busiest rank the least Newton-Schulz work at any dp (a smaller k
    gives each rank more matrices: llama3-8b at dp 1024, 3.6x more with `auto`'s k = 32) and
    keeps 1/dp of the optimizer state. `auto`: the largest k whose plan keeps buckets bounded,
    padding under 1% and the Newton-Schulz cost within 1.10 of the mean
    (`wholeshard.planning.auto`; `wholeshard plan --shard-group-size auto` shows why). A
    mesh's hybrid dims ("dp_replicate" x "dp_shard") or "ep" dim, when given, say k instead."""
    node_size: int | None = None
    """The data-parallel ranks of a node (consecutive in the data-parallel group, as torchrun
    numbers them: its --nproc-per-node), for two-level groups where a shard group spans several
    nodes: each bucket reduce-scatters within the node, then across nodes (1/node_size of it
    per rank crosses the network, and a ring is a node or a node count long, not k), and
    gathers the other way. None: one level, the default. Needs equal-shard buckets (strategy
    "exchange" or "balanced"; "auto" then never picks owner buckets). Any size dividing the
    shard group trains the same model; the machines' own makes it fast. `wholeshard plan
    --node-size` prices both forms on a fabric."""
    matrix_params: MatrixParams | None = None
    """`matrix_params(name, param) -> bool` replaces the default routing rule's decision of which
    params the matrix rule steps (the rest: AdamW) (`wholeshard.planning.routing`)."""
    expert_params: MatrixParams | None = None
    """`expert_params(name, param) -> bool`: which params are a MoE's experts, split over a
    mesh's "ep" dim (each ep rank holds its own); used only with one. None: names with an
    `experts` part (`layers.0.mlp.experts.w1`, `experts.3.up.weight`) ([Note: expert
    parallelism] in `wholeshard.distributed.mesh`)."""
    mp_policy: MixedPrecisionPolicy | None = None
    """torch's `torch.distributed.fsdp.MixedPrecisionPolicy`, with FSDP2's meanings:
    `param_dtype` the buffers' dtype, which forward and backward compute with (frozen params
    are cast to it too; the optimizer keeps fp32 masters when it is not float32; None: the
    trainable params' own dtype); `reduce_dtype` the dtype gradients are accumulated and
    reduced in (None: the compute dtype; `torch.float32` keeps bf16 gradients' sums exact to
    fp32); `output_dtype` the dtype floating-point outputs of the wrapped module's forward are
    cast to (None: left as computed); `cast_forward_inputs` casts the floating-point forward
    inputs to `param_dtype` when that is given. None: `MixedPrecisionPolicy()`, all off."""
    reshard_after_forward: bool = False
    """Fully sharded: between steps each rank keeps only its own shards; a module's params are
    gathered before its forward and again before its backward, and released after each. For
    models whose params, gradients and state do not fit replicated."""
    overlap_grad_reduce: bool = True
    """Reduce each storage unit during backward, as soon as all its gradients are in (FSDP2 always
    does). Off: every unit is reduced at the step, so every full gradient unit lives until
    then (fully sharded, that is the whole model's gradients); the same bits either way."""
    overlap_param_gather: bool = False
    """Gather the updated params during the next forward, each unit just ahead of the modules
    that use it, instead of at the end of `optimizer.step()`."""
    pipelined_step: bool = False
    """`optimizer.step()` updates each unit as soon as its reduction lands and dispatches its
    gather at once; the same bits as the unpipelined step."""
    fp8_param_gather: bool = False
    """Sync the weights of FP8 layers as FP8 (convert the model with `wholeshard.fp8.convert`
    before wrapping)."""
    param_init: ParamInit | None = None
    """`fn(name, tensor)` filling one param in place: build from a model on the meta device.
    Each rank materialises only what it holds and calls `fn` for the params it owns (and every
    frozen one), under torch's RNG seeded from the name, so values do not depend on the world
    size or mode; buffers are left for the model's own init after wrapping ([Note: meta-device
    construction] in `engine/_meta.py`)."""

    def __post_init__(self) -> None:
        if self.bucket_size is not None and not (
            is_int(self.bucket_size) and self.bucket_size >= 1
        ):
            raise ConfigError(
                "bucket_size", f"bucket_size must be None or an int >= 1, got {self.bucket_size!r}"
            )
        if self.node_size is not None and not (is_int(self.node_size) and self.node_size >= 1):
            raise ConfigError(
                "node_size",
                f"node_size must be None (one level) or an int >= 1 (the data-parallel ranks of "
                f"a node, torchrun's --nproc-per-node), got {self.node_size!r}",
            )
        k = self.shard_group_size
        if k is not None and k != "auto" and not (is_int(k) and k >= 1):
            raise ConfigError(
                "shard_group_size",
                f"shard_group_size must be None, an int >= 1 or 'auto', got {k!r}",
            )
        if self.mp_policy is not None:
            _check_policy(self.mp_policy)
        for name in ("overlap_grad_reduce", "overlap_param_gather", "reshard_after_forward",
                     "pipelined_step", "fp8_param_gather"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    name, f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        for name, what in (
            ("matrix_params", "a function matrix_params(name, param) -> bool"),
            ("expert_params", "a function expert_params(name, param) -> bool"),
            ("param_init", "a function fn(name, tensor)"),
        ):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ConfigError(
                    name, f"{name} must be None or {what}, got {getattr(self, name)!r}"
                )

    @classmethod
    def from_options(
        cls, config: DataParallelConfig | None, options: dict[str, Any]
    ) -> DataParallelConfig:
        """`config`, or the config `options` (field names as keywords) describe; not both."""
        if config is not None and options:
            raise TypeError(
                f"pass either config=DataParallelConfig(...) or its fields as keywords, not both "
                f"(got config and {sorted(options)}); use dataclasses.replace(config, ...) to "
                f"change a config"
            )
        if config is not None:
            if not isinstance(config, cls):
                raise TypeError(f"config must be a DataParallelConfig, got {type(config).__name__}")
            return config
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(
                f"DataParallel got unexpected keyword argument(s) {unknown}; the options are the "
                f"fields of DataParallelConfig: {sorted(names)}"
            )
        return cls(**options)


def _check_policy(policy: Any) -> None:
    import torch  # a policy was given, so torch is imported already
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(policy, MixedPrecisionPolicy):
        raise ConfigError(
            "mp_policy",
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy (e.g. "
            f"MixedPrecisionPolicy(param_dtype=torch.bfloat16)), got {policy!r}",
        )
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(policy, name)
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise ConfigError(
                "mp_policy",
                f"mp_policy.{name} must be None or a floating-point torch.dtype (e.g. "
                f"torch.bfloat16), got {value!r}",
            )


@dataclass(frozen=True)
class Variant:
    """The engine's other ways of doing what `DataParallelConfig`'s defaults do, kept for
    comparison (`wholeshard bench`, the tests), not for training: `DataParallel(...,
    _variant=Variant(...))`. Each default is the design's; the others are the planner's
    alternatives and registered layouts (the bench's baselines), which a user has no reason to
    pick."""

    layout: str | None = None
    """A registered layout's name: a rewrite of the plan with its own sync schemes ([Note:
    layouts] in `wholeshard.planning.layouts`; the legacy baselines are the bench's: import
    `wholeshard.bench.baselines`). None: the design's plan."""
    strategy: Strategy = "auto"
    """How matrices are dealt to ranks: `balanced` (equal shards, the matrix rule's cost even),
    `owners` (owner buckets of any size: each shard reduced to its owner and broadcast back),
    `size_match` (equal shards in rows of same-size matrices, Megatron's rule), `exchange` (one
    buffer in per-layer equal shards; each matrix's reduced pieces sent to its owner by an
    all-to-all and back), or `auto`: from 64 ranks a shard group (or with `node_size`) the
    exchange; below, balanced where it meets the plan targets (bucket bound, 1% padding, 1.10
    imbalance), else owners."""
    exchange_every: int | None = None
    """With the exchange strategy: exchange gradients to their owners, and params back, after
    every this many buckets in reduce order; None: once per step (the same bits either way)."""
    separate_all_gather_group: bool | None = None
    """Sync params on a second process group, so gathers do not queue behind reductions.
    None: on when fully sharded or pipelined (where gathers run beside reductions)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                "strategy", f"strategy must be one of {STRATEGIES}, got {self.strategy!r}"
            )
        if self.layout is not None:
            try:
                layout_named(self.layout)
            except ValueError as e:
                raise ConfigError("layout", str(e)) from None
        if self.exchange_every is not None and not (
            is_int(self.exchange_every) and self.exchange_every >= 1
        ):
            raise ConfigError(
                "exchange_every",
                f"exchange_every must be None (once per step) or an int >= 1 (buckets), got "
                f"{self.exchange_every!r}",
            )
        if self.separate_all_gather_group not in (None, True, False):
            raise ConfigError(
                "separate_all_gather_group",
                f"separate_all_gather_group must be None, True or False, got "
                f"{self.separate_all_gather_group!r}",
            )

    def check(self, config: DataParallelConfig) -> None:
        """Raise `ConfigError` if `config` cannot run under this variant: an option its layout
        refuses."""
        if self.layout is None:
            return
        for name, why in layout_named(self.layout).refuses:
            value = getattr(config, name)
            if value:
                raise ConfigError(
                    name, f"layout={self.layout!r} cannot take {name}={value!r}: {why}"
                )
