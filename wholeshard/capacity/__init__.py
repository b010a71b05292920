"""Capacity: what a plan costs, from shapes alone, for `wholeshard plan`, tools and the docs.

Above the engine: nothing under `planning` or `engine` imports it, so `DataParallel` never
computes a report. Modules: `presets` and `shapes` (specs without a model), `model_shapes`
(specs of a module or a transformers model directory, built on the meta device), `costs` (what
a plan costs each rank in a mode: memory, collectives, bytes; with `_lifetimes` for the fully
sharded peak), `alpha_beta` (a collective's latency and bandwidth price on a fabric),
`projection` (a step-time estimate from those), `bucket_hint` (where its latency term is large,
a `--bucket-size` that shrinks it, planned again), `equal_shards` (the collectives FSDP2-style
equal shards would issue, for comparison), `tp_traffic` (each rank's
slices and Newton-Schulz traffic under tensor parallelism) and `choice` (the report of the
automatic choice `planning.auto.decide` made: `ShardGroupChoice`, `plan_and_choice`).
Invariant: every plan here is the one `planning.plan_for` (what `DataParallel` calls)
makes for the same inputs.
"""
