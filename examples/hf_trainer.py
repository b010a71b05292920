"""transformers' Trainer with wholeshard: `WholeshardTrainer` in place of `Trainer`.

    torchrun --nproc-per-node 2 examples/hf_trainer.py    # or: python examples/hf_trainer.py

A tiny Llama (random init, byte vocabulary) learning to count (each token is the last plus 1).
The trainer wraps the model in wholeshard.DataParallel, steps it with LayerwiseOptimizer (Muon
on the matrices, AdamW on the rest, from TrainingArguments), clips by the global norm, and writes
checkpoints that resume at any world size. 8 steps of 4 rows a rank: at 2 processes each rank
reads its own rows and the 8 steps are one epoch of the 64 rows (half an epoch in one process).
On a machine without a GPU, `use_cpu=True` is what sets Trainer up for the torchrun processes
(Accelerate's multi-process CPU mode); without it WholeshardTrainer refuses to start, since
Trainer would deal every rank the same batches. See docs/integrations.md.
"""

import sys

import torch
import transformers

from wholeshard.integrations.transformers import WholeshardTrainer

out = sys.argv[1] if len(sys.argv) > 1 else "runs/hf_trainer"
torch.manual_seed(0)  # the same model on every rank (DataParallel checks it)
config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
)  # fmt: skip
model = transformers.AutoModelForCausalLM.from_config(config)
starts = torch.randint(0, 256, (64, 1), generator=torch.Generator().manual_seed(0))
rows = (starts + torch.arange(33)) % 256
data = [{"input_ids": r, "labels": r} for r in rows]
args = transformers.TrainingArguments(
    output_dir=out,
    max_steps=8,
    per_device_train_batch_size=4,
    learning_rate=1e-2,
    weight_decay=0.01,
    max_grad_norm=1.0,
    logging_steps=2,
    save_steps=4,
    report_to=[],
    use_cpu=not torch.cuda.is_available(),
)
trainer = WholeshardTrainer(model=model, args=args, train_dataset=data)
trainer.train()
trainer.save_model(f"{out}/final")  # every rank calls it; loads with from_pretrained
