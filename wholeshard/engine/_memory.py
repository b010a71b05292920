"""What a `DataParallel` rank holds between steps, by kind (`DataParallel.memory`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import nn

from ._storage import BucketStorage


class StateHolder(Protocol):
    """What `DataParallel.memory` asks the optimizer attached to it."""

    def state_bytes(self) -> dict[str, int]: ...


def memory(
    buckets: Sequence[BucketStorage],
    frozen: Sequence[nn.Parameter],
    reshard: bool,
    optimizer: StateHolder | None,
) -> dict[str, int]:
    """Bytes by kind: `params` and `grads` the buckets keep between steps, the optimizer's
    `masters` and `optimizer_state` (0 without one), `frozen_params`, and (`reshard`) the
    largest full bucket that exists only during forward and backward, `transient_bucket`."""
    params = grads = 0
    for b in buckets:
        p, g = b.persistent_bytes()
        params, grads = params + p, grads + g
    out = {
        "params": params,
        "grads": grads,
        "masters": 0,
        "optimizer_state": 0,
        "frozen_params": sum(p.nbytes for p in frozen),
        "transient_bucket": max(b.full_bytes() for b in buckets) if reshard else 0,
    }
    if optimizer is not None:
        out.update(optimizer.state_bytes())
    return out
