"""`wholeshard bench`'s machinery: wholeshard against the distributed Muon setups users would
pick instead. Modules: `configs` (the registry of configurations and workloads, no torch),
`builders` (how each is built), `workloads` (the work), `worker` (one rank's run), `traffic`
(bytes sent), `waits` (blocked time), `floor` (the no-communication floor), `memory`, `report`
and `plot` (output). The command itself is `wholeshard.cli.bench`.
"""
