"""`wholeshard.bench.exchange_bucket`: one exchange bucket's reduce-scatter, exchange and gather,
timed, on CPU at a small size (the GPU tier runs it on CUDA tensors)."""

from __future__ import annotations

from support import run

from wholeshard.bench.exchange_bucket import PHASES, exchange_bucket_row, layer
from wholeshard.planning import ONE_BUCKET, plan_exactly, segments


def test_the_row_times_an_exact_exchange_of_the_planned_pieces() -> None:
    rows = run(exchange_bucket_row, 3, 0.05, "cpu", 2)
    (buffer,) = plan_exactly(layer(0.05), 3, bucket_size=ONE_BUCKET, strategy="exchange").buffers
    for row in rows:
        assert row["exact"] and (row["ranks"], row["numel"]) == (3, buffer.numel), row
        assert row["moved"] == sum(s.numel for s in segments(buffer)) > 0
        assert all(row[p] > 0 for p in PHASES), row
        ratio = (row["reduce_scatter_s"] + row["to_owners_s"]) / row["reduce_scatter_s"]
        assert row["exchange_over_reduce_scatter"] == ratio


def test_one_rank_moves_nothing_and_is_exact() -> None:
    (row,) = run(exchange_bucket_row, 1, 0.05, "cpu", 1)
    assert row["exact"] and row["moved"] == 0, row
