"""Whether a step's gradients were clipped by `LayerwiseOptimizer.clip_grad_norm_`, for an
integration whose framework is set up to clip (transformers' `max_grad_norm`, Lightning's
`gradient_clip_val`).

[Note: clipping the framework asked for]
A framework clips through its own internals (`Trainer._clip_grad_norm`, a precision plugin's
`clip_grad_by_norm`), which the integrations override. Should a framework release stop calling
through them and clip its own way (torch's `clip_grad_norm_` over the wrapped params, whose
`.grad` stays None, or over the optimizer's masters, each rank's own norm), it would clip
nothing, or clip wrongly, without a word. So an integration that knows clipping is configured
says so (`LayerwiseOptimizer.expect_clipping`), and a step whose gradients
`LayerwiseOptimizer.clip_grad_norm_` did not clip at that norm or below raises before any
update. No collective: every rank runs the same framework code, so every rank takes the same
decision.
"""

from __future__ import annotations

import math


class ClippingRecord:
    """The clipping a step needs (`expected`) and the clipping it got (`clipped_at`)."""

    def __init__(self) -> None:
        self.expected: tuple[float, str] | None = None  # (max_norm, the setting that asks)
        self.clipped_at = math.inf  # the lowest max_norm clipped at since the last step

    def clipped(self, max_norm: float) -> None:
        self.clipped_at = min(self.clipped_at, max_norm)

    def forget(self) -> None:
        """New gradients: no clipping yet."""
        self.clipped_at = math.inf

    def check(self, step: int) -> None:
        """Raise if the gradients of optimizer step `step` were not clipped as expected; forget
        this step's clipping either way."""
        clipped_at, self.clipped_at = self.clipped_at, math.inf
        if self.expected is None:
            return
        max_norm, source = self.expected
        if clipped_at <= max_norm:
            return
        got = "did not clip them" if math.isinf(clipped_at) else f"clipped them to {clipped_at}"
        raise RuntimeError(
            f"optimizer step {step}: {source} asks to clip the gradients to norm {max_norm}, but "
            f"LayerwiseOptimizer.clip_grad_norm_ {got}: the framework did not clip "
            f"through the wholeshard integration (this release of it clips its own way, which "
            f"under wholeshard.DataParallel clips nothing or by one rank's norm). Nothing was "
            f"updated. Use a framework version the integration supports (the extras in "
            f"wholeshard's pyproject.toml), or clip with LayerwiseOptimizer.clip_grad_norm_"
            f"({max_norm}) before the step"
        )
