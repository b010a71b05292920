"""Run `wholeshard bench` and store its JSON in docs/results/bench.json (and its chart in
docs/images/bench.png), for `python tools/make_docs.py` to render the tables of
docs/benchmarks.md (and the bench excerpts in docs/memory_modes.md, docs/fp8.md and
docs/data_parallel.md).

    python tools/measure_bench.py [--results FILE] [--chart FILE | --no-chart] [BENCH FLAGS ...]

BENCH FLAGS default to `--workload all --repeat 3`. The bench's JSON records the machine and
`measured`: the date, the command, the step, warm-up and round counts.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "bench.json"
CHART = ROOT / "docs" / "images" / "bench.png"
DEFAULT_FLAGS = ["--workload", "all", "--repeat", "3"]


def main(argv: list[str] | None = None) -> int:
    ours = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ours.add_argument("--results", type=Path, default=RESULTS, help="where the JSON goes")
    ours.add_argument("--chart", type=Path, default=CHART, help="where the chart goes")
    ours.add_argument("--no-chart", action="store_true", help="draw no chart")
    paths, flags = ours.parse_known_args(sys.argv[1:] if argv is None else argv)
    flags = flags or DEFAULT_FLAGS
    if any(f in ("--json", "--png") for f in flags):
        sys.exit("measure_bench: --json and --png are set here (--results, --chart)")
    png = [] if paths.no_chart else ["--png", str(paths.chart)]
    paths.results.parent.mkdir(parents=True, exist_ok=True)
    bench = [sys.executable, "-m", "wholeshard", "bench", *flags, "--json", str(paths.results)]
    return subprocess.run([*bench, *png], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
