"""The planner's machinery; `wholeshard.layout` and `wholeshard.plan` are its public entry points.

- `records`: what goes in and comes out (`ParamSpec`, `Bucket`, `Placement`) and the costs;
- `buffer`: `Layout`, the record of one planned buffer, with its owner rule and invariant checker;
- `rows`: the size-matching planner (rows of same-size params);
- `balanced`: the balanced planner (Newton-Schulz cost across ranks);
- `packing`: the packing helpers the balanced planner uses (`pack`, `FirstFit`).
"""
