"""Rows of results: aggregation over ranks, the agreement check, markdown (the table and its
footer) and JSON output.

Aggregation: each rank reports medians over its timed steps; a row takes the largest value over
ranks (the slowest rank sets the pace; memory is what the fullest rank needs), except
`persistent_bytes_all_ranks`, the sum over ranks; `floor_s` is the sum of its two parts, each
the largest over ranks (`floor.py`). A size some rank cannot report is None. With
several rounds, a row's times are medians over rounds, its sizes the largest. Final losses are
global means, equal on every rank.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

from .configs import REFERENCE

LOSS_RTOL = 1e-2
"""Final losses agree when within this relative distance of the reference's (module note)."""


@dataclass
class Row:
    """One workload x configuration result; the JSON schema, field for field."""

    workload: str
    config: str
    step_s: float | None = None
    optimizer_s: float | None = None
    comm_wait_s: float | None = None
    bytes_sent_per_rank: int | None = None
    gather_bytes_per_rank: int | None = None
    """The part of `bytes_sent_per_rank` sent by all-gathers and broadcasts
    (`TrafficCounter.gather_bytes`): param sync for wholeshard and `ddp_kj_muon`; see the note
    in `traffic.py` for what else it holds on DDP and FSDP2 rows."""
    peak_rss_bytes: int | None = None
    peak_rss_delta_bytes: int | None = None
    """Peak RSS minus the RSS just before the model was built: what the model, its optimizers
    and training (first use of their kernels included) added at the peak."""
    optimizer_state_bytes: int | None = None
    persistent_bytes: int | None = None
    """Params + grads + masters + optimizer state a wholeshard rank holds between steps, by
    `DataParallel.memory()`; None for other configurations."""
    persistent_bytes_all_ranks: int | None = None
    ratio_vs_ddp_torch_muon: float | None = None
    floor_forward_backward_s: float | None = None
    """Forward + backward of one rank's micro-batch on the bare model, no communication."""
    floor_optimizer_s: float | None = None
    """One optimizer step over the busiest rank's owned share alone, no collectives."""
    floor_s: float | None = None
    """The sum of the two: the part of a step no distributed scheme can remove (`floor.py`)."""
    ratio_vs_floor: float | None = None
    final_loss: float | None = None
    error: str | None = None


def from_ranks(workload: str, config: str, ranks: list[dict[str, Any]]) -> Row:
    """Combine the per-rank figures of one run into a row."""

    def worst(key: str) -> Any:
        return _largest([r[key] for r in ranks])

    persistent = [r["persistent_bytes"] for r in ranks]
    forward_backward, optimizer = worst("floor_forward_backward_s"), worst("floor_optimizer_s")
    return Row(
        workload=workload,
        config=config,
        step_s=worst("step_s"),
        optimizer_s=worst("optimizer_s"),
        comm_wait_s=worst("comm_wait_s"),
        bytes_sent_per_rank=worst("bytes_sent_per_rank"),
        gather_bytes_per_rank=worst("gather_bytes_per_rank"),
        peak_rss_bytes=worst("peak_rss_bytes"),
        peak_rss_delta_bytes=worst("peak_rss_delta_bytes"),
        optimizer_state_bytes=worst("optimizer_state_bytes"),
        persistent_bytes=_largest(persistent),
        persistent_bytes_all_ranks=None if None in persistent else sum(persistent),
        floor_forward_backward_s=forward_backward,
        floor_optimizer_s=optimizer,
        floor_s=forward_backward + optimizer,
        final_loss=ranks[0]["final_loss"],
    )


def merge_rounds(rounds: list[Row]) -> Row:
    """One row from the same configuration's rows of several rounds: times are medians over the
    successful rounds, sizes the largest; the first error if no round succeeded."""
    done = [r for r in rounds if r.error is None]
    if not done:
        return rounds[0]

    def median(key: str) -> float:
        return statistics.median(getattr(r, key) for r in done)

    def largest(key: str) -> int | None:
        return _largest([getattr(r, key) for r in done])

    return Row(
        workload=done[0].workload,
        config=done[0].config,
        step_s=median("step_s"),
        optimizer_s=median("optimizer_s"),
        comm_wait_s=median("comm_wait_s"),
        bytes_sent_per_rank=largest("bytes_sent_per_rank"),
        gather_bytes_per_rank=largest("gather_bytes_per_rank"),
        peak_rss_bytes=largest("peak_rss_bytes"),
        peak_rss_delta_bytes=largest("peak_rss_delta_bytes"),
        optimizer_state_bytes=largest("optimizer_state_bytes"),
        persistent_bytes=largest("persistent_bytes"),
        persistent_bytes_all_ranks=largest("persistent_bytes_all_ranks"),
        floor_forward_backward_s=median("floor_forward_backward_s"),
        floor_optimizer_s=median("floor_optimizer_s"),
        floor_s=median("floor_s"),
        final_loss=done[0].final_loss,
    )


def _largest(values: list[Any]) -> Any:
    """The largest of `values`, or None if any is None (a figure some process could not give)."""
    return None if None in values else max(values)


def fill_ratios(rows: list[Row]) -> None:
    """Set `ratio_vs_ddp_torch_muon` on every row whose workload has a reference time, and
    `ratio_vs_floor` on every row with a floor."""
    reference = {r.workload: r.step_s for r in rows if r.config == REFERENCE and r.error is None}
    for r in rows:
        ref = reference.get(r.workload)
        if r.error is None and ref:
            r.ratio_vs_ddp_torch_muon = r.step_s / ref
        if r.error is None and r.floor_s:
            r.ratio_vs_floor = r.step_s / r.floor_s


def disagreements(rows: list[Row], rtol: float = LOSS_RTOL) -> list[str]:
    """A message for every row whose final loss is not within `rtol` of its workload's
    reference (`ddp_torch_muon`, or the median successful row if that failed)."""
    messages = []
    for workload in dict.fromkeys(r.workload for r in rows):
        done = [r for r in rows if r.workload == workload and r.error is None]
        if len(done) < 2:
            continue
        ref = next((r for r in done if r.config == REFERENCE), None)
        ref_loss = ref.final_loss if ref else sorted(r.final_loss for r in done)[len(done) // 2]
        ref_name = REFERENCE if ref else "the median"
        for r in done:
            if abs(r.final_loss - ref_loss) > rtol * abs(ref_loss):
                messages.append(
                    f"{workload}/{r.config}: final loss {r.final_loss:.6g} differs from "
                    f"{ref_name}'s {ref_loss:.6g} by more than {rtol:.0%}"
                )
    return messages


def machine(nproc: int, forked: bool = False) -> dict[str, Any]:
    """What the numbers were measured on (`forked`: workers run one thread, see `launch`)."""
    import torch  # here, not at the top: the report's formatting serves tools without torch

    cores = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cores
    try:
        muon_version: str | None = metadata.version("muon-optimizer")
    except metadata.PackageNotFoundError:
        muon_version = None
    return {
        "cpu": _cpu_name(),
        "cores": cores,
        "usable_cores": usable,
        "threads_per_rank": 1 if forked else max(1, cores // nproc),
        "torch": torch.__version__,
        "muon_optimizer": muon_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backend": "gloo",
        "load_average_start": list(os.getloadavg()),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def to_json(
    machine_info: dict[str, Any],
    world_size: int,
    rows: list[Row],
    overrides: dict[str, Any] | None = None,
    measured: dict[str, Any] | None = None,
) -> str:
    """The `--json` document; `overrides` are the `DataParallelConfig` fields the run imposed on
    every wholeshard configuration (`{}` if none), `measured` when and how (date, command, step
    counts)."""
    doc = {
        "machine": machine_info,
        "measured": dict(measured or {}),
        "world_size": world_size,
        "overrides": dict(overrides or {}),
        "results": [asdict(r) for r in rows],
    }
    return json.dumps(doc, indent=2)


def fmt_mb(x: float | None) -> str:
    """Bytes as MB in a table cell ("" when unknown)."""
    return "" if x is None else f"{x / 1e6:.1f}"


def fmt_s(x: float | None) -> str:
    """Seconds in a table cell."""
    return "" if x is None else f"{x:.3f}"


def fmt_ratio(x: float | None) -> str:
    """A ratio in a table cell."""
    return "" if x is None else f"{x:.2f}x"


def markdown(rows: list[Row], flagged: list[str]) -> str:
    """The results table (README-ready), one line per row, errors and disagreements noted."""
    bad = {m.split(":", 1)[0] for m in flagged}
    lines = [
        "| workload | config | step s | optimizer s | comm wait s | sent/rank MB "
        "| gather MB/rank | peak RSS MB | peak RSS delta MB | opt state MB | persistent MB/rank "
        "| vs ddp_torch_muon | floor s | vs floor | final loss | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = fmt_ratio(r.ratio_vs_ddp_torch_muon)
        loss = "" if r.final_loss is None else f"{r.final_loss:.5f}"
        note = r.error or ("LOSS DISAGREES" if f"{r.workload}/{r.config}" in bad else "")
        note = note.replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {r.workload} | {r.config} | {fmt_s(r.step_s)} | {fmt_s(r.optimizer_s)} "
            f"| {fmt_s(r.comm_wait_s)} | {fmt_mb(r.bytes_sent_per_rank)} "
            f"| {fmt_mb(r.gather_bytes_per_rank)} | {fmt_mb(r.peak_rss_bytes)} "
            f"| {fmt_mb(r.peak_rss_delta_bytes)} | {fmt_mb(r.optimizer_state_bytes)} "
            f"| {fmt_mb(r.persistent_bytes)} | {ratio} | {fmt_s(r.floor_s)} "
            f"| {fmt_ratio(r.ratio_vs_floor)} "
            f"| {loss} | {note} |"
        )
    return "\n".join(lines)


def footer(
    machine_info: dict[str, Any],
    nproc: int,
    steps: int,
    warmup: int,
    repeat: int,
    overrides: dict[str, Any] | None = None,
) -> str:
    """The line under the table: machine, step counts, load, and any overrides in effect."""
    m = machine_info
    line = (
        f"{nproc} gloo ranks x {m['threads_per_rank']} thread(s) on {m['cpu']} "
        f"({m['cores']} cores), torch {m['torch']}; medians of {steps} steps after {warmup} "
        f"warm-up, {repeat} round(s); load average {m['load_average_start'][0]:.2f} -> "
        f"{m['load_average_end'][0]:.2f}"
    )
    if overrides:
        keywords = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        line += f"; every wholeshard (ws_*) configuration overridden with {keywords}"
    return line
