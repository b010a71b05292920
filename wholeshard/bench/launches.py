"""Kernel launches per step, counted with `torch.profiler` on one extra untimed step
(`wholeshard bench --count-launches`).

On every device the count is a proxy read from the aten ops the profiler records: the top-level
aten ops (no aten op above them: those Python, autograd's backward nodes or a hook called) that
run a kernel: not a view or an allocation (`NO_KERNEL`), and, for an op that may copy or not
(`MAYBE_COPY`: `to`, `reshape`, ...), one that calls an op that does. On CUDA it is about the
kernel launches of the step, since one top-level op launches one kernel or a few; on CPU, where
a bf16 `bmm` loops over its matrices in `addmm_` calls and a foreach op over its tensors,
counting every aten op would count those loops, and the top-level count is what a GPU would
launch. Collectives are not aten ops and do not count.

On CUDA the profiler also records the CUDA runtime and driver launch calls (`cudaLaunchKernel`,
`cuLaunchKernel`, ...: `LAUNCH_CALLS`), every kernel the process launched, NCCL's included:
`cuda_launches_per_step`. Each figure has an `optimizer_` part: what ran inside the
configuration's `step()` (every optimizer of the setup), marked with `OPTIMIZER_MARK`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

OPTIMIZER_MARK = "wholeshard.bench.optimizer_step"
"""The `record_function` range around the optimizer step of the profiled step."""

NO_KERNEL = frozenset(
    {
        # views and metadata
        "aten::alias",
        "aten::as_strided",
        "aten::broadcast_tensors",
        "aten::chunk",
        "aten::detach",
        "aten::diagonal",
        "aten::expand",
        "aten::expand_as",
        "aten::lift_fresh",
        "aten::mT",
        "aten::narrow",
        "aten::numpy_T",
        "aten::permute",
        "aten::resolve_conj",
        "aten::resolve_neg",
        "aten::select",
        "aten::slice",
        "aten::split",
        "aten::split_with_sizes",
        "aten::squeeze",
        "aten::t",
        "aten::transpose",
        "aten::unbind",
        "aten::unflatten",
        "aten::unsqueeze",
        "aten::view",
        "aten::view_as",
        "aten::_reshape_alias",
        "aten::_unsafe_view",
        # allocations
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::resize_",
        "aten::set_",
    }
)
"""Aten ops that run no kernel."""

MAYBE_COPY = frozenset(
    {"aten::contiguous", "aten::flatten", "aten::reshape", "aten::to", "aten::type_as"}
)
"""Aten ops that run a kernel only through an op they call (a copy), else return a view or their
input."""

LAUNCH_CALLS = ("cudaLaunch", "cuLaunch")
"""Name prefixes of the CUDA runtime and driver calls that launch a kernel."""


def _is_aten(event: Any) -> bool:
    return event.name.startswith("aten::")


def _ancestors(event: Any) -> Iterator[Any]:
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def runs_kernel(event: Any) -> bool:
    """Whether an aten op runs a kernel (module note). An op that runs one may call views and
    allocations (`mm` calls `resolve_conj`), so only `MAYBE_COPY` ops look at what they call."""
    if event.name in MAYBE_COPY:
        return any(runs_kernel(c) for c in event.cpu_children if _is_aten(c))
    return event.name not in NO_KERNEL


def is_top_level(event: Any) -> bool:
    """An aten op with no aten op above it."""
    return _is_aten(event) and not any(_is_aten(a) for a in _ancestors(event))


def in_optimizer(event: Any) -> bool:
    return any(a.name == OPTIMIZER_MARK for a in _ancestors(event))


def count(events: Iterable[Any], cuda: bool) -> dict[str, int | None]:
    """The step's figures (module note) from the profiler's events; the CUDA ones None unless
    `cuda`."""
    events = list(events)
    kernels = [e for e in events if is_top_level(e) and runs_kernel(e)]
    calls = [e for e in events if e.name.startswith(LAUNCH_CALLS)]
    return {
        "launches_per_step": len(kernels),
        "optimizer_launches_per_step": sum(map(in_optimizer, kernels)),
        "cuda_launches_per_step": len(calls) if cuda else None,
        "optimizer_cuda_launches_per_step": sum(map(in_optimizer, calls)) if cuda else None,
    }


FIELDS = tuple(count([], cuda=True))
"""The figures `count` returns, in order."""


class StepProfile:
    """Profiles the block (one training step) and sets `counts` on exit; `optimizer()` marks the
    optimizer step inside it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profile = profile(activities=activities)
        self.counts: dict[str, int | None] = {}

    def __enter__(self) -> StepProfile:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._profile.__exit__(*exc)
        if exc[0] is None:
            self.counts = count(self._profile.events(), self.cuda)

    @staticmethod
    def optimizer() -> record_function:
        return record_function(OPTIMIZER_MARK)
