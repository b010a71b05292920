"""What a `DataParallel` rank holds between steps, by kind (`DataParallel.memory`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import nn

from ._storage import StorageUnit


class StateHolder(Protocol):
    """What `DataParallel.memory` asks the optimizer attached to it."""

    def state_bytes(self) -> dict[str, int]:
        """`masters` and `optimizer_state` bytes; optionally `host`, those in host memory."""
        ...


def memory(
    units: Sequence[StorageUnit],
    frozen: Sequence[nn.Parameter],
    reshard: bool,
    optimizer: StateHolder | None,
) -> dict[str, int]:
    """Bytes by kind: `params` and `grads` the units keep between steps, the optimizer's
    `masters` and `optimizer_state` (0 without one; wherever they are), `frozen_params`, and
    (`reshard`) the largest full unit that exists only during forward and backward,
    `transient_unit`; then where the kept ones are: `host`, the masters and state the optimizer
    keeps in host memory (offloaded), `device`, the rest of the kinds before `transient_unit`."""
    params = grads = 0
    for b in units:
        p, g = b.persistent_bytes()
        params, grads = params + p, grads + g
    out = {
        "params": params,
        "grads": grads,
        "masters": 0,
        "optimizer_state": 0,
        "frozen_params": sum(p.nbytes for p in frozen),
        "transient_unit": max(b.full_bytes() for b in units) if reshard else 0,
    }
    host = 0
    if optimizer is not None:
        state = dict(optimizer.state_bytes())
        host = state.pop("host", 0)
        out.update(state)
    kept = ("params", "grads", "masters", "optimizer_state", "frozen_params")
    return out | {"device": sum(out[k] for k in kept) - host, "host": host}
