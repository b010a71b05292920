"""`DataParallelConfig`: one definition of every option, checked at construction, and the two
ways to pass it; the bucket states' transitions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import make_model, mp
from torch.distributed.fsdp import MixedPrecisionPolicy

import wholeshard
from wholeshard import DataParallelConfig
from wholeshard.cli.flags import field_docs
from wholeshard.engine._storage import UnitState
from wholeshard.engine.config import ConfigError, Variant


def test_every_field_has_a_docstring_and_a_default() -> None:
    docs = field_docs(DataParallelConfig)
    for f in dataclasses.fields(DataParallelConfig):
        assert docs.get(f.name), f.name
        assert f.default is not dataclasses.MISSING, f.name


def test_keywords_build_the_same_config_as_the_object() -> None:
    cfg = DataParallelConfig(bucket_size=4096, shard_group_size=1, overlap_grad_reduce=False)
    by_keywords = wholeshard.DataParallel(
        make_model(), bucket_size=4096, shard_group_size=1, overlap_grad_reduce=False
    )
    by_object = wholeshard.DataParallel(make_model(), cfg)
    assert by_keywords.dp_config == by_object.dp_config == cfg
    assert by_keywords.plan == by_object.plan
    assert wholeshard.DataParallel(make_model()).dp_config == DataParallelConfig()


def test_at_most_twelve_options_and_the_baselines_are_not_among_them() -> None:
    names = {f.name for f in dataclasses.fields(DataParallelConfig)}
    assert len(names) <= 12, sorted(names)
    assert not names & {f.name for f in dataclasses.fields(Variant)}
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['scheme'\]"):
        wholeshard.DataParallel(make_model(), scheme="ping_pong")


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
        (dict(mp_policy=torch.bfloat16), "mp_policy", "MixedPrecisionPolicy"),
        (dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8)), "mp_policy", "floating"),
        (dict(mp_policy=MixedPrecisionPolicy(reduce_dtype="fp32")), "mp_policy", "reduce_dtype"),
        (dict(overlap_grad_reduce=1), "overlap_grad_reduce", "True or False"),
        (dict(matrix_params="fc"), "matrix_params", "a function"),
    ],
)
def test_bad_values_name_their_field(options: dict, field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        DataParallelConfig(**options)
    assert e.value.field == field


@pytest.mark.parametrize(
    "variant, options, field, message",
    [
        (dict(strategy="zigzag"), {}, "strategy", "strategy must be one of"),
        (
            dict(layout="aligned"),
            {},
            "layout",
            r"layout 'aligned' is not registered \(registered: .*'ping_pong'.*register_layout.*"
            r"import wholeshard.bench.baselines",
        ),
        (dict(separate_all_gather_group="yes"), {}, "separate_all_gather_group", "None, True"),
        (
            dict(layout="ping_pong"),
            dict(reshard_after_forward=True),
            "reshard_after_forward",
            "layout='ping_pong' cannot take reshard_after_forward=True: .* equal",
        ),
        (dict(layout="ping_pong"), dict(fp8_param_gather=True), "fp8_param_gather", "no shards"),
        (
            dict(layout="shard_broadcasts"),
            dict(fp8_param_gather=True),
            "fp8_param_gather",
            "layout='shard_broadcasts' cannot take fp8_param_gather=True: .* never FP8",
        ),
    ],
)
def test_bad_variants_name_their_field(variant: dict, options: dict, field: str, message: str):
    with pytest.raises(ConfigError, match=message) as e:
        Variant(**variant).check(DataParallelConfig(**options))
    assert e.value.field == field


def test_a_config_cannot_change() -> None:
    cfg = DataParallelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bucket_size = 4096  # type: ignore[misc]
    assert dataclasses.replace(cfg, bucket_size=4096).bucket_size == 4096


def test_mp_policy_has_fsdp2s_meanings() -> None:
    model = make_model().to(torch.bfloat16)
    ddp = wholeshard.DataParallel(model)  # no policy: the model's own dtype, reduced in it
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert ddp.units[0].param.dtype == ddp.units[0].grad.dtype == torch.bfloat16
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ddp = wholeshard.DataParallel(make_model(), mp_policy=policy)
    assert ddp.units[0].param.dtype == torch.bfloat16
    assert ddp.units[0].grad.dtype == torch.float32
    compute = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # reduce_dtype None: compute's
    assert wholeshard.DataParallel(make_model(), mp_policy=compute).units[0].grad.dtype == (
        torch.bfloat16
    )
    mixed = make_model()
    mixed.head.to(torch.bfloat16)
    with pytest.raises(ValueError, match="pass mp_policy=MixedPrecisionPolicy"):
        wholeshard.DataParallel(mixed)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32)
    assert wholeshard.DataParallel(mixed, mp_policy=fp32).units[0].param.dtype == torch.float32


def test_output_dtype_casts_the_forward_outputs() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    ddp = wholeshard.DataParallel(make_model(), mp_policy=policy)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    assert ddp(tokens).dtype == torch.float32
    plain = wholeshard.DataParallel(make_model(), mp_policy=mp(torch.bfloat16))
    assert plain(tokens).dtype == torch.bfloat16


def test_the_wrapped_models_attributes_show_through() -> None:
    model = make_model()
    model.config = {"hidden_size": 32}  # a transformers model's config, say
    ddp = wholeshard.DataParallel(model)
    assert ddp.config is model.config
    with pytest.raises(AttributeError, match="no_such_thing"):
        ddp.no_such_thing  # noqa: B018


def test_bucket_state_transitions_are_asserted() -> None:
    ddp = wholeshard.DataParallel(make_model())
    storage = ddp.units[0]
    assert storage.state is UnitState.FRESH
    with pytest.raises(AssertionError, match="FRESH, expected STALE or RELEASED"):
        storage.start_gather()
    storage.mark_stale()
    assert storage.state is UnitState.STALE
    storage.state = UnitState.GATHERING  # as if a gather were in flight
    for transition in (storage.mark_stale, storage.release_params, storage.start_gather):
        with pytest.raises(AssertionError, match="GATHERING"):
            transition()
