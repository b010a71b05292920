"""The optional extras the job needs (`train`: tqdm, matplotlib; `hf`: transformers,
tokenizers, datasets, safetensors): a clear error when one is missing."""

from __future__ import annotations

import importlib.util

TRAIN_EXTRA = ("tqdm", "matplotlib")
HF_EXTRA = ("transformers", "tokenizers", "datasets", "safetensors")
EXTRAS = {"train": TRAIN_EXTRA, "hf": HF_EXTRA}


class MissingExtra(ImportError):
    """A package of an extra is not installed."""


def missing() -> list[str]:
    """Packages of the `train` extra that are not importable."""
    return [name for name in TRAIN_EXTRA if importlib.util.find_spec(name) is None]


def require(name: str, extra: str = "train") -> None:
    """Raise MissingExtra with an install hint unless `name` is importable."""
    if importlib.util.find_spec(name) is None:
        raise MissingExtra(
            f"wholeshard train needs {name!r}: pip install 'wholeshard[{extra}]' "
            f"(or: pip install {' '.join(EXTRAS[extra])})"
        )
