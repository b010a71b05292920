"""Optimizer-state offload on one GPU (the GPU tier, marker `cuda`): two ranks sharing the GPU
over gloo train the same model with and without `LayerwiseOptimizer(offload_state=True)`.

Asserted: the same bits; device memory between steps lower by what the optimizer reports in
host memory; the peak (`torch.cuda.max_memory_allocated`) lower; no host sync in a step.
Measured and printed, never asserted: peak and resident device memory and the step time of
each. Every test skips without CUDA.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist
from support import ADAMW_KW, MUON_KW, cuda_deterministic, data_parallel, mp, run_cuda
from torch import nn

import wholeshard

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WIDTH, LAYERS, BATCH = 1024, 16, 64
"""16 matrices of 1024 x 1024, one bucket each: a rank owns one matrix in each of 8 units, so
offloaded it holds at most 3 units' masters and state on the device instead of 8."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())]
    return nn.Sequential(*layers).cuda()


def _batch(g: torch.Generator) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, device="cuda", generator=g, dtype=torch.bfloat16)


def _train(offload: bool, ddp_kw: dict, steps: int = 6, warm: int = 2) -> dict:
    """Train `steps` on this rank's batches; device memory (above what the process held before:
    between steps, and the peak) and time over the steps after `warm`."""
    cuda_deterministic()
    gc.collect()
    before = torch.cuda.memory_allocated()
    rank = dist.get_rank()
    ddp = data_parallel(_model(), mp_policy=mp(torch.bfloat16), bucket_size=2 * WIDTH**2, **ddp_kw)
    opt = wholeshard.LayerwiseOptimizer(
        ddp, matrix=MUON_KW, adamw=ADAMW_KW, nonfinite=None, offload_state=offload
    )
    g = torch.Generator(device="cuda").manual_seed(rank)
    batches = [_batch(g) for _ in range(steps)]
    for x in batches[:warm]:  # the state exists after these
        ddp(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # frees blocks whose side-stream uses are done
    resident = torch.cuda.memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for x in batches[warm:]:
        ddp(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / (steps - warm)
    ddp.finish_param_sync()
    with ddp.full_params():
        params = {n: p.detach().cpu().clone() for n, p in ddp.module.named_parameters()}
    state = {}
    for key, entry in opt.state_dict()["state"].items():
        state[key] = {k: v.cpu().clone() for k, v in entry.items() if torch.is_tensor(v)}
    return {
        "params": params,
        "state": state,
        "resident": resident,
        "peak": torch.cuda.max_memory_allocated() - before,
        "step_s": seconds,
        "memory": ddp.memory(),
    }


def _with_and_without(ddp_kw: dict) -> tuple[dict, dict]:
    return _train(False, ddp_kw), _train(True, ddp_kw)


MODES = {
    "zero": dict(overlap_grad_reduce=True),
    "pipelined": dict(pipelined_step=True, overlap_grad_reduce=True, overlap_param_gather=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_offload_lowers_device_memory_with_the_same_bits(mode: str) -> None:
    for rank, (kept, offloaded) in enumerate(run_cuda(_with_and_without, 2, MODES[mode])):
        for name, value in kept["params"].items():
            assert torch.equal(value, offloaded["params"][name]), name
        for key, entry in kept["state"].items():
            for k, v in entry.items():
                assert torch.equal(v, offloaded["state"][key][k]), (key, k)
        host = offloaded["memory"]["host"]
        assert kept["memory"]["host"] == 0 and host > 0
        assert offloaded["memory"]["device"] == kept["memory"]["device"] - host
        assert offloaded["resident"] <= kept["resident"] - host
        assert offloaded["peak"] < kept["peak"]
        mib = 2**20
        print(
            f"{mode} rank {rank}: peak {kept['peak'] / mib:.1f} -> {offloaded['peak'] / mib:.1f} "
            f"MiB, between steps {kept['resident'] / mib:.1f} -> "
            f"{offloaded['resident'] / mib:.1f} MiB ({host / mib:.1f} MiB in host memory), "
            f"step {kept['step_s'] * 1e3:.2f} -> {offloaded['step_s'] * 1e3:.2f} ms"
        )


def _syncs(ddp_kw: dict) -> int:
    """Host-device syncs of two steady offloaded steps, by torch's sync debug mode."""
    import warnings

    cuda_deterministic()
    ddp = data_parallel(_model(), mp_policy=mp(torch.bfloat16), bucket_size=2 * WIDTH**2, **ddp_kw)
    opt = wholeshard.LayerwiseOptimizer(
        ddp, matrix=MUON_KW, adamw=ADAMW_KW, nonfinite=None, offload_state=True
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [_batch(g) for _ in range(4)]
    for x in xs[:2]:
        ddp(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for x in xs[2:]:
                ddp(x).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


@pytest.mark.parametrize("mode", list(MODES))
def test_offloaded_steps_do_not_sync_the_host(mode: str) -> None:
    [got] = run_cuda(_syncs, 1, MODES[mode], backend="nccl")
    assert got == 0
