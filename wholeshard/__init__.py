"""wholeshard: data-parallel training for matrix optimizers, every tensor whole on one rank.

The public surface is `__all__` plus the `checkpoint`, `fp8`, `launch`, `plan`, `layout`,
`routing` and `presets` modules; modules with a leading underscore are machinery (as FSDP2's
`_fsdp_*`): bucket storage, the collective schedule, hooks, groups, the planners' internals.
"""

from ._collectives import CollectiveError
from .checkpoint import Checkpointable, CheckpointError, load_checkpoint, save_checkpoint
from .data_parallel import DataParallel
from .layout import Bucket, Layout, ParamSpec, Placement, plan_layout
from .optim import LayerwiseOptimizer
from .plan import Plan, plan_buffers
from .routing import Route, route_params, routing_table

__all__ = [
    "Bucket",
    "CheckpointError",
    "Checkpointable",
    "CollectiveError",
    "DataParallel",
    "LayerwiseOptimizer",
    "Layout",
    "ParamSpec",
    "Placement",
    "Plan",
    "Route",
    "load_checkpoint",
    "plan_buffers",
    "plan_layout",
    "route_params",
    "routing_table",
    "save_checkpoint",
]
__version__ = "0.1.0"
