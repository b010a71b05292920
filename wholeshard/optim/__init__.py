"""Optimizers that run on the pieces of params each rank owns: `LayerwiseOptimizer`;
`BatchedMuon`, torch's Muon with same-shape matrices orthogonalized together; the contract
checkpoints need of an optimizer (`pieces`: `OwnedPiece`, `Checkpointable`); and
`first_nonfinite`, the non-finite check a plain torch optimizer can share; `NorMuon`, Muon with
per-row second-moment normalisation, and `Muon`, torch's Muon, both with a choice of
Newton-Schulz coefficients (the fixed quintic or Polar Express)."""

from ._step_check import first_nonfinite
from .batched_muon import BatchedMuon
from .layerwise import LayerwiseOptimizer
from .normuon import Muon, NorMuon
from .pieces import Checkpointable, OwnedPiece

__all__ = [
    "BatchedMuon",
    "Checkpointable",
    "LayerwiseOptimizer",
    "Muon",
    "NorMuon",
    "OwnedPiece",
    "first_nonfinite",
]
