"""Lightning Fabric with wholeshard: `WholeshardFabricStrategy`.

    fabric run --accelerator cpu --devices 2 examples/lightning_fabric.py   # or: python ...

A tiny Llama (random init, byte vocabulary) learning to count (each token is the last plus 1),
in Fabric's own loop: setup_module wraps the model in wholeshard.DataParallel, the optimizer is
the LayerwiseOptimizer over it (Muon on the matrices, AdamW on the rest), no_backward_sync
accumulates with one reduction per step, clip_gradients clips by the global norm, and
fabric.save writes a checkpoint that fabric.load reads at any world size. See
docs/integrations.md.
"""

import sys

import lightning as L
import torch
import transformers

from wholeshard.integrations.lightning import WholeshardFabricStrategy, layerwise_optimizer

out = sys.argv[1] if len(sys.argv) > 1 else "runs/lightning_fabric"
fabric = L.Fabric(accelerator="cpu", devices=2, strategy=WholeshardFabricStrategy())
fabric.launch()
torch.manual_seed(0)  # the same model on every rank (DataParallel checks it)
config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
)  # fmt: skip
model = fabric.setup_module(transformers.AutoModelForCausalLM.from_config(config))
optimizer = fabric.setup_optimizers(  # built over the wrapped model, after setup_module
    layerwise_optimizer(
        model,
        matrix=dict(lr=1e-2, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
        adamw=dict(lr=1e-2, weight_decay=0.01),
    )
)
starts = torch.randint(0, 256, (64, 1), generator=torch.Generator().manual_seed(0))
rows = (starts + torch.arange(33)) % 256
data = [{"input_ids": r, "labels": r} for r in rows]
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=4))

state = {"model": model, "optimizer": optimizer, "step": 0}
for i, batch in enumerate(loader):
    last = i % 2 == 1  # two micro-batches a step
    with fabric.no_backward_sync(model, enabled=not last):
        loss = model(**batch).loss
        fabric.backward(loss / 2)
    if last:
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the global norm
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        fabric.print(f"step {state['step']} loss {loss.item():.3f} grad norm {norm.item():.3f}")
fabric.save(f"{out}/ckpt", state)  # a directory; fabric.load(path, state) at any world size
