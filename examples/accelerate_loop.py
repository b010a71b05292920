"""An Accelerate training loop on a wholeshard model: `WholeshardAccelerator`.

    torchrun --nproc-per-node 2 examples/accelerate_loop.py   # or: accelerate launch, python

A tiny Llama (random init, byte vocabulary) learning to count (each token is the last plus 1).
The loop is Accelerate's own (prepare, accumulate, backward, clip_grad_norm_, save_state); the
model is wrapped in wholeshard.DataParallel and stepped by LayerwiseOptimizer (Muon on the
matrices, AdamW on the rest); nothing wraps it in torch DDP, clipping is by the global norm, and
save_state writes a wholeshard checkpoint that load_state reads at any world size. See
docs/integrations.md.
"""

import sys

import torch
import transformers

import wholeshard
from wholeshard.integrations.accelerate import WholeshardAccelerator

out = sys.argv[1] if len(sys.argv) > 1 else "runs/accelerate_loop"
# First: it joins the process group (cpu=True: Accelerate's multi-process CPU mode, gloo).
accelerator = WholeshardAccelerator(
    cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2
)
torch.manual_seed(0)  # the same model on every rank (DataParallel checks it)
config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
)  # fmt: skip
model = wholeshard.DataParallel(transformers.AutoModelForCausalLM.from_config(config))
optimizer = wholeshard.LayerwiseOptimizer(
    model,
    matrix=dict(lr=1e-2, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
    adamw=dict(lr=1e-2, weight_decay=0.01),
)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
starts = torch.randint(0, 256, (64, 1), generator=torch.Generator().manual_seed(0))
rows = (starts + torch.arange(33)) % 256
loader = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in rows], batch_size=4)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

for batch in loader:
    with accelerator.accumulate(model):  # micro-batches under model.no_sync(): one reduction
        loss = model(**batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the global norm
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    if accelerator.sync_gradients:
        step = optimizer.optimizer.steps
        accelerator.print(f"step {step} loss {loss.item():.3f} grad norm {norm.item():.3f}")
        if step == 2:
            accelerator.save_state(f"{out}/state")  # load_state(...) resumes at any world size

accelerator.unwrap_model(model).save_pretrained(  # every rank: get_state_dict gathers
    f"{out}/final",
    is_main_process=accelerator.is_main_process,
    save_function=accelerator.save,
    state_dict=accelerator.get_state_dict(model),
)
