"""Optimizers that run on the pieces of params each rank owns: `LayerwiseOptimizer`, and the
matrix rules it steps (the skeleton `matrix_rule.MatrixRule`; by name: `rules`): `Muon`, torch's
with a choice of Newton-Schulz schedule and algorithm (`gram_ns`), and `NorMuon`, with per-row
second-moment normalisation; `BatchedMuon`, same-shape matrices orthogonalized together; `SOAP`
(`LayerwiseOptimizer` lays the params out for its `matrix_cost`); `tensor_parallel`, Muon on
DTensor matrices (`Muon(tp_mode=)`). `QKClip`: MuonClip's per-head clip inside the step;
`split_qkv`, `split_heads`: row blocks stepped as separate matrices (`ns_split`); `pieces`: the
contract checkpoints need (`OwnedPiece`, `Checkpointable`); `first_nonfinite`: the non-finite
check a plain torch optimizer can share. Bringing your own rule: docs/optimizers.md."""

from ._step_check import first_nonfinite
from .batched_muon import BatchedMuon
from .layerwise import LayerwiseOptimizer
from .normuon import Muon, NorMuon
from .ns_split import split_heads, split_qkv
from .pieces import Checkpointable, OwnedPiece
from .qk_clip import QKClip
from .soap import SOAP

__all__ = [
    "BatchedMuon",
    "Checkpointable",
    "LayerwiseOptimizer",
    "Muon",
    "NorMuon",
    "OwnedPiece",
    "QKClip",
    "SOAP",
    "first_nonfinite",
    "split_heads",
    "split_qkv",
]
