"""The example training job behind `wholeshard train`: `config` (TrainConfig), `trainer`
(Trainer, train), `resume` (where a run starts), `env`, `baseline` (the torch DDP + AdamW path),
`data`, `lr_schedule`, `outputs` (the output directory, metrics, progress bar, trace, loss
plot), `restarts`, `extras`."""
