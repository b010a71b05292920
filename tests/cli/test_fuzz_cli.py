"""Fuzzing the command line: every numeric flag of `train`, `plan` and `bench`, and `plan
--shapes` files. A bad value always exits 2 with one argparse-style error line on stderr naming
what is wrong, before any worker starts; never a traceback, never a hang.

The CLI runs in-process (`wholeshard.cli.main`). Launching is replaced by `Started`, so a value
the CLI accepts ends there instead of spawning training or a benchmark.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from wholeshard import cli
from wholeshard.cli import MAX_NPROC
from wholeshard.cli import plan as plan_tool

FUZZ = settings(max_examples=25, deadline=timedelta(seconds=30))
WATCHDOG_S = 120  # a call that takes this long is hung: fail instead of blocking the suite


class Started(Exception):
    """A launch or a training run would start here."""


@dataclass
class Result:
    code: int | str  # exit code, or "started"
    out: str
    err: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if "error:" in line]


def _start(*args, **kwargs):
    raise Started


@contextlib.contextmanager
def _watchdog(seconds: int) -> Iterator[None]:
    def fire(signum, frame):
        raise TimeoutError(f"the CLI call did not return within {seconds} s (hung)")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run(argv: list[str]) -> Result:
    """`wholeshard *argv` in this process, with launching replaced by `Started`. Any exception
    but SystemExit propagates, failing the test with its traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("wholeshard.distributed.launch.launch", _start))
        stack.enter_context(mock.patch("wholeshard.train.trainer.train", _start))
        stack.enter_context(mock.patch("wholeshard.bench.worker.preload", lambda: None))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        stack.enter_context(_watchdog(WATCHDOG_S))
        try:
            code: int | str = cli.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Started:
            code = "started"
    return Result(code, out.getvalue(), err.getvalue())


def assert_rejected(result: Result, *mentions: str) -> None:
    """Exit 2, nothing on stdout, one error line (after argparse's usage lines, if any) that
    names each of `mentions`."""
    assert result.code == 2, (result.code, result.err)
    assert result.out == ""
    assert "Traceback (most recent call last)" not in result.err
    lines = [line for line in result.err.splitlines() if line.strip()]
    (error,) = result.error_lines
    assert lines[-1] == error, result.err
    for line in lines[:-1]:
        assert line.startswith(("usage:", " ")), result.err  # argparse's usage block
    for mention in mentions:  # a flag may be named by its keyword (--dp: dp_size)
        keyword = mention.lstrip("-").replace("-", "_")
        assert mention in error or (mention.startswith("--") and keyword in error), (mention, error)


def assert_clean(result: Result) -> None:
    """Accepted (started, or exit 0), or rejected as `assert_rejected` says (the error may name
    another flag: `--nproc 3` is refused as `--batch-size 32` not splitting over 3 ranks)."""
    if result.code not in ("started", 0):
        assert_rejected(result)


# -- numeric flags ---------------------------------------------------------------------------------


def _subparser(command: str):
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return sub.choices[command]


def numeric_flags(command: str) -> list[str]:
    """Every flag of `command` whose value argparse converts to a number."""
    flags = []
    for action in _subparser(command)._actions:
        if not action.option_strings or action.type is None or action.choices is not None:
            continue
        try:
            value = action.type("1")
        except Exception:  # a string type that rejects "1" is not numeric either
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            flags.append(action.option_strings[-1])
    return flags


@dataclass(frozen=True)
class Flag:
    kind: type  # int or float
    low: float  # smallest valid value
    strict: bool = False  # low itself is invalid
    high: float | None = None  # largest valid value, if any
    good: str = "1"  # a value accepted with the base argv

    def below(self) -> st.SearchStrategy[str]:
        if self.kind is int:
            return st.integers(max_value=int(self.low) - (0 if self.strict else 1)).map(str)
        ceiling = self.low if self.strict else math.nextafter(self.low, -math.inf)
        return st.floats(max_value=ceiling, allow_nan=False, allow_infinity=False).map(repr)

    def above(self) -> st.SearchStrategy[str]:
        assert self.high is not None
        if self.kind is int:
            return st.integers(min_value=int(self.high) + 1).map(str)
        floor = math.nextafter(self.high, math.inf)
        return st.floats(min_value=floor, allow_nan=False, allow_infinity=False).map(repr)


TRAIN = {
    "--nproc": Flag(int, 1, high=MAX_NPROC, good="2"),
    "--threads": Flag(int, 1, high=1024),
    "--seq-len": Flag(int, 1, high=65536, good="64"),
    "--batch-size": Flag(int, 1, good="8"),
    "--steps": Flag(int, 1, good="20"),
    "--lr": Flag(float, 0.0, strict=True, good="0.01"),
    "--warmup": Flag(int, 0, high=300),  # at most --steps (300 by default)
    "--min-lr-ratio": Flag(float, 0.0, high=1.0, good="0.1"),
    "--weight-decay": Flag(float, 0.0, good="0.1"),
    "--clip-grad": Flag(float, 0.0, good="0.5"),
    "--bucket-size": Flag(int, 1, good="100000"),
    "--seed": Flag(int, 0, high=2**31 - 1, good="7"),
    "--checkpoint-every": Flag(int, 0, good="10"),
    "--keep-last": Flag(int, 1, good="2"),
    "--eval-every": Flag(int, 1, good="10"),
    "--eval-batches": Flag(int, 1, good="2"),
    "--log-every": Flag(int, 1, good="5"),
}
LAYOUT = {
    "--dp": Flag(int, 1, high=plan_tool.MAX_DP, good="4"),
    "--bucket-size": Flag(int, 1, good="1000"),
    "--shard-group-size": Flag(int, 1, good="2"),
    "--node-size": Flag(int, 1, good="2"),
}
BENCH = {
    "--nproc": Flag(int, 1, high=MAX_NPROC, good="2"),
    "--steps": Flag(int, 1, good="3"),
    "--repeat": Flag(int, 1, good="2"),
}
KNOWN = {"train": TRAIN, "plan": LAYOUT, "bench": BENCH}


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shapes")


@pytest.fixture(scope="module")
def base_argv(tmp_path_factory: pytest.TempPathFactory, shapes_dir: Path) -> dict[str, list[str]]:
    """Per command, flags that make a run valid apart from the one under test."""
    small = {
        "params": [{"name": f"h.{i}.weight", "shape": [16, 8], "matrix": True} for i in range(6)]
    }
    (shapes_dir / "small.json").write_text(json.dumps(small))
    out = tmp_path_factory.mktemp("train-out")
    return {
        "train": ["train", "--out", str(out), "--overwrite"],
        "plan": ["plan", "--shapes", str(shapes_dir / "small.json"), "--json"],
        "bench": ["bench", "--quick", "--workload", "mlp", "--config", "ws_sync"],
    }


def argv_with(base: dict[str, list[str]], command: str, flag: str, value: str) -> list[str]:
    argv = [*base[command], f"{flag}={value}"]
    if command == "plan" and flag != "--dp":
        argv.append("--dp=4")
    return argv


ALL_FLAGS = [(c, f) for c in KNOWN for f in numeric_flags(c)]
KNOWN_FLAGS = [(c, f) for c, flags in KNOWN.items() for f in flags]


@pytest.mark.parametrize("command", sorted(KNOWN))
def test_every_known_numeric_flag_exists(command: str) -> None:
    """The tables above cover real flags (a renamed flag fails here, not silently)."""
    assert set(KNOWN[command]) <= set(numeric_flags(command))


@pytest.mark.parametrize(("command", "flag"), KNOWN_FLAGS)
def test_a_good_value_is_accepted(base_argv, command: str, flag: str) -> None:
    """The harness can tell acceptance from rejection: a valid value goes through."""
    result = run(argv_with(base_argv, command, flag, KNOWN[command][flag].good))
    assert result.code in ("started", 0), result.err
    assert "error" not in result.err


def _not_a_number(text: str) -> bool:
    for kind in (int, float):
        try:
            kind(text)
            return False
        except (ValueError, OverflowError):
            pass
    return True


def _text(max_size: int) -> st.SearchStrategy[str]:
    # argparse itself turns `--flag=--` into an empty list, skipping the flag's type: not ours
    return st.text(max_size=max_size).filter(lambda v: v != "--")


GARBAGE = st.one_of(
    _text(30).filter(_not_a_number),
    st.sampled_from(["", " ", "nan", "NaN", "inf", "-inf", "+Infinity", "1e999", "-1e999"]),
    st.sampled_from(["0x10", "1,000", "1.2.3", "-", "=", "1 2", "\x00", "e3"]),
)


@pytest.mark.parametrize(("command", "flag"), ALL_FLAGS)
@FUZZ
@given(value=GARBAGE)
@example(value="9" * 5000)  # past Python's int-from-text digit limit
def test_non_numbers_are_rejected(base_argv, command: str, flag: str, value: str) -> None:
    assert_rejected(run(argv_with(base_argv, command, flag, value)), flag)


# plan --dp's random values plan up to MAX_DP ranks (14 s): slow; its bounds and worst cases
# stay fast (test_out_of_range_values_are_rejected, test_nastiest_values_name_the_flag)
@pytest.mark.parametrize(
    ("command", "flag"),
    [
        pytest.param(c, f, marks=pytest.mark.slow) if (c, f) == ("plan", "--dp") else (c, f)
        for c, f in ALL_FLAGS
    ],
)
@FUZZ
@given(value=st.one_of(st.integers().map(str), st.floats().map(repr), _text(12)))
@example(value="9" * 400)  # an int no float holds
@example(value="-" + "9" * 400)
@example(value="1e308")
@example(value=str(2**64))
def test_any_value_is_accepted_or_rejected_cleanly(
    base_argv, command: str, flag: str, value: str
) -> None:
    """Whatever the value: started (or exit 0) or one clean error line; never a traceback."""
    assert_clean(run(argv_with(base_argv, command, flag, value)))


@pytest.mark.parametrize(("command", "flag"), KNOWN_FLAGS)
@FUZZ
@given(data=st.data())
def test_out_of_range_values_are_rejected(base_argv, command: str, flag: str, data) -> None:
    spec = KNOWN[command][flag]
    strategies = [spec.below()] + ([spec.above()] if spec.high is not None else [])
    value = data.draw(st.one_of(strategies))
    assert_rejected(run(argv_with(base_argv, command, flag, value)), flag)


@pytest.mark.parametrize(("command", "flag"), KNOWN_FLAGS)
def test_int_flags_reject_fractions(base_argv, command: str, flag: str) -> None:
    if KNOWN[command][flag].kind is int:
        for value in ("1.5", "2.0", "1e3"):
            assert_rejected(run(argv_with(base_argv, command, flag, value)), flag)


def test_nastiest_values_name_the_flag(base_argv) -> None:
    """Explicit worst cases: huge counts that would start thousands of processes or plan for
    billions of ranks, and overflowing ints, all stop at the parser."""
    assert_rejected(run(argv_with(base_argv, "bench", "--nproc", str(10**6))), "--nproc")
    assert_rejected(run(argv_with(base_argv, "plan", "--dp", str(2**64))), "--dp")
    assert_rejected(run(argv_with(base_argv, "plan", "--dp", str(2**32))), "--dp")
    assert_rejected(run(argv_with(base_argv, "train", "--warmup", "9" * 400)), "--warmup")
    assert_rejected(run(argv_with(base_argv, "train", "--lr", "1e999")), "--lr")
    assert_rejected(run(argv_with(base_argv, "train", "--nproc", str(2**40))), "--nproc")
    odd = argv_with(base_argv, "train", "--nproc", "3")  # 32 sequences cannot split over 3
    assert_rejected(run(odd), "--batch-size")
    assert_rejected(run(argv_with(base_argv, "train", "--seed", str(2**31))), "--seed")


# -- plan --shapes files -----------------------------------------------------------------------

NAMES = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
DIMS = st.lists(st.integers(1, 64), max_size=4)
GOOD_ENTRY = st.fixed_dictionaries(
    {"name": NAMES, "shape": DIMS, "matrix": st.booleans()},
    optional={"tied": st.booleans()},
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
# An entry with one thing wrong: a field of the wrong type, a missing or unknown field, or a
# dim that is negative, zero, not an int, or too large for a tensor.
BAD_ENTRY = st.one_of(
    GOOD_ENTRY.flatmap(
        lambda e: st.sampled_from(["name", "shape", "matrix", "tied"]).flatmap(
            lambda field: JSON_VALUES.filter(lambda v: not _valid_field(field, v)).map(
                lambda v: {**e, field: v}
            )
        )
    ),
    GOOD_ENTRY.flatmap(
        lambda e: st.sampled_from(["name", "shape", "matrix"]).map(
            lambda field: {k: v for k, v in e.items() if k != field}
        )
    ),
    GOOD_ENTRY.map(lambda e: {**e, "dtype": "float32"}),
    st.tuples(GOOD_ENTRY, DIMS, st.integers(max_value=0), DIMS).map(
        lambda t: {**t[0], "shape": [*t[1], t[2], *t[3]]}
    ),
    st.tuples(GOOD_ENTRY, st.integers(2**63, 2**200)).map(lambda t: {**t[0], "shape": [t[1], 2]}),
    JSON_VALUES.filter(lambda v: not isinstance(v, dict)),
)


def _valid_field(field: str, value: object) -> bool:
    if field == "name":
        return isinstance(value, str) and value != ""
    if field == "shape":
        return isinstance(value, list) and all(
            type(d) is int and 0 < d for d in value
        )  # a shape of small dims is valid
    return isinstance(value, bool)


def write_shapes(directory: Path, document: object) -> str:
    path = directory / "fuzz.json"
    text = document if isinstance(document, str) else json.dumps(document)
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    return str(path)


def plan_shapes(path: str, dp: int = 4) -> Result:
    return run(["plan", "--shapes", path, f"--dp={dp}", "--json"])


def _unique(entries: list[dict]) -> list[dict]:
    seen: set[str] = set()
    return [e for e in entries if not (e["name"] in seen or seen.add(e["name"]))]


@FUZZ
@given(entries=st.lists(GOOD_ENTRY, max_size=12).map(_unique), dp=st.integers(1, 8))
def test_valid_shapes_files_plan_every_param(shapes_dir: Path, entries, dp: int) -> None:
    result = plan_shapes(write_shapes(shapes_dir, {"params": entries}), dp)
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    assert [p["name"] for p in doc["params"]] == [e["name"] for e in entries]
    assert [p["shape"] for p in doc["params"]] == [e["shape"] for e in entries]


@FUZZ
@given(
    before=st.lists(GOOD_ENTRY, max_size=4),
    bad=BAD_ENTRY,
    after=st.lists(st.one_of(GOOD_ENTRY, BAD_ENTRY), max_size=4),
)
def test_one_bad_entry_rejects_the_file(shapes_dir: Path, before, bad, after) -> None:
    before = _unique(before)
    index = len(before)
    path = write_shapes(shapes_dir, {"params": [*before, bad, *after]})
    result = plan_shapes(path)
    assert_rejected(result, "wholeshard plan: error:", path)
    # the first bad entry is the one reported (a duplicate name among `before` is ruled out)
    assert f"params[{index}]" in result.error_lines[0]


@FUZZ
@given(document=JSON_VALUES.filter(lambda v: not isinstance(v, dict) or "params" not in v))
@example(document={"params": {"name": "a", "shape": [2]}})
@example(document='{"params": [')
@example(document="[" * 100_000)  # deep nesting: json.loads hits the recursion limit
@example(document="\ud800")  # not valid UTF-8 on disk
def test_documents_without_a_params_list_are_rejected(shapes_dir: Path, document) -> None:
    path = write_shapes(shapes_dir, document)
    assert_rejected(plan_shapes(path), path)


@FUZZ
@given(entries=st.lists(GOOD_ENTRY, min_size=1, max_size=6), copy=st.data())
def test_duplicate_names_are_rejected(shapes_dir: Path, entries, copy) -> None:
    twin = copy.draw(st.sampled_from(entries))
    entries = [*entries, {**copy.draw(GOOD_ENTRY), "name": twin["name"]}]
    assert_rejected(plan_shapes(write_shapes(shapes_dir, {"params": entries})), "duplicate", "name")


def test_shapes_edge_cases(shapes_dir: Path) -> None:
    """Explicit worst cases."""

    def rejected(params: list, *mentions: str) -> None:
        assert_rejected(plan_shapes(write_shapes(shapes_dir, {"params": params})), *mentions)

    rejected([{"name": "w", "shape": [4, 0]}], "no elements")
    rejected([{"name": "w", "shape": [4, -3]}], "negative")
    rejected([{"name": "w", "shape": [True, 2]}], "list of ints")
    rejected([{"name": "w", "shape": [2.0, 2]}], "list of ints")
    rejected([{"name": "w", "shape": "4x4"}], "list of ints")
    rejected([{"name": "w", "shape": [10**30, 10**30]}], "more than a torch tensor")
    big = [{"name": n, "shape": [2**62], "matrix": False} for n in ("w", "v")]
    rejected(big, "together")
    # a stack of 2**38 matrices would take the planner days; refused up front
    rejected([{"name": "experts.w", "shape": [2] * 40, "matrix": True}], "matrices")
    rejected([{"name": "w", "shape": [4, 4], "matrix": "yes"}], "matrix")
    rejected([{"name": "", "shape": [4]}], "name")
    rejected([{"shape": [4]}], "missing field 'name'")
    rejected([{"name": "w"}], "missing field 'shape'")
    rejected([{"name": "w", "shape": [4, 4]}], 'missing field "matrix"', '"matrix": true')


def test_thousands_of_params_plan(shapes_dir: Path) -> None:
    params = [
        {"name": f"layers.{i}.w", "shape": [32 + i % 7, 16], "matrix": True} for i in range(3000)
    ]
    params += [{"name": f"layers.{i}.b", "shape": [16], "matrix": False} for i in range(3000)]
    result = plan_shapes(write_shapes(shapes_dir, {"params": params}), dp=8)
    assert result.code == 0, result.err
    assert len(json.loads(result.out)["params"]) == 6000
    # the same model as a stack is also accepted, matrices and elementwise params alike
    stacked = [{"name": "experts.w", "shape": [3000, 16, 8], "matrix": True}]
    assert plan_shapes(write_shapes(shapes_dir, {"params": stacked}), dp=8).code == 0
