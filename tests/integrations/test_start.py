"""What every integration checks when training starts (`wholeshard.integrations.start`): the
routing it logs, no silent fallback to AdamW, no foreign wrapper or optimizer."""

from __future__ import annotations

import pytest
import torch
from support import make_model, run, wrapped
from torch.nn.parallel import DistributedDataParallel

from wholeshard.integrations.start import (
    RoutingCounts,
    check_optimizer,
    check_routing,
    data_parallel_of,
)


def test_routing_counts_what_goes_where() -> None:
    counts = check_routing(make_model())
    # TinyLM: 2 blocks of qkv 96x32, proj 32x32, fc 128x32, out 32x128 to Muon; embeddings,
    # head, norms and biases (7 a block) to AdamW.
    assert counts == RoutingCounts(8, 2 * (3072 + 1024 + 4096 + 4096), 19, counts.adamw_params)
    assert counts.summary() == (
        f"wholeshard routing: 8 matrices (24,576 params) to Muon, 19 tensors "
        f"({counts.adamw_params:,} params) to AdamW"
    )
    total = sum(p.numel() for p in make_model().parameters())
    assert counts.matrix_params + counts.adamw_params == total


def test_no_matrix_is_refused_unless_adamw_alone_is_intended() -> None:
    nothing = lambda name, param: False  # noqa: E731
    with pytest.raises(ValueError, match=r"no param goes to the matrix rule.*adamw_only=True"):
        check_routing(make_model(), nothing)
    assert check_routing(make_model(), nothing, adamw_only=True) is None


def test_a_foreign_optimizer_or_model_is_refused() -> None:
    ddp, opt = wrapped()
    assert check_optimizer(ddp, opt) is opt
    with pytest.raises(TypeError, match=r"SGD.*wholeshard\.LayerwiseOptimizer\(ddp"):
        check_optimizer(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    other, other_opt = wrapped()
    with pytest.raises(ValueError, match="another wholeshard.DataParallel"):
        check_optimizer(ddp, other_opt)
    with pytest.raises(TypeError, match=r"not a wholeshard\.DataParallel: wrap it"):
        data_parallel_of(make_model())


def _ddp_around() -> str:
    ddp, _ = wrapped()
    try:
        data_parallel_of(DistributedDataParallel(ddp))
    except TypeError as e:
        return str(e)
    return "no error"


def test_torch_ddp_around_the_wrapper_is_refused() -> None:
    (message,) = run(_ddp_around, 1)
    assert "DistributedDataParallel around a wholeshard.DataParallel" in message
