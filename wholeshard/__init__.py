"""wholeshard: data-parallel training for matrix optimizers, every matrix whole on one rank.

The public surface is `__all__`, what a training script needs: `DataParallel` (with its
options, `DataParallelConfig`), `LayerwiseOptimizer`, `save_checkpoint` and `load_checkpoint`
(and `CheckpointError`), `CollectiveError` (a collective that failed or timed out), and
`route_params` / `routing_table` (which optimizer updates each param). Beside it, the modules
`wholeshard.optim` (the optimizers, the checkpoint contract `Checkpointable`, the row-block
splits `split_qkv` and `split_heads`), `wholeshard.fp8` (FP8 formats and layers),
`wholeshard.checkpoint` (save, load, export), `wholeshard.planning` (plans from shapes:
`plan_for` -> the `Plan` `DataParallel` makes, of `Buffer`s, `Bucket`s and `Placement`s, from
`ParamSpec`s; `plan_exactly` for exactly given settings; presets,
shapes files; `planning.routing.Route`) and `wholeshard.distributed.launch` (local worker
processes). Everything else is machinery: modules with a leading underscore, and the `engine`
package behind `DataParallel`. The words are defined once, in [Note: wholeshard vocabulary]
(`wholeshard.planning`).

Names are imported on first use (PEP 562), so `import wholeshard` and the `wholeshard` command's
`--help` do not pay for torch; `from wholeshard import DataParallel` works as usual.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "DataParallel": "wholeshard.engine.data_parallel",
    "DataParallelConfig": "wholeshard.engine.config",
    "LayerwiseOptimizer": "wholeshard.optim.layerwise",
    "save_checkpoint": "wholeshard.checkpoint",
    "load_checkpoint": "wholeshard.checkpoint",
    "CheckpointError": "wholeshard.checkpoint",
    "CollectiveError": "wholeshard.distributed.collectives",
    "route_params": "wholeshard.planning.routing",
    "routing_table": "wholeshard.planning.routing",
}
_MODULES = ("checkpoint", "distributed", "fp8", "integrations", "optim", "planning")
"""The public modules, imported on first use as the names are (`wholeshard.optim.Muon`)."""
__all__ = [
    "CheckpointError",
    "CollectiveError",
    "DataParallel",
    "DataParallelConfig",
    "LayerwiseOptimizer",
    "load_checkpoint",
    "route_params",
    "routing_table",
    "save_checkpoint",
]

if TYPE_CHECKING:
    from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from .distributed.collectives import CollectiveError
    from .engine.config import DataParallelConfig
    from .engine.data_parallel import DataParallel
    from .optim.layerwise import LayerwiseOptimizer
    from .planning.routing import route_params, routing_table
del TYPE_CHECKING  # the namespace holds the public names alone


def __getattr__(name: str) -> object:
    import importlib

    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")  # the import sets the attribute
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'wholeshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names: `__all__`, the public modules and `__version__` (the machinery that
    imports bring in, `engine` and the like, is left out)."""
    return sorted({*__all__, *_MODULES, "__version__"})
