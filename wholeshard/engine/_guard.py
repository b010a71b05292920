"""What a wrapped model must be, and must stay: checks that turn misuse into clear errors.

- At construction (`placement_problem`): every param and buffer is materialised (not on the meta
  device), all params are on one device, and every param is contiguous (each param becomes a
  contiguous view of its bucket: strides another tensor relies on would silently change).
- After construction (`ParamSignature`): the same Parameter objects, in the same number, with
  the same `requires_grad`. Buffers are planned once, so a param frozen, unfrozen, replaced,
  added or removed after wrapping would train wrongly (its gradient never reduced, its update
  lost). `LayerwiseOptimizer.step` asks at every step, inside the all-reduce every rank takes,
  so all ranks raise together.
"""

from __future__ import annotations

import torch
from torch import nn


def placement_problem(module: nn.Module) -> str | None:
    """Why `module` cannot be wrapped as it is, or None."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_meta:
            return (
                f"{name!r} is on the meta device (not materialised): call "
                f"model.to_empty(device=...) and initialise or load the weights before wrapping"
            )
    devices: dict[torch.device, str] = {}
    for name, p in module.named_parameters():
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        where = ", ".join(f"{name!r} on {device}" for device, name in devices.items())
        return f"params are on several devices ({where}): move the whole model to one device first"
    for name, p in module.named_parameters():
        if not p.is_contiguous():
            return (
                f"param {name!r} is not contiguous (shape {tuple(p.shape)}, stride {p.stride()}): "
                f"each param becomes a contiguous view of its bucket, so make it contiguous "
                f"before wrapping (p.data = p.data.contiguous())"
            )
    return None


class ParamSignature:
    """The identity, count and `requires_grad` of a module's params when it was wrapped."""

    def __init__(self, module: nn.Module) -> None:
        self._names = {id(p): name for name, p in module.named_parameters()}
        self._key = self._of(module)

    @staticmethod
    def _of(module: nn.Module) -> list[tuple[int, bool]]:
        return [(id(p), p.requires_grad) for p in module.parameters()]

    def changes(self, module: nn.Module) -> str | None:
        """What changed in `module`'s params since wrapping, or None (cheap when nothing did)."""
        if self._of(module) == self._key:
            return None
        now = {id(p): (name, p) for name, p in module.named_parameters()}
        wrapped_requires_grad = dict(self._key)
        for key, name in self._names.items():
            if key not in now:
                names_now = {n for n, _ in now.values()}
                what = "replaced by a new Parameter" if name in names_now else "removed"
                return _changed(f"param {name!r} was {what}")
        for key, (name, p) in now.items():
            if key not in self._names:
                return _changed(f"param {name!r} was added")
            if p.requires_grad != wrapped_requires_grad[key]:
                return _changed(
                    f"param {name!r} has requires_grad={p.requires_grad}, "
                    f"{wrapped_requires_grad[key]} when it was wrapped"
                )
        return _changed("the params' order changed")


def _changed(what: str) -> str:
    return (
        f"the model changed after it was wrapped in DataParallel: {what}. The buffers are planned "
        f"once, at wrapping: freeze, replace or add params before wrapping (then wrap again)"
    )
