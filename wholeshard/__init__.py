"""wholeshard: data-parallel training for matrix optimizers, every matrix whole on one rank.

The public surface is `__all__` (also the names below) and the modules `wholeshard.fp8` (FP8
formats and layers), `wholeshard.checkpoint` (save, load, export), `wholeshard.planning` (plans
from shapes: `plan_buffers`, presets, shapes files) and `wholeshard.distributed.launch` (local
worker processes). Everything else is machinery: modules with a leading underscore, and the
`engine` package behind `DataParallel`. The words are defined once, in [Note: wholeshard
vocabulary] (`wholeshard.planning`).

Names are imported on first use (PEP 562), so `import wholeshard` and the `wholeshard` command's
`--help` do not pay for torch; `from wholeshard import DataParallel` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "DataParallel": "wholeshard.engine.data_parallel",
    "DataParallelConfig": "wholeshard.engine.config",
    "LayerwiseOptimizer": "wholeshard.optim.layerwise",
    "Checkpointable": "wholeshard.optim.pieces",
    "split_qkv": "wholeshard.optim.ns_split",
    "split_heads": "wholeshard.optim.ns_split",
    "save_checkpoint": "wholeshard.checkpoint",
    "load_checkpoint": "wholeshard.checkpoint",
    "CheckpointError": "wholeshard.checkpoint",
    "CollectiveError": "wholeshard.distributed.collectives",
    "plan_buffers": "wholeshard.planning",
    "Plan": "wholeshard.planning",
    "Buffer": "wholeshard.planning",
    "Bucket": "wholeshard.planning",
    "Placement": "wholeshard.planning",
    "ParamSpec": "wholeshard.planning",
    "Route": "wholeshard.planning.routing",
    "route_params": "wholeshard.planning.routing",
    "routing_table": "wholeshard.planning.routing",
}
__all__ = [
    "Bucket",
    "Buffer",
    "CheckpointError",
    "Checkpointable",
    "CollectiveError",
    "DataParallel",
    "DataParallelConfig",
    "LayerwiseOptimizer",
    "ParamSpec",
    "Placement",
    "Plan",
    "Route",
    "load_checkpoint",
    "plan_buffers",
    "route_params",
    "routing_table",
    "save_checkpoint",
    "split_heads",
    "split_qkv",
]

if TYPE_CHECKING:
    from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from .distributed.collectives import CollectiveError
    from .engine.config import DataParallelConfig
    from .engine.data_parallel import DataParallel
    from .optim.layerwise import LayerwiseOptimizer
    from .optim.ns_split import split_heads, split_qkv
    from .optim.pieces import Checkpointable
    from .planning import Bucket, Buffer, ParamSpec, Placement, Plan, plan_buffers
    from .planning.routing import Route, route_params, routing_table


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'wholeshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
