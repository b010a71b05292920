"""`wholeshard bench`'s machinery: wholeshard against the distributed Muon setups users would
pick instead. Modules: `configs` (the registry of configurations and workloads, no torch),
`baselines` (the legacy baselines, registered as layouts; `baseline_storage`: their engine half),
`builders` (how each is built), `rule_optimizers` (what steps the matrices under each matrix
rule), `workloads` (the work), `worker` (one rank's run), `timing` (CPU clock or CUDA events),
`traffic` (bytes sent), `wait_clock` (blocked time), `owner_bucket` (one owner bucket's
collectives, timed), `floor` (the no-communication floor and the torch-Muon yardstick), `flops`
(Newton–Schulz arithmetic, GPU peaks), `launches` (kernel launches per step),
`memory_figures`, `machine`, `report` and `plot` (output). The command itself is
`wholeshard.cli.bench`.
"""
