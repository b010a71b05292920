"""The example training job behind `wholeshard train`: `config` (TrainConfig), `trainer`
(Trainer, train), `resume` (where a run starts), `env`, `baseline` (the torch DDP + AdamW path),
`data`, `schedule`, `report`, `plot`, `restarts`, `extras`."""
