"""Lightning's Trainer with wholeshard: `WholeshardStrategy`.

    python examples/lightning_trainer.py     # 2 CPU processes (Lightning starts the second)

A tiny Llama (random init, byte vocabulary) in a LightningModule, learning to count (each
token is the last plus 1). The strategy wraps the module in wholeshard.DataParallel;
configure_optimizers builds the LayerwiseOptimizer over it (Muon on the matrices, AdamW on the
rest) with an LR scheduler; gradient_clip_val clips by the global norm, accumulate_grad_batches
reduces once per step, and trainer.save_checkpoint writes a checkpoint that fit(ckpt_path=...)
resumes at any world size. See docs/integrations.md.
"""

import sys

import lightning as L
import torch
import transformers

from wholeshard.integrations.lightning import WholeshardStrategy, layerwise_optimizer

out = sys.argv[1] if len(sys.argv) > 1 else "runs/lightning_trainer"


class CountingLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same model on every rank (DataParallel checks it)
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        )  # fmt: skip
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: dict, index: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, index: int) -> None:
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)  # current params

    def configure_optimizers(self) -> dict:
        optimizer = layerwise_optimizer(  # over the DataParallel the strategy wrapped
            self,
            matrix=dict(lr=1e-2, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
            adamw=dict(lr=1e-2, weight_decay=0.01),
        )
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


starts = torch.randint(0, 256, (64, 1), generator=torch.Generator().manual_seed(0))
rows = (starts + torch.arange(33)) % 256
data = [{"input_ids": r, "labels": r} for r in rows]
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=WholeshardStrategy(),
    max_steps=4,
    accumulate_grad_batches=2,
    gradient_clip_val=1.0,  # by the global norm: trainer.strategy.grad_norm
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
)
module = CountingLlama()
trainer.fit(
    module,
    torch.utils.data.DataLoader(data, batch_size=4),
    torch.utils.data.DataLoader(data[:8], batch_size=4),
)
trainer.save_checkpoint(f"{out}/last.ckpt")  # a directory: fit(ckpt_path=...) at any world size
with trainer.strategy.data_parallel.full_params():  # every rank; the main one writes
    if trainer.is_global_zero:
        module.model.save_pretrained(f"{out}/final")  # loads with from_pretrained
