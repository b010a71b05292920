"""Units of the bench's Muon and device figures: the matrix-optimizer configurations, the new
workloads, the torch-Muon yardstick, Newton–Schulz flops and GPU peaks, launch counting,
`--device cuda` (its CPU half: flags, the error without CUDA, the report's fields)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch
from support import bench_machine, bench_rank
from torch.utils.flop_counter import FlopCounterMode

from wholeshard.bench import launches, machine
from wholeshard.bench.builders import MATRIX_CLASSES, _aux_adam_groups, build, unavailable
from wholeshard.bench.configs import (
    CONFIGS,
    MATRIX_OPTIMIZERS,
    Rule,
    wholeshard,
    with_overrides,
)
from wholeshard.bench.floor import muon_matrices, torch_muon
from wholeshard.bench.flops import bf16_peak_tflops, ns_flops, total_ns_flops
from wholeshard.bench.report import Row, fill_ratios, footer, from_ranks, markdown, merge_rounds
from wholeshard.bench.timing import Timer, max_memory_allocated
from wholeshard.bench.wait_clock import WaitClock
from wholeshard.bench.workloads import get_workload
from wholeshard.cli import bench as cli
from wholeshard.distributed.launch import launch
from wholeshard.optim import BatchedMuon
from wholeshard.optim.pieces import MATRIX
from wholeshard.planning.routing import route_params

# -- configurations and workloads ----------------------------------------------------------


def test_batched_rows_are_ws_overlap_with_another_matrix_optimizer() -> None:
    for name, matrix in (("ws_batched_muon", "batched"), ("ws_batched_muon_fp32", "batched_fp32")):
        config = CONFIGS[name]
        assert config.parallel == CONFIGS["ws_overlap"].parallel
        assert config.matrix_optimizer == matrix and config.fp8 is None
        overridden = with_overrides(name, {"bucket_size": 4096})
        assert overridden.matrix_optimizer == matrix and overridden.parallel.bucket_size == 4096
    assert all(c.matrix_optimizer == "torch" for n, c in CONFIGS.items() if "batched" not in n)
    assert set(MATRIX_CLASSES) == set(MATRIX_OPTIMIZERS)
    with pytest.raises(ValueError, match="unknown matrix optimizer"):
        wholeshard("ws_x", "x", matrix_optimizer="adam")


def _built_optimizer(config: str) -> tuple[str, str, str, str]:
    """(class, matmul dtype) of the matrix optimizer a ws row steps with, and of its floor's."""
    workload = get_workload("many-matrices", quick=True)
    setup = build(CONFIGS[config], workload, WaitClock())
    (opt,) = setup.optimizers
    inner = opt._inner[MATRIX]
    model = setup.bare_model()
    routes = route_params(model, workload.matrix_params)
    for r in routes:
        r.param.grad = torch.randn_like(r.param)
    (share,) = setup.owned_optimizers(routes)
    return tuple(  # type: ignore[return-value]
        x for o in (inner, share) for x in (type(o).__name__, str(getattr(o, "matmul_dtype", None)))
    )


@pytest.mark.parametrize(
    "config, expected",
    [
        ("ws_overlap", ("Muon", "None")),
        ("ws_batched_muon", ("BatchedMuon", "torch.bfloat16")),
        ("ws_batched_muon_fp32", ("BatchedMuon", "torch.float32")),
    ],
)
def test_a_rows_matrix_optimizer_steps_its_training_and_its_floor(config, expected) -> None:
    built = launch(_built_optimizer, 2, (config,), start_method="fork", timeout=120)
    assert built == [expected * 2] * 2


def test_many_matrices_puts_every_matrix_in_the_loss() -> None:
    workload = get_workload("many-matrices", quick=True)
    model = workload.make_model()
    x, y = workload.local_batch(0, 0, 2)
    workload.loss(model(x), y).backward()
    routes = route_params(model, workload.matrix_params)
    assert len(routes) == 16 and all(r.matrix and r.param.ndim == 2 for r in routes)
    assert all(r.param.grad is not None and r.param.grad.abs().sum() > 0 for r in routes)
    assert not workload.stacked
    full = get_workload("many-matrices").make_model()
    assert [tuple(p.shape) for p in full.parameters()] == [(64, 64)] * 512


def test_experts_are_stacks_every_expert_in_the_loss() -> None:
    workload = get_workload("experts")
    model = workload.make_model()
    shapes = {
        r.name: (r.matrix, tuple(r.param.shape))
        for r in route_params(model, workload.matrix_params)
    }
    assert shapes == {
        "router": (True, (64, 64)),
        "up": (True, (64, 64, 64)),
        "down": (True, (64, 64, 64)),
    }
    assert workload.stacked
    x, y = workload.local_batch(0, 0, 2)
    workload.loss(model(x), y).backward()
    for p in (model.up, model.down):
        assert (p.grad.flatten(1).abs().sum(1) > 0).all()  # every expert got a gradient


def test_workloads_torchs_muon_or_fp8_cannot_run_are_unavailable_for_them() -> None:
    experts, mlp = get_workload("experts", True), get_workload("mlp", True)
    for name in ("ddp_torch_muon", "fsdp2_torch_muon"):
        assert "2-D params only" in unavailable(CONFIGS[name], experts)
        assert unavailable(CONFIGS[name], mlp) is None
    for name in ("ws_fp8_mxfp8", "ws_fp8_tensorwise"):
        assert "stacked params" in unavailable(CONFIGS[name], experts)
    for name in ("ws_sync", "ws_overlap", "ws_batched_muon", "ws_fully_sharded"):
        assert unavailable(CONFIGS[name], experts) is None


def test_a_workload_on_a_device_builds_and_batches_there() -> None:
    workload = get_workload("mlp", quick=True)
    assert workload.on(torch.device("cpu")) is workload
    meta = workload.on(torch.device("meta"))
    assert all(p.is_meta for p in meta.make_model().parameters())
    x, y = meta.local_batch(1, 1, 2)
    assert x.is_meta and y.is_meta and x.shape == workload.local_batch(1, 1, 2)[0].shape


# -- the yardstick and Newton-Schulz flops --------------------------------------------------


def test_yardstick_is_torch_muon_on_every_matrix_of_the_share_alone() -> None:
    matrix, stack, bias = torch.randn(4, 6), torch.randn(3, 5, 2), torch.randn(5)
    for p in (matrix, stack, bias):
        p.grad = torch.randn_like(p)
    share = [
        BatchedMuon([matrix], lr=0.1),
        SimpleNamespace(param_groups=_aux_adam_groups([stack], [])),  # MuonWithAuxAdam's
        torch.optim.AdamW([bias]),
    ]
    found = muon_matrices(share)
    assert [id(p) for p in found] == [id(matrix), id(stack)]
    (yardstick,) = torch_muon(found)
    assert type(yardstick) is torch.optim.Muon
    copies = yardstick.param_groups[0]["params"]
    expected = [matrix, *stack.unbind(0)]
    grads = [matrix.grad, *stack.grad.unbind(0)]
    assert len(copies) == 4
    for c, p, g in zip(copies, expected, grads, strict=True):
        assert torch.equal(c, p) and torch.equal(c.grad, g) and c.data_ptr() != p.data_ptr()
    before = [p.clone() for p in expected]
    yardstick.step()  # 2-D params only: torch's Muon takes them
    for c, p, b in zip(copies, expected, before, strict=True):
        assert torch.equal(p, b) and not torch.equal(c, b)  # the copies move, the share not
    assert torch_muon([]) == []


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32), (3, 16, 48)])
def test_ns_flops_are_what_torchs_and_batched_muons_steps_multiply(shape) -> None:
    """FlopCounterMode counts the matmul flops of a step: Newton–Schulz's and nothing else."""
    for cls in (torch.optim.Muon, BatchedMuon):
        params = [torch.nn.Parameter(t) for t in torch.randn(shape).reshape(-1, *shape[-2:])]
        for p in params:
            p.grad = torch.randn_like(p)
        counter = FlopCounterMode(display=False)
        with counter:
            cls(params, lr=0.02).step()
        assert counter.get_total_flops() == ns_flops(shape), cls.__name__
    assert total_ns_flops([shape, shape]) == 2 * ns_flops(shape)
    assert ns_flops((64, 64), steps=1) == 6 * 64**3
    assert ns_flops((5,)) == 0  # no matrix, no Newton-Schulz


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_bf16_peaks_by_device_name(name: str, peak: float | None) -> None:
    assert bf16_peak_tflops(name) == peak


def test_cpu_timer_is_the_wall_clock() -> None:
    timer = Timer(torch.device("cpu"))
    a, b = timer.stamp(), timer.stamp()
    assert isinstance(a, float) and timer.seconds(a, b) == b - a >= 0
    assert max_memory_allocated(torch.device("cpu")) is None


# -- launch counting -------------------------------------------------------------------------


def _event(name: str, parent=None) -> SimpleNamespace:
    e = SimpleNamespace(name=name, cpu_parent=parent, cpu_children=[])
    if parent is not None:
        parent.cpu_children.append(e)
    return e


def test_launches_count_top_level_ops_that_run_a_kernel() -> None:
    step = _event("ProfilerStep")
    linear = _event("aten::linear", step)  # a kernel, counted once with its children
    _event("aten::t", linear)
    addmm = _event("aten::addmm", linear)
    _event("cudaLaunchKernel", addmm)
    _event("aten::select", step)  # a view
    noop = _event("aten::to", step)  # a cast to what it already is
    copy = _event("aten::reshape", step)  # a reshape that copied
    _event("aten::_unsafe_view", _event("aten::clone", copy))
    backward = _event("MmBackward0", step)
    _event("aten::resolve_conj", _event("aten::mm", backward))  # a kernel calling a view
    opt = _event(launches.OPTIMIZER_MARK, step)
    lerp = _event("aten::_foreach_lerp_", _event("Optimizer.step#Muon.step", opt))
    _event("cuLaunchKernelEx", lerp)
    _event("cudaLaunchKernel", lerp)
    _event("aten::empty", opt)
    events = [step, *_walk(step)]
    assert not launches.runs_kernel(noop) and launches.runs_kernel(copy)
    assert launches.count(events, cuda=False) == {
        "launches_per_step": 4,  # linear, reshape, mm, _foreach_lerp_
        "optimizer_launches_per_step": 1,
        "cuda_launches_per_step": None,
        "optimizer_cuda_launches_per_step": None,
    }
    counts = launches.count(events, cuda=True)
    assert (counts["cuda_launches_per_step"], counts["optimizer_cuda_launches_per_step"]) == (3, 2)
    assert tuple(counts) == launches.FIELDS


def _walk(event):
    for c in event.cpu_children:
        yield c
        yield from _walk(c)


def _optimizer_launches(cls: type, n: int) -> int:
    params = [torch.nn.Parameter(torch.randn(32, 32)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = cls(params, lr=0.02)
    opt.step()  # the momentum buffers
    with launches.StepProfile(torch.device("cpu")) as profiled:
        with profiled.optimizer():
            opt.step()
    return profiled.counts["optimizer_launches_per_step"]


def test_profiled_launches_grow_per_matrix_for_torch_and_per_shape_for_batched() -> None:
    torch4, torch8 = (
        _optimizer_launches(torch.optim.Muon, 4),
        _optimizer_launches(torch.optim.Muon, 8),
    )
    batched4, batched8 = _optimizer_launches(BatchedMuon, 4), _optimizer_launches(BatchedMuon, 8)
    assert torch8 == 2 * torch4 and torch4 >= 4 * 20  # ~23 kernels per matrix, one by one
    assert batched8 == batched4 < torch4  # one batch whatever its size


# -- the report's new figures ------------------------------------------------------------------


def test_fill_ratios_adds_share_yardstick_ratio_and_ns_rate() -> None:
    rows = [
        Row(
            "m",
            "ws_a",
            step_s=2.0,
            optimizer_s=0.5,
            torch_muon_owned_s=1.0,
            ns_flops_per_step=10**12,
        ),
        Row("m", "ws_b", step_s=1.0, optimizer_s=1.0, torch_muon_owned_s=0.0, ns_flops_per_step=0),
        Row("m", "broken", error="boom", torch_muon_owned_s=1.0),
    ]
    fill_ratios(rows, peak_tflops=4.0)
    assert (rows[0].optimizer_share, rows[0].ratio_optimizer_vs_torch_muon) == (0.25, 0.5)
    assert (rows[0].ns_tflops, rows[0].ns_peak_fraction) == (2.0, 0.5)
    assert rows[1].optimizer_share == 1.0  # a share holding no matrix: no ratio, no rate
    assert (rows[1].ratio_optimizer_vs_torch_muon, rows[1].ns_tflops) == (None, None)
    assert rows[2].optimizer_share is None and rows[2].ratio_optimizer_vs_torch_muon is None
    fill_ratios(rows)  # no known peak
    assert rows[0].ns_tflops == 2.0 and rows[0].ns_peak_fraction is None


def test_new_figures_take_the_busiest_rank_and_the_largest_over_rounds() -> None:
    counted = dict(launches_per_step=50, optimizer_launches_per_step=20)
    a = bench_rank(
        torch_muon_owned_s=0.4, ns_flops_per_step=100, max_memory_allocated_bytes=7, **counted
    )
    b = bench_rank(torch_muon_owned_s=0.6, ns_flops_per_step=90, max_memory_allocated_bytes=9)
    b |= dict(launches_per_step=60, optimizer_launches_per_step=25)
    row = from_ranks("m", "ws_a", [a, b])
    assert (row.torch_muon_owned_s, row.ns_flops_per_step) == (0.6, 100)
    assert (row.max_memory_allocated_bytes, row.launches_per_step) == (9, 60)
    assert row.optimizer_launches_per_step == 25 and row.cuda_launches_per_step is None
    rounds = [
        from_ranks("m", "ws_a", [bench_rank(torch_muon_owned_s=t, launches_per_step=n)])
        for t, n in ((0.3, 5), (0.1, 7), (0.2, 6))
    ]
    merged = merge_rounds(rounds)
    assert (merged.torch_muon_owned_s, merged.launches_per_step) == (0.2, 7)
    assert merged.max_memory_allocated_bytes is None


def _columns(table: str) -> list[str]:
    return [c.strip() for c in table.splitlines()[0].strip("|").split("|")]


def test_markdown_adds_gpu_and_launch_columns_only_when_they_apply() -> None:
    row = Row("m", "ws_a", step_s=1.0, optimizer_s=0.5, torch_muon_owned_s=1.0, final_loss=1.0)
    row.ns_flops_per_step, row.max_memory_allocated_bytes = 3 * 10**12, 2 * 10**9
    fill_ratios([row], peak_tflops=60.0)
    cpu = markdown([row], [])
    assert "opt share" in _columns(cpu) and "opt vs torch Muon" in _columns(cpu)
    assert "NS TFLOP/s" not in cpu and "launches/step" not in cpu
    cuda = markdown([row], [], device="cuda")
    cols = _columns(cuda)
    cells = [c.strip() for c in cuda.splitlines()[2].strip("|").split("|")]
    assert len(cells) == len(cols) and len({line.count("|") for line in cuda.splitlines()}) == 1
    got = dict(zip(cols, cells, strict=True))
    assert (got["max alloc MB"], got["NS TFLOP/s"], got["of bf16 peak"]) == (
        "2000.0",
        "6.00",
        "10.0%",
    )
    assert (got["opt share"], got["opt vs torch Muon"]) == ("50%", "0.50x")
    row.launches_per_step, row.optimizer_launches_per_step = 12804, 11776
    counted = markdown([row], [])
    cells = [c.strip() for c in counted.splitlines()[2].strip("|").split("|")]
    got = dict(zip(_columns(counted), cells, strict=True))
    assert (got["launches/step"], got["opt launches"]) == ("12,804", "11,776")
    assert "CUDA launches/step" not in got


def test_footer_names_the_gpu_backend_and_peak() -> None:
    info = bench_machine(
        cores=16,
        device="cuda",
        backend="nccl",
        gpu="NVIDIA H100 80GB HBM3",
        gpu_bf16_peak_tflops=989.0,
    )
    line = footer(info, 1, 3, 1, 1)
    assert line.startswith("1 nccl ranks x 1 thread(s) on cpu (16 cores), on NVIDIA H100")
    assert "bf16 peak 989 TFLOP/s" in line
    assert "bf16 peak unknown" in footer(info | {"gpu_bf16_peak_tflops": None}, 2, 3, 1, 1)


def test_machine_names_the_gpu_and_its_peak(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    info = machine.machine(1, device="cuda", backend="nccl")
    assert (info["device"], info["backend"], info["gpu"], info["gpus"]) == (
        "cuda",
        "nccl",
        "NVIDIA H200",
        1,
    )
    assert info["gpu_bf16_peak_tflops"] == 989.0
    cpu = machine.machine(2)
    assert (cpu["device"], cpu["backend"]) == ("cpu", "gloo") and "gpu" not in cpu


# -- the command line ----------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_device_and_count_launches_flags(capsys) -> None:
    plain = _args()
    assert (plain.device, plain.count_launches) == ("cpu", False)
    args = _args("--device", "cuda", "--count-launches", "--workload", "many-matrices")
    assert (args.device, args.count_launches, args.workload) == ("cuda", True, "many-matrices")
    assert _args("--workload", "experts").workload == "experts"
    with pytest.raises(SystemExit) as exit_info:
        _args("--device", "tpu")
    assert exit_info.value.code == 2 and "--device" in capsys.readouterr().err


def test_device_cuda_without_cuda_fails_clearly_before_any_worker(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    started = []
    monkeypatch.setattr(cli, "_run_one", lambda *a, **k: started.append(a))
    assert cli.main(_args("--device", "cuda", "--quick", "--workload", "mlp")) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "CUDA is not available" in err
    assert not started


def test_backend_is_nccl_only_with_a_gpu_per_rank(monkeypatch) -> None:
    assert cli._backend("cpu", 4) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert (cli._backend("cuda", 1), cli._backend("cuda", 2)) == ("nccl", "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli._backend("cuda", 1) is None


def test_runs_pass_device_backend_and_counting_to_the_workers(monkeypatch, tmp_path) -> None:
    seen = []

    def fake_run_one(workload, config, nproc, steps, warmup, quick, imposed, *rest):
        seen.append((workload, config, rest))
        return Row(workload, config, error="not run"), []

    monkeypatch.setattr(cli, "_run_one", fake_run_one)
    argv = ["--quick", "--workload", "experts", "--config", "ws_sync", "--count-launches"]
    assert cli.main(_args(*argv, "--json", str(tmp_path / "b.json"))) == 0
    assert seen == [("experts", "ws_sync", ("cpu", "gloo", True, Rule(), True))]
