"""Specs of a model the user has, for planning it without training it: `module_specs` routes a
module as `DataParallel` would (build it under `torch.device("meta")`: no memory), and
`model_specs("hf:DIR")` builds the causal LM of a local transformers model directory from its
`config.json` alone, on the meta device (nothing is downloaded, no weights are read). Plan them
directly (`wholeshard plan --model hf:DIR`) or write them to a shapes file
(`shapes.write_shapes`, for `wholeshard plan --shapes`). torch and transformers are imported
when a model is routed or built, not before.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..planning.routing import MatrixParams, route_params
from ..planning.specs import ParamSpec

if TYPE_CHECKING:
    from torch import nn

HF_DIR = "hf:"
"""The prefix of a transformers model directory (`hf:DIR`), as `wholeshard train --model`."""


class ModelError(ValueError):
    """A model that cannot be built for planning; the message names it and says what to do."""


def module_specs(module: nn.Module, matrix_params: MatrixParams | None = None) -> list[ParamSpec]:
    """The specs `DataParallel` plans for `module`: every trainable param in registration order,
    a tied one once under its first name, routed by `routing.route_params` (`matrix_params` as
    there). Shapes only: a module on the meta device gives the same specs."""
    return [
        ParamSpec(r.name, r.shape, r.matrix, r.tied) for r in route_params(module, matrix_params)
    ]


def model_specs(name: str) -> list[ParamSpec]:
    """The specs of model `name`, `hf:DIR`: `transformers.AutoModelForCausalLM` built from
    `DIR/config.json` on the meta device, routed by `module_specs`. ModelError naming `name`
    and what to do when it is not `hf:DIR`, DIR has no config.json, transformers is missing or
    cannot build a causal LM from the config."""
    path = name.removeprefix(HF_DIR)
    if not name.startswith(HF_DIR) or not path:
        raise ModelError(f"expected hf:DIR (a transformers model directory), got {name!r}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelError(
            f"{name}: no config.json in {path!r}; give the directory transformers' "
            "save_pretrained wrote (its config is enough, weights are not read)"
        )
    try:
        import torch
        import transformers
    except ImportError:
        raise ModelError(f"{name}: needs transformers (pip install 'wholeshard[hf]')") from None
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:  # transformers' errors for configs it cannot build are of any type
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(
            f"{name}: transformers cannot build a causal LM from its config ({first}); build "
            "the model yourself and write a shapes file (docs/planning.md#from-a-model-you-have)"
        ) from None
    return module_specs(model)
