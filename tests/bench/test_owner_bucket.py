"""`wholeshard.bench.owner_bucket`: one owner bucket's reduction and gather, timed, on CPU at a
small size (the GPU tier runs it at the largest size a GPU holds)."""

from __future__ import annotations

import pytest
import torch
from support import run

from wholeshard.bench.owner_bucket import largest_numel, owner_bucket_row
from wholeshard.capacity.costs import ring_bytes

TIMES = ("reduce_s", "gather_s")


@pytest.mark.parametrize("owners", ["every", "one"])
def test_the_row_times_an_exact_reduction_and_gather(owners: str) -> None:
    rows = run(owner_bucket_row, 3, 3000, "cpu", owners, 2)
    row = rows[0]
    assert all({**r, **{t: row[t] for t in TIMES}} == row for r in rows)
    assert row["exact"] and (row["ranks"], row["numel"], row["owners"]) == (3, 3000, owners)
    assert all(r[t] > 0 for r in rows for t in TIMES)
    assert row["bytes_sent"] == ring_bytes("reduce", 12000, 3) + ring_bytes("broadcast", 6000, 3)


def test_on_cpu_the_largest_bucket_is_the_measurement_scripts() -> None:
    assert largest_numel(torch.device("cpu"), 2) == 16 * 2**20
