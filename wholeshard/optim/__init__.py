"""Optimizers that run on the params each rank owns."""

from .layerwise import LayerwiseOptimizer

__all__ = ["LayerwiseOptimizer"]
