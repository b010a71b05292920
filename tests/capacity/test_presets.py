"""Tests for `wholeshard.presets`: published sizes, each param's stated route, GQA and
bias details, and that every preset plans."""

from __future__ import annotations

import pytest

from wholeshard.capacity.presets import PRESETS, adamw, matrix, preset
from wholeshard.planning import ParamSpec, plan_exactly

# Published totals (HF configs; DeepSeek-V3's 671B main model, without the 14B MTP module).
TOTALS = {
    "gpt2-small": 124_439_808,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "qwen2.5-7b": 7_615_616_512,
}


def by_name(specs: list[ParamSpec]) -> dict[str, ParamSpec]:
    return {s.name: s for s in specs}


@pytest.mark.parametrize("name", sorted(TOTALS))
def test_dense_presets_match_published_parameter_counts(name: str) -> None:
    specs = preset(name)
    assert sum(s.numel for s in specs) == TOTALS[name]
    assert len({s.name for s in specs}) == len(specs)


def test_moe_preset_is_deepseek_v3_sized() -> None:
    specs = PRESETS["moe-256x"]()
    total = sum(s.numel for s in specs)
    assert 670e9 < total < 672e9
    experts = [s for s in specs if ".mlp.experts." in s.name]
    assert len(experts) == 58 * 256 * 3  # layers 3..60 are MoE
    assert {s.shape for s in experts} == {(2048, 7168), (7168, 2048)}
    names = by_name(specs)
    assert names["model.layers.0.mlp.gate_proj.weight"].shape == (18432, 7168)  # dense
    assert "model.layers.2.mlp.gate.weight" not in names
    assert names["model.layers.3.mlp.gate.weight"].shape == (256, 7168)
    assert names["model.layers.3.mlp.shared_experts.down_proj.weight"].shape == (7168, 2048)
    assert names["model.layers.60.self_attn.kv_b_proj.weight"].shape == (32768, 512)
    assert not names["model.layers.3.mlp.gate.e_score_correction_bias"].matrix
    assert not names["lm_head.weight"].matrix and not names["model.embed_tokens.weight"].matrix
    assert names["model.layers.3.mlp.gate.weight"].matrix  # the router is a hidden matrix


def test_llama_gqa_shapes_and_untied_head() -> None:
    names = by_name(preset("llama3-70b"))
    assert names["model.layers.79.self_attn.k_proj.weight"].shape == (1024, 8192)
    assert names["model.layers.0.self_attn.q_proj.weight"].shape == (8192, 8192)
    assert names["model.layers.0.mlp.down_proj.weight"].shape == (8192, 28672)
    head, embed = names["lm_head.weight"], names["model.embed_tokens.weight"]
    assert head.shape == embed.shape == (128256, 8192)
    # the untied output head is AdamW's, like the embedding
    assert not head.matrix and not head.tied and not embed.matrix and not embed.tied


def test_qwen_has_qkv_biases_only() -> None:
    names = by_name(preset("qwen2.5-7b"))
    for proj, size in (("q", 3584), ("k", 512), ("v", 512)):
        bias = names[f"model.layers.27.self_attn.{proj}_proj.bias"]
        assert bias.shape == (size,) and not bias.matrix
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert names["lm_head.weight"].shape == (152064, 3584)


def test_gpt2_head_is_tied_to_wte() -> None:
    specs = preset("gpt2-small")
    names = by_name(specs)
    assert "lm_head.weight" not in names
    wte = names["transformer.wte.weight"]
    assert wte.tied and not wte.matrix and specs[0] is wte
    assert not names["transformer.wpe.weight"].matrix
    assert names["transformer.h.11.attn.c_attn.weight"].shape == (2304, 768)
    assert sum(s.matrix for s in specs) == 12 * 4


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_state_each_route(name: str) -> None:
    """Each param states its route where it is made (`matrix` / `adamw`): hidden-layer weights
    Muon's, embeddings, the head, norms and biases AdamW's (`tests/planning/test_routing.py`
    checks the presets against `route_params` on the models they describe)."""
    specs = by_name(preset(name))
    for s in specs.values():
        assert not s.matrix or len(s.shape) >= 2, s.name
        last = s.name.split(".")[-2]
        if last in ("wte", "wpe", "embed_tokens", "lm_head") or "norm" in s.name:
            assert not s.matrix, s.name
    assert specs["model.layers.0.self_attn.o_proj.weight" if name != "gpt2-small"
                 else "transformer.h.0.attn.c_attn.weight"].matrix  # fmt: skip
    assert matrix("w", 4, 4) == ParamSpec("w", (4, 4), matrix=True)
    assert adamw("e", 4, 4, tied=True) == ParamSpec("e", (4, 4), matrix=False, tied=True)
    with pytest.raises(ValueError, match=">= 2 dims"):
        matrix("b", 4)


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown preset 'llama2'.*gpt2-small"):
        preset("llama2")


@pytest.mark.parametrize("name", sorted(set(PRESETS) - {"moe-256x"}))
def test_every_dense_preset_plans(name: str) -> None:
    specs = preset(name)
    plan = plan_exactly(specs, 16, bucket_size=40_000_000, shard_group_size=8)
    plan.check(specs)
    fused_experts = name == "qwen3-30b-a3b"
    kinds = ["matrix", "stacked", "adamw"] if fused_experts else ["matrix", "adamw"]
    assert [b.kind for b in plan.buffers] == kinds
