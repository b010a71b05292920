"""Real transformers models (GPT-2, Llama, Qwen3-MoE) under DataParallel at 2 ranks.

Tiny random-init models built offline from configs, default routing. Each model is checked in
one launch: synchronous and overlapped training match the one-process reference (torch.optim
Muon + AdamW with the same routing; each expert matrix of a fused MoE stack and each Conv1D
weight in (out, in) orientation stepped as a param of its own, see `support.reference_run`),
overlapped is bitwise equal to synchronous, gradient checkpointing changes nothing, and greedy
`generate()` right after an overlapped step gives the reference's tokens on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import hf_support
import pytest
import torch
from support import (
    OVERLAP,
    SEQ,
    VOCAB,
    assert_bitwise_equal,
    assert_matches,
    batch,
    reference_run,
    run,
    wholeshard_run,
)
from torch import nn

from wholeshard import route_params

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 4
HIDDEN, LAYERS, HEADS = 32, 2, 2
# KV_NOTE: no grouped-query attention. At random init attention is near uniform, so with one
# key/value head both heads output the same mix of the same values: o_proj's input, and so its
# gradient, has rank head_dim (16 of 32). Newton-Schulz lifts the null directions' rounding
# noise to full size, and the summation order of the gradient average would show (3e-3).
BUCKET = dict(bucket_size=4000)  # several buckets per model, so overlap has work to overlap
FS = dict(reshard_after_forward=True)


def gpt2() -> nn.Module:
    cfg = hf_support.config("gpt2", VOCAB, 2 * SEQ, heads=HEADS)  # HIDDEN wide, LAYERS deep
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)  # Conv1D layers, head tied to the embedding


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,  # see KV_NOTE
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def qwen3_moe() -> nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        moe_intermediate_size=HIDDEN // 2,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,  # see KV_NOTE
        head_dim=HIDDEN // HEADS,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg)  # loss: CE on the logits, no router aux loss


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama, "qwen3_moe": qwen3_moe}
# The MoE trains two steps. Runs that sum the gradient average in another order differ by
# ~2e-4 per element after one Muon step and ~5e-4 after two (Newton-Schulz in bf16 lifts the
# rounding); a token whose 2nd and 3rd router logits are that close then picks another expert,
# and the runs are no longer comparable. Two steps keep every forward within one step of the
# reference, where no choice flips.
STEPS = {"gpt2": 3, "llama": 3, "qwen3_moe": 2}


def checkpointed(make: Callable[[], nn.Module]) -> nn.Module:
    model = make()
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    model.config.use_cache = False  # no KV cache while recomputing (transformers would warn)
    return model


def greedy(model: nn.Module) -> list[list[int]]:
    """A few greedy tokens from two prompts of a fixed batch. (The reference's top-2 logit gaps
    are >= 1e-2, far above the runs' logit differences: no near-tie decides a token.)"""
    prompt = batch(50)[0][:2, : SEQ - NEW_TOKENS]
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
    return out[:, prompt.shape[1] :].tolist()


def _all_modes(name: str) -> dict[str, dict]:
    """One launch per model: sync, overlapped (+ generate), overlapped with checkpointing, and
    both fully sharded."""
    make, steps = MODELS[name], STEPS[name]
    return {
        "sync": wholeshard_run(steps, make=make, ddp_kw=BUCKET),
        "overlap": wholeshard_run(steps, make=make, ddp_kw=dict(BUCKET, **OVERLAP), probe=greedy),
        "checkpointed": wholeshard_run(
            steps, make=functools.partial(checkpointed, make), ddp_kw=dict(BUCKET, **OVERLAP)
        ),
        "fully_sharded": wholeshard_run(
            steps, make=make, ddp_kw=dict(BUCKET, **OVERLAP, **FS), probe=greedy
        ),
        "fully_sharded_checkpointed": wholeshard_run(
            steps, make=functools.partial(checkpointed, make), ddp_kw=dict(BUCKET, **OVERLAP, **FS)
        ),
    }


def modulo_router_shift(result: dict) -> dict:
    """`result` with each softmax router's rows centred. Adding one vector to every row of a
    router changes no routing probability, so its gradient never has that component, but a
    Muon update does: Newton-Schulz lifts the rounding noise of that null direction (the
    gradient is cast to bf16) to full size, and which noise depends on the summation order of
    the gradient average. The centred router is what the model computes with."""
    params = {
        name: p - p.mean(0, keepdim=True) if name.endswith("mlp.gate.weight") else p
        for name, p in result["params"].items()
    }
    return dict(result, params=params)


@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_like_the_reference(name: str) -> None:
    ref = modulo_router_shift(reference_run(STEPS[name], make=MODELS[name], probe=greedy))
    outs = run(_all_modes, 2, name)
    for rank, out in enumerate(outs):
        assert_matches(modulo_router_shift(out["sync"]), ref)
        assert_matches(modulo_router_shift(out["overlap"]), ref)
        assert_bitwise_equal(out["sync"], out["overlap"])
        # Checkpointing recomputes the same forward (same first loss), but autograd then sums
        # some gradients in another order, so later steps are close, not equal.
        assert out["checkpointed"]["losses"][0] == out["overlap"]["losses"][0]
        assert_matches(modulo_router_shift(out["checkpointed"]), ref)
        # Fully sharded: the same arithmetic, params gathered per module and released.
        assert_bitwise_equal(out["fully_sharded"], out["overlap"])
        assert out["fully_sharded"]["probe"] == out["overlap"]["probe"]
        assert_bitwise_equal(out["fully_sharded_checkpointed"], out["checkpointed"])
        tokens = out["overlap"]["probe"]
        assert tokens == outs[0]["overlap"]["probe"], f"rank {rank} generated other tokens"
        assert tokens == ref["probe"], "generated tokens differ from the reference model's"


def _muon_names(model: nn.Module) -> tuple[set[str], dict[str, bool]]:
    routes = route_params(model)
    return {r.name for r in routes if r.matrix}, {r.name: r.transposed for r in routes}


def test_default_routing_of_real_models() -> None:
    """Hidden-layer weights with >= 2 dims go to Muon whatever their module class; embeddings,
    the output head (tied or not), norms and biases go to AdamW."""
    muon, transposed = _muon_names(gpt2())
    assert muon == {
        f"transformer.h.{i}.{m}.weight"
        for i in range(LAYERS)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert all(transposed[n] for n in muon), "Conv1D weights are stored (in, out)"

    muon, transposed = _muon_names(llama())
    assert muon == {
        f"model.layers.{i}.{m}.weight"
        for i in range(LAYERS)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }
    assert not any(transposed.values())

    muon, _ = _muon_names(qwen3_moe())
    assert muon == {
        f"model.layers.{i}.{m}"
        for i in range(LAYERS)
        for m in ("self_attn.q_proj.weight", "self_attn.k_proj.weight")
        + ("self_attn.v_proj.weight", "self_attn.o_proj.weight")
        + ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    }
