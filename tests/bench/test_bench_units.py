"""Units of `wholeshard bench`: the traffic model, the report, memory figures, availability,
overrides, CLI wiring."""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from support import bench_machine, bench_rank

from wholeshard import DataParallelConfig
from wholeshard.bench import builders
from wholeshard.bench.builders import build, every_param, unavailable
from wholeshard.bench.configs import CONFIGS, with_overrides
from wholeshard.bench.memory_figures import (
    optimizer_state_bytes,
    peak_rss_bytes,
    persistent_bytes,
    rss_bytes,
)
from wholeshard.bench.report import (
    Row,
    disagreements,
    fill_ratios,
    footer,
    from_ranks,
    markdown,
    merge_rounds,
)
from wholeshard.bench.traffic import TrafficCounter, bytes_sent
from wholeshard.bench.wait_clock import WaitClock
from wholeshard.bench.workloads import get_workload
from wholeshard.cli.bench import add_parser, flag_overrides, main
from wholeshard.distributed import collectives
from wholeshard.distributed.launch import launch
from wholeshard.engine.config import Variant
from wholeshard.planning.routing import route_params

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


class _Op:
    """A stand-in for an `OpOverload` as `TrafficCounter.__torch_dispatch__` sees it."""

    def __init__(self, namespace: str, name: str) -> None:
        self.namespace, self._opname = namespace, name

    def __call__(self, *args, **kwargs) -> None:
        return None


PARAM_GATHERS = [
    ("c10d", "_allgather_base_", (MB, MB[: 1 << 16])),
    ("c10d", "allgather_", ([list(MB.chunk(4))], [MB[: 1 << 16]])),
    ("c10d", "allgather_into_tensor_coalesced_", ([MB], [MB[: 1 << 16]])),
    ("c10d", "broadcast_", ([MB], None, 0)),
    ("_c10d_functional", "all_gather_into_tensor", (MB, 4, "g")),
    ("_c10d_functional", "all_gather_into_tensor_coalesced", ([MB], 4, "g")),
    ("_c10d_functional", "broadcast", (MB, 0, "g")),
    ("c10d_functional", "all_gather_into_tensor", (MB, 4, "g")),
]
GRADIENT_TRAFFIC = [
    ("c10d", "allreduce_", ([MB], None)),
    ("c10d", "allreduce_coalesced_", ([MB], None)),
    ("c10d", "_reduce_scatter_base_", (MB[: 1 << 16], MB)),
    ("c10d", "reduce_scatter_", ([MB[:1]], [list(MB.chunk(4))])),
    ("c10d", "reduce_scatter_tensor_coalesced_", ([MB[: 1 << 16]], [MB])),
    ("_c10d_functional", "all_reduce", (MB, "sum", "g")),
    ("_c10d_functional", "all_reduce_coalesced", ([MB], "sum", "g")),
    ("_c10d_functional", "reduce_scatter_tensor", (MB, "avg", 4, "g")),
]


def _counter_on_four_ranks(*ops: tuple) -> TrafficCounter:
    counter = TrafficCounter()
    counter.world, counter.rank = 4, 1
    for namespace, name, args in ops:
        counter.__torch_dispatch__(_Op(namespace, name), (), args)
    return counter


@pytest.mark.parametrize("namespace, name, args", PARAM_GATHERS)
def test_all_gathers_and_broadcasts_count_as_param_gathers(namespace, name, args) -> None:
    counter = _counter_on_four_ranks((namespace, name, args))
    assert counter.gather_bytes == counter.bytes == bytes_sent(namespace, name, args, 4, 1) > 0
    assert not counter.unmodelled


@pytest.mark.parametrize("namespace, name, args", GRADIENT_TRAFFIC)
def test_reduce_scatters_and_all_reduces_are_not_param_gathers(namespace, name, args) -> None:
    counter = _counter_on_four_ranks((namespace, name, args))
    assert counter.bytes == bytes_sent(namespace, name, args, 4, 1) > 0
    assert counter.gather_bytes == 0 and not counter.unmodelled


def test_gather_bytes_are_the_gather_part_of_a_mixed_step() -> None:
    counter = _counter_on_four_ranks(*GRADIENT_TRAFFIC, *PARAM_GATHERS, ("c10d", "gather_", ()))
    gathers = sum(bytes_sent(ns, name, args, 4, 1) for ns, name, args in PARAM_GATHERS)
    grads = sum(bytes_sent(ns, name, args, 4, 1) for ns, name, args in GRADIENT_TRAFFIC)
    assert (counter.gather_bytes, counter.bytes) == (gathers, gathers + grads)
    assert counter.unmodelled == {"c10d::gather_"}  # unmodelled: in neither figure


def test_ratios_and_loss_agreement() -> None:
    rows = [
        Row("mlp", "ddp_torch_muon", step_s=2.0, final_loss=1.0, floor_s=1.6),
        Row("mlp", "ws_sync", step_s=1.0, final_loss=1.001, floor_s=0.8),
        Row("mlp", "odd", step_s=1.5, final_loss=1.5),
        Row("mlp", "broken", error="boom"),
    ]
    fill_ratios(rows)
    assert [r.ratio_vs_ddp_torch_muon for r in rows] == [1.0, 0.5, 0.75, None]
    assert [r.ratio_vs_floor for r in rows] == [1.25, 1.25, None, None]
    flagged = disagreements(rows)
    assert len(flagged) == 1 and flagged[0].startswith("mlp/odd:")
    table = markdown(rows, flagged)
    assert "LOSS DISAGREES" in table and "boom" in table
    assert "| peak RSS delta MB |" in table and "| persistent MB/rank |" in table
    assert "| sent/rank MB | gather MB/rank |" in table
    assert "| floor s | vs floor |" in table and "| 0.800 | 1.25x |" in table
    widths = {line.count("|") for line in table.splitlines()}
    assert len(widths) == 1  # every line has as many cells as the header


def _rank(persistent: int | None, delta: int, gather: int = 2, floor=(0.2, 0.3)) -> dict:
    return bench_rank(
        persistent_bytes=persistent,
        peak_rss_delta_bytes=delta,
        gather_bytes_per_rank=gather,
        floor_forward_backward_s=floor[0],
        floor_optimizer_s=floor[1],
    )


def test_ranks_combine_to_the_fullest_rank_and_persistent_bytes_also_to_a_sum() -> None:
    ranks = [_rank(10, 50, gather=3, floor=(0.25, 0.5)), _rank(30, 40, gather=5, floor=(0.5, 0.25))]
    row = from_ranks("mlp", "ws_sync", ranks)
    assert row.floor_s == 1.0, "the slowest forward + backward and the busiest owned share"
    assert (row.peak_rss_delta_bytes, row.persistent_bytes) == (50, 30)
    assert row.gather_bytes_per_rank == 5
    assert row.persistent_bytes_all_ranks == 40
    other = from_ranks("mlp", "ddp_torch_muon", [_rank(None, 50), _rank(None, 40)])
    assert other.persistent_bytes is None and other.persistent_bytes_all_ranks is None


def test_rounds_merge_to_medians_and_survive_a_failed_round() -> None:
    rounds = [
        Row(
            "mlp",
            "ws_sync",
            step_s=s,
            optimizer_s=s / 2,
            comm_wait_s=0.1,
            bytes_sent_per_rank=8,
            gather_bytes_per_rank=m // 25,
            peak_rss_bytes=m,
            peak_rss_delta_bytes=m // 10,
            optimizer_state_bytes=4,
            persistent_bytes=m // 100,
            persistent_bytes_all_ranks=m // 50,
            floor_forward_backward_s=s / 8,
            floor_optimizer_s=s / 4,
            floor_s=s * 3 / 8,
            final_loss=0.5,
        )
        for s, m in ((3.0, 100), (1.0, 300), (2.0, 200))
    ] + [Row("mlp", "ws_sync", error="killed")]
    merged = merge_rounds(rounds)
    assert (merged.step_s, merged.optimizer_s, merged.peak_rss_bytes) == (2.0, 1.0, 300)
    assert (merged.peak_rss_delta_bytes, merged.persistent_bytes) == (30, 3)
    assert (merged.persistent_bytes_all_ranks, merged.gather_bytes_per_rank) == (6, 12)
    assert (merged.floor_forward_backward_s, merged.floor_optimizer_s) == (0.25, 0.5)
    assert merged.floor_s == 0.75
    unknown = from_ranks("mlp", "ddp_torch_muon", [_rank(None, 1)])  # no persistent figure
    assert merge_rounds([unknown, unknown]).persistent_bytes is None
    assert merged.error is None
    assert merge_rounds([Row("mlp", "x", error="boom")]).error == "boom"


def test_optimizer_state_bytes_counts_each_tensor_once() -> None:
    p = torch.nn.Parameter(torch.zeros(10, 10))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    # exp_avg, exp_avg_sq (400 B each) and the fp32 step counter (4 B)
    assert optimizer_state_bytes([opt]) == 804


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RSS is read from procfs")
def test_rss_is_positive_and_at_most_the_peak() -> None:
    rss = rss_bytes()
    assert rss is not None and 0 < rss <= peak_rss_bytes()


def test_persistent_bytes_sum_what_outlives_a_step() -> None:
    memory = dict(params=1, grads=2, masters=4, optimizer_state=8, transient_unit=100, later=1000)
    assert persistent_bytes(memory) == 15


def _floor_share(config: str) -> int:
    """How many of the bare model's params this rank's floor optimizers step, after checking
    each is a fresh copy holding a param's values and gradient."""
    workload = get_workload("mlp", quick=True)
    setup = build(CONFIGS[config], workload, WaitClock())
    model = (setup.bare_model or workload.make_model)()
    routes = route_params(model, workload.matrix_params)
    for r in routes:
        r.param.grad = torch.randn_like(r.param)
    optimizers = (setup.owned_optimizers or every_param)(routes)
    copies = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    for c in copies:
        assert all(c.data_ptr() != r.param.data_ptr() for r in routes)
        assert any(torch.equal(c, r.param) and torch.equal(c.grad, r.param.grad) for r in routes)
    return len(copies)


@pytest.mark.parametrize(
    "config, shares",
    [("ddp_torch_muon", [3, 3]), ("ddp_kj_muon", [2, 1]), ("ws_pipelined", [2, 1])],
)
def test_floor_steps_each_configurations_own_share(config: str, shares: list[int]) -> None:
    """`mlp --quick` has 3 matrices: torch DDP steps all on every rank, the round-robin and
    the plan split them 2 + 1."""
    if config == "ddp_kj_muon":
        pytest.importorskip("muon")
    assert launch(_floor_share, 2, (config,), start_method="fork", timeout=120) == shares


def test_only_a_missing_peer_package_makes_a_configuration_unavailable() -> None:
    for name in ("ws_sync", "ws_overlap", "ws_ping_pong", "ddp_torch_muon", "fsdp2_torch_muon"):
        assert unavailable(CONFIGS[name]) is None


def test_pipelined_fully_sharded_and_fp8_rows_sit_between_overlap_and_ping_pong() -> None:
    names = list(CONFIGS)
    i = names.index("ws_overlap")
    fully_sharded = ["ws_fully_sharded", "ws_fully_sharded_one_group"]
    fp8 = ["ws_fp8_mxfp8", "ws_fp8_tensorwise"]
    want = ["ws_pipelined", "ws_exchange", *fully_sharded, *fp8, "ws_ping_pong"]
    assert names[i + 1 : i + 8] == want
    assert CONFIGS["ws_exchange"].variant == Variant(strategy="exchange")
    overlap = dict(overlap_grad_reduce=True, overlap_param_gather=True)
    assert CONFIGS["ws_pipelined"].parallel == DataParallelConfig(pipelined_step=True, **overlap)
    assert CONFIGS["ws_fp8_tensorwise"].parallel.fp8_param_gather is True
    assert CONFIGS["ws_fp8_tensorwise"].fp8 == "tensorwise"
    assert CONFIGS["ws_fully_sharded"].parallel == DataParallelConfig(
        reshard_after_forward=True, **overlap
    )
    one_group = CONFIGS["ws_fully_sharded_one_group"]
    assert one_group.parallel == CONFIGS["ws_fully_sharded"].parallel
    assert one_group.variant == Variant(separate_all_gather_group=False)
    assert CONFIGS["ws_ping_pong"].variant == Variant(layout="ping_pong")
    assert CONFIGS["ddp_torch_muon"].parallel is None
    assert CONFIGS["ws_sync"].parallel.bucket_size is None  # the library's default


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_override_flags_parse_to_keywords_only_when_given() -> None:
    assert flag_overrides(_bench_args()) == {}
    assert flag_overrides(_bench_args("--bucket-size", "4096", "--shard-group-size", "auto")) == {
        "bucket_size": 4096,
        "shard_group_size": "auto",
    }
    assert flag_overrides(_bench_args("--no-overlap-grad-reduce")) == {"overlap_grad_reduce": False}
    args = _bench_args("--reshard-after-forward", "--overlap-param-gather")
    assert flag_overrides(args) == {"reshard_after_forward": True, "overlap_param_gather": True}


def test_overrides_replace_wholeshard_keywords_only() -> None:
    fine = with_overrides("ws_overlap", {"bucket_size": 4096})
    assert fine.name == "ws_overlap"
    assert fine.parallel == DataParallelConfig(
        overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=4096
    )
    assert CONFIGS["ws_overlap"].parallel.bucket_size is None  # not mutated
    sharded = with_overrides("ws_fully_sharded_one_group", {"bucket_size": 4096})
    assert sharded.variant == CONFIGS["ws_fully_sharded_one_group"].variant
    for name in ("ddp_torch_muon", "fsdp2_torch_muon"):
        assert with_overrides(name, {"reshard_after_forward": True}) is CONFIGS[name]
    assert with_overrides("ws_sync", {}) is CONFIGS["ws_sync"]
    with pytest.raises(TypeError, match="no_such_mode"):
        with_overrides("ws_sync", {"no_such_mode": True})


def test_overrides_keep_a_configurations_fp8_recipe() -> None:
    """The bug one config object fixed: overriding a keyword rebuilt the FP8 rows without
    their recipe, so `DataParallel` saw fp8_param_gather=True on an unconverted model."""
    for name, recipe in (("ws_fp8_mxfp8", "mxfp8"), ("ws_fp8_tensorwise", "tensorwise")):
        sharded = with_overrides(name, {"reshard_after_forward": True})
        assert sharded.fp8 == recipe and sharded.parallel.fp8_param_gather
        assert sharded.parallel.reshard_after_forward


class _Stop(Exception):
    pass


def test_overrides_reach_the_data_parallel_call(monkeypatch) -> None:
    seen: dict = {}

    class Recorder:
        def __init__(self, module, config, _variant) -> None:
            seen["config"], seen["variant"] = config, _variant
            raise _Stop

    monkeypatch.setattr(builders, "DataParallel", Recorder)
    config = with_overrides("ws_fully_sharded_one_group", {"bucket_size": 4096})
    with pytest.raises(_Stop):
        build(config, get_workload("mlp", quick=True), WaitClock())
    got = seen["config"]
    assert (got.bucket_size, got.reshard_after_forward) == (4096, True)
    assert seen["variant"] == Variant(separate_all_gather_group=False)


def test_footer_names_the_overrides_in_effect() -> None:
    machine = bench_machine()
    plain = footer(machine, 2, 3, 1, 1)
    assert plain.startswith("2 gloo ranks x 1 thread(s) on cpu (2 cores)")
    assert "overrid" not in plain
    line = footer(machine, 2, 3, 1, 1, {"overlap_grad_reduce": False})
    assert line.startswith(plain) and "overlap_grad_reduce=False" in line


def test_a_configuration_rejecting_an_override_gets_an_error_row(
    monkeypatch, tmp_path, capfd
) -> None:
    """The ping-pong baseline rejects resharding: the row carries the error, no worker starts
    for it, the run goes on and its footer names the override."""
    out = tmp_path / "bench.json"
    argv = "--quick --workload mlp --config ws_ping_pong --reshard-after-forward --json".split()
    assert main(_bench_args(*argv, str(out))) == 0
    assert "overridden with reshard_after_forward=True" in capfd.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["overrides"] == {"reshard_after_forward": True}
    (row,) = doc["results"]
    assert "cannot take reshard_after_forward" in row["error"]


def test_registers_as_a_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="wholeshard")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--workload", "mlp", "--steps", "3", "--quick"])
    assert args.run is main and args.workload == "mlp" and args.steps == 3 and args.quick


def test_rejects_bad_input_without_starting_workers(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command", required=True))
    for flag, value in (
        ("--nproc", "0"),
        ("--nproc", "100000"),
        ("--steps", "0"),
        ("--repeat", "-1"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["bench", flag, value])
        assert exit_info.value.code == 2
        assert f"argument {flag}: expected an integer" in capsys.readouterr().err
    no_ws = ["bench", "--config", "ddp_torch_muon", "--no-overlap-grad-reduce"]
    assert main(parser.parse_args(no_ws)) == 2
    assert "--no-overlap-grad-reduce" in capsys.readouterr().err


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
