"""The optional `train` extra (tqdm, matplotlib): a clear error when it is missing."""

from __future__ import annotations

import importlib.util

TRAIN_EXTRA = ("tqdm", "matplotlib")


class MissingExtra(ImportError):
    """A package of the `train` extra is not installed."""


def missing() -> list[str]:
    """Packages of the `train` extra that are not importable."""
    return [name for name in TRAIN_EXTRA if importlib.util.find_spec(name) is None]


def require(name: str) -> None:
    """Raise MissingExtra with an install hint unless `name` is importable."""
    if importlib.util.find_spec(name) is None:
        raise MissingExtra(
            f"wholeshard train needs {name!r}: pip install 'wholeshard[train]' "
            f"(or: pip install {' '.join(TRAIN_EXTRA)})"
        )
