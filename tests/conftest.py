"""Test-session settings and fixtures shared by every test module."""

from pathlib import Path

import pytest
import torch

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
