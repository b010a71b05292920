"""The planner's cost as a property of the matrix rule: `check_cost` warns when a rule's
`matrix_cost` is not the one its `DataParallel` was planned with."""

from __future__ import annotations

import warnings

from ..planning.specs import MatrixCost, newton_schulz_cost


def check_cost(planned: MatrixCost | None, rule: type) -> None:
    """Warn (once per call) when `rule` has a `matrix_cost` other than `planned`
    (`DataParallelConfig.matrix_cost`; None: Newton-Schulz cost, `newton_schulz_cost`): the
    ranks' matrices were then balanced for another rule's work. A rule without one is taken
    to cost Newton-Schulz."""
    cost = getattr(rule, "matrix_cost", None)
    planned = planned or newton_schulz_cost
    if cost is None or cost == planned:
        return
    name = rule.__name__
    warnings.warn(
        f"{name} costs a matrix with {name}.matrix_cost, but the DataParallel was planned with "
        f"{getattr(planned, '__qualname__', planned)}, so its matrices are balanced for another "
        f"rule's work: pass DataParallel(model, matrix_cost={name}.matrix_cost)",
        stacklevel=3,
    )
