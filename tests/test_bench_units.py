"""Units of `wholeshard bench`: the traffic model, the report, availability, CLI wiring."""

from __future__ import annotations

import argparse
import time

import pytest
import torch
import torch.distributed as dist

from wholeshard import collectives
from wholeshard.bench import add_parser, main
from wholeshard.bench import configs as bench_configs
from wholeshard.bench.configs import wholeshard_config
from wholeshard.bench.memory import optimizer_state_bytes
from wholeshard.bench.report import Row, disagreements, fill_ratios, markdown, merge_rounds
from wholeshard.bench.traffic import bytes_sent
from wholeshard.bench.waits import WaitClock

MB = torch.zeros(1 << 18)  # 1 MiB of fp32


@pytest.mark.parametrize(
    "namespace, name, args, expected",
    [
        ("c10d", "allreduce_", ([MB], None), 2 * 3 / 4 * 2**20),
        ("c10d", "_reduce_scatter_base_", (MB[: 1 << 16], MB), 3 / 4 * 2**20),
        ("c10d", "_allgather_base_", (MB, MB[: 1 << 16]), 3 / 4 * 2**20),
        ("c10d", "allgather_", ([list(MB.chunk(4))], [MB[: 1 << 16]]), 3 / 4 * 2**20),
        ("c10d", "broadcast_", ([MB], None, 0), 3 / 4 * 2**20),
        ("c10d", "reduce_scatter_", ([MB[:1]], [list(MB.chunk(4))]), 3 / 4 * 2**20),
        ("_c10d_functional", "all_gather_into_tensor", (MB, 4, "g"), 3 * 2**20),
        ("_c10d_functional", "reduce_scatter_tensor", (MB, "avg", 4, "g"), 3 / 4 * 2**20),
        ("_c10d_functional", "all_reduce", (MB, "sum", "g"), 2 * 3 / 4 * 2**20),
        ("c10d", "recv_", ([MB], None, 0, 0), 0),
    ],
)
def test_traffic_model_on_four_ranks(namespace, name, args, expected) -> None:
    assert bytes_sent(namespace, name, args, 4, 1) == expected


def test_unknown_collective_is_reported_not_guessed() -> None:
    assert bytes_sent("c10d", "gather_", ([MB],), 4, 0) is None


def test_ratios_and_loss_agreement() -> None:
    rows = [
        Row("mlp", "ddp_torch_muon", step_s=2.0, final_loss=1.0),
        Row("mlp", "ws_sync", step_s=1.0, final_loss=1.001),
        Row("mlp", "odd", step_s=1.5, final_loss=1.5),
        Row("mlp", "broken", error="boom"),
    ]
    fill_ratios(rows)
    assert [r.ratio_vs_ddp_torch_muon for r in rows] == [1.0, 0.5, 0.75, None]
    flagged = disagreements(rows)
    assert len(flagged) == 1 and flagged[0].startswith("mlp/odd:")
    table = markdown(rows, flagged)
    assert "LOSS DISAGREES" in table and "boom" in table


def test_rounds_merge_to_medians_and_survive_a_failed_round() -> None:
    rounds = [
        Row(
            "mlp",
            "ws_sync",
            step_s=s,
            optimizer_s=s / 2,
            comm_wait_s=0.1,
            bytes_sent_per_rank=8,
            peak_rss_bytes=m,
            optimizer_state_bytes=4,
            final_loss=0.5,
        )
        for s, m in ((3.0, 100), (1.0, 300), (2.0, 200))
    ] + [Row("mlp", "ws_sync", error="killed")]
    merged = merge_rounds(rounds)
    assert (merged.step_s, merged.optimizer_s, merged.peak_rss_bytes) == (2.0, 1.0, 300)
    assert merged.error is None
    assert merge_rounds([Row("mlp", "x", error="boom")]).error == "boom"


def test_optimizer_state_bytes_counts_each_tensor_once() -> None:
    p = torch.nn.Parameter(torch.zeros(10, 10))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    # exp_avg, exp_avg_sq (400 B each) and the fp32 step counter (4 B)
    assert optimizer_state_bytes([opt]) == 804


def test_missing_wholeshard_keyword_is_unavailable_not_an_error() -> None:
    config = wholeshard_config("ws_future", "a mode from a later issue", no_such_mode=True)
    reason = config.unavailable()
    assert reason is not None and reason.startswith("not available in this version")
    for name in ("ws_sync", "ws_overlap", "ws_ping_pong"):
        assert bench_configs.CONFIGS[name].unavailable() is None


def test_registers_as_a_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="wholeshard")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--workload", "mlp", "--steps", "3", "--quick"])
    assert args.run is main and args.workload == "mlp" and args.steps == 3 and args.quick


def test_rejects_bad_counts_without_starting_workers(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command", required=True))
    assert main(parser.parse_args(["bench", "--nproc", "0"])) == 2
    assert main(parser.parse_args(["bench", "--steps", "0"])) == 2
    assert main(parser.parse_args(["bench", "--repeat", "0"])) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_wait_clock_counts_nested_blocks_once_and_restores_patches() -> None:
    originals = (dist.all_reduce, dist.Work.wait, collectives.wait)
    clock = WaitClock()
    with clock.watch():
        assert collectives.wait is not originals[2]
        with clock.blocked():
            time.sleep(0.02)
            with clock.blocked():
                time.sleep(0.02)
        collectives.wait(None)  # a patched wholeshard collective: counted, returns at once
    assert 0.04 <= clock.seconds < 0.5
    clock.add(-1.0)  # a negative tail (nothing blocked) adds nothing
    assert clock.seconds >= 0.04
    assert (dist.all_reduce, dist.Work.wait, collectives.wait) == originals
