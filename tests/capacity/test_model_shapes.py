"""Tests for planning a model the user has: `model_shapes.module_specs` routes a module as
`DataParallel` does, `shapes.write_shapes` writes the specs as a shapes file `load_shapes` reads
back equal, and `model_specs` refuses what it cannot build, saying what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wholeshard.capacity.model_shapes import ModelError, model_specs, module_specs
from wholeshard.capacity.shapes import load_shapes, write_shapes
from wholeshard.planning.routing import route_params


def test_a_module_written_as_a_shapes_file_reads_back_as_its_specs(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    with torch.device("meta"):  # shapes only: nothing allocated
        model = transformers.GPT2LMHeadModel(config)
    specs = module_specs(model)
    routes = route_params(model)
    assert [(s.name, s.shape, s.matrix, s.tied) for s in specs] == [
        (r.name, r.shape, r.matrix, r.tied) for r in routes
    ]
    assert specs[0].name == "transformer.wte.weight" and specs[0].tied and not specs[0].matrix
    assert any(s.matrix for s in specs) and "lm_head.weight" not in {s.name for s in specs}
    path = tmp_path / "gpt2.json"
    write_shapes(str(path), specs)
    assert load_shapes(str(path)) == specs
    assert len(path.read_text().splitlines()) == len(specs) + 2  # one param a line


@pytest.mark.parametrize("name", ["llama3-8b", "hf:", "preset:gpt2-small"])
def test_model_specs_takes_hf_dir_only(name: str) -> None:
    with pytest.raises(ModelError, match=r"expected hf:DIR \(a transformers model directory\)"):
        model_specs(name)


def test_model_specs_needs_a_config(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=f"hf:{tmp_path}: no config.json in"):
        model_specs(f"hf:{tmp_path}")
