"""wholeshard: data-parallel training for matrix optimizers, every tensor whole on one rank.

The public surface is `__all__` plus the `checkpoint`, `fp8`, `launch`, `plan`, `layout`,
`routing` and `presets` modules; modules with a leading underscore are machinery (as FSDP2's
`_fsdp_*`): bucket storage, the collective schedule, hooks, groups, the planners' internals.
"""

from ._collectives import CollectiveError
from .checkpoint import Checkpointable, CheckpointError, load_checkpoint, save_checkpoint
from .data_parallel import DataParallel
from .optim import LayerwiseOptimizer
from .planning import Bucket, Buffer, ParamSpec, Placement, Plan, plan_buffers
from .routing import Route, route_params, routing_table

__all__ = [
    "Bucket",
    "Buffer",
    "CheckpointError",
    "Checkpointable",
    "CollectiveError",
    "DataParallel",
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
]
__version__ = "0.1.0"
