"""Test-session settings and fixtures shared by every test module."""

from pathlib import Path

import pytest
import torch

import wholeshard.distributed.launch

ROOT = Path(__file__).resolve().parent.parent

# Forked workers run with one thread (OpenMP does not survive fork); the in-process reference
# must use the same count, or matmul reduction order, and so the last bits, differ.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small training text for `wholeshard train` runs: this repo's train loop, twice."""
    path = tmp_path_factory.mktemp("data") / "text.py"
    path.write_bytes((ROOT / "wholeshard" / "train" / "trainer.py").read_bytes() * 2)
    return path


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail a test that starts workers, and keep it out of any torchrun job (no RANK, WORLD_SIZE,
    LOCAL_RANK): for tests of what `wholeshard train` does before it launches, which take it with
    `pytestmark = pytest.mark.usefixtures("no_launch")`."""

    def refuse(*args, **kwargs):
        raise AssertionError("workers were started")

    monkeypatch.setattr(wholeshard.distributed.launch, "launch", refuse)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
