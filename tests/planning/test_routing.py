"""The routing rule (`wholeshard.planning.routing`): which params Muon updates, real models.

Unit tests, no process group. Tiny transformers models are built offline from configs with
random init: weights of hidden layers with >= 2 dims go to Muon whatever their module class
(`nn.Linear`, GPT-2's `Conv1D`, a bare router param, fused expert stacks); embeddings, the output
head (tied or not), norms and biases go to AdamW. The presets state the same routes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support import make_model
from torch import nn

import wholeshard
from wholeshard.capacity.presets import PRESETS
from wholeshard.planning.routing import (
    Route,
    route_params,
    routing_summary,
    routing_table,
)

VOCAB, HIDDEN, LAYERS, HEADS, EXPERTS = 64, 32, 2, 2, 4


def gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)  # Conv1D layers, head tied to wte


def llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=1,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def qwen3_moe() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        moe_intermediate_size=HIDDEN // 2, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, head_dim=HIDDEN // HEADS, num_experts=EXPERTS,
        num_experts_per_tok=2, decoder_sparse_step=1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg)


def mixtral(tie: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        num_local_experts=EXPERTS, num_experts_per_tok=2, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": gpt2,
    "llama": llama,
    "qwen3_moe": qwen3_moe,
    "mixtral": mixtral,
}


def layer_names(*names: str) -> set[str]:
    """`"{layer}.{name}"` for every layer and name."""
    return {f"{i}.{n}" for i in range(LAYERS) for n in names}


def by_name(model: nn.Module) -> dict[str, Route]:
    return {r.name: r for r in route_params(model)}


def muon_names(routes: dict[str, Route]) -> set[str]:
    return {n for n, r in routes.items() if r.matrix}


ATTN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
ATTN += ("self_attn.o_proj.weight",)


def test_gpt2_conv1d_weights_are_muon_and_transposed() -> None:
    routes = by_name(gpt2())
    blocks = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    expected = {f"transformer.h.{n}" for n in layer_names(*blocks)}
    assert muon_names(routes) == expected
    assert {n for n, r in routes.items() if r.transposed} == expected, "Conv1D stores (in, out)"
    wte = routes["transformer.wte.weight"]
    assert not wte.matrix and wte.tied, "the head tied to wte is AdamW's, under wte's name"
    assert "lm_head.weight" not in routes
    assert not routes["transformer.wpe.weight"].matrix
    assert not routes["transformer.h.0.attn.c_attn.bias"].transposed, "only weights are (in, out)"


def test_llama_untied_head_and_embedding_are_adamw() -> None:
    routes = by_name(llama())
    mlp = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    assert muon_names(routes) == {f"model.layers.{n}" for n in layer_names(*ATTN, *mlp)}
    head, embed = routes["lm_head.weight"], routes["model.embed_tokens.weight"]
    assert not head.matrix and not head.tied and not embed.matrix and not embed.tied
    assert not any(r.transposed for r in routes.values())
    assert routes["model.layers.0.self_attn.k_proj.weight"].param.shape == (HIDDEN // 2, HIDDEN)


@pytest.mark.parametrize("make", [qwen3_moe, mixtral], ids=["qwen3_moe", "mixtral"])
def test_moe_router_and_expert_stacks_are_muon(make: Callable[[], nn.Module]) -> None:
    routes = by_name(make())
    moe = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    assert muon_names(routes) == {f"model.layers.{n}" for n in layer_names(*ATTN, *moe)}
    router = routes["model.layers.0.mlp.gate.weight"]
    assert router.param.shape == (EXPERTS, HIDDEN), "a bare 2-D param of the router module"
    for stack in ("gate_up_proj", "down_proj"):
        r = routes[f"model.layers.1.mlp.experts.{stack}"]
        assert r.param.ndim == 3 and r.param.shape[0] == EXPERTS and not r.transposed
    assert not routes["lm_head.weight"].matrix and not routes["model.embed_tokens.weight"].matrix
    assert not routes["model.norm.weight"].matrix


def test_a_tied_head_is_adamw() -> None:
    routes = by_name(mixtral(tie=True))
    assert "lm_head.weight" not in routes
    embed = routes["model.embed_tokens.weight"]
    assert embed.tied and not embed.matrix


@pytest.mark.parametrize(
    "name, preset", [("gpt2", "gpt2-small"), ("llama", "llama3-8b"), ("qwen3_moe", "qwen3-30b-a3b")]
)
def test_presets_state_the_module_rules_routes(name: str, preset: str) -> None:
    """A preset's explicit `matrix` is what `route_params` decides on the model it describes."""
    stated = {s.name: s.matrix for s in PRESETS[preset]()}
    routes = route_params(MODELS[name]())
    assert all(r.name in stated for r in routes)
    assert {r.name: stated[r.name] for r in routes} == {r.name: r.matrix for r in routes}


@pytest.mark.core
def test_tinylm_head_and_root_params_are_adamw() -> None:
    """The test model: untied `head` (named like a head) and the bare position table `pos`,
    registered on the root module, are not weights of hidden layers."""
    routes = by_name(make_model())
    assert muon_names(routes) == {
        f"blocks.{i}.{n}.weight" for i in range(2) for n in ("qkv", "proj", "fc", "out")
    }
    for n in ("head.weight", "pos", "emb.weight", "ln.weight", "blocks.0.fc.bias"):
        assert not routes[n].matrix, n


def test_compiled_model_routes_like_the_model() -> None:
    """`torch.compile(m)` registers m as `_orig_mod`: m's own params stay root params, and the
    routes use m's own names."""
    compiled = torch.compile(make_model())
    routes = route_params(compiled)
    plain = route_params(make_model())
    assert [(r.name, r.matrix) for r in routes] == [(r.name, r.matrix) for r in plain]


def test_module_class_does_not_matter_but_convs_and_heads_do() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)  # (out, in, kh, kw) is not a stack of matrices
            self.body = nn.Module()
            self.body.mix = nn.Parameter(torch.randn(8, 8))  # bare 2-D param of a hidden module
            self.body.attn = nn.MultiheadAttention(8, 2)  # in_proj_weight: not an nn.Linear
            self.classifier = nn.Linear(8, 10)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))  # root param, 3-D

    routes = by_name(Net())
    assert muon_names(routes) == {
        "body.mix",
        "body.attn.in_proj_weight",
        "body.attn.out_proj.weight",
    }


def test_get_output_embeddings_names_the_head() -> None:
    """A model that says which module is its head (transformers' convention) is believed, even
    when the head's name is not a usual one."""

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB, HIDDEN)
            self.body = nn.Linear(HIDDEN, HIDDEN)
            self.unembed = nn.Linear(HIDDEN, VOCAB)

        def get_output_embeddings(self) -> nn.Module:
            return self.unembed

    routes = by_name(LM())
    assert muon_names(routes) == {"body.weight"}


@pytest.mark.core
def test_matrix_params_overrides_the_decision_not_transposed() -> None:
    model = gpt2()
    only_head = route_params(model, matrix_params=lambda name, p: name == "transformer.wte.weight")
    assert {r.name for r in only_head if r.matrix} == {"transformer.wte.weight"}
    everything_2d = route_params(model, matrix_params=lambda name, p: p.ndim >= 2)
    routes = {r.name: r for r in everything_2d}
    assert routes["transformer.wpe.weight"].matrix and routes["transformer.wte.weight"].matrix
    assert routes["transformer.h.0.mlp.c_fc.weight"].transposed


def test_a_1d_param_routed_to_muon_raises() -> None:
    with pytest.raises(ValueError, match=r"fewer than 2 dims: \['ln.weight'\].*matrix_params"):
        route_params(make_model(), matrix_params=lambda name, p: name == "ln.weight" or p.ndim == 2)


@pytest.mark.core
def test_nothing_routed_to_muon_raises_with_the_table() -> None:
    class OnlyRoot(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

    with pytest.raises(ValueError, match="no parameter is routed to Muon.*root module") as e:
        route_params(OnlyRoot())
    assert "w " in str(e.value) and "adamw" in str(e.value)


def test_routing_table_of_a_module_and_of_routes() -> None:
    model = qwen3_moe()
    table = wholeshard.routing_table(model)
    assert table == routing_table(route_params(model))
    lines = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert len(lines) == len(list(model.parameters()))
    assert "matrix (stack of 4)" in lines["model.layers.0.mlp.experts.gate_up_proj"]
    assert lines["lm_head.weight"].rstrip().endswith("adamw")
    assert "4x32" in lines["model.layers.0.mlp.gate.weight"]
    gpt = routing_table(gpt2())
    assert "adamw (tied)" in gpt and "matrix (transposed: stored (in, out))" in gpt
    # a module that routes nothing to Muon still gets its table (route_params would raise)
    assert "adamw" in routing_table(nn.Sequential(nn.LayerNorm(4)))


def test_routing_summary_counts_stack_matrices() -> None:
    routes = route_params(qwen3_moe())
    muon = [r for r in routes if r.matrix]
    matrices = sum(r.param.shape[0] if r.param.ndim == 3 else 1 for r in muon)
    assert matrices == LAYERS * (4 + 1 + 2 * EXPERTS)
    summary = routing_summary(routes)
    adamw = len(routes) - len(muon)
    assert summary.startswith(f"routing: {matrices} matrices (")
    assert f"to Muon, {adamw} tensors (" in summary and summary.endswith("params) to AdamW")
    muon_numel = sum(r.param.numel() for r in muon)
    assert f"({muon_numel / 1e6:.2f}M params) to Muon" in summary
    one = routing_summary(route_params(nn.Sequential(nn.Linear(4, 4, bias=False))))
    assert one == "routing: 1 matrix (16 params) to Muon, 0 tensors (0 params) to AdamW"


class _Embed(nn.Module):
    """An embedding table a model indexes itself (not an `nn.Embedding`)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim))


@pytest.mark.parametrize("where", ["emb", "tok_embeddings", "embed"])
def test_embedding_tables_are_told_by_name(where: str) -> None:
    model = nn.Module()
    model.body = nn.Module()
    model.body.proj = nn.Linear(8, 8)
    setattr(model.body, where, _Embed(16, 8))  # a module named like an embedding
    model.body.tables = nn.Module()
    setattr(model.body.tables, where, nn.Parameter(torch.randn(16, 8)))  # a bare table
    routes = {r.name: r.matrix for r in route_params(model)}
    assert routes == {
        "body.proj.weight": True,
        "body.proj.bias": False,
        f"body.{where}.weight": False,
        f"body.tables.{where}": False,
    }


def test_routing_table_lists_frozen_params() -> None:
    model = nn.Module()
    model.body = nn.Linear(8, 8)
    model.frozen = nn.Linear(8, 4)
    model.frozen.requires_grad_(False)
    table = routing_table(model)
    lines = {line.split()[0]: line.split()[1:] for line in table.splitlines()[1:]}
    assert lines["frozen.weight"] == ["4x8", "frozen"]
    assert lines["frozen.bias"] == ["4", "frozen"]
    assert lines["body.weight"] == ["8x8", "matrix"]
