"""A `DataParallel` over a strict subgroup of the world creates its own groups without the ranks
outside it: only the members call `DataParallel`, as when some ranks run another pipeline stage
or only evaluate. Every group (shard, replica, separate all-gather) must then be made by its
members alone; `new_subgroups_by_enumeration` (every world rank) would wait for rank 2 forever.
Under eager NCCL init they must be split from the subgroup's communicator (`split_group`):
gloo cannot split, so the "eager" cases record the splits and make the groups locally.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from support import (
    ADAMW_KW,
    MUON_KW,
    TOL,
    data_parallel,
    lm_loss,
    local_batch,
    make_model,
    reference_run,
)

import wholeshard
from wholeshard.distributed import groups
from wholeshard.distributed.launch import launch

TOLERANCE = dict(atol=TOL[torch.float32]["atol"], rtol=TOL[torch.float32]["rtol"])
MODES = {
    "separate-gather": dict(separate_all_gather_group=True),
    "shard-groups": dict(shard_group_size=1),
    "shard-groups-separate-gather": dict(shard_group_size=1, separate_all_gather_group=True),
}


def _refused(*args: object, **kwargs: object) -> None:
    raise AssertionError("every world rank must call this: not for a strict subgroup")


def _split_group_on_gloo(parent, split_ranks, timeout=None):  # noqa: ANN001, ANN202
    """What `split_group` does under eager NCCL, by the means gloo has: record the call."""
    SPLITS.append(split_ranks)
    mine = next(s for s in split_ranks if dist.get_rank(parent) in s)
    ranks = [dist.get_global_rank(parent, r) for r in mine]
    return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)


SPLITS: list = []


def _train(ddp_kw: dict, members: list[int] | None, eager: bool = False) -> dict | None:
    """Train 3 steps on the ranks `members` (None: every rank), as ranks 0..len-1 of 2.
    `eager`: as if NCCL were initialised eagerly (a device bound to the default group)."""
    group = dist.new_group(members) if members is not None else None  # every rank calls it
    if members is not None and dist.get_rank() not in members:
        return None  # this rank never builds a DataParallel
    if members is not None:  # this process only: the calls that would wait for rank 2
        dist.new_subgroups_by_enumeration = _refused
        if eager:
            groups.comms_split_from_world = lambda: True
            dist.split_group = _split_group_on_gloo
    ddp = data_parallel(make_model(), process_group=group, **ddp_kw)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    for step in range(3):  # each rank's slice of the batch, by its rank in the group
        lm_loss(ddp, *local_batch(step, ddp.rank, ddp.dp_size)).backward()
        opt.step()
        opt.zero_grad()
    with ddp.full_params():
        params = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    return {"params": params, "splits": SPLITS}


CASES = [("shard-groups-separate-gather", False), *((mode, True) for mode in MODES)]
IDS = [f"{mode}-{'eager' if eager else 'lazy'}" for mode, eager in CASES]


@pytest.mark.parametrize(("mode", "eager"), CASES, ids=IDS)
def test_a_strict_subgroup_makes_its_groups_alone(mode: str, eager: bool) -> None:
    fn = functools.partial(_train, MODES[mode], [0, 1], eager)
    sub = launch(fn, 3, start_method="fork", timeout=60)
    assert sub[2] is None
    ref = reference_run(3)
    for got in sub[:2]:
        for k, want in ref["params"].items():
            torch.testing.assert_close(got["params"][k], want, **TOLERANCE)
        splits = got["splits"]
        if not eager:
            assert splits == []
        elif "shard_group_size" in MODES[mode]:  # blocks of 1 (and replicas over both ranks)
            assert splits[:2] == [[[0], [1]], [[0, 1]]]
        else:
            assert splits == [[[0, 1]]]
