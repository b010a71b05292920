"""The machinery behind `wholeshard.DataParallel` (FSDP2's `_fully_shard` in spirit).

`config` defines the options (`DataParallelConfig`, and `Variant`: the alternatives kept for
comparison), `data_parallel` the wrapper (`DataParallel`), `step_protocol` the verbs the
optimizer drives its step with (`StepProtocol`, reached as `ddp.step_protocol`, and the
`OwnedRange`s it hands out) and `layouts` a layout's engine half ([Note: layouts] in
`wholeshard.planning.layouts`); the rest is private: `_sharded_group` (`ShardedGroup`: the params
of one process group, their plan, units, scheduler and hooks; the wrapper holds one per group,
FSDP2's `FSDPParamGroup`), `_init` (the construction steps; `_meta`: from the meta device),
`_storage` (a unit's storage, states and collectives; `_fp8_storage` is its FP8
kind; `_sync`: each bucket sync scheme's executable half), `_owned` (what a rank
updates), `_schedule` (when collectives run; `_waits`: how long waits hold the step up;
`_skips`: modules some rank skipped), `_hooks` (module hooks), `_guard` (misuse checks;
`_tp_check`: which DTensor params it can hold), `_memory`, `_experts` (experts over "ep": their
group, layout and values).
Import the public names from `wholeshard`; this package re-exports nothing, so that importing
`wholeshard.engine.config` (the CLI does) does not import torch.
"""
