"""How `LayerwiseOptimizer` drives its inner torch optimizers: their per-param states read as
one mapping (`States`), and a group stepping a subset of its params (`holding`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch


class States(Mapping):
    """The inner optimizers' per-param state, read-only, as one mapping. (A `ChainMap` would
    not do: looking up an AdamW master in Muon's `defaultdict` state creates an empty entry.)"""

    def __init__(self, *states: Mapping[torch.Tensor, dict[str, Any]]) -> None:
        self._states = states

    def __getitem__(self, key: torch.Tensor) -> dict[str, Any]:
        for states in self._states:
            if key in states:
                return states[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for states in self._states:
            yield from states

    def __len__(self) -> int:
        return sum(len(states) for states in self._states)


@contextlib.contextmanager
def holding(group: dict[str, Any], params: list[torch.Tensor]) -> Iterator[None]:
    """`group` holds only `params` (a subset of its own) inside the block: a torch optimizer
    steps what its groups hold; group settings and per-param state are untouched."""
    every = group["params"]
    group["params"] = params
    try:
        yield
    finally:
        group["params"] = every
