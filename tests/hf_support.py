"""Tiny transformers models and a tokenizer trained offline, saved as model directories.

Every test that needs `hf:DIR` builds one here: `model_dir(tmp, "llama")` writes a
transformers model directory (config, safetensors weights, and a BPE tokenizer trained on a few
kilobytes of text) that `AutoModelForCausalLM.from_pretrained(dir, local_files_only=True)` and
`AutoTokenizer.from_pretrained(dir)` load without the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 300  # > 256 special + merges; small enough that the head is tiny
EOS = "<|endoftext|>"

TEXT = (
    "The quick brown fox jumps over the lazy dog. "
    "Pack my box with five dozen liquor jugs. "
    "def add(a, b):\n    return a + b\n"
    "Sphinx of black quartz, judge my vow. "
    "How vexingly quick daft zebras jump! "
) * 40


def train_tokenizer(out: Path, text: str = TEXT, vocab: int = VOCAB) -> None:
    """A byte-level BPE tokenizer trained on `text`, with an EOS token, saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text[i : i + 200] for i in range(0, len(text), 200)], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(out)


def config(kind: str, vocab: int = VOCAB, seq: int = 64, heads: int = 4):
    """A tiny config of `kind` (`llama`, `gpt2`, `qwen3_moe`): hidden 32, 2 layers, `heads`
    attention heads (as many key/value heads)."""
    common = dict(vocab_size=vocab, attn_implementation="eager", eos_token_id=0, bos_token_id=0)
    if kind == "gpt2":
        return transformers.GPT2Config(
            n_positions=seq,
            n_embd=32,
            n_layer=2,
            n_head=heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    small = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        **common,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**small)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **small,
            moe_intermediate_size=16,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            experts_implementation="eager",
            output_router_logits=True,
            router_aux_loss_coef=0.01,
        )
    raise ValueError(f"unknown tiny model {kind!r}")


def model_dir(root: Path, kind: str = "llama", *, tokenizer: bool = True, seed: int = 0) -> Path:
    """Save a tiny `kind` model (random init from `seed`), and a tokenizer, under `root/kind`."""
    import torch

    out = Path(root) / kind
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(kind))
    model.save_pretrained(out)
    if tokenizer:
        train_tokenizer(out)
    return out


def config_file(root: Path, kind: str = "llama", vocab: int = VOCAB) -> Path:
    """A tiny `kind` config as a JSON file (`hf-config:FILE`)."""
    path = Path(root) / f"{kind}.json"
    path.write_text(json.dumps(config(kind, vocab).to_dict()))
    return path


def jsonl(path: Path, docs: int = 60, field: str = "text") -> Path:
    """A JSONL corpus of `docs` short documents under `field`."""
    sentences = [s.strip() + "." for s in TEXT.split(".") if s.strip()][:5]
    with open(path, "w") as f:
        for i in range(docs):
            f.write(json.dumps({field: f"{i}: " + " ".join(sentences[i % 5 :] * 3)}) + "\n")
    return path
