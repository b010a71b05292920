"""`WaitTimer` ([Note] in `engine/_waits.py`): each wait counts as the larger of the host's
time and the current stream's (CUDA events), read when asked for. The CUDA half runs in the GPU
tier; here fake events stand in for CUDA's, so the bookkeeping is checked without clocks."""

from __future__ import annotations

import pytest
import torch

from wholeshard.engine import _waits
from wholeshard.engine._waits import WaitTimer


class FakeEvent:
    """A CUDA event whose completion and timing the test sets."""

    made: list[FakeEvent] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at_ms = 0.0
        self.done = False
        self.synchronized = False
        FakeEvent.made.append(self)

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized = self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at_ms - self.at_ms


def test_cpu_counts_the_host_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 10.5, 20.0, 20.25])
    monkeypatch.setattr(_waits.time, "perf_counter", lambda: next(clock))
    timer = WaitTimer(torch.device("cpu"))
    for _ in range(2):
        with timer.blocked():
            pass
    assert timer.seconds == 0.75


def test_cuda_counts_the_larger_clock_and_reads_events_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeEvent.made = []
    monkeypatch.setattr(_waits.torch.cuda, "Event", FakeEvent)
    clock = iter([0.0, 0.001, 5.0, 5.5])  # host: 1 ms (NCCL-like), then 500 ms (gloo-like)
    monkeypatch.setattr(_waits.time, "perf_counter", lambda: next(clock))
    timer = WaitTimer(torch.device("cuda", 0))
    with timer.blocked():
        pass
    FakeEvent.made[1].at_ms = 300.0  # the stream idled 300 ms
    with timer.blocked():
        pass
    FakeEvent.made[3].at_ms = 2.0
    assert not any(e.synchronized for e in FakeEvent.made)  # nothing read inside the waits
    assert timer.seconds == pytest.approx(0.3 + 0.5)
    assert FakeEvent.made[1].synchronized and FakeEvent.made[3].synchronized


def test_cuda_folds_only_completed_events_when_many_are_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeEvent.made = []
    monkeypatch.setattr(_waits.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(_waits, "_PENDING_LIMIT", 3)
    monkeypatch.setattr(_waits.time, "perf_counter", lambda: 0.0)
    timer = WaitTimer(torch.device("cuda", 0))
    for i in range(4):
        with timer.blocked():
            pass
        FakeEvent.made[-1].at_ms = 1000.0
        FakeEvent.made[-1].done = i < 2  # the last two are still running on the stream
    with timer.blocked():  # over the limit: the two completed pairs are folded in, unsynced
        pass
    assert len(timer._pending) == 3
    assert not any(e.synchronized for e in FakeEvent.made)
    FakeEvent.made[-1].at_ms = 1000.0
    assert timer.seconds == pytest.approx(5.0)
