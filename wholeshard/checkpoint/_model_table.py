"""What a checkpoint records about its model, and the check that a model is the same one.

The manifest's model table names every routed param (shape, dtype, Muon or AdamW), every
other state-dict tensor (persistent buffers and frozen params) and every tied alias. A load
checks the model against it, and the DCP metadata against both, before anything is read. Which
params are frozen may differ (`trainable_changes`): every value is saved as `model/<name>`
either way, and only params trainable in both are checked for the same routing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..distributed.dtensor import Place, is_dtensor, shard_place
from ..engine.data_parallel import DataParallel
from ..optim.pieces import Checkpointable
from ..planning.routing import clean_name
from ._consensus import RankConsensus
from .directory import MANIFEST, TRAINER, CheckpointError


def other_tensors(ddp: DataParallel) -> dict[str, torch.Tensor]:
    """State-dict tensors DataParallel does not shard: persistent buffers and frozen params."""
    routed = {id(r.param) for r in ddp.routes}
    out = {}
    for fqn, value in ddp.module.state_dict(keep_vars=True).items():
        name = clean_name(fqn)
        if not torch.is_tensor(value):
            raise TypeError(f"module state {name!r} is not a tensor; checkpoints hold tensors only")
        if id(value) not in routed:
            out[name] = value
    return out


def aliases(ddp: DataParallel) -> dict[str, str]:
    """Every other name of a routed (tied) param, mapped to its route name."""
    first = {id(r.param): r.name for r in ddp.routes}
    out = {}
    for fqn, p in ddp.module.named_parameters(remove_duplicate=False):
        name = clean_name(fqn)
        if id(p) in first and first[id(p)] != name:
            out[name] = first[id(p)]
    return out


Table = tuple[dict[str, Any], dict[str, Any]]  # the manifest's `params` and `others`


def model_table(ddp: DataParallel, group: RankConsensus) -> Table:
    """The manifest's `params` and `others` for `ddp`'s model, by their names in the whole
    model (`tensor_places`); with experts split over "ep", every rank's together (every rank of
    `group`, the model ranks, calls it)."""
    places = tensor_places(ddp)
    params = {
        places[r.name][0]: {
            "shape": list(places[r.name][1]),
            "dtype": _dtype(r.param),
            "optimizer": "matrix" if r.matrix else "adamw",
        }
        for r in ddp.routes
    }
    others = {
        places[name][0]: {"shape": list(places[name][1]), "dtype": _dtype(t)}
        for name, t in other_tensors(ddp).items()
    }
    if ddp.expert_layout is None:
        return params, others
    merged: Table = ({}, {})
    for rank_params, rank_others in group.all_gather((params, others)):
        merged[0].update(rank_params)
        merged[1].update(rank_others)
    return merged


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def tensor_places(ddp: DataParallel) -> dict[str, Place]:
    """Every state-dict tensor of `ddp`'s model (trainable params, buffers, frozen params) by
    its name here: its name, shape and this rank's place (dim, offset) in the whole model, for
    save and load alike. The place is a tensor-parallel shard's (`distributed.dtensor.
    shard_place`) or a stack of this rank's experts' (`ExpertLayout`); None: whole here."""
    out = {r.name: (r.name, r.logical_shape, shard_place(r.param)) for r in ddp.routes}
    others = other_tensors(ddp)
    out |= {name: (name, tuple(t.shape), None) for name, t in others.items()}
    layout = ddp.expert_layout
    if layout is None:
        return out
    tensors = {r.name: r.param for r in ddp.routes if not is_dtensor(r.param)} | others
    return out | layout.places(
        {name: out[name][1] for name, t in tensors.items() if layout.is_expert(name, t)}
    )


def state_keys(metadata: Metadata, name: str) -> list[str]:
    """The optimizer state keys saved for param `name` (its master excluded)."""
    prefix = f"optim/{name}/"
    return sorted(
        k[len(prefix) :]
        for k in metadata.state_dict_metadata
        if k.startswith(prefix) and k != f"{prefix}master"
    )


def check_model(
    ckpt: Path,
    manifest: dict[str, Any],
    metadata: Metadata,
    table: Table,
    optimizer: Checkpointable,
    trainer: dict[str, Any],
) -> None:
    """Raise if the checkpoint is of another model (`different_model`: its first differences
    from this model's `model_table`, which params are frozen aside) or is damaged."""
    params, others = table
    model = {**params, **others}
    if differences := model_differences(manifest, table):
        raise CheckpointError(different_model(ckpt, differences))
    md = metadata.state_dict_metadata
    expected: dict[str, tuple[int, ...] | None] = {
        f"model/{n}": tuple(e["shape"]) for n, e in model.items()
    }
    for name, entry in params.items():
        if f"optim/{name}/master" in md:
            expected[f"optim/{name}/master"] = tuple(entry["shape"])
        expected.update({f"optim/{name}/{k}": None for k in state_keys(metadata, name)})
    damaged = []
    for key, shape in sorted(expected.items()):
        found = md.get(key)
        if not isinstance(found, TensorStorageMetadata):
            damaged.append(f"{key} is missing")
        elif shape is not None and tuple(found.size) != shape:
            damaged.append(f"{key} has shape {tuple(found.size)}, the manifest says {shape}")
        elif sum(math.prod(c.sizes) for c in found.chunks) != math.prod(found.size):
            damaged.append(f"{key}'s chunks do not cover it exactly once (a shard is missing)")
    if len(trainer.get("param_groups", ())) != len(optimizer.param_groups):
        damaged.append(
            f"{TRAINER} has {len(trainer.get('param_groups', ()))} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    if damaged:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: " + "; ".join(damaged[:10]))


SHOWN = 4
"""How many differences `different_model` names, shared among their kinds (one each at least)."""


def model_differences(manifest: dict[str, Any], table: Table) -> dict[str, list[str]]:
    """The differences that refuse a load, by kind, each a list of one entry per tensor (sorted
    by name); kinds without differences left out. Names and shapes of every tensor, and the
    routing of params trainable then and now; a dtype differing alone is no difference (params
    load from their fp32 masters)."""
    params, others = table
    saved, model = {**manifest["params"], **manifest["others"]}, {**params, **others}
    both = sorted(set(saved) & set(model))
    routed = sorted(set(manifest["params"]) & set(params))  # trainable then and now
    kinds = {
        "not in the checkpoint": sorted(set(model) - set(saved)),
        "not in the model": sorted(set(saved) - set(model)),
        "of another shape (checkpoint -> model)": [
            f"{n} {_shape(saved[n], model[n])} -> {_shape(model[n], saved[n])}"
            for n in both
            if saved[n]["shape"] != model[n]["shape"]
        ],
        "of another optimizer (checkpoint -> model)": [
            f"{n} {manifest['params'][n]['optimizer']} -> {params[n]['optimizer']}"
            for n in routed
            if manifest["params"][n]["optimizer"] != params[n]["optimizer"]
        ],
    }
    return {kind: entries for kind, entries in kinds.items() if entries}


def different_model(ckpt: Path, differences: dict[str, list[str]]) -> str:
    """The message refusing a checkpoint of another model: each kind of difference, its count
    and its first entries (`SHOWN` in all), and how to load it."""
    shown = max(1, SHOWN // len(differences))
    said = []
    for kind, entries in differences.items():
        more = len(entries) - shown
        first = ", ".join(entries[:shown]) + (f" and {more} more" if more > 0 else "")
        said.append(f"{len(entries)} tensor{'s' * (len(entries) > 1)} {kind}: {first}")
    fix = f"Load it into the model it was saved from (the tensors its {MANIFEST} lists)"
    if any(kind.startswith("of another optimizer") for kind in differences):
        fix += ", the same params routed to the matrix optimizer (DataParallel's matrix_params)"
    fix += (
        "; to resume `wholeshard train`, pass the --model, --pos and --tie of the run that saved it"
    )
    return f"checkpoint {ckpt} was saved from a different model: {'; '.join(said)}. {fix}"


def _shape(entry: dict[str, Any], other: dict[str, Any]) -> str:
    """`entry`'s shape, and its dtype where `other`'s differs."""
    dtype = f" {entry['dtype']}" if entry["dtype"] != other["dtype"] else ""
    return f"{tuple(entry['shape'])}{dtype}"


def trainable_changes(manifest: dict[str, Any], table: Table) -> tuple[list[str], list[str]]:
    """Params trainable now but frozen in the checkpoint, and the reverse (sorted names), from
    this model's `model_table`."""
    params, others = table
    saved_params, saved_others = manifest["params"], manifest["others"]
    return sorted(set(params) & set(saved_others)), sorted(set(others) & set(saved_params))


def names(xs: list[str]) -> str:
    """`xs` joined, the first 8 of them."""
    return ", ".join(xs[:8]) + (f" and {len(xs) - 8} more" if len(xs) > 8 else "")
