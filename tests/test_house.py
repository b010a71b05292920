"""The shape of the package, checked: layers, private names, cycles, module size, and what the
command line and `import wholeshard` import.

Layers, lowest first; a package imports only itself or lower layers (never a peer):
planning (routing and plans, pure) -> distributed, fp8, models -> engine -> optim -> checkpoint
-> train, bench -> cli. A module never imports a private module or name of another package.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.core  # every house rule is in the fast tier

ROOT = Path(__file__).resolve().parent.parent / "wholeshard"
LAYERS = {
    "planning": 0,
    "distributed": 1,
    "fp8": 1,
    "models": 1,
    "engine": 2,
    "optim": 3,
    "checkpoint": 4,
    "capacity": 4,
    "train": 5,
    "bench": 5,
    "integrations": 5,
    "cli": 6,
}
MAX_LINES = 400


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (`wholeshard.engine._storage`)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every import in the module, at any level (function
    bodies and `TYPE_CHECKING` blocks included), relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found += [(target, alias.name) for alias in node.names]
    return found


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "wholeshard" else None


def edges() -> dict[str, set[str]]:
    """module -> the wholeshard modules it imports (a `from package import module` counts as
    importing the module)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        for module, imported in imports(name, path):
            if not module.startswith("wholeshard"):
                continue
            submodule = f"{module}.{imported}"
            targets.add(submodule if submodule in known else module)
        graph[name] = targets - {name}
    return graph


def test_layers_import_only_downward() -> None:
    wrong = []
    for name, targets in edges().items():
        here = package_of(name)
        if here not in LAYERS:  # wholeshard/__init__.py and __main__.py: the surface
            continue
        for target in targets:
            there = package_of(target)
            if there is None or there == here:
                continue
            if there not in LAYERS or LAYERS[there] >= LAYERS[here]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_private_name_of_another_package_is_imported() -> None:
    wrong = []
    for name, path in modules().items():
        here = package_of(name)
        for module, imported in imports(name, path):
            if package_of(module) in (None, here):
                continue
            private = [p for p in module.split(".")[2:] if p.startswith("_")]
            if private or (imported or "").startswith("_"):
                wrong.append(f"{name}: from {module} import {imported}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle() -> None:
    graph = edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    # A package's __init__ may re-export its own modules; that is not a cycle of concepts.
    cycles = [c for c in cycles if not all(m.startswith(c[0]) for m in c)]
    assert not cycles, cycles


def test_every_module_reads_in_a_sitting() -> None:
    long = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


BASELINE_NAMES = re.compile(r"ping.pong|unaligned|shard_broadcasts|param_sync\s*[=:]", re.I)
"""The legacy baselines' names: the bench's layouts (`wholeshard.bench.baselines`), never the
core's ([Note: layouts] in `wholeshard.planning.layouts`)."""


def test_the_core_names_no_legacy_baseline() -> None:
    """Every package but the bench holds the design and one extension point (layouts), no
    baseline's branch or name: the baselines are layouts the bench registers."""
    found = [
        f"{name}:{n}: {line.strip()}"
        for name, path in modules().items()
        if package_of(name) != "bench"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if BASELINE_NAMES.search(line)
    ]
    assert not found, "\n".join(found)


def test_top_level_holds_the_concepts_only() -> None:
    entries = {p.name for p in ROOT.iterdir() if p.name != "__pycache__"}
    assert entries == {"__init__.py", "__main__.py", "py.typed", *LAYERS}, entries


def _imported_by(*steps: str) -> list[set[str]]:
    """The modules loaded after each of `steps`, run in turn in one fresh interpreter."""
    show = "import sys; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", "\n".join(f"{step}\n{show}" for step in steps)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [set(line.split()) for line in out.stdout.splitlines()]


@pytest.mark.parametrize(
    "code",
    [
        "import wholeshard",
        "import wholeshard.cli as c; c.build_parser()",
        "from wholeshard.capacity.presets import PRESETS; from wholeshard.planning import "
        "plan_for; plan_for(PRESETS['gpt2-small'](), 8)",
        "from wholeshard.train.config import TrainConfig; TrainConfig()",
    ],
    ids=["import", "cli-parsers", "planning", "train-config"],
)
def test_what_needs_no_torch_imports_none(code: str) -> None:
    """`wholeshard --help`, every subcommand's `--help`, `wholeshard plan` and the train job's
    config answer without importing torch (seconds of start-up)."""
    [loaded] = _imported_by(code)
    assert "torch" not in loaded


def test_training_imports_dcp_only_to_save_or_load() -> None:
    """torch.distributed.checkpoint costs ~0.65 s to import: only checkpoints pay it."""
    trained, saved = _imported_by(
        "import wholeshard.train.trainer, wholeshard.cli.train",
        "from wholeshard import save_checkpoint",
    )
    assert "torch" in trained and "torch.distributed.checkpoint" not in trained
    assert "torch.distributed.checkpoint" in saved


def test_the_package_namespace_holds_its_public_names_only() -> None:
    """`dir(wholeshard)`: `__all__`, the public modules and `__version__`, each reachable
    (no `Any`, `TYPE_CHECKING`, `annotations`, `importlib`, nor the machinery imports bring in)."""
    code = (
        "import wholeshard; from wholeshard import DataParallel; "
        "print(' '.join(dir(wholeshard))); "
        "print(' '.join(type(getattr(wholeshard, n)).__name__ for n in dir(wholeshard)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    names, kinds = (line.split() for line in out.stdout.splitlines())
    import wholeshard

    modules = ["checkpoint", "distributed", "fp8", "integrations", "optim", "planning"]
    assert names == sorted([*wholeshard.__all__, *modules, "__version__"])
    assert [k for n, k in zip(names, kinds, strict=True) if n in modules] == ["module"] * 6


def test_the_gpu_check_runs_every_file_of_the_gpu_tier() -> None:
    """tools/gpu_check.sh names the GPU tier's files (shortest first, to fit a lent machine's
    time): every test file marked `cuda` must be among them."""
    tests = ROOT.parent / "tests"
    marked = {
        str(p.relative_to(ROOT.parent))
        for p in tests.rglob("test_*.py")
        if "pytest.mark.cuda" in p.read_text() and p.name != "test_house.py"
    }
    script = (ROOT.parent / "tools" / "gpu_check.sh").read_text()
    assert "tests/gpu/test_cuda.py" in marked
    assert {m for m in marked if m not in script} == set()
