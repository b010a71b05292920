"""Param specs of published models from shapes alone, no tensor allocated: a preset lists
`ParamSpec`s in registration order, as the model's `named_parameters()` would (a tied tensor
once, under its first name, with `tied=True`), each param's route (`matrix` or `adamw`) stated
where it is made, as [Note: the routing rule] in `routing` decides it on the published model.
Experts are listed one matrix per param, as the published checkpoints do, except
`qwen3-30b-a3b`, whose fused expert stacks (E, out, in) are stacked Muon params.
"""

from __future__ import annotations

from collections.abc import Callable

from ..planning.specs import ParamSpec


def matrix(name: str, *shape: int) -> ParamSpec:
    """A hidden layer's weight, Muon's (the matrix rule's): `shape` has >= 2 dims."""
    if len(shape) < 2:
        raise ValueError(f"{name}: a matrix has >= 2 dims, got shape {shape}")
    return ParamSpec(name, tuple(shape), matrix=True)


def adamw(name: str, *shape: int, tied: bool = False) -> ParamSpec:
    """An embedding, the output head, a norm or a bias: AdamW's."""
    return ParamSpec(name, tuple(shape), matrix=False, tied=tied)


def gpt2_small() -> list[ParamSpec]:
    """GPT-2 small (124M): 12 layers, d 768, vocab 50257, 1024 positions, head tied to `wte`;
    HF names, `Conv1D` weights in `nn.Linear` (out, in) orientation."""
    d, vocab, ctx = 768, 50257, 1024
    specs = [adamw("transformer.wte.weight", vocab, d, tied=True)]
    specs.append(adamw("transformer.wpe.weight", ctx, d))
    for i in range(12):
        p = f"transformer.h.{i}."
        specs += [
            adamw(p + "ln_1.weight", d),
            adamw(p + "ln_1.bias", d),
            matrix(p + "attn.c_attn.weight", 3 * d, d),
            adamw(p + "attn.c_attn.bias", 3 * d),
            matrix(p + "attn.c_proj.weight", d, d),
            adamw(p + "attn.c_proj.bias", d),
            adamw(p + "ln_2.weight", d),
            adamw(p + "ln_2.bias", d),
            matrix(p + "mlp.c_fc.weight", 4 * d, d),
            adamw(p + "mlp.c_fc.bias", 4 * d),
            matrix(p + "mlp.c_proj.weight", d, 4 * d),
            adamw(p + "mlp.c_proj.bias", d),
        ]
    specs += [adamw("transformer.ln_f.weight", d), adamw("transformer.ln_f.bias", d)]
    return specs


def _llama_like(
    *,
    layers: int,
    d: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    tied: bool = False,
    qkv_bias: bool = False,
) -> list[ParamSpec]:
    """A Llama-style decoder (GQA attention, SwiGLU MLP, RMSNorm) with HF names, untied and
    without biases unless asked."""
    head_dim = d // heads
    kv = kv_heads * head_dim
    specs = [adamw("model.embed_tokens.weight", vocab, d, tied=tied)]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            matrix(p + "self_attn.q_proj.weight", heads * head_dim, d),
            *([adamw(p + "self_attn.q_proj.bias", heads * head_dim)] if qkv_bias else []),
            matrix(p + "self_attn.k_proj.weight", kv, d),
            *([adamw(p + "self_attn.k_proj.bias", kv)] if qkv_bias else []),
            matrix(p + "self_attn.v_proj.weight", kv, d),
            *([adamw(p + "self_attn.v_proj.bias", kv)] if qkv_bias else []),
            matrix(p + "self_attn.o_proj.weight", d, heads * head_dim),
            matrix(p + "mlp.gate_proj.weight", ffn, d),
            matrix(p + "mlp.up_proj.weight", ffn, d),
            matrix(p + "mlp.down_proj.weight", d, ffn),
            adamw(p + "input_layernorm.weight", d),
            adamw(p + "post_attention_layernorm.weight", d),
        ]
    specs.append(adamw("model.norm.weight", d))
    if not tied:
        specs.append(adamw("lm_head.weight", vocab, d))
    return specs


def llama3_8b() -> list[ParamSpec]:
    """Llama 3 8B: 32 layers, d 4096, 32 heads / 8 KV heads, FFN 14336, vocab 128256, untied."""
    return _llama_like(layers=32, d=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)


def llama3_70b() -> list[ParamSpec]:
    """Llama 3 70B: 80 layers, d 8192, 64 heads / 8 KV heads, FFN 28672, vocab 128256, untied."""
    return _llama_like(layers=80, d=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)


def qwen25_7b() -> list[ParamSpec]:
    """Qwen2.5 7B: 28 layers, d 3584, 28 heads / 4 KV heads, FFN 18944, vocab 152064, untied
    embeddings (`tie_word_embeddings: false` for 7B), biases on q/k/v only."""
    return _llama_like(
        layers=28, d=3584, heads=28, kv_heads=4, ffn=18944, vocab=152064, qkv_bias=True
    )


def moe_256x() -> list[ParamSpec]:
    """A DeepSeek-V3-like MoE (~671B params, ~45k tensors), HF names, MTP layer left out: 61
    layers of MLA attention (RMSNorms on the q and kv latents), 0-2 dense, 3-60 with a router
    (and its score-correction bias), 256 routed experts and 1 shared expert; untied head."""
    d, vocab, experts, expert_ffn, dense_ffn = 7168, 129280, 256, 2048, 18432
    heads, q_rank, kv_rank, rope, nope, v_dim = 128, 1536, 512, 64, 128, 128

    def mlp(prefix: str, ffn: int) -> list[ParamSpec]:
        return [
            matrix(prefix + "gate_proj.weight", ffn, d),
            matrix(prefix + "up_proj.weight", ffn, d),
            matrix(prefix + "down_proj.weight", d, ffn),
        ]

    specs = [adamw("model.embed_tokens.weight", vocab, d)]
    for i in range(61):
        p = f"model.layers.{i}."
        specs += [
            matrix(p + "self_attn.q_a_proj.weight", q_rank, d),
            adamw(p + "self_attn.q_a_layernorm.weight", q_rank),
            matrix(p + "self_attn.q_b_proj.weight", heads * (nope + rope), q_rank),
            matrix(p + "self_attn.kv_a_proj_with_mqa.weight", kv_rank + rope, d),
            adamw(p + "self_attn.kv_a_layernorm.weight", kv_rank),
            matrix(p + "self_attn.kv_b_proj.weight", heads * (nope + v_dim), kv_rank),
            matrix(p + "self_attn.o_proj.weight", d, heads * v_dim),
        ]
        if i < 3:
            specs += mlp(p + "mlp.", dense_ffn)
        else:
            specs += [
                matrix(p + "mlp.gate.weight", experts, d),
                adamw(p + "mlp.gate.e_score_correction_bias", experts),
            ]
            for e in range(experts):
                specs += mlp(p + f"mlp.experts.{e}.", expert_ffn)
            specs += mlp(p + "mlp.shared_experts.", expert_ffn)
        specs += [
            adamw(p + "input_layernorm.weight", d),
            adamw(p + "post_attention_layernorm.weight", d),
        ]
    specs += [adamw("model.norm.weight", d), adamw("lm_head.weight", vocab, d)]
    return specs


def qwen3_30b_a3b() -> list[ParamSpec]:
    """Qwen3-30B-A3B with transformers 5's fused experts: 48 layers, d 2048, 32 heads / 4 KV
    heads of dim 128 (q/k RMSNorms), vocab 151936, untied head; every layer a router (128 x
    2048) and 128 experts of FFN 768 stored as stacks `gate_up_proj` (128, 1536, 2048) and
    `down_proj` (128, 2048, 768), each a stack of (out, in) matrices."""
    d, vocab, experts, ffn, heads, kv_heads, head_dim = 2048, 151936, 128, 768, 32, 4, 128
    specs = [adamw("model.embed_tokens.weight", vocab, d)]
    for i in range(48):
        p = f"model.layers.{i}."
        specs += [
            matrix(p + "self_attn.q_proj.weight", heads * head_dim, d),
            matrix(p + "self_attn.k_proj.weight", kv_heads * head_dim, d),
            matrix(p + "self_attn.v_proj.weight", kv_heads * head_dim, d),
            matrix(p + "self_attn.o_proj.weight", d, heads * head_dim),
            adamw(p + "self_attn.q_norm.weight", head_dim),
            adamw(p + "self_attn.k_norm.weight", head_dim),
            matrix(p + "mlp.experts.gate_up_proj", experts, 2 * ffn, d),
            matrix(p + "mlp.experts.down_proj", experts, d, ffn),
            matrix(p + "mlp.gate.weight", experts, d),
            adamw(p + "input_layernorm.weight", d),
            adamw(p + "post_attention_layernorm.weight", d),
        ]
    specs += [adamw("model.norm.weight", d), adamw("lm_head.weight", vocab, d)]
    return specs


PRESETS: dict[str, Callable[[], list[ParamSpec]]] = {
    "gpt2-small": gpt2_small,
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "qwen2.5-7b": qwen25_7b,
    "moe-256x": moe_256x,
    "qwen3-30b-a3b": qwen3_30b_a3b,
}


def preset(name: str) -> list[ParamSpec]:
    """The specs of preset `name` (one of `PRESETS`); ValueError naming the choices otherwise."""
    try:
        build = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
    return build()
