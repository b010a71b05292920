"""Optimizers that run on the pieces of params each rank owns: `LayerwiseOptimizer`;
`BatchedMuon`, torch's Muon with same-shape matrices orthogonalized together; the contract
checkpoints need of an optimizer (`pieces`: `OwnedPiece`, `Checkpointable`); and
`first_nonfinite`, the non-finite check a plain torch optimizer can share; `NorMuon`, Muon with
per-row second-moment normalisation, and `Muon`, torch's Muon, both with a choice of
Newton-Schulz coefficients (the fixed quintic or Polar Express); `QKClip`, MuonClip's per-head
query/key clip applied by each matrix's owner inside the step; `SOAP`, Adam in the eigenbasis
of Shampoo's factors, whose `matrix_cost` the planner balances
(`DataParallel(model, matrix_cost=SOAP.matrix_cost)`). `rules` names the matrix rules for the
train job and the bench; `gram_ns` is the Gram form of Newton-Schulz (`ns_algorithm="gram"`);
`tensor_parallel` is Newton-Schulz on DTensor matrices sharded by tensor parallelism
(`Muon(tp_mode=)`); `ns_split` the row blocks stepped as separate matrices
(`LayerwiseOptimizer(ns_split=split_qkv(...))`, `split_heads`); `matrix_rule` the skeleton the
rules share (`MatrixRule`).
Bringing your own rule: docs/optimizers.md."""

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
