"""Lightning with wholeshard: `WholeshardStrategy` for `lightning.pytorch.Trainer`,
`WholeshardFabricStrategy` for `lightning.fabric.Fabric`, and `layerwise_optimizer` (the
`LayerwiseOptimizer` over the wrapped module, for `configure_optimizers` or after
`fabric.setup_module`). Needs `pip install 'wholeshard[lightning]'`.
"""

from .common import layerwise_optimizer
from .fabric import WholeshardFabricStrategy
from .trainer import WholeshardStrategy

__all__ = ["WholeshardFabricStrategy", "WholeshardStrategy", "layerwise_optimizer"]
