"""Regenerate the generated blocks of the docs: option tables from the code, results from JSON.

    python tools/make_docs.py           # rewrite every stale block in place
    python tools/make_docs.py --check   # exit 1 naming the stale blocks, change nothing

A generated block is everything between a marker line `<!-- make_docs: NAME -->` and the next
`<!-- /make_docs -->` in README.md or a page under docs/. NAME picks the generator (`BLOCKS`);
a block may appear on several pages. Option tables come from the dataclasses and their field
docstrings (`wholeshard.engine.config.DataParallelConfig`, `wholeshard.train.config`); results
tables come from the files under docs/results/, which only the `tools/measure_*.py` scripts
write, and each starts with a line naming when, where and how they were measured. Nothing here
imports torch or measures anything, so `--check` takes about a second (tests/test_docs.py runs
it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing it

from wholeshard.bench.report import fmt_mb, fmt_ratio, fmt_s  # noqa: E402
from wholeshard.cli.flags import field_docs, field_kind, flag_name  # noqa: E402

RESULTS = ROOT / "docs" / "results"
BLOCK = re.compile(r"(<!-- make_docs: (\S+) -->\n)(.*?)(<!-- /make_docs -->)", re.S)
REQUIRED = {
    "data-parallel-config": "docs/data_parallel.md",
    "train-flags": "docs/train.md",
    "train-jobfile": "docs/train.md",
    "train-make-train": "docs/train.md",
    "bench": "docs/benchmarks.md",
    "plans-recommended": "docs/planning.md",
    "plans-latency": "docs/planning.md",
    "exchange-model": "docs/planning.md",
    "exchange-choices": "docs/planning.md",
    "exchange-gloo": "docs/planning.md",
    "exchange-gpu": "docs/planning.md",
    "two-level": "docs/planning.md",
    "compat": "docs/compat.md",
}
"""Blocks that must exist (on that page): `--check` fails when a marker goes missing."""


# -- helpers ------------------------------------------------------------------------------------


def load(name: str) -> dict:
    """docs/results/NAME, parsed."""
    path = RESULTS / name
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(
            f"make_docs: {path.relative_to(ROOT)} is missing; measure it first"
        ) from None


def cell(text: object) -> str:
    """`text` made safe for one markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(head: list[str], align: str, rows: Iterable[list[object]]) -> list[str]:
    """A markdown table; `align` has one letter per column: l (left) or r (right)."""
    out = ["| " + " | ".join(head) + " |"]
    out.append("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return out


def type_text(cls: type, field: dataclasses.Field) -> str:
    """The field's choices where it has them (a `Literal`), else its annotation."""
    kind = field_kind(cls, field)
    if kind is not None and kind[1] is not None:
        choices = [f'`"{c}"`' for c in kind[1]]
        if "None" in str(field.type):
            choices.append("`None`")
        return " | ".join(choices)
    return f"`{field.type}`"


def default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


def measured(when: str, machine: dict, how: str, source: str, extra: str = "") -> str:
    """The header line of a results block: date, machine, software, command, source file."""
    where = f"{machine.get('cpu', '?')} ({machine.get('cores', '?')} cores)"
    if machine.get("gpu"):
        where = f"one {machine['gpu']}"
    software = f"torch {machine.get('torch', '?')}"
    if machine.get("python"):
        software += f", Python {machine['python']}"
    line = f"_Measured {when} on {where}, {software}; `{how}`"
    if extra:
        line += f"; {extra}"
    return line + f". Data: [{source}]({_link(source)})._"


def _link(source: str) -> str:
    """`source` (relative to the repository) as a link from a page under docs/."""
    return source.removeprefix("docs/")


# -- option tables ------------------------------------------------------------------------------


def data_parallel_config() -> list[str]:
    """Every `DataParallelConfig` field: name, type, default, docstring."""
    from wholeshard.engine.config import DataParallelConfig

    docs = field_docs(DataParallelConfig)
    rows = [
        [f"`{f.name}`", type_text(DataParallelConfig, f), default_text(f), docs.get(f.name, "")]
        for f in dataclasses.fields(DataParallelConfig)
    ]
    return table(["field", "type", "default", "meaning"], "llll", rows)


def train_flags() -> list[str]:
    """Every `wholeshard train` flag, section by section, from `TrainConfig` and the parser."""
    from wholeshard.cli import build_parser
    from wholeshard.engine.config import DataParallelConfig
    from wholeshard.train.config import PARALLEL_SET_BY_THE_JOB, SECTIONS, TrainConfig

    sections = {f.name: f for f in dataclasses.fields(TrainConfig)}
    train = next(
        p
        for a in build_parser()._subparsers._group_actions  # type: ignore[union-attr]
        for name, p in a.choices.items()
        if name == "train"
    )
    out: list[str] = []

    def rows_of(cls: type, prefix: str, skip: frozenset[str] = frozenset()) -> list[list[str]]:
        docs = field_docs(cls)
        rows = []
        for f in dataclasses.fields(cls):
            if f.name in skip or f.name in SECTIONS or field_kind(cls, f) is None:
                continue
            flag = flag_name(f)
            text = f"`{flag}`"
            if field_kind(cls, f)[0] is bool and f.default is not False:  # a --x/--no-x switch
                text += f", `--no-{flag[2:]}`"
            rows.append([text, f"`{prefix}{f.name}`", default_text(f), docs.get(f.name, "")])
        return rows

    def extras(dests: set[str]) -> list[list[str]]:
        """Flags the parser adds beyond the config's fields (in `cli/train.py`)."""
        rows = []
        for action in train._actions:
            flag = next((s for s in action.option_strings if s.startswith("--")), None)
            if flag in dests:
                default = "" if action.default in (None, False) else f"`{action.default}`"
                rows.append([f"`{flag}`", "", default, action.help or ""])
        return rows

    head, align = ["flag", "field", "default", "meaning"], "llll"
    out += ["### job", ""]
    job = extras({"--nproc", "--config", "--print-config"})
    out += table(head, align, job + rows_of(TrainConfig, ""))
    for name in SECTIONS:
        cls = sections[name].default_factory
        doc = " ".join((cls.__doc__ or "").split())
        if name == "parallel":
            doc = (
                "`DataParallelConfig` (see [data_parallel.md](data_parallel.md#options)), "
                "except the fields the job sets itself: "
                + ", ".join(f"`{n}`" for n in sorted(PARALLEL_SET_BY_THE_JOB))
                + ". Only with `--optimizer muon`."
            )
            rows = extras({"--overlap"}) + rows_of(
                DataParallelConfig, "parallel.", PARALLEL_SET_BY_THE_JOB
            )
        else:
            rows = rows_of(cls, name + ".")
        if name == "output":
            rows += extras({"--overwrite", "--json"})
        out += ["", f"### {name}", "", doc, ""]
        out += table(head, align, rows)
    return out


def train_jobfile() -> list[str]:
    """The job file of the default config, every key with its field's docstring
    (`wholeshard.train.jobfile.dumps`)."""
    from wholeshard.train.config import TrainConfig
    from wholeshard.train.jobfile import dumps

    return ["```toml", *dumps(TrainConfig(), docs=field_docs).splitlines(), "```"]


# -- results: wholeshard bench ----------------------------------------------------------------

BENCH_COLUMNS: list[tuple[str, str, Callable[[dict], str]]] = [
    ("step s", "step_s", lambda r: fmt_s(r["step_s"])),
    ("optimizer s", "optimizer_s", lambda r: fmt_s(r["optimizer_s"])),
    ("comm wait s", "comm_wait_s", lambda r: fmt_s(r["comm_wait_s"])),
    ("sent/rank MB", "bytes_sent_per_rank", lambda r: fmt_mb(r["bytes_sent_per_rank"])),
    ("gather MB/rank", "gather_bytes_per_rank", lambda r: fmt_mb(r["gather_bytes_per_rank"])),
    ("peak RSS MB", "peak_rss_bytes", lambda r: fmt_mb(r["peak_rss_bytes"])),
    ("peak RSS delta MB", "peak_rss_delta_bytes", lambda r: fmt_mb(r["peak_rss_delta_bytes"])),
    ("opt state MB", "optimizer_state_bytes", lambda r: fmt_mb(r["optimizer_state_bytes"])),
    ("persistent MB/rank", "persistent_bytes", lambda r: fmt_mb(r["persistent_bytes"])),
    (
        "persistent MB, all ranks",
        "persistent_bytes_all_ranks",
        lambda r: fmt_mb(r["persistent_bytes_all_ranks"]),
    ),
    (
        "vs ddp_torch_muon",
        "ratio_vs_ddp_torch_muon",
        lambda r: fmt_ratio(r["ratio_vs_ddp_torch_muon"]),
    ),
    ("floor s", "floor_s", lambda r: fmt_s(r["floor_s"])),
    ("vs floor", "ratio_vs_floor", lambda r: fmt_ratio(r["ratio_vs_floor"])),
    (
        "final loss",
        "final_loss",
        lambda r: "" if r["final_loss"] is None else f"{r['final_loss']:.5f}",
    ),
]


def bench_header(doc: dict) -> str:
    m, run = doc["machine"], doc.get("measured", {})
    threads = m.get("threads_per_rank", "?")
    extra = f"{doc['world_size']} gloo ranks x {threads} thread(s)"
    if run.get("steps"):
        extra += (
            f", medians of {run['steps']} steps after {run.get('warmup', '?')} warm-up, "
            f"{run.get('repeat', 1)} round(s)"
        )
    start, end = m.get("load_average_start"), m.get("load_average_end")
    if start and end:
        extra += f"; load average {start[0]:.2f} -> {end[0]:.2f}"
    if doc.get("overrides"):
        extra += "; every ws_* configuration overridden with " + ", ".join(
            f"{k}={v!r}" for k, v in doc["overrides"].items()
        )
    return measured(
        run.get("date", "(date not recorded)"),
        m,
        run.get("command", "wholeshard bench --json FILE"),
        "docs/results/bench.json",
        extra,
    )


def bench_rows(doc: dict, configs: list[str] | None = None) -> list[dict]:
    rows = [r for r in doc["results"] if configs is None or r["config"] in configs]
    if configs is not None:
        rows.sort(key=lambda r: (r["workload"], configs.index(r["config"])))
    return rows


def bench(doc: dict | None = None) -> list[str]:
    """Every row of the bench JSON, with every column some row has a value for."""
    doc = doc or load("bench.json")
    rows = bench_rows(doc)
    columns = [c for c in BENCH_COLUMNS if any(r.get(c[1]) is not None for r in rows)]
    full = [{c[1]: r.get(c[1]) for c in BENCH_COLUMNS} | r for r in rows]
    body = [
        [r["workload"], r["config"], *(c[2](r) for c in columns), r.get("error") or ""]
        for r in full
    ]
    head = ["workload", "config", *(c[0] for c in columns), "note"]
    out = [bench_header(doc), "", *table(head, "ll" + "r" * len(columns) + "l", body)]
    from wholeshard.bench.configs import CONFIGS

    absent = [name for name in CONFIGS if name not in {r["config"] for r in rows}]
    if absent:
        out += ["", "Configurations not in this run: " + ", ".join(f"`{n}`" for n in absent) + "."]
    return out


def bench_subset(configs: list[str], keys: list[str], versus: str) -> list[str]:
    """Some configurations and columns of the bench JSON, with step time relative to `versus`."""
    doc = load("bench.json")
    rows = bench_rows(doc, configs)
    base = {r["workload"]: r["step_s"] for r in rows if r["config"] == versus and r["step_s"]}
    columns = [c for c in BENCH_COLUMNS if c[1] in keys]
    head = ["workload", "config", "step s", f"vs {versus}", *(c[0] for c in columns)]
    body = []
    for r in rows:
        r = {c[1]: r.get(c[1]) for c in BENCH_COLUMNS} | r
        rel = r["step_s"] / base[r["workload"]] if r["step_s"] and r["workload"] in base else None
        body.append(
            [
                r["workload"],
                r["config"],
                fmt_s(r["step_s"]),
                fmt_ratio(rel),
                *(c[2](r) for c in columns),
            ]
        )
    return [bench_header(doc), "", *table(head, "llrr" + "r" * len(columns), body)]


def bench_memory() -> list[str]:
    return bench_subset(
        [
            "ws_sync",
            "ws_overlap",
            "ws_fully_sharded",
            "ws_fully_sharded_one_group",
            "fsdp2_torch_muon",
        ],  # fmt: skip
        [
            "comm_wait_s",
            "bytes_sent_per_rank",
            "gather_bytes_per_rank",
            "persistent_bytes",
            "persistent_bytes_all_ranks",
            "peak_rss_delta_bytes",
        ],  # fmt: skip
        "ws_overlap",
    )


def bench_fp8() -> list[str]:
    return bench_subset(
        ["ws_overlap", "ws_fp8_mxfp8", "ws_fp8_tensorwise"],
        ["bytes_sent_per_rank", "gather_bytes_per_rank", "persistent_bytes", "final_loss"],
        "ws_overlap",
    )


def bench_baselines() -> list[str]:
    return bench_subset(
        ["ws_sync", "ws_overlap", "ws_ping_pong"],
        [
            "comm_wait_s",
            "bytes_sent_per_rank",
            "gather_bytes_per_rank",
            "persistent_bytes",
            "final_loss",
        ],  # fmt: skip
        "ws_sync",
    )


# -- results: wholeshard train ----------------------------------------------------------------


def train_set(name: str) -> dict:
    doc = load("train.json")
    if name not in doc.get("sets", {}):
        raise SystemExit(
            f"make_docs: docs/results/train.json has no set {name!r}: run "
            f"python tools/measure_train.py --set {name}"
        )
    return doc["sets"][name]


def train_header(s: dict, set_name: str) -> str:
    m = s["machine"]
    extra = ""
    if m.get("load_average_start") is not None and m.get("load_average_end") is not None:
        extra = f"load average {m['load_average_start']:.2f} -> {m['load_average_end']:.2f}"
    return measured(
        s["date"],
        m,
        f"python tools/measure_train.py --set {set_name}",
        "docs/results/train.json",
        extra,
    )


def train_compare(set_name: str = "optimizers") -> list[str]:
    """Validation loss at a few steps of each run of a set of full-length runs, and when the
    first run reaches the others' final validation loss."""
    s = train_set(set_name)
    runs = s["runs"]
    steps = sorted({int(k) for r in runs for k in r["val_loss"]} - {0})
    shown = [st for st in steps if st in (50, 100, 150) or st == steps[-1]]
    best = {st: min(r["val_loss"][str(st)] for r in runs) for st in shown}
    body = []
    for r in runs:
        summary = r["summary"]
        losses = [r["val_loss"][str(st)] for st in shown]
        body.append(
            [
                f"`{r['command']}`",
                summary.get("matrix_optimizer") or summary["optimizer"],
                f"{summary['lr']:g}",
                summary["param_dtype"],
                " / ".join(
                    f"**{v:.3f}**" if v == best[st] and len(runs) > 1 else f"{v:.3f}"
                    for st, v in zip(shown, losses, strict=True)
                ),
            ]
        )
    head = ["run", "optimizer", "lr", "params", "val loss at step " + " / ".join(map(str, shown))]
    out = [train_header(s, set_name), "", *table(head, "llllr", body)]
    first = runs[0]
    for other in runs[1:]:
        target = other["val_loss"][str(steps[-1])]
        reached = [st for st in steps if first["val_loss"][str(st)] <= target]
        if reached:
            out += [
                "",
                f"`{first['command']}` reaches the final validation loss of "
                f"`{other['command']}` ({target:.3f}) by step {reached[0]} of {steps[-1]} "
                f"(evaluations every {steps[1] - steps[0]} steps).",
            ]
    return out


def train_make_train() -> list[str]:
    """The default job (`make train`) on each CPU kind measured: wall time and final loss."""
    kinds = load("train.json").get("per_cpu_kind", {}).get("make_train", {})
    if not kinds:
        raise SystemExit("make_docs: run python tools/measure_train.py --set make_train first")
    body = []
    for kind, s in sorted(kinds.items()):
        run, m = s["runs"][0], s["machine"]
        summary = run["summary"]
        minutes, seconds = divmod(round(run["seconds"]), 60)
        start = m.get("load_average_start")
        body.append(
            [
                kind,
                str(m["cores"]),
                f"{minutes} min {seconds:02d} s",
                f"{summary['final_val_loss']:.3f}",
                str(summary.get("newton_schulz")),
                summary["param_dtype"],
                f"{run['median_step_s'] * 1e3:.0f} ms",
                "" if start is None else f"{start:.1f}",
                f"{s['date']}, torch {m['torch']}",
            ]
        )
    head = ["CPU (bf16 matmul units)", "cores", "wall time", "final val loss", "newton-schulz",
            "compute", "median step", "load at start", "measured"]  # fmt: skip
    note = (
        "_`python tools/measure_train.py --set make_train` (the default job, 2 processes, from "
        "the command to its exit), one record per CPU kind; data: "
        "[docs/results/train.json](results/train.json)._"
    )
    return [note, "", *table(head, "lrrrllrrl", body)]


def train_transcript() -> list[str]:
    """What the default run printed (its first lines and its last)."""
    s = train_set("optimizers")
    run = s["runs"][0]
    if not run["printed"]:
        raise SystemExit("make_docs: the stored default run kept no output; measure it again")
    lines = [
        ln.replace(str(Path(run["summary"]["out"])), "runs/<timestamp>") for ln in run["printed"]
    ]
    return [train_header(s, "optimizers"), "", "```", "$ make train", *lines, "```"]


def train_modes() -> list[str]:
    """Median step time and time blocked on collectives, and the final loss, per mode."""
    s = train_set("modes")
    body = [
        [
            f"`{' '.join(r['flags'][4:]) or '(none: synchronous)'}`",
            fmt_s(r["median_step_s"]),
            f"{r['median_comm_wait_s']:.4f}",
            f"{r['summary']['final_loss']:.4f}",
            f"{r['summary']['final_val_loss']:.4f}",
        ]
        for r in s["runs"]
    ]
    head = ["flags (with --steps 100 --eval-every 100)", "median step s", "median comm wait s",
            "final loss", "final val loss"]  # fmt: skip
    return [train_header(s, "modes"), "", *table(head, "lrrrr", body)]


# -- results: plans ---------------------------------------------------------------------------

PADDING_TARGET, IMBALANCE_TARGET = 0.01, 1.10


def plans_doc() -> dict:
    return load("plans.json")


def plans_header(doc: dict) -> str:
    return measured(
        doc["date"],
        doc["machine"],
        "python tools/measure_plans.py",
        "docs/results/plans.json",
    )


def _plans_index(doc: dict) -> dict[tuple, dict]:
    return {
        (r["preset"], r["dp"], r["shard_group_size"], r["strategy"], r["bucket_rule"]): r
        for r in doc["rows"]
    }


def _ok(r: dict) -> bool:
    return r["padding_fraction"] <= PADDING_TARGET and r["ns_cost_imbalance"] <= IMBALANCE_TARGET


def _plan_cells(r: dict) -> list[str]:
    """Padding, imbalance (each marked ✗ where it misses its target), buckets, seconds."""
    padding, imbalance = r["padding_fraction"], r["ns_cost_imbalance"]
    return [
        f"{padding:.2%}" + (" ✗" if padding > PADDING_TARGET else ""),
        f"{imbalance:.3f}" + (" ✗" if imbalance > IMBALANCE_TARGET else ""),
        str(r["muon_buckets"]),
        f"{r['plan_seconds']:.2f}",
    ]


def recommended_k(doc: dict, index: dict, preset: str, dp: int, rule: str) -> tuple[int, bool]:
    """The largest measured k at which `balanced` meets both targets, else the smallest k."""
    ks = sorted(
        {r["shard_group_size"] for r in doc["rows"] if (r["preset"], r["dp"]) == (preset, dp)}
    )
    good = [k for k in ks if _ok(index[(preset, dp, k, "balanced", rule)])]
    return (max(good), True) if good else (ks[0], False)


def plans_table(rule: str, which: str) -> list[str]:
    """Both strategies side by side; `which`: the recommended k, or k = dp."""
    doc = plans_doc()
    index = _plans_index(doc)
    body = []
    for preset in doc["presets"]:
        for dp in doc["dps"]:
            if which == "recommended":
                k, reachable = recommended_k(doc, index, preset, dp, rule)
                k_cell = str(k) if reachable else f"{k} (targets unreachable)"
            else:
                k, k_cell = dp, str(dp)
            rows = [index[(preset, dp, k, s, rule)] for s in ("size_match", "balanced")]
            body.append([preset, dp, k_cell, f"{rows[0]['bucket_size']:,}", *_plan_cells(rows[0]),
                         *_plan_cells(rows[1])])  # fmt: skip
    head = ["preset", "dp", "k", "bucket size", "size_match: padding", "imbalance", "Muon buckets",
            "plan s", "balanced: padding", "imbalance", "Muon buckets", "plan s"]  # fmt: skip
    return [plans_header(doc), "", *table(head, "lrrr" + "r" * 8, body)]


def plans_every_k(presets: tuple[str, ...] = ("llama3-70b", "qwen3-30b-a3b")) -> list[str]:
    doc = plans_doc()
    index = _plans_index(doc)
    body = []
    for preset in presets:
        for dp in doc["dps"]:
            ks = sorted(
                {
                    r["shard_group_size"]
                    for r in doc["rows"]
                    if (r["preset"], r["dp"]) == (preset, dp)
                }
            )
            for k in ks:
                rows = [index[(preset, dp, k, s, "default")] for s in ("size_match", "balanced")]
                body.append([preset, dp, k, *_plan_cells(rows[0]), *_plan_cells(rows[1])])
    head = ["preset", "dp", "k", "size_match: padding", "imbalance", "Muon buckets", "plan s",
            "balanced: padding", "imbalance", "Muon buckets", "plan s"]  # fmt: skip
    return [plans_header(doc), "", *table(head, "lrr" + "r" * 8, body)]


def scale() -> list[str]:
    """What `plan_for` chooses for the presets at dp 8-1024, by default and with automatic
    shard groups."""
    doc = load("scale.json")
    gib = 1024**3
    body = []
    for r in doc["rows"]:
        groups = "auto" if r["shard_group_size"] else "dp"
        owner = f"{r['owner_buckets']} owner" if r["owner_buckets"] else "equal"
        body.append([
            r["preset"], r["dp"], groups, r["k"], r["strategy"],
            f"{r['buckets']} ({owner})",
            f"{r['largest_bucket'] / 1e6:,.0f}M / {r['bucket_limit'] / 1e6:,.0f}M",
            f"{r['padding_fraction']:.2%}", f"{r['ns_imbalance']:.3f}",
            "yes" if r["meets_targets"] else "no",
            f"{r['zero_optimizer_state_bytes'] / gib:.2f}",
            f"{r['fully_sharded_persistent_bytes'] / gib:.2f}",
            f"{r['fully_sharded_peak_transient_bytes'] / gib:.2f}",
            f"{r['plan_seconds']:.2f}",
        ])  # fmt: skip
    head = ["preset", "dp", "groups", "k", "strategy", "buckets", "largest / limit",
            "padding", "NS imbalance", "targets met", "ZeRO opt. state GiB",
            "fully sharded GiB", "peak transient GiB", "plan s"]  # fmt: skip
    how = "python tools/measure_scale.py"
    header = measured(doc["date"], doc["machine"], how, "docs/results/scale.json")
    return [header, "", *table(head, "lrlrlrrrrlrrrr", body)]


def plans_latency() -> list[str]:
    """Per preset and dp: the plan's collectives per step, priced (latency and bandwidth
    terms), and the busiest rank's Newton-Schulz time, beside FSDP2-style equal shards."""
    doc = load("latency.json")
    gib = 1024**3
    body = []
    for r in doc["rows"]:
        p, e = r["projection"], r["equal_shards"]
        body.append([
            r["preset"], r["dp"], f"{r['strategy']} (k {r['shard_group_size']})",
            f"{p['collectives']:,}", f"{p['bytes_sent'] / gib:,.1f}", f"{p['latency_s']:.3f}",
            f"{p['bandwidth_s']:.3f}", f"{p['newton_schulz_s']:.4f}",
            f"{e['collectives']:,}", f"{e['bytes_sent'] / gib:,.1f}", f"{e['latency_s']:.3f}",
            f"{e['bandwidth_s']:.3f}",
        ])  # fmt: skip
    head = ["preset", "dp", "plan", "collectives", "GiB sent", "latency s", "bandwidth s",
            "Newton-Schulz s", "equal shards: collectives", "GiB sent", "latency s",
            "bandwidth s"]  # fmt: skip
    how = "python tools/measure_latency.py"
    extra = f"priced on `{doc['fabric']}` with `{doc['gpu']}`"
    header = measured(doc["date"], doc["machine"], how, "docs/results/latency.json", extra)
    return [header, "", *table(head, "lrlrrrrrrrrr", body)]


DESIGNS = {
    "auto": "default before the exchange",
    "exchange": "exchange",
    "equal_shards": "equal shards (FSDP2 floor)",
    "dion": "dion-style (padded megabatches)",
}
"""The designs of the exchange model's table, in its order."""


def exchange_model() -> list[str]:
    """Per preset and dp: the default plan before the exchange, the exchange plan, equal
    shards and the dion-style form, priced under both bandwidth models."""
    doc = load("exchange-model.json")
    gib = 1024**3
    body = []
    for r in doc["rows"]:
        for key, words in DESIGNS.items():
            d = r["designs"][key]
            ns = d["newton_schulz_s"]
            bw = d["bandwidth_s"]
            steps = [d["latency_s"] + bw[m] + (ns or 0) for m in ("N", "P")]
            name = f"{words} ({r['auto_strategy']})" if key == "auto" else words
            body.append([
                r["preset"], r["dp"], name, f"{d['collectives']:,}", f"{d['latency_s']:.3f}",
                f"{d['bytes_sent'] / gib:,.1f}", f"{bw['N']:.3f}", f"{bw['P']:.3f}",
                "-" if ns is None else f"{ns:.4f}", f"{steps[0]:.3f}", f"{steps[1]:.3f}",
            ])  # fmt: skip
    head = ["preset", "dp", "design", "collectives", "latency s", "GiB sent", "bandwidth s (N)",
            "bandwidth s (P)", "Newton-Schulz s", "step s (N)", "step s (P)"]  # fmt: skip
    how = "python tools/measure_exchange_model.py"
    extra = f"priced on `{doc['fabric']}` with `{doc['gpu']}`"
    header = measured(doc["date"], doc["machine"], how, "docs/results/exchange-model.json", extra)
    return [header, "", *table(head, "lrlrrrrrrrr", body)]


def exchange_choices() -> list[str]:
    """Where the fastest of balanced, owners and exchange is not what `auto` picks at k = dp
    (from 64 ranks the exchange, balanced only where the exchange misses a target and it
    overshoots less), on every fabric."""
    doc = load("exchange-model.json")
    rows = [c for c in doc["choices"] if c["rule"] != c["winner"]]
    body = [
        [c["preset"], c["dp"], f"`{c['fabric']}`", c["rule"], c["winner"],
         *(f"{c['step_s'][s]:.3f}" for s in ("balanced", "owners", "exchange"))]
        for c in rows
    ]  # fmt: skip
    head = ["preset", "dp", "fabric", "rule picks", "fastest", "balanced step s",
            "owners step s", "exchange step s"]  # fmt: skip
    agree = len(doc["choices"]) - len(rows)
    how = "python tools/measure_exchange_model.py"
    extra = f"{agree} of {len(doc['choices'])} (preset, dp, fabric) agree"
    header = measured(doc["date"], doc["machine"], how, "docs/results/exchange-model.json", extra)
    return [header, "", *table(head, "lrlllrrr", body)]


def exchange_gloo() -> list[str]:
    """One bucket's reduction and gather, gloo on this CPU: reduce-scatter + exchange against
    today's owner groups."""
    doc = load("exchange-gloo.json")
    body = [
        [r["ranks"], r["mb"], r["matrices"], f"{r['owner_group_ms']:.1f}",
         f"{r['exchange_ms']:.1f}", f"{r['exchange_ms'] / r['owner_group_ms']:.2f}",
         f"{r['reduce_scatter_ms']:.1f}", f"{r['all_to_all_ms']:.1f}"]
        for r in doc["rows"]
    ]  # fmt: skip
    head = ["ranks", "MB", "matrices", "owner groups ms", "reduce-scatter + exchange ms",
            "ratio", "of which reduce-scatter + all-gather ms", "all-to-alls ms"]  # fmt: skip
    how = "python tools/measure_exchange.py"
    extra = f"median of {doc['repeats']}"
    header = measured(doc["date"], doc["machine"], how, "docs/results/exchange-gloo.json", extra)
    return [header, "", *table(head, "rrrrrrrr", body)]


def two_level() -> list[str]:
    """Per preset and dp: the default plan in one level and in two levels of a node, priced
    under both bandwidth models; the faster structure by step under each."""
    doc = load("two-level.json")
    body = []
    for r in doc["rows"]:
        steps = {}
        for node, d in r["levels"].items():
            ns, bw = d["newton_schulz_s"], d["bandwidth_s"]
            steps[node] = [d["latency_s"] + bw[m] + ns for m in ("N", "P")]
        for node, d in r["levels"].items():
            bw = d["bandwidth_s"]
            faster = ["yes" if steps[node][i] == min(s[i] for s in steps.values()) else ""
                      for i in (0, 1)]  # fmt: skip
            words = "one level" if node == "1" else f"two levels of {node}"
            body.append([
                r["preset"], r["dp"], f"{words} ({d['strategy']})", f"{d['collectives']:,}",
                f"{d['latency_s']:.3f}", f"{bw['N']:.3f}", f"{bw['P']:.3f}",
                f"{d['newton_schulz_s']:.4f}", f"{steps[node][0]:.3f}", f"{steps[node][1]:.3f}",
                *faster,
            ])  # fmt: skip
    head = ["preset", "dp", "groups", "collectives", "latency s", "bandwidth s (N)",
            "bandwidth s (P)", "Newton-Schulz s", "step s (N)", "step s (P)", "faster (N)",
            "faster (P)"]  # fmt: skip
    how = "python tools/measure_two_level.py"
    extra = f"priced on `{doc['fabric']}` with `{doc['gpu']}`"
    header = measured(doc["date"], doc["machine"], how, "docs/results/two-level.json", extra)
    return [header, "", *table(head, "lrlrrrrrrrll", body)]


def exchange_gpu() -> list[str]:
    """One exchange bucket on CUDA tensors (the GPU tier's row): its reduce-scatter, the
    all-to-alls and the all-gather, and the grads' direction over the reduce-scatter alone."""
    doc = load("exchange-gpu.json")
    phases = ("reduce_scatter_s", "to_owners_s", "from_owners_s", "all_gather_s")
    body = [
        [r["ranks"], r["backend"], r["mb"], f"{r['moved'] / r['numel']:.2f}",
         *(f"{1e3 * r[p]:.3f}" for p in phases), f"{r['exchange_over_reduce_scatter']:.2f}"]
        for r in doc["rows"]
    ]  # fmt: skip
    head = ["ranks", "backend", "MB", "moved / bucket", "reduce-scatter ms", "to owners ms",
            "back ms", "all-gather ms", "(reduce-scatter + to owners) / reduce-scatter"]  # fmt: skip  # noqa: E501
    extra = f"median of {doc['repeats']}"
    header = measured(
        doc["date"], doc["machine"], doc["command"], "docs/results/exchange-gpu.json", extra
    )
    return [header, "", *table(head, "rlrrrrrrr", body)]


# -- results: resident memory -----------------------------------------------------------------


def rss() -> list[str]:
    doc = load("rss.json")
    body = []
    for run in doc["runs"]:
        for w in run["workers"]:
            body.append(
                [
                    f"`{run['command']}`",
                    w["rank"],
                    f"{w['from_step']} -> {w['to_step']}",
                    f"{w['from_mib']:.1f} -> {w['to_mib']:.1f}",
                    f"{w['growth']:+.2%}",
                    f"{w['min_mib']:.1f} / {w['max_mib']:.1f}",
                ]
            )
    head = ["run", "worker", "steps", "RSS MiB", "change", "min / max MiB in between"]
    dates = " and ".join(sorted({run["date"] for run in doc["runs"]}))
    how = "python tools/measure_rss.py --steps N --from-step S -- TRAIN FLAGS"
    return [
        measured(dates, doc["runs"][-1]["machine"], how, "docs/results/rss.json"),
        "",
        *table(head, "lrrrrr", body),
    ]


# -- results: tested versions ------------------------------------------------------------------

COMPAT_COLUMNS = ("python", "torch", "transformers", "accelerate", "lightning", "trl", "datasets")


def compat() -> list[str]:
    """Each set `tools/measure_compat.py` tested: its date, main versions, result and the
    other packages' versions."""
    body, others = [], []
    for name in ("floors", "newest"):
        doc = load(f"compat-{name}.json")
        found = doc.get("versions", {})
        suites = "; ".join(
            f"{s['suite']}: {s['passed']} passed, {s['failed']} failed" for s in doc["suites"]
        )
        result = f"{doc['result']} ({suites})" if suites else doc["result"]
        body.append([name, doc["date"], *(found.get(c, "-") for c in COMPAT_COLUMNS), result])
        rest = ", ".join(f"{k} {v}" for k, v in found.items() if k not in COMPAT_COLUMNS)
        others.append(f"- {name}: {rest}")
    head = ["set", "date", *COMPAT_COLUMNS, "result"]
    source = "docs/results/compat-floors.json, compat-newest.json"
    line = f"_`python tools/measure_compat.py` (`make test-compat`). Data: {source}._"
    return [line, "", *table(head, "l" * len(head), body), "", "Other packages:", "", *others]


# -- the blocks -------------------------------------------------------------------------------

BLOCKS: dict[str, Callable[[], list[str]]] = {
    "data-parallel-config": data_parallel_config,
    "train-flags": train_flags,
    "train-jobfile": train_jobfile,
    "train-transcript": train_transcript,
    "train-compare": train_compare,
    "train-make-train": train_make_train,
    "train-fp8": lambda: train_compare("fp8"),
    "train-rules": lambda: train_compare("rules"),
    "train-newton-schulz": lambda: train_compare("newton_schulz"),
    "train-modes": train_modes,
    "bench": bench,
    "bench-memory": bench_memory,
    "bench-fp8": bench_fp8,
    "bench-baselines": bench_baselines,
    "plans-recommended": lambda: plans_table("default", "recommended"),
    "plans-recommended-40m": lambda: plans_table("40M", "recommended"),
    "plans-no-groups": lambda: plans_table("default", "no_groups"),
    "plans-every-k": plans_every_k,
    "plans-scale": scale,
    "plans-latency": plans_latency,
    "exchange-model": exchange_model,
    "exchange-choices": exchange_choices,
    "exchange-gloo": exchange_gloo,
    "exchange-gpu": exchange_gpu,
    "two-level": two_level,
    "rss": rss,
    "compat": compat,
}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def render(text: str, cache: dict[str, str]) -> tuple[str, list[str]]:
    """`text` with every block regenerated, and the names of the blocks that changed."""
    changed = []

    def replace(m: re.Match) -> str:
        name = m.group(2)
        if name not in BLOCKS:
            raise SystemExit(f"make_docs: unknown block {name!r}; known: {', '.join(BLOCKS)}")
        if name not in cache:
            cache[name] = "\n".join(BLOCKS[name]()) + "\n"
        if m.group(3) != cache[name]:
            changed.append(name)
        return m.group(1) + cache[name] + m.group(4)

    return BLOCK.sub(replace, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report stale blocks, write nothing")
    args = parser.parse_args(argv)
    cache: dict[str, str] = {}
    stale, found = [], {}
    for page in pages():
        text = page.read_text()
        new, changed = render(text, cache)
        rel = str(page.relative_to(ROOT))
        for m in BLOCK.finditer(text):
            found.setdefault(m.group(2), set()).add(rel)
        stale += [f"{rel}: {name}" for name in changed]
        if changed and not args.check:
            page.write_text(new)
    missing = [
        f"{page}: {name}" for name, page in REQUIRED.items() if page not in found.get(name, ())
    ]
    for line in missing:
        print(f"make_docs: missing block {line}", file=sys.stderr)
    if args.check:
        for line in stale:
            print(f"make_docs: stale block {line} (run python tools/make_docs.py)", file=sys.stderr)
        return 1 if stale or missing else 0
    for line in stale:
        print(f"make_docs: rewrote {line}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
