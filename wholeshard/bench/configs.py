"""The registry of benchmarked configurations and workloads, one line each; no torch here.

A configuration is a name, a description and, for a wholeshard one, its `DataParallelConfig`
(`parallel`), FP8 recipe (`fp8`) and the optimizer class stepping its Muon matrices
(`matrix_optimizer`, a key of `MATRIX_OPTIMIZERS`); the others are the distributed Muon setups
users would pick instead, built by name (`builders`). A run can override `DataParallelConfig`
fields on every wholeshard configuration at once (`with_overrides`); wholeshard buckets are the
library's default size.

Every configuration uses the same hyperparameters (`MUON_KW`, `ADAMW_KW`), chosen so that
`torch.optim.Muon` and `muon.MuonWithAuxAdam` compute the same update: Nesterov momentum 0.95,
the "original" shape scaling `sqrt(max(1, rows / cols))`, AdamW eps 1e-10, no weight decay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..engine.config import DataParallelConfig, Variant
from .baselines import PING_PONG

MUON_KW: dict[str, Any] = dict(lr=0.02, momentum=0.95, weight_decay=0.0)
ADAMW_KW: dict[str, Any] = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
REFERENCE = "ddp_torch_muon"
"""The configuration every step time is compared with."""

WORKLOADS = {
    "gpt": "the train job's byte GPT on a random Markov chain's bytes",
    "mlp": "square linear layers regressing a random teacher (Newton-Schulz dominates)",
    "many-matrices": "512 bias-free 64x64 linear layers side by side (launch-bound Muon)",
    "experts": "a dense-gated MoE layer: 64-expert stacks (E, out, in) and a router",
}
"""The work every configuration runs (`workloads.get_workload`)."""

MATRIX_OPTIMIZERS = {
    "torch": "torch.optim.Muon (one matrix at a time)",
    "batched": "wholeshard.optim.BatchedMuon, bf16 Newton-Schulz products (torch's kernels)",
    "batched_fp32": "wholeshard.optim.BatchedMuon with matmul_dtype=torch.float32",
}
"""What steps a wholeshard configuration's owned Muon matrices (`LayerwiseOptimizer`'s
`matrix_optimizer`), by name (`builders.MATRIX_CLASSES` holds the classes)."""


MATRIX_RULES = ("muon", "normuon", "soap")
"""`wholeshard.optim.rules.MATRIX_RULES`: the optimizers a matrix rule names (a test checks)."""
NS_ALGORITHMS = ("standard", "gram")
"""`wholeshard.optim.gram_ns.NS_ALGORITHMS` (a test checks)."""
NS_COEFFICIENTS = ("quintic", "polar_express")
"""`wholeshard.optim.normuon.SCHEDULES` (a test checks)."""
KJ_RULE = "ddp_kj_rule"
"""The KJ-style peer of every rule (`rule_optimizers` module note)."""


@dataclass(frozen=True)
class Rule:
    """A matrix rule: its optimizer (`MATRIX_RULES`) and Newton–Schulz choices (module note of
    `rule_optimizers`); the default is torch's Muon with the standard quintic."""

    optimizer: str = "muon"
    ns_algorithm: str = "standard"
    ns_coefficients: str = "quintic"

    def __post_init__(self) -> None:
        if self.optimizer not in MATRIX_RULES:
            raise ValueError(f"matrix optimizer must be one of {MATRIX_RULES}")
        if self.ns_algorithm not in NS_ALGORITHMS or self.ns_coefficients not in NS_COEFFICIENTS:
            raise ValueError(
                f"ns_algorithm in {NS_ALGORITHMS}, ns_coefficients in {NS_COEFFICIENTS}"
            )

    @property
    def label(self) -> str:
        """ "" for the default rule, else its non-default parts joined by "+" ("gram")."""
        return "+".join(v for k, v in vars(self).items() if v != getattr(DEFAULT_RULE, k))

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_RULE


DEFAULT_RULE = Rule()


@dataclass(frozen=True)
class BenchConfig:
    """A benchmarked configuration: a wholeshard one (`parallel` set) or a peer."""

    name: str
    description: str
    parallel: DataParallelConfig | None = None
    """`DataParallel`'s config for a wholeshard configuration; None for the peers."""
    fp8: str | None = None
    """Convert the model's matrix-routed linears to this FP8 recipe first (wholeshard only)."""
    matrix_optimizer: str = "torch"
    """Which `MATRIX_OPTIMIZERS` entry steps the owned Muon matrices (wholeshard only)."""
    variant: Variant = Variant()
    """The engine's variant (wholeshard only): a baseline kept for comparison, or the default."""


def rule_sensitive(config: BenchConfig) -> bool:
    """Whether `config` is built differently per rule: the wholeshard ones and `KJ_RULE`."""
    return config.parallel is not None or config.name == KJ_RULE


def wholeshard(
    name: str,
    description: str,
    fp8: str | None = None,
    matrix_optimizer: str = "torch",
    **options: Any,
) -> BenchConfig:
    """A wholeshard configuration: `options` are `DataParallelConfig` fields or `Variant` ones."""
    if matrix_optimizer not in MATRIX_OPTIMIZERS:
        raise ValueError(f"unknown matrix optimizer {matrix_optimizer!r}")
    variant_fields = {f.name for f in dataclasses.fields(Variant)}
    variant = Variant(**{k: v for k, v in options.items() if k in variant_fields})
    parallel = DataParallelConfig(**{k: v for k, v in options.items() if k not in variant_fields})
    return BenchConfig(name, description, parallel, fp8, matrix_optimizer, variant)


def with_overrides(name: str, overrides: Mapping[str, Any]) -> BenchConfig:
    """`CONFIGS[name]` with `overrides` replacing fields of its `DataParallelConfig` if it is a
    wholeshard configuration; any other configuration, or no overrides, returns it unchanged."""
    config = CONFIGS[name]
    if config.parallel is None or not overrides:
        return config
    parallel = dataclasses.replace(config.parallel, **overrides)
    config.variant.check(parallel)  # a ConfigError (ValueError) names what it cannot take
    return dataclasses.replace(config, parallel=parallel)


# -- the registry: benchmarks run in this order ----------------------------------------------

_OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True)

CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig(
            "ddp_torch_muon",
            "torch DDP + torch.optim.Muon/AdamW: every rank orthogonalizes every matrix",
        ),
        BenchConfig(
            "ddp_kj_muon",
            "torch DDP + muon.MuonWithAuxAdam (round-robin owners, all-reduce + all-gather)",
        ),
        BenchConfig(
            "ddp_kj_rule",
            "torch DDP + the run's matrix rule KJ-style: round-robin owners, params broadcast "
            "(with the default rule: ddp_kj_muon's scheme on torch.optim.Muon)",
        ),
        BenchConfig(
            "fsdp2_torch_muon",
            "torch FSDP2 fully_shard per layer + torch.optim.Muon/AdamW on DTensors",
        ),
        wholeshard(
            "ws_sync",
            "wholeshard DataParallel + LayerwiseOptimizer, synchronous",
            overlap_grad_reduce=False,
        ),
        wholeshard(
            "ws_default",
            "wholeshard with DataParallelConfig()'s defaults: each bucket reduced during backward, "
            "params gathered at the step",
        ),
        wholeshard(
            "ws_overlap",
            "wholeshard with grad-reduce and param-gather overlap",
            **_OVERLAP,
        ),
        wholeshard(
            "ws_pipelined",
            "ws_overlap with the pipelined step: each bucket updated as its reduction lands, "
            "gathered at once",
            **_OVERLAP,
            pipelined_step=True,
        ),
        wholeshard(
            "ws_exchange",
            "ws_overlap with the exchange strategy: per-layer reduce-scatter, each matrix's "
            "pieces sent to its owner and back by one all-to-all each way a step",
            strategy="exchange",
            **_OVERLAP,
        ),
        wholeshard(
            "ws_fully_sharded",
            "wholeshard fully sharded (reshard after forward) + overlap, own all-gather group",
            reshard_after_forward=True,
            **_OVERLAP,
        ),
        wholeshard(
            "ws_fully_sharded_one_group",
            "ws_fully_sharded with every collective on one process group",
            reshard_after_forward=True,
            **_OVERLAP,
            separate_all_gather_group=False,
        ),
        wholeshard(
            "ws_fp8_mxfp8",
            "wholeshard overlap, MXFP8 linears, FP8 param gather (bf16 on the wire)",
            fp8="mxfp8",
            fp8_param_gather=True,
            **_OVERLAP,
        ),
        wholeshard(
            "ws_fp8_tensorwise",
            "wholeshard overlap, tensorwise FP8 linears, FP8 bytes on the wire",
            fp8="tensorwise",
            fp8_param_gather=True,
            **_OVERLAP,
        ),
        wholeshard(
            "ws_ping_pong",
            "wholeshard, the ping-pong baseline",
            layout=PING_PONG.name,
            overlap_grad_reduce=False,
        ),
        wholeshard(
            "ws_batched_muon",
            "ws_overlap with BatchedMuon: same-shape matrices orthogonalized as one batch",
            matrix_optimizer="batched",
            **_OVERLAP,
        ),
        wholeshard(
            "ws_batched_muon_fp32",
            "ws_batched_muon summing the bf16 Newton-Schulz products in fp32 GEMMs",
            matrix_optimizer="batched_fp32",
            **_OVERLAP,
        ),
    )
}
