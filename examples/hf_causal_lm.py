"""Fine-tune a transformers causal LM with wholeshard: DataParallel + LayerwiseOptimizer.

    python examples/hf_causal_lm.py --tiny llama --steps 20 --nproc 2     # random init, offline
    python examples/hf_causal_lm.py --model path/to/local/model            # weights (+ tokenizer)
    python examples/hf_causal_lm.py --config-json config.json              # any config, random init
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py --tiny qwen3-moe

Data is the train job's corpus (the Python standard library's `.py` sources, or `--data PATH`),
as bytes (vocab >= 256) or through the model's tokenizer when `--model` has one. Without
torchrun it runs `--nproc` local CPU processes (gloo) with `wholeshard.distributed.launch`.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import transformers
from torch.nn import functional as F

import wholeshard
from wholeshard.distributed.launch import launch
from wholeshard.train.data import load_corpus, train_batch

SMALL = dict(  # byte-level (vocab 256), hidden 64, 2 layers: builds in milliseconds
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
TINY = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4),
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, moe_intermediate_size=32, head_dim=16, num_experts=4, num_experts_per_tok=2
    ),
}


def build(args) -> tuple[torch.nn.Module, object | None]:
    """(model, tokenizer or None): a local checkpoint, or a config with random init."""
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
        files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any(os.path.exists(os.path.join(args.model, f)) for f in files):
            return model, None
        return model, transformers.AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    cfg = transformers.AutoConfig.from_pretrained(args.config_json) if args.config_json else None
    return transformers.AutoModelForCausalLM.from_config(cfg or TINY[args.tiny]()), None


def tokens_of(args, tok, vocab: int) -> torch.Tensor:
    text = load_corpus(args.data).train
    if tok is None:
        if vocab < 256:
            raise SystemExit(f"byte-level data needs a vocab of >= 256, the model has {vocab}")
        return text
    text = bytes(text[: args.max_bytes].tolist()).decode("utf-8", errors="replace")
    return torch.tensor(tok(text)["input_ids"])


def worker(args) -> None:
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)  # every rank builds the same model (rank 0's values win anyway)
    model, tok = build(args)
    model.to(device).train()
    if args.compile:
        model.compile()  # in place: parameter names stay the model's own
    ddp = wholeshard.DataParallel(
        model,
        bucket_size=args.bucket_size,
        param_dtype=getattr(torch, args.param_dtype),
        overlap_grad_reduce=args.overlap,
        overlap_param_gather=args.overlap,
        reshard_after_forward=args.reshard_after_forward,
    )
    opt = wholeshard.LayerwiseOptimizer(
        ddp,
        muon=dict(lr=args.lr, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
        adamw=dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01),
    )
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    )
    data = tokens_of(args, tok, model.config.vocab_size)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        muon = sum(r.param.numel() for r in ddp.routes if r.muon) / n
        print(f"{type(model).__name__}: {n / 1e6:.2f}M params ({muon:.0%} on Muon), ", end="")
        print(f"{world} rank(s) on {device}, {len(data):,} tokens")
    for step in range(args.steps):
        start = time.perf_counter()
        x, y = train_batch(data, step, args.batch_size, args.seq_len, args.seed, rank, world)
        logits = ddp(input_ids=x.to(device)).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())
        loss.backward()
        norm, lr = opt.clip_grad_norm_(1.0).item(), sched.get_last_lr()[0]
        opt.step()
        opt.zero_grad()
        sched.step()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        took = time.perf_counter() - start
        if rank == 0:
            print(f"step {step + 1:3d}  loss {loss.item():.4f}  grad_norm {norm:.3f}  ", end="")
            print(f"lr {lr:.2e}  {took:.2f}s")
    with ddp.full_params():  # every rank enters: fully sharded, this gathers the params
        if args.save and rank == 0:
            model.save_pretrained(args.save)  # plain transformers weights, loadable with --model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="local directory of a transformers checkpoint")
    src.add_argument("--config-json", help="a config.json: random init from it")
    src.add_argument("--tiny", choices=sorted(TINY), help="a tiny built-in config, random init")
    p.add_argument("--nproc", type=int, default=2, help="local processes (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="a text file or directory (default: the Python stdlib)")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="text to tokenize")
    p.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--bucket-size", type=int, default=None)
    p.add_argument("--overlap", action="store_true", help="overlap grad reduce + param gather")
    p.add_argument(
        "--reshard-after-forward",
        action="store_true",
        help="fully sharded: keep only owned params between steps",
    )
    p.add_argument("--compile", action="store_true", help="model.compile() before wrapping")
    p.add_argument("--save", help="rank 0 saves the trained model here (save_pretrained)")
    args = p.parse_args()
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: we are a rank
        worker(args)
    else:
        launch(functools.partial(worker, args), args.nproc)


if __name__ == "__main__":
    main()
