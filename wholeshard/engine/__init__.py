"""The machinery behind `wholeshard.DataParallel` (FSDP2's `_fully_shard` in spirit).

`config` defines the options (`DataParallelConfig`) and `data_parallel` the wrapper
(`DataParallel`, `OwnedRange`); the rest is private: `_init` (construction steps), `_storage`
(bucket storage, its states and collectives), `_fp8_storage` and `_unaligned_storage` (storage
kinds), `_schedule` (when collectives run), `_hooks` (module hooks), `_guard` (misuse checks).
Import the public names from `wholeshard`; this package re-exports nothing, so that importing
`wholeshard.engine.config` (the CLI does) does not import torch.
"""
