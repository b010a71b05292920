"""The Python API on a transformers causal LM: DataParallel + LayerwiseOptimizer in a loop.

    torchrun --nproc-per-node 2 examples/hf_causal_lm.py    # or: python examples/hf_causal_lm.py

A tiny Llama (random init, byte vocabulary) learning to count (each token is the last plus 1),
to show the calls; the training
job (`wholeshard train --model hf:DIR --data corpus.jsonl`) is the whole job: datasets, the
token cache, checkpoints, restarts, export. See docs/transformers.md.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import wholeshard

if "WORLD_SIZE" in os.environ:  # under torchrun: one process per rank
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
if not torch.cuda.is_available():
    device = torch.device("cpu")
torch.manual_seed(0)  # the same model on every rank (construction checks it)
config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
)  # fmt: skip
model = transformers.AutoModelForCausalLM.from_config(config).to(device)
ddp = wholeshard.DataParallel(model, overlap_grad_reduce=True, overlap_param_gather=True)
opt = wholeshard.LayerwiseOptimizer(
    ddp,
    matrix=dict(lr=1e-2, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
    adamw=dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01),
)
rank = dist.get_rank() if dist.is_initialized() else 0
for step in range(10):
    g = torch.Generator().manual_seed(1000 * step + rank)  # this rank's slice of the batch
    starts = torch.randint(0, 256, (4, 1), generator=g)
    tokens = ((starts + torch.arange(65)) % 256).to(device)
    logits = ddp(input_ids=tokens[:, :-1], use_cache=False).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}")
with ddp.full_params():  # every rank enters; fully sharded, this gathers the params
    if rank == 0:
        model.save_pretrained("runs/hf_causal_lm")  # loads with from_pretrained, or --model hf:
if dist.is_initialized():
    dist.destroy_process_group()
