"""Training with wholeshard where users already train: transformers' `Trainer`, Accelerate
loops, Lightning and Fabric (docs/integrations.md).

Each module imports its framework only when it is itself imported (extras `wholeshard[hf]`,
`wholeshard[lightning]`); this package imports nothing. `start` holds what every integration
checks when training starts: the routing summary it logs, the refusal to train with AdamW alone
unless told, and the foreign optimizers and wrappers it refuses.
"""
