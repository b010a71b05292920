"""`DataParallel(shard_group_size="auto")`: the plan `planning.auto` chooses, trained like any
hybrid plan (against the one-process reference)."""

from __future__ import annotations

from support import assert_matches, reference_run, run, wholeshard_run

from wholeshard.capacity.choice import auto_shard_group_size
from wholeshard.planning import ParamSpec

STEPS = 3


def _auto(steps: int) -> dict:
    out = wholeshard_run(steps, ddp_kw=dict(shard_group_size="auto"), keep_ddp=True)
    ddp = out.pop("ddp")
    specs = [ParamSpec(r.name, r.shape, r.matrix, r.tied) for r in ddp.routes]
    choice = auto_shard_group_size(specs, ddp.dp_size)
    out["k"], out["chosen"] = ddp.shard_group_size, choice.k
    out["same_plan"] = ddp.plan == choice.plan
    return out


def test_auto_shard_groups_train_as_the_reference() -> None:
    ref = reference_run(STEPS)
    outs = run(_auto, 4, STEPS)
    for out in outs:
        # The test transformer pads 14% at k = 4, so the choice is a smaller group.
        assert out["k"] == out["chosen"] < 4 and out["same_plan"]
        assert_matches(out, ref)
