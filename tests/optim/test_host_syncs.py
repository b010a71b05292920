"""Host syncs in a training step ([Note: host syncs in a step] in `optim/_step_check.py`).

On CUDA a sync is the host reading a device tensor's values; the GPU tier proves the count with
`torch.cuda.set_sync_debug_mode("error")`. On the CPU every tensor is on the host, so this test
counts what it can see: every read of a tensor's values into Python (`item`, `tolist`, `bool`,
`int`, `float`, `index`, `numpy`, `nonzero`, `equal`) during a step's forward, backward and
`opt.step()`, leaving out the tensors that stay on the host on CUDA too: the step check's staged
result (pinned host memory) and torch's AdamW `step` counters (CPU tensors unless fused or
capturable). A read it cannot see: a blocking device-to-host `.to("cpu")` (a no-op here).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import (
    ADAMW_KW,
    MUON_KW,
    OVERLAP,
    SYNC,
    data_parallel,
    lm_loss,
    local_batch,
    make_model,
    run,
)

import wholeshard
from wholeshard.optim import _step_check

_READS = {
    torch.Tensor: ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy",
                   "nonzero"),
    torch: ("nonzero", "equal"),
}  # fmt: skip


class CountReads:
    """Counts reads of a tensor's values into Python inside it, on any thread and inside
    autograd hooks too (it patches the methods: a `TorchFunctionMode` is not active where the
    autograd engine calls hooks)."""

    def __init__(self, host: list[torch.Tensor]) -> None:
        self.host = host  # tensors that live on the host on CUDA too
        self.reads: list[str] = []
        self._saved: list[tuple[object, str, object]] = []

    def _counting(self, name: str, fn):
        def read(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if not any(any(t is h for h in self.host) for t in tensors):
                self.reads.append(name)
            return fn(*args, **kwargs)

        return read

    def __enter__(self) -> CountReads:
        for owner, names in _READS.items():
            for name in names:
                fn = getattr(owner, name)
                self._saved.append((owner, name, fn))
                setattr(owner, name, self._counting(name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)


def _reads_per_step(nonfinite: str | None, ddp_kw: dict, clip: bool) -> list[list[str]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = data_parallel(make_model(), **ddp_kw)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW, nonfinite=nonfinite)
    host: list[torch.Tensor] = []
    stage = _step_check.PendingCheck.stage

    def staging(self):
        out = stage(self)
        host.append(self.host)
        return out

    _step_check.PendingCheck.stage = staging
    per_step = []
    try:
        for step in range(4):
            host += [s["step"] for s in opt.state.values() if "step" in s]
            with CountReads(host) as counter:
                lm_loss(ddp, *local_batch(step, rank, world)).backward()
                if clip:
                    opt.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
            per_step.append(counter.reads)
    finally:
        _step_check.PendingCheck.stage = stage
    return per_step


MODES = {
    "sync": SYNC,
    "overlap": OVERLAP,
    "fully-sharded": dict(reshard_after_forward=True, **OVERLAP),
    "pipelined": dict(pipelined_step=True, **OVERLAP),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("nonfinite", "reads"), [(None, 0), ("error", 1), ("skip", 1)])
def test_a_step_reads_the_device_at_most_once(mode: str, nonfinite: str | None, reads: int):
    # Fully sharded with overlapped reductions over 2+ ranks reads one more value: which modules
    # every rank ran in this forward ([Note: collective order] in the engine's `_schedule`).
    reads += mode == "fully-sharded"
    for per_step in run(_reads_per_step, 2, nonfinite, MODES[mode], mode == "overlap"):
        # The first step creates the optimizers' state; from the second on, the steady state.
        assert [len(r) for r in per_step[1:]] == [reads] * 3, per_step
        assert all(set(r) == {"tolist"} for r in per_step[1:] if r), per_step
