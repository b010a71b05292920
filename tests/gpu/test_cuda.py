"""The GPU tier (`make test-gpu`, marker `cuda`): what only a GPU can show, on one GPU.

Every test skips without CUDA, so `make test` stays green on CPU. Workers are spawned (CUDA does
not survive a fork) and run deterministic algorithms ([Note: deterministic GPU runs] in
`support.cuda_deterministic`), so the bitwise claims hold here as on CPU. Several ranks on one
GPU use gloo on CUDA tensors; NCCL needs a GPU per rank, so here it runs at world size 1 (what
needs two or more GPUs is listed in docs/gpu.md).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
from support import (
    ADAMW_KW,
    MAIN_MODES,
    MUON_KW,
    OVERLAP,
    assert_bitwise_equal,
    assert_matches,
    cuda_deterministic,
    data_parallel,
    lm_loss,
    local_batch,
    make_model,
    mp,
    reference_run,
    run_cuda,
    train_steps,
    wholeshard_run,
)
from torch import nn

import wholeshard
from wholeshard.fp8.formats import quantize_mxfp8, quantize_tensorwise

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(steps: int, **kw) -> dict:
    cuda_deterministic()
    return wholeshard_run(steps, device="cuda", **kw)


def test_nccl_at_world_size_1_matches_the_reference() -> None:
    [out] = run_cuda(_run, 1, 3, backend="nccl", ddp_kw=OVERLAP)
    cuda_deterministic()
    assert_matches(out, reference_run(3, device="cuda"))


@pytest.mark.parametrize("mode", list(MAIN_MODES))
def test_gloo_on_cuda_matches_the_reference(mode: str) -> None:
    outs = run_cuda(_run, 2, 3, ddp_kw=dict(bucket_size=3000, **MAIN_MODES[mode]))
    cuda_deterministic()
    ref = reference_run(3, device="cuda")
    for out in outs:
        assert_matches(out, ref)


def test_owner_buckets_of_several_owners_on_cuda_match_the_reference() -> None:
    """Owner buckets of 1 and 3 owners at 3 ranks: each bucket's reduces and broadcasts go as
    one coalesced group ([Note: owner collectives]) of CUDA tensors."""
    kw = dict(bucket_size=20000, strategy="owners", **OVERLAP)
    outs = run_cuda(_run, 3, 3, ddp_kw=kw)
    cuda_deterministic()
    ref = reference_run(3, device="cuda")
    for out in outs:
        assert_matches(out, ref)


@pytest.mark.parametrize(
    "ddp_kw",
    [OVERLAP, dict(pipelined_step=True, exchange_every=1, **OVERLAP)],
    ids=["overlap", "pipelined-per-bucket"],
)
def test_exchange_strategy_on_cuda_matches_the_reference(ddp_kw: dict) -> None:
    """The exchange's all-to-alls of CUDA tensors ([Note: exchange buffers]): NCCL at world
    size 1 (nothing to exchange), gloo at 3 ranks."""
    kw = dict(bucket_size=3000, strategy="exchange", **ddp_kw)
    [one] = run_cuda(_run, 1, 3, backend="nccl", ddp_kw=kw)
    outs = run_cuda(_run, 3, 3, ddp_kw=kw)
    cuda_deterministic()
    ref = reference_run(3, device="cuda")
    for out in [one, *outs]:
        assert_matches(out, ref)


def test_two_level_groups_on_cuda_match_the_reference() -> None:
    """Two-level groups of CUDA tensors ([Note: two-level groups]): 4 ranks in nodes of 2,
    fully sharded and overlapped, each bucket's second stage ordered after its first by a
    stream's wait; NCCL where each rank has a GPU, else gloo with the ranks sharing one."""
    backend = "nccl" if torch.cuda.device_count() >= 4 else "gloo"
    kw = dict(bucket_size=3000, strategy="exchange", node_size=2, reshard_after_forward=True)
    outs = run_cuda(_run, 4, 3, backend=backend, ddp_kw=dict(kw, **OVERLAP))
    cuda_deterministic()
    ref = reference_run(3, device="cuda")
    for out in outs:
        assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_overlap_and_fully_sharded_are_bitwise_sync_on_cuda(dtype: torch.dtype) -> None:
    kw = dict(param_dtype=dtype, evaluate=True)
    sync = run_cuda(_run, 2, 3, ddp_kw=dict(bucket_size=3000), **kw)
    for mode in ("overlap", "fully-sharded", "pipelined"):
        other = run_cuda(_run, 2, 3, ddp_kw=dict(bucket_size=3000, **MAIN_MODES[mode]), **kw)
        for a, b in zip(sync, other, strict=True):
            assert_bitwise_equal(a, b)


def _adamw_across_a_checkpoint(adamw: dict, path: str, via: str) -> dict:
    """Train 2 steps, save, build again, load, train 2 more; return the params."""
    cuda_deterministic()

    def build():
        ddp = wholeshard.DataParallel(make_model().cuda(), mp_policy=mp(torch.bfloat16))
        return ddp, wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW | adamw)

    ddp, opt = build()
    train_steps(ddp, opt, range(2))
    if via == "checkpoint":
        wholeshard.save_checkpoint(path, ddp, opt)
    saved = opt.state_dict()
    ddp, opt = build()
    if via == "checkpoint":
        wholeshard.load_checkpoint(path, ddp, opt)
    else:
        opt.load_state_dict(saved)
    steps = [s.get("step") for s in opt.state.values() if "step" in s]
    assert steps and all(s.device.type == "cuda" and s.dtype == torch.float32 for s in steps)
    train_steps(ddp, opt, range(2, 4))
    return {n: p.detach().float().cpu() for n, p in ddp.module.named_parameters()}


def _adamw_uninterrupted(adamw: dict) -> dict:
    cuda_deterministic()
    ddp = wholeshard.DataParallel(make_model().cuda(), mp_policy=mp(torch.bfloat16))
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW | adamw)
    train_steps(ddp, opt, range(4))
    return {n: p.detach().float().cpu() for n, p in ddp.module.named_parameters()}


@pytest.mark.parametrize("via", ["checkpoint", "state_dict"])
@pytest.mark.parametrize("adamw", [dict(fused=True), dict(capturable=True)], ids=str)
def test_fused_and_capturable_adamw_resume(adamw: dict, via: str, tmp_path) -> None:
    [resumed] = run_cuda(_adamw_across_a_checkpoint, 1, adamw, str(tmp_path), via, backend="nccl")
    [straight] = run_cuda(_adamw_uninterrupted, 1, adamw, backend="nccl")
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name


def _cpu_buffer_in_a_cuda_model() -> torch.Tensor:
    model = make_model().cuda()
    model.register_buffer("table", torch.full((4,), float(dist.get_rank())))  # stays on the CPU
    wholeshard.DataParallel(model)
    assert model.table.device.type == "cpu"
    return model.table


def test_a_cpu_buffer_of_a_cuda_model_gets_rank_0s_values() -> None:
    for table in run_cuda(_cpu_buffer_in_a_cuda_model, 2):
        assert torch.equal(table, torch.zeros(4))


def _quantized_on(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g) * torch.logspace(-8, 8, 128)
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-40, 448.0])
    out = []
    for t in (x, torch.zeros(8, 32), x.bfloat16().float()):
        tw = quantize_tensorwise(t.to(device))
        mx = quantize_mxfp8(t.to(device))
        out += [tw.data.view(torch.uint8), tw.scale, mx.data.view(torch.uint8), mx.scale]
    return [o.cpu() for o in out]


def test_fp8_quantization_on_cuda_is_bitwise_the_cpu_result() -> None:
    for cpu, gpu in zip(_quantized_on("cpu"), _quantized_on("cuda"), strict=True):
        assert torch.equal(cpu.reshape(-1).view(torch.uint8), gpu.reshape(-1).view(torch.uint8))


def test_tensorwise_scales_stay_on_the_device() -> None:
    q = quantize_tensorwise(torch.zeros(4, 4, device="cuda"))
    assert q.scale.device.type == "cuda" and q.scale.item() == 1.0


def _unused_params_on_cuda() -> tuple[torch.Tensor, torch.Tensor]:
    cuda_deterministic()
    model = make_model().cuda()
    model.unused = nn.Linear(32, 32).cuda()
    before = model.unused.weight.detach().clone()
    ddp = wholeshard.DataParallel(model)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        lm_loss(ddp, *local_batch(step, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    return before.cpu(), model.unused.weight.detach().cpu()


def test_a_param_without_gradient_is_not_stepped_on_cuda() -> None:
    for before, after in run_cuda(_unused_params_on_cuda, 2):
        assert torch.equal(before, after)


def _syncs_in_steps(nonfinite: str | None, ddp_kw: dict) -> int:
    """Host-device syncs of two steady steps (forward, backward, `opt.step()`), counted by
    torch's sync debug mode; the batches are on the GPU before."""
    import warnings

    ddp = data_parallel(make_model().cuda(), mp_policy=mp(torch.bfloat16), **ddp_kw)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW, nonfinite=nonfinite)
    train_steps(ddp, opt, range(2))  # warm: optimizer state exists
    batches = [[t.cuda() for t in local_batch(step, 0, 1)] for step in (2, 3)]
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for x, y in batches:
                lm_loss(ddp, x, y).backward()
                opt.step()
                opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only sync debug mode's own warning: set_sync_debug_mode also warns, once, that the mode is
    # a prototype that "does not yet detect all synchronizing operations".
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


@pytest.mark.parametrize("mode", ["overlap", "pipelined", "fully-sharded"])
@pytest.mark.parametrize(("nonfinite", "syncs"), [("error", 2), (None, 0)])
def test_steps_sync_the_host_once_or_never(nonfinite: str | None, syncs: int, mode: str) -> None:
    # With nonfinite set, the step check is read at once: one sync a step; with None, its
    # result is staged and read a step later: none ([Note: host syncs in a step]).
    [got] = run_cuda(_syncs_in_steps, 1, nonfinite, MAIN_MODES[mode], backend="nccl")
    assert got == syncs


def _stream_wait_is_counted() -> tuple[float, float]:
    from wholeshard.engine._waits import WaitTimer

    timer = WaitTimer(torch.device("cuda"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy for ~0.1 s on any GPU
    done = torch.cuda.Event()
    done.record(side)
    host = time.perf_counter()
    with timer.blocked():  # what NCCL's wait() does: the current stream waits, the host not
        torch.cuda.current_stream().wait_event(done)
    host = time.perf_counter() - host
    return timer.seconds, host


def test_comm_wait_counts_the_streams_idle_time_on_cuda() -> None:
    [(seconds, host)] = run_cuda(_stream_wait_is_counted, 1)
    assert seconds > 10 * host


def _saved_both_ways_on_cuda(blocking: str, background: str) -> int:
    cuda_deterministic()
    ddp = data_parallel(make_model().cuda())
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    train_steps(ddp, opt, range(2))
    wholeshard.save_checkpoint(blocking, ddp, opt, extra={"step": 2})
    saving = wholeshard.save_checkpoint(background, ddp, opt, extra={"step": 2}, blocking=False)
    train_steps(ddp, opt, range(2, 4))  # mutates what was staged (pinned) during the write
    saving.wait()
    again = wholeshard.save_checkpoint(background, ddp, opt, extra={"step": 4}, blocking=False)
    again.wait()  # (the second save reuses the pinned buffers)
    return saving.staged_bytes


def test_a_background_save_from_cuda_writes_what_a_blocking_one_does(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    staged = run_cuda(_saved_both_ways_on_cuda, 2, str(a), str(b))
    files = [json.loads((d / "step-2/wholeshard.json").read_text())["body"] for d in (a, b)]
    files = [f["files"] for f in files]
    assert all(f.pop(".metadata") for f in files) and files[0] == files[1]
    assert all(s > 0 for s in staged)
    assert (b / "latest").read_text() == "step-4\n"
