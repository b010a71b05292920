"""Test the versions pyproject.toml declares: fresh virtual environments for the declared floors
and for the newest releases, each running the core tier, the integration tests and the
checkpoint tests; the results go to docs/results/compat-SET.json.

    python tools/measure_compat.py [floors] [newest] [--python PY] [--keep]

- `floors`: every `>=X` of the project's dependencies and extras installed as `==X` (the
  constraints file it writes is `.compat/floors-constraints.txt`), on the lowest Python that
  `requires-python` admits (found as `pythonX.Y` on PATH or under pyenv's versions).
- `newest`: the newest release of every dependency and extra that pip resolves, torch
  included (on a CPU-only machine torch's default build, which runs on the CPU), with any
  site-wide pip constraint lifted for this environment alone.
Each set gets a new venv under `.compat/SET` (kept between runs with `--keep`, rebuilt
otherwise). An install that fails prints pip's own words, which name the package and version;
a test run that fails prints the failing tests and the set's versions. Exits 1 if any set
failed. `python tools/make_docs.py` renders docs/compat.md's table from the result files.
`make test-compat` runs both sets.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from result_file import write_results  # noqa: E402

try:
    import tomllib
except ImportError:  # Python 3.10: the dev extra's tomli
    import tomli as tomllib

COMPAT = ROOT / ".compat"
RESULTS = ROOT / "docs" / "results"
FRESH_DOCS = "tests/test_docs.py::test_generated_blocks_are_fresh"
SUITES = {
    "core tier": ["-m", "core", "--deselect", FRESH_DOCS],
    "integrations + checkpoints": ["tests/integrations", "tests/checkpoint", "-m", "not core"],
}
"""What each set runs: pytest arguments by name (the second skips what the first ran). The
docs' freshness is `make test`'s to check: the compat table is what this run rewrites. A test
module skipped whole fails its set: every extra is installed, so a skip means a package that
does not import (lightning 2.5 beside matplotlib 3.7.0 and numpy 2)."""
REPORTED = (
    "torch transformers tokenizers accelerate datasets safetensors trl lightning "
    "huggingface-hub numpy tqdm matplotlib muon-optimizer pytest hypothesis"
).split()
"""The packages whose installed versions a result names."""
PIP_TIMEOUT = 1800
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*>=\s*([^,;\s]+)\s*(;.*)?$")


def declared() -> tuple[list[str], list[str], str]:
    """pyproject.toml's requirement strings (dependencies and every extra), the extras' names
    and `requires-python`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    requirements = list(project["dependencies"])
    for names in extras.values():
        requirements += names
    return requirements, sorted(extras), project["requires-python"]


def floors(requirements: list[str]) -> list[str]:
    """One `name==X` constraint (with its marker) per `name>=X` requirement; the highest floor
    where a name is declared twice."""
    pins: dict[str, tuple[tuple[int, ...], str]] = {}
    for text in requirements:
        match = REQUIREMENT.match(text)
        if match is None:
            raise SystemExit(f"measure_compat: cannot read a floor from {text!r} (want name>=X)")
        name, version, marker = match.group(1).lower(), match.group(2), match.group(3) or ""
        key = tuple(int(p) for p in re.findall(r"\d+", version))
        if name not in pins or key > pins[name][0]:
            pins[name] = (key, f"{name}=={version}{marker}")
    return [line for _, line in pins.values()]


def lowest_python(requires: str) -> str:
    """The interpreter of the lowest Python `requires` (`>=3.X`) admits."""
    match = re.fullmatch(r">=\s*3\.(\d+)", requires.strip())
    if match is None:
        raise SystemExit(f"measure_compat: cannot read requires-python {requires!r}")
    minor = match.group(1)
    name = f"python3.{minor}"
    pyenv = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/3.{minor}.*/bin/{name}")))
    found = pyenv[-1] if pyenv else shutil.which(name)  # pyenv's own, not its shim
    if found is None:
        raise SystemExit(
            f"measure_compat: no {name} on PATH or under ~/.pyenv/versions: install it (pyenv "
            f"install 3.{minor}) or pass --python"
        )
    return found


def pip(venv: Path, args: list[str], constraint: Path) -> subprocess.CompletedProcess:
    """`pip ARGS` in `venv`, with `constraint` in place of any site-wide constraint file."""
    env = {**os.environ, "PIP_CONSTRAINT": str(constraint), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=PIP_TIMEOUT)
    except subprocess.TimeoutExpired:
        why = (
            f"pip found no set of versions in {PIP_TIMEOUT} s (its resolver backtracks without "
            f"end when pins conflict): the pins are in {constraint}; `uv pip compile -c "
            f"{constraint} pyproject.toml --all-extras` names the conflict in seconds\n"
        )
        return subprocess.CompletedProcess(cmd, 1, "", why)


def install(name: str, venv: Path, python: str, extras: list[str], pins: list[str]) -> str | None:
    """Make `venv` and install the project with every extra under `pins` (empty: the newest,
    upgrading everything); pip's error on failure, else None."""
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    constraint = COMPAT / f"{name}-constraints.txt"
    constraint.write_text("".join(f"{p}\n" for p in pins))
    upgrade = [] if pins else ["--upgrade", "--upgrade-strategy", "eager"]
    torch_first = pip(venv, [*upgrade, "torch"], constraint)  # torch alone first, as make does
    if torch_first.returncode != 0:
        return torch_first.stderr
    done = pip(venv, [*upgrade, "-e", f"{ROOT}[{','.join(extras)}]"], constraint)
    return done.stderr if done.returncode != 0 else None


def versions(venv: Path) -> dict[str, str]:
    """The installed versions of `REPORTED` in `venv` (absent ones left out)."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for n in sys.argv[1:]:\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code, *REPORTED],
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(done.stdout)
    py = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {"python": py.stdout.strip(), **found}


def run_suite(venv: Path, name: str, args: list[str]) -> dict:
    """pytest `args` in `venv`: counts, seconds and the failing tests."""
    slug = re.sub(r"\W+", "-", name)
    report = COMPAT / f"{venv.name}-{slug}.xml"
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    done = subprocess.run(
        [*cmd, *args, f"--junitxml={report}"], cwd=ROOT, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failing: list[str] = []
    unloaded: list[str] = []  # test modules skipped whole: a package that does not import
    if report.exists():
        for suite in ET.parse(report).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
            for case in suite.iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    failing.append(f"{case.get('classname')}::{case.get('name')}")
                skipped = case.find("skipped")
                if skipped is not None and not case.get("classname"):  # skipped at collection
                    unloaded.append(f"{case.get('name')}: {(skipped.text or '').strip()[-300:]}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    ok = done.returncode == 0 and not unloaded
    return {
        "suite": name,
        "pytest_args": args,
        "passed": passed,
        "failed": counts["failures"] + counts["errors"],
        "skipped": counts["skipped"],
        "seconds": round(seconds, 1),
        "ok": ok,
        "failing": failing,
        "modules_not_loaded": unloaded,
        "tail": "" if ok else done.stdout[-3000:],
    }


def measure(name: str, python: str, keep: bool) -> dict:
    requirements, extras, requires = declared()
    pins = floors(requirements) if name == "floors" else []
    venv = COMPAT / name
    COMPAT.mkdir(exist_ok=True)
    started = datetime.date.today().isoformat()
    reuse = keep and venv.exists()
    doing = "reusing" if reuse else f"installing into (with {python})"
    print(f"[{name}] {doing} {venv.relative_to(ROOT)}", file=sys.stderr)
    error = None if reuse else install(name, venv, python, extras, pins)
    doc: dict = {"set": name, "date": started, "requested": pins or ["newest of every package"]}
    if error is not None:
        print(f"[{name}] install FAILED:\n{error}", file=sys.stderr)
        return {**doc, "result": "install failed", "install_error": error[-3000:], "suites": []}
    doc["versions"] = versions(venv)
    said = ", ".join(f"{k} {v}" for k, v in doc["versions"].items())
    print(f"[{name}] {said}", file=sys.stderr)
    suites = []
    for suite, args in SUITES.items():
        result = run_suite(venv, suite, args)
        suites.append(result)
        state = "passed" if result["ok"] else "FAILED"
        print(
            f"[{name}] {suite}: {state}: {result['passed']} passed, {result['failed']} failed, "
            f"{result['skipped']} skipped in {result['seconds']} s",
            file=sys.stderr,
        )
        for test in result["failing"]:
            print(f"[{name}]   FAILED {test}", file=sys.stderr)
        for module in result["modules_not_loaded"]:
            print(f"[{name}]   NOT LOADED {module}", file=sys.stderr)
        if result["failing"] or result["modules_not_loaded"]:
            print(f"[{name}]   (these failed with {said})", file=sys.stderr)
    ok = all(s["ok"] for s in suites)
    return {**doc, "result": "passed" if ok else "failed", "suites": suites}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "sets", nargs="*", choices=["floors", "newest"], default=["floors", "newest"]
    )
    parser.add_argument(
        "--python", help="the interpreter (default: lowest for floors, this one for newest)"
    )
    parser.add_argument("--keep", action="store_true", help="reuse an existing .compat/SET venv")
    args = parser.parse_args(argv)
    failed = []
    for name in args.sets:
        _, _, requires = declared()
        python = args.python or (lowest_python(requires) if name == "floors" else sys.executable)
        doc = measure(name, python, args.keep)
        write_results(RESULTS / f"compat-{name}.json", doc, said=f"[{name}] {doc['result']}:")
        if doc["result"] != "passed":
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
