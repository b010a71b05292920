"""Rows of results: aggregation over ranks, the agreement check, markdown (the table and its
footer) and JSON output.

Aggregation: each rank reports medians over its timed steps; a row takes the largest value over
ranks (the slowest rank sets the pace; memory is what the fullest rank needs, counts what the
busiest rank runs), except `persistent_bytes_all_ranks`, the sum over ranks; `floor_s` is the
sum of its two parts, each the largest over ranks (`floor.py`). A size some rank cannot report
is None. With several rounds, a row's times are medians over rounds, its sizes and counts the
largest. Final losses are global means, equal on every rank. Ratios and rates (`fill_ratios`)
are computed from a row's final figures.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .configs import KJ_RULE, REFERENCE
from .machine import (
    SLOW_BF16,
    machine,  # noqa: F401  (its home before machine.py; tools import it here)
)

LOSS_RTOL = 1e-2
"""Final losses agree when within this relative distance of the reference's (module note)."""


def _per_rank() -> Any:
    """A `Row` field each rank reports (`from_ranks`)."""
    return field(default=None, metadata={"per_rank": True})


@dataclass
class Row:
    """One workload x configuration result; the JSON schema, field for field."""

    workload: str
    config: str
    step_s: float | None = _per_rank()
    optimizer_s: float | None = _per_rank()
    comm_wait_s: float | None = _per_rank()
    bytes_sent_per_rank: int | None = _per_rank()
    gather_bytes_per_rank: int | None = _per_rank()
    """The part of `bytes_sent_per_rank` sent by all-gathers and broadcasts
    (`TrafficCounter.gather_bytes`): param sync for wholeshard and `ddp_kj_muon`; see the note
    in `traffic.py` for what else it holds on DDP and FSDP2 rows."""
    peak_rss_bytes: int | None = _per_rank()
    peak_rss_delta_bytes: int | None = _per_rank()
    """Peak RSS minus the RSS just before the model was built: what the model, its optimizers
    and training (first use of their kernels included) added at the peak."""
    optimizer_state_bytes: int | None = _per_rank()
    persistent_bytes: int | None = _per_rank()
    """Params + grads + masters + optimizer state a wholeshard rank holds between steps, by
    `DataParallel.memory()`; None for other configurations."""
    persistent_bytes_all_ranks: int | None = None
    ratio_vs_ddp_torch_muon: float | None = None
    optimizer_share: float | None = None
    """`optimizer_s / step_s`: the optimizer step's share of a step."""
    torch_muon_owned_s: float | None = _per_rank()
    """The yardstick: `torch.optim.Muon` stepping the busiest rank's owned Muon matrices alone,
    each a param of its own, no collectives, in the same worker (`floor.py`)."""
    ratio_optimizer_vs_torch_muon: float | None = None
    """`optimizer_s / torch_muon_owned_s`: the configuration's whole optimizer step (its
    communication included) against torch's Muon on the same matrices alone."""
    ns_flops_per_step: int | None = _per_rank()
    """Newton–Schulz product flops of the busiest rank's owned matrices per step (`flops.py`)."""
    ns_tflops: float | None = None
    """`ns_flops_per_step / optimizer_s` in TFLOP/s: the rate over the whole optimizer step, so
    a lower bound on the Newton–Schulz kernels' own."""
    ns_peak_fraction: float | None = None
    """`ns_tflops` over the GPU's dense bf16 peak (`flops.bf16_peak_tflops`); None on CPU and
    on a GPU the table does not know."""
    max_memory_allocated_bytes: int | None = _per_rank()
    """`torch.cuda.max_memory_allocated` after the timed steps, fullest rank; None on CPU."""
    launches_per_step: int | None = _per_rank()
    """Kernel-running top-level aten ops of one step (`launches.py`); None without
    `--count-launches`."""
    optimizer_launches_per_step: int | None = _per_rank()
    """The part of `launches_per_step` inside the optimizer step."""
    cuda_launches_per_step: int | None = _per_rank()
    """CUDA kernel launch calls of one step (CUDA with `--count-launches` only)."""
    optimizer_cuda_launches_per_step: int | None = _per_rank()
    """The part of `cuda_launches_per_step` inside the optimizer step."""
    floor_forward_backward_s: float | None = _per_rank()
    """Forward + backward of one rank's micro-batch on the bare model, no communication."""
    floor_optimizer_s: float | None = _per_rank()
    """One optimizer step over the busiest rank's owned share alone, no collectives."""
    floor_s: float | None = None
    """The sum of the two: the part of a step no distributed scheme can remove (`floor.py`)."""
    ratio_vs_floor: float | None = None
    final_loss: float | None = None
    error: str | None = None
    rule: str = ""
    """The matrix rule's label (`configs.Rule.label`): "" for the default rule and for the
    rule-independent peers."""
    ratio_vs_kj_rule: float | None = None
    """`step_s` over that of `ddp_kj_rule` under the same rule: the rule distributed by
    wholeshard against the same rule run KJ-style (round-robin over replicated params)."""

    @property
    def name(self) -> str:
        """The configuration as tables and messages name it: `config[rule]` under a rule."""
        return f"{self.config}[{self.rule}]" if self.rule else self.config


_PER_RANK = tuple(f.name for f in fields(Row) if f.metadata.get("per_rank"))


def from_ranks(workload: str, config: str, ranks: list[dict[str, Any]], rule: str = "") -> Row:
    """Combine the per-rank figures of one run (under the rule labelled `rule`) into a row."""
    worst = {key: _largest([r[key] for r in ranks]) for key in _PER_RANK}
    persistent = [r["persistent_bytes"] for r in ranks]
    return Row(
        workload,
        config,
        **worst,
        persistent_bytes_all_ranks=None if None in persistent else sum(persistent),
        floor_s=worst["floor_forward_backward_s"] + worst["floor_optimizer_s"],
        final_loss=ranks[0]["final_loss"],
        rule=rule,
    )


def merge_rounds(rounds: list[Row]) -> Row:
    """One row from the same configuration's rows of several rounds: times (`*_s`) the medians
    over the successful rounds, sizes and counts the largest; the first error if none succeeded."""
    done = [r for r in rounds if r.error is None]
    if not done:
        return rounds[0]
    merged: dict[str, Any] = {}
    for key in (*_PER_RANK, "persistent_bytes_all_ranks", "floor_s"):
        values = [getattr(r, key) for r in done]
        merged[key] = _median(values) if key.endswith("_s") else _largest(values)
    return Row(
        done[0].workload, done[0].config, **merged, final_loss=done[0].final_loss, rule=done[0].rule
    )


def _largest(values: list[Any]) -> Any:
    """The largest of `values`, or None if any is None (a figure some process could not give)."""
    return None if None in values else max(values)


def _median(values: list[Any]) -> Any:
    """The median of `values`, or None if any is None."""
    return None if None in values else statistics.median(values)


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def fill_ratios(rows: list[Row], peak_tflops: float | None = None) -> None:
    """Set every successful row's ratios, optimizer share and Newton–Schulz rate (each `Row`
    field says what it is), the rate also against `peak_tflops`, the GPU's bf16 peak, if known."""
    reference = {r.workload: r.step_s for r in rows if r.config == REFERENCE and r.error is None}
    kj = {(r.workload, r.rule): r.step_s for r in rows if r.config == KJ_RULE and not r.error}
    for r in rows:
        if r.error is not None:
            continue
        r.ratio_vs_ddp_torch_muon = _ratio(r.step_s, reference.get(r.workload))
        r.ratio_vs_kj_rule = _ratio(r.step_s, kj.get((r.workload, r.rule)))
        r.ratio_vs_floor = _ratio(r.step_s, r.floor_s)
        r.optimizer_share = _ratio(r.optimizer_s, r.step_s)
        r.ratio_optimizer_vs_torch_muon = _ratio(r.optimizer_s, r.torch_muon_owned_s)
        if r.ns_flops_per_step and r.optimizer_s:
            r.ns_tflops = r.ns_flops_per_step / r.optimizer_s / 1e12
            r.ns_peak_fraction = _ratio(r.ns_tflops, peak_tflops)


def disagreements(rows: list[Row], rtol: float = LOSS_RTOL) -> list[str]:
    """A message for every row whose final loss is not within `rtol` of its workload's
    reference under its rule (`ddp_torch_muon`, or the median successful row of the rule if
    that failed or the rule is not the default)."""
    messages = []
    for workload, rule in dict.fromkeys((r.workload, r.rule) for r in rows):
        done = [r for r in rows if (r.workload, r.rule) == (workload, rule) and r.error is None]
        if len(done) < 2:
            continue
        ref = next((r for r in done if r.config == REFERENCE and not rule), None)
        ref_loss = ref.final_loss if ref else sorted(r.final_loss for r in done)[len(done) // 2]
        ref_name = REFERENCE if ref else "the median"
        for r in done:
            if abs(r.final_loss - ref_loss) > rtol * abs(ref_loss):
                messages.append(
                    f"{workload}/{r.name}: final loss {r.final_loss:.6g} differs from "
                    f"{ref_name}'s {ref_loss:.6g} by more than {rtol:.0%}"
                )
    return messages


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


def _cell(spec: str) -> Callable[[Any], str]:
    """A table cell's format: `spec` (`str.format`) of a figure, "" when unknown (None)."""
    return lambda x: "" if x is None else spec.format(x)


fmt_s = _cell("{:.3f}")
fmt_ratio = _cell("{:.2f}x")
fmt_count = _cell("{:,}")
fmt_share = _cell("{:.0%}")
_fmt_tflops = _cell("{:.2f}")
_fmt_peak = _cell("{:.1%}")
_fmt_loss = _cell("{:.5f}")

_COLUMNS = [
    ("step s", "step_s", fmt_s, "always"),
    ("optimizer s", "optimizer_s", fmt_s, "always"),
    ("opt share", "optimizer_share", fmt_share, "always"),
    ("comm wait s", "comm_wait_s", fmt_s, "always"),
    ("sent/rank MB", "bytes_sent_per_rank", fmt_mb, "always"),
    ("gather MB/rank", "gather_bytes_per_rank", fmt_mb, "always"),
    ("peak RSS MB", "peak_rss_bytes", fmt_mb, "always"),
    ("peak RSS delta MB", "peak_rss_delta_bytes", fmt_mb, "always"),
    ("opt state MB", "optimizer_state_bytes", fmt_mb, "always"),
    ("persistent MB/rank", "persistent_bytes", fmt_mb, "always"),
    ("vs ddp_torch_muon", "ratio_vs_ddp_torch_muon", fmt_ratio, "always"),
    ("floor s", "floor_s", fmt_s, "always"),
    ("vs floor", "ratio_vs_floor", fmt_ratio, "always"),
    ("torch Muon s", "torch_muon_owned_s", fmt_s, "always"),
    ("opt vs torch Muon", "ratio_optimizer_vs_torch_muon", fmt_ratio, "always"),
    ("max alloc MB", "max_memory_allocated_bytes", fmt_mb, "cuda"),
    ("NS TFLOP/s", "ns_tflops", _fmt_tflops, "cuda"),
    ("of bf16 peak", "ns_peak_fraction", _fmt_peak, "cuda"),
    ("launches/step", "launches_per_step", fmt_count, "given"),
    ("opt launches", "optimizer_launches_per_step", fmt_count, "given"),
    ("CUDA launches/step", "cuda_launches_per_step", fmt_count, "given"),
    ("opt CUDA launches", "optimizer_cuda_launches_per_step", fmt_count, "given"),
    ("vs ddp_kj_rule", "ratio_vs_kj_rule", fmt_ratio, "given"),
    ("final loss", "final_loss", _fmt_loss, "always"),
]
"""(header, `Row` field, cell format, when a table has the column: always, on `device="cuda"`,
or when some row has that figure)."""


def markdown(rows: list[Row], flagged: list[str], device: str = "cpu") -> str:
    """The results table (README-ready), one line per row, errors and disagreements noted; on
    `device="cuda"` with the GPU columns, and with launch counts when some row has them."""
    bad = {m.split(":", 1)[0] for m in flagged}
    columns = [
        (name, key, cell)
        for name, key, cell, when in _COLUMNS
        if when in ("always", device)
        or (when == "given" and any(getattr(r, key) is not None for r in rows))
    ]
    head = ["workload", "config", *(name for name, _, _ in columns), "note"]
    lines = [
        "| " + " | ".join(head) + " |",
        "|---|---|" + "---:|" * len(columns) + "---|",
    ]
    for r in rows:
        note = r.error or ("LOSS DISAGREES" if f"{r.workload}/{r.name}" in bad else "")
        note = note.replace("|", "\\|").replace("\n", " ")
        cells = [r.workload, r.name, *(cell(getattr(r, key)) for _, key, cell in columns), note]
        lines.append("| " + " | ".join(cells) + " |")
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
    where = f"{m['cpu']} ({m['cores']} cores)"
    if m.get("device") == "cuda":
        peak = m.get("gpu_bf16_peak_tflops")
        where += f", on {m['gpu']} (bf16 peak {'unknown' if peak is None else f'{peak:g} TFLOP/s'})"
    line = (
        f"{nproc} {m.get('backend', 'gloo')} ranks x {m['threads_per_rank']} thread(s) on "
        f"{where}, torch {m['torch']}; medians of {steps} steps after {warmup} "
        f"warm-up, {repeat} round(s); load average {m['load_average_start'][0]:.2f} -> "
        f"{m['load_average_end'][0]:.2f}"
    )
    if m.get("device", "cpu") == "cpu" and m.get("cpu_bf16_matmul") == SLOW_BF16:
        line += "; bf16 matmuls on a slow path (no AVX512-BF16, no AMX)"
    if overrides:
        keywords = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        line += f"; every wholeshard (ws_*) configuration overridden with {keywords}"
    return line
