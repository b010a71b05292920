"""`DataParallelConfig`: one definition of every option, checked at construction, and the two
ways to pass it; the bucket states' transitions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import make_model

import wholeshard
from wholeshard import DataParallelConfig
from wholeshard.cli.flags import field_docs
from wholeshard.engine._storage import BucketState
from wholeshard.engine.config import ConfigError


def test_every_field_has_a_docstring_and_a_default() -> None:
    docs = field_docs(DataParallelConfig)
    for f in dataclasses.fields(DataParallelConfig):
        assert docs.get(f.name), f.name
        assert f.default is not dataclasses.MISSING, f.name


def test_keywords_build_the_same_config_as_the_object() -> None:
    cfg = DataParallelConfig(bucket_size=4096, strategy="size_match", overlap_grad_reduce=True)
    by_keywords = wholeshard.DataParallel(
        make_model(), bucket_size=4096, strategy="size_match", overlap_grad_reduce=True
    )
    by_object = wholeshard.DataParallel(make_model(), cfg)
    assert by_keywords.config == by_object.config == cfg
    assert by_keywords.plan == by_object.plan
    assert wholeshard.DataParallel(make_model()).config == DataParallelConfig()


def test_config_and_keywords_together_or_unknown_keywords_are_refused() -> None:
    with pytest.raises(TypeError, match="not both"):
        wholeshard.DataParallel(make_model(), DataParallelConfig(), bucket_size=4096)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['layout'\]"):
        wholeshard.DataParallel(make_model(), layout="ping_pong")
    with pytest.raises(TypeError, match="must be a DataParallelConfig"):
        wholeshard.DataParallel(make_model(), {"bucket_size": 4096})


@pytest.mark.parametrize(
    "options, field, message",
    [
        (dict(bucket_size=0), "bucket_size", "int >= 1"),
        (dict(bucket_size=True), "bucket_size", "int >= 1"),
        (dict(shard_group_size=-2), "shard_group_size", "int >= 1 or 'auto'"),
        (dict(shard_group_size="max"), "shard_group_size", "int >= 1 or 'auto'"),
        (dict(shard_group_size="auto", scheme="ping_pong"), "shard_group_size", "scheme='whole'"),
        (dict(strategy="zigzag"), "strategy", "strategy must be one of"),
        (dict(scheme="aligned"), "scheme", "scheme must be one of"),
        (dict(param_sync="scatter"), "param_sync", "param_sync must be one of"),
        (dict(param_dtype=torch.int8), "param_dtype", "floating-point"),
        (dict(grad_reduce_dtype="float32"), "grad_reduce_dtype", "floating-point"),
        (dict(overlap_grad_reduce=1), "overlap_grad_reduce", "True or False"),
        (dict(separate_all_gather_group="yes"), "separate_all_gather_group", "None, True"),
        (dict(timeout=30), "timeout", "timedelta"),
        (dict(use_muon="fc"), "use_muon", "a function"),
        (dict(scheme="ping_pong", reshard_after_forward=True), "reshard_after_forward", "ping_p"),
        (dict(scheme="ping_pong", fp8_param_gather=True), "fp8_param_gather", "scheme='whole'"),
    ],
)
def test_bad_values_name_their_field(options: dict, field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        DataParallelConfig(**options)
    assert e.value.field == field


def test_a_config_cannot_change() -> None:
    cfg = DataParallelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bucket_size = 4096  # type: ignore[misc]
    assert dataclasses.replace(cfg, bucket_size=4096).bucket_size == 4096


def test_param_dtype_none_keeps_the_models_dtype_as_fsdp2_does() -> None:
    model = make_model().to(torch.bfloat16)
    ddp = wholeshard.DataParallel(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert ddp.buckets[0].param.dtype == torch.bfloat16
    assert ddp.buckets[0].grad.dtype == torch.float32  # grads reduce in fp32 unless told
    mixed = make_model()
    mixed.head.to(torch.bfloat16)
    with pytest.raises(ValueError, match="pass param_dtype"):
        wholeshard.DataParallel(mixed)
    assert wholeshard.DataParallel(mixed, param_dtype=torch.float32).buckets[0].param.dtype == (
        torch.float32
    )


def test_bucket_state_transitions_are_asserted() -> None:
    ddp = wholeshard.DataParallel(make_model())
    storage = ddp.buckets[0]
    assert storage.state is BucketState.FRESH
    with pytest.raises(AssertionError, match="FRESH, expected STALE or RELEASED"):
        storage.start_gather()
    storage.mark_stale()
    assert storage.state is BucketState.STALE
    storage.state = BucketState.GATHERING  # as if a gather were in flight
    for transition in (storage.mark_stale, storage.release_params, storage.start_gather):
        with pytest.raises(AssertionError, match="GATHERING"):
            transition()
