"""Tests for `wholeshard plan` (`wholeshard.cli.plan`): JSON fields and types, the table (what
a user decides on first, the detail after), the default dtypes, `--model hf:DIR`, the PNG, and
clear errors with exit code 2 for bad shapes files and models."""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wholeshard.capacity.costs import OPS, Mode, plan_costs
from wholeshard.capacity.presets import preset
from wholeshard.capacity.projection import project
from wholeshard.cli import plan as plan_tool
from wholeshard.planning import default_bucket_size, plan_exactly, plan_for
from wholeshard.planning.targets import bucket_size_for

REPO = Path(__file__).resolve().parents[2]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="wholeshard")
    plan_tool.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    code = args.run(args)
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, content: object) -> str:
    path = tmp_path / "shapes.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


SMALL = {
    "params": [
        {"name": "wte.weight", "shape": [100, 32], "matrix": False, "tied": True},
        {"name": "h.0.fc.weight", "shape": [64, 32], "matrix": True},
        {"name": "h.0.fc.bias", "shape": [64], "matrix": False},
        {"name": "h.0.proj.weight", "shape": [32, 64], "matrix": False},
        {"name": "h.1.fc.weight", "shape": [64, 32], "matrix": True},
        {"name": "scale", "shape": [], "matrix": False},
    ]
}


def test_json_has_every_field_with_its_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--shapes", write(tmp_path, SMALL), "--dp", "4", "--shard-group-size", "2"]
    code, out, err = run(
        [*args, "--bucket-size", "4096", "--strategy", "balanced", "--json"], capsys
    )
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert set(doc) == {
        "dp",
        "strategy",
        "shard_group_size",
        "node_size",
        "bucket_size",
        "padding_fraction",
        "ns_cost_imbalance",
        "plan_seconds",
        "buffers",
        "params",
        "mode",
        "per_rank",
        "per_step",
        "assumed_dtypes",
        "strategy_choice",
    }
    assert (doc["dp"], doc["shard_group_size"], doc["strategy"]) == (4, 2, "balanced")
    choice = doc["strategy_choice"]
    assert set(choice) == {
        "chosen",
        "runner_up",
        "fabric",
        "gpu",
        "figures",
        "unplanned",
        "group_structure",
    }
    assert doc["node_size"] == 1
    assert (choice["chosen"], choice["fabric"], choice["gpu"]) == (
        "balanced",
        "nvlink4-ndr400",
        "h100",
    )
    assert set(choice["figures"]) == {"balanced", "owners", "exchange"} and not choice["unplanned"]
    others = {s: f["step_s"] for s, f in choice["figures"].items() if s != "balanced"}
    assert choice["runner_up"] == min(others, key=others.__getitem__)
    for f in choice["figures"].values():
        terms = f["latency_s"] + f["bandwidth_s"] + f["newton_schulz_s"]
        assert f["step_s"] == pytest.approx(terms) and isinstance(f["collectives"], int)
    assert doc["bucket_size"] == 4096
    for field in ("padding_fraction", "ns_cost_imbalance", "plan_seconds"):
        assert isinstance(doc[field], float) and doc[field] >= 0
    assert 0 <= doc["padding_fraction"] < 1 and doc["ns_cost_imbalance"] >= 1
    assert [b["kind"] for b in doc["buffers"]] == ["matrix", "adamw"]
    for b in doc["buffers"]:
        assert set(b) == {"kind", "numel", "buckets"} and isinstance(b["numel"], int)
        assert b["buckets"][-1]["end"] == b["numel"]
        for c in b["buckets"]:
            assert set(c) == {"start", "end", "shard_numel", "collectives"}
            assert c["collectives"] == "reduce_scatter/all_gather"
            assert all(isinstance(c[f], int) for f in ("start", "end", "shard_numel"))
            assert c["end"] - c["start"] == 2 * c["shard_numel"]
    assert [p["name"] for p in doc["params"]] == [p["name"] for p in SMALL["params"]]
    for p in doc["params"]:
        assert set(p) == {"name", "shape", "kind", "buffer", "bucket", "start", "end", "owner"}
        assert p["kind"] == doc["buffers"][p["buffer"]]["kind"]
        assert isinstance(p["shape"], list) and all(isinstance(d, int) for d in p["shape"])
        assert p["end"] - p["start"] == math.prod(p["shape"])
        bucket = doc["buffers"][p["buffer"]]["buckets"][p["bucket"]]
        assert bucket["start"] <= p["start"] and p["end"] <= bucket["end"]
        if p["kind"] == "matrix":
            assert p["owner"] == (p["start"] - bucket["start"]) // bucket["shard_numel"]
        else:
            assert p["owner"] is None
    by_name = {p["name"]: p for p in doc["params"]}
    assert by_name["h.0.proj.weight"]["kind"] == "adamw"  # explicit "matrix": false wins
    assert by_name["wte.weight"]["kind"] == "adamw" and by_name["h.0.fc.weight"]["kind"] == "matrix"
    assert doc["mode"] == {
        "reshard_after_forward": False,
        "param_dtype": "bfloat16",
        "grad_reduce_dtype": "float32",
        "shard_group_size": 2,
        "overlap_grad_reduce": True,
        "overlap_param_gather": False,
        "clip_grad_norm": True,
        "offload_state": False,
    }
    per_rank, per_step = doc["per_rank"], doc["per_step"]
    assert set(per_rank) == {"shard_rank", "persistent_bytes", "persistent_total_min",
                             "device_bytes", "host_bytes", "peak_transient_bytes",
                             "transient_unit_bytes"}  # fmt: skip
    assert per_rank["device_bytes"] == per_rank["persistent_bytes"]["total"]
    assert per_rank["host_bytes"] == 0
    kinds = {"params", "grads", "masters", "optimizer_state", "master_grads", "total"}
    assert set(per_rank["persistent_bytes"]) == kinds
    assert all(isinstance(v, int) and v >= 0 for v in per_rank["persistent_bytes"].values())
    assert per_rank["persistent_bytes"]["params"] == 2 * sum(b["numel"] for b in doc["buffers"])
    assert doc["assumed_dtypes"] == {"param_dtype": "bfloat16", "grad_reduce_dtype": "float32"}
    assert per_rank["peak_transient_bytes"] == per_rank["transient_unit_bytes"] == 0
    assert set(per_step) == {"collectives", "bytes_sent", "bytes_sent_by_op"}
    assert set(per_step["collectives"]) <= set(OPS) and isinstance(per_step["bytes_sent"], int)
    assert per_step["bytes_sent"] == sum(per_step["bytes_sent_by_op"].values())
    buckets = sum(len(b["buckets"]) for b in doc["buffers"])
    # per bucket: a reduce-scatter, an all-reduce across the 2 replicas, an all-gather; then
    # the step check and the clipping norm
    assert per_step["collectives"] == {
        "reduce_scatter": buckets,
        "all_reduce": buckets + 2,
        "all_gather": buckets,
    }


@pytest.mark.parametrize(
    "flags, mode",
    [
        ([], Mode(param_dtype="bfloat16")),
        (["--param-dtype", "float32"], Mode()),
        (
            ["--reshard-after-forward", "--param-dtype", "bfloat16", "--overlap-grad-reduce"],
            Mode(reshard_after_forward=True, param_dtype="bfloat16", overlap_grad_reduce=True),
        ),
        (
            ["--grad-reduce-dtype", "bfloat16", "--overlap-param-gather"],
            Mode(param_dtype="bfloat16", grad_reduce_dtype="bfloat16", overlap_param_gather=True),
        ),
        (
            ["--offload-state", "--grad-reduce-dtype", "bfloat16"],
            Mode(param_dtype="bfloat16", grad_reduce_dtype="bfloat16", offload_state=True),
        ),
    ],
)
def test_json_costs_are_the_plans_in_the_mode_the_flags_name(
    capsys: pytest.CaptureFixture[str], flags: list[str], mode: Mode
) -> None:
    argv = ["--preset", "qwen3-30b-a3b", "--dp", "32", "--shard-group-size", "8"]
    code, out, _ = run([*argv, *flags, "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    specs = preset("qwen3-30b-a3b")
    bucket_size = default_bucket_size(sum(s.numel for s in specs), 32)
    plan = plan_exactly(specs, 32, bucket_size=bucket_size, shard_group_size=8)
    costs = plan_costs(plan, specs, mode)
    worst = costs.worst_rank
    assert doc["mode"]["reshard_after_forward"] == mode.reshard_after_forward
    assert (doc["mode"]["param_dtype"], doc["mode"]["grad_reduce_dtype"]) == (
        mode.param_dtype,
        mode.grad_reduce_dtype,
    )
    assert doc["per_rank"]["shard_rank"] == worst
    assert doc["per_rank"]["persistent_bytes"] == costs.persistent[worst]
    assert doc["per_rank"]["persistent_total_min"] == min(p["total"] for p in costs.persistent)
    assert doc["per_rank"]["peak_transient_bytes"] == costs.peak_transient
    assert doc["mode"]["offload_state"] == mode.offload_state
    assert doc["per_rank"]["device_bytes"] == costs.device_bytes(worst)
    assert doc["per_rank"]["host_bytes"] == costs.host_bytes(worst)
    assert doc["per_step"]["collectives"] == costs.counts()
    assert doc["per_step"]["bytes_sent"] == costs.bytes_sent
    if mode.reshard_after_forward:  # each rank keeps 1/8 of the bf16 params
        numel = sum(b["numel"] for b in doc["buffers"])
        assert doc["per_rank"]["persistent_bytes"]["params"] == numel // 8 * 2
        assert doc["per_rank"]["peak_transient_bytes"] >= doc["per_rank"]["transient_unit_bytes"]


def lead(out: str) -> str:
    """The table's lines before the plan's detail, unwrapped: one line per label."""
    head = out.split("\nplan ")[0]
    return re.sub(r"\n {19}", " ", head)


def test_table_tells_memory_and_traffic(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "gpt2-small", "--dp", "8", "--reshard-after-forward"]
    code, out, _ = run([*argv, "--grad-reduce-dtype", "float32"], capsys)
    assert code == 0
    specs = preset("gpt2-small")
    plan = plan_exactly(specs, 8, bucket_size=default_bucket_size(sum(s.numel for s in specs), 8))
    costs = plan_costs(plan, specs, Mode(reshard_after_forward=True, param_dtype="bfloat16"))
    mine = costs.persistent[costs.worst_rank]
    text = lead(out)
    assert (
        "fully sharded, each rank keeps its shards; params bfloat16, grads reduced in "
        "float32 (the default: --param-dtype bfloat16)" in text
    )
    assert f"memory per rank    {plan_tool.size(mine['total'])} between steps" in text
    assert f"params {plan_tool.size(mine['params'])}, grads {plan_tool.size(mine['grads'])}" in text
    assert f"up to {plan_tool.size(costs.peak_transient)} of gathered buckets" in text
    counts = costs.counts()
    assert f"in {sum(counts.values())} collectives (" in text
    assert f"{counts['all_gather']} all_gather" in text
    assert f"traffic per step   {plan_tool.size(costs.bytes_sent)} sent per rank" in text


def test_offload_state_splits_memory_between_device_and_host(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--preset", "llama3-8b", "--dp", "8"]
    code, out, _ = run([*argv, "--offload-state"], capsys)
    assert code == 0
    specs = preset("llama3-8b")
    plan = plan_for(specs, 8)
    costs = plan_costs(plan, specs, Mode(param_dtype="bfloat16", offload_state=True))
    worst, size = costs.worst_rank, plan_tool.size
    device, host = costs.device_bytes(worst), costs.host_bytes(worst)
    assert host > 0 and device + host == costs.persistent[worst]["total"]
    held = f"({size(device)} on the device, {size(host)} of masters and state in host memory)"
    assert held in " ".join(lead(out).split())
    code, out, _ = run(argv, capsys)
    assert "host memory" not in out


def test_the_table_leads_with_what_a_user_decides_on(capsys: pytest.CaptureFixture[str]) -> None:
    """The model and its ranks, then the mode, memory per rank, step time (here: how to project
    it) and traffic; the plan's detail (strategy and why, the other strategies' steps, the group
    structure, buckets, padding, Newton-Schulz) and the bucket tables after them."""
    code, out, _ = run(["--preset", "llama3-8b", "--dp", "8"], capsys)
    assert code == 0
    labels = [line.split("  ")[0] for line in out.splitlines() if line[:1] not in ("", " ")]
    assert labels[:13] == [
        "llama3-8b: 8.03B params (291 tensors) on 8 ranks, one shard group",
        "mode",
        "memory per rank",
        "step time",
        "traffic per step",
        "plan",
        "strategies",
        "group structure",
        "shard groups",
        "buckets",
        "padding",
        "Newton-Schulz",
        "planned in",
    ]
    assert labels[13].startswith("buffer 0 (matrix, whole tensors)")
    assert "not projected: name the network with --fabric (nvlink3-hdr200," in lead(out)
    specs = preset("llama3-8b")
    costs = plan_costs(plan_for(specs, 8), specs, Mode(param_dtype="bfloat16"))
    mine = costs.persistent[costs.worst_rank]
    assert f"memory per rank    {plan_tool.size(mine['total'])} between steps" in lead(out)


def test_buckets_line_gives_the_sizes_the_plan_has(capsys: pytest.CaptureFixture[str]) -> None:
    """The bucket size is where a bucket closes, not a floor: llama3-8b's norms sit in
    element-wise buckets of a layer each, far below its 40M-element bucket size."""
    code, out, _ = run(["--preset", "llama3-8b", "--dp", "8"], capsys)
    assert code == 0
    plan = plan_for(preset("llama3-8b"), 8)
    text = re.sub(r"\s+", " ", out)
    for b in plan.buffers:
        sizes = [c.numel for c in b.buckets]
        assert f"{len(sizes)} {b.kind} buckets of {min(sizes):,} to {max(sizes):,} elements" in text
    assert f"bucket size {plan.bucket_size:,}: a bucket closes once it holds about" in text
    assert min(c.numel for b in plan.buffers for c in b.buckets) < plan.bucket_size
    assert ">=" not in out


@pytest.mark.parametrize(
    "flags, assumed",
    [
        ([], {"param_dtype": "bfloat16", "grad_reduce_dtype": "float32"}),
        (["--param-dtype", "float32"], {"grad_reduce_dtype": "float32"}),
        (["--param-dtype", "bfloat16", "--grad-reduce-dtype", "bfloat16"], {}),
    ],
)
def test_dtypes_default_as_users_train_and_the_json_says_what_it_assumed(
    capsys: pytest.CaptureFixture[str], flags: list[str], assumed: dict[str, str]
) -> None:
    """bf16 params and grads reduced in fp32 (the train job's), unless the flags say; the JSON's
    `assumed_dtypes` lists the dtypes no flag named, and the table says them."""
    argv = ["--preset", "gpt2-small", "--dp", "4", *flags]
    code, out, _ = run([*argv, "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["assumed_dtypes"] == assumed
    named = dict(zip(flags[::2], flags[1::2], strict=True))
    for field, default in (("param_dtype", "bfloat16"), ("grad_reduce_dtype", "float32")):
        assert doc["mode"][field] == named.get(f"--{field.replace('_', '-')}", default)
    numel = sum(b["numel"] for b in doc["buffers"])
    element = {"bfloat16": 2, "float32": 4}[doc["mode"]["param_dtype"]]
    assert doc["per_rank"]["persistent_bytes"]["params"] == element * numel
    code, out, _ = run(argv, capsys)
    mode = lead(out).splitlines()[2]
    for field, dtype in assumed.items():
        assert f"--{field.replace('_', '-')} {dtype}" in mode
    assert ("the default" in mode) == bool(assumed)


LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 tie_word_embeddings=False)  # fmt: skip
"""Llama 3 8B's published config, the fields that shape its params."""


def test_model_hf_dir_plans_what_the_preset_does_as_docs_show(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model hf:DIR` builds the causal LM of DIR/config.json on the meta device and routes it:
    Llama 3 8B's config gives exactly the `llama3-8b` preset's plan and costs, and the table
    and figures of docs/planning.md's worked example."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    transformers.LlamaConfig(**LLAMA3_8B).save_pretrained("llama3-8b")
    argv = ["--dp", "16", "--reshard-after-forward", "--json"]
    code, out, err = run(["--model", "hf:llama3-8b", *argv], capsys)
    assert code == 0, err
    got = json.loads(out)
    code, out, _ = run(["--preset", "llama3-8b", *argv], capsys)
    want = json.loads(out)
    assert got.pop("plan_seconds") >= 0 and want.pop("plan_seconds") >= 0
    assert got == want
    docs = (REPO / "docs" / "planning.md").read_text()
    command = ["--model", "hf:llama3-8b", "--dp", "16", "--fabric", "nvlink4-ndr400"]
    assert f"wholeshard plan {' '.join(command)}\n" in docs
    code, out, _ = run(command, capsys)
    marker = "<!-- plan example: checked by tests/cli/test_plan_command.py -->\n```text\n"
    assert code == 0 and out.startswith(docs.split(marker)[1].split("```")[0])
    total, peak = (
        got["per_rank"]["persistent_bytes"]["total"],
        got["per_rank"]["peak_transient_bytes"],
    )
    reading = f"{plan_tool.size(total)} a rank between steps, plus up to {plan_tool.size(peak)} of"
    assert reading in re.sub(r"\s+", " ", docs)


@pytest.mark.parametrize("what", ["no config", "not a causal LM", "nothing for Muon"])
def test_a_model_that_cannot_be_planned_exits_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    transformers = pytest.importorskip("transformers")
    if what == "not a causal LM":
        transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64).save_pretrained(tmp_path)  # fmt: skip
    elif what == "nothing for Muon":  # no layers: embedding, norm and head only
        config = dict(LLAMA3_8B, num_hidden_layers=0, hidden_size=64, vocab_size=100)
        transformers.LlamaConfig(**config).save_pretrained(tmp_path)
    code, out, err = run(["--model", f"hf:{tmp_path}", "--dp", "2"], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"wholeshard plan: error: --model hf:{tmp_path}: ")
    assert err.count("\n") == 1
    expected = {
        "no config": "no config.json in",
        "not a causal LM": "transformers cannot build a causal LM from its config",
        "nothing for Muon": "Muon",
    }
    assert expected[what] in err


def test_fabric_adds_a_projection(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "llama3-8b", "--dp", "16", "--shard-group-size", "8"]
    flags = ["--fabric", "nvlink4-ndr400", "--gpu", "h200"]
    code, out, _ = run([*argv, *flags, "--json"], capsys)
    assert code == 0
    specs = preset("llama3-8b")
    plan = plan_exactly(specs, 16, bucket_size=default_bucket_size(sum(s.numel for s in specs), 16),
                        shard_group_size=8)  # fmt: skip
    expected = project(plan_costs(plan, specs, Mode(param_dtype="bfloat16")), "nvlink4-ndr400",
                       "h200")  # fmt: skip
    assert json.loads(out)["projection"] == expected.as_dict() | {"bucket_size_hint": None}
    code, out, _ = run([*argv, *flags], capsys)
    assert code == 0 and f"step time          {expected.describe()}" in lead(out)


def test_sizes_read_in_binary_units() -> None:
    assert [plan_tool.size(n) for n in (0, 1023, 1536, 3 * 2**30, 5 * 2**40)] == [
        "0 B",
        "1023 B",
        "1.50 KiB",
        "3.00 GiB",
        "5.00 TiB",
    ]


def test_json_matches_plan_exactly_for_a_preset(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--preset", "gpt2-small", "--dp", "8", "--strategy", "size_match",
                        "--shard-group-size", "8", "--json"], capsys)  # fmt: skip
    assert code == 0
    doc = json.loads(out)
    specs = preset("gpt2-small")
    bucket_size = default_bucket_size(sum(s.numel for s in specs), 8)  # DataParallel's default
    plan = plan_exactly(specs, 8, bucket_size=bucket_size, strategy="size_match")
    assert doc["strategy"] == "size_match" and doc["shard_group_size"] == 8
    assert doc["bucket_size"] == bucket_size
    assert doc["padding_fraction"] == plan.padding_fraction
    assert doc["ns_cost_imbalance"] == plan.ns_cost_imbalance
    assert [b["numel"] for b in doc["buffers"]] == [b.numel for b in plan.buffers]
    assert len(doc["params"]) == 148


def test_table_lists_every_bucket(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["--preset", "llama3-8b", "--dp", "64", "--shard-group-size", "8"], capsys)
    assert code == 0 and err == ""
    plan = plan_exactly(preset("llama3-8b"), 64, bucket_size=40_000_000, shard_group_size=8)
    assert "8 shard group(s) of 8 ranks" in out
    assert f"\npadding            {plan.padding_fraction:.3%}" in out
    assert f"imbalance {plan.ns_cost_imbalance:.3f}" in out
    rows = [line for line in out.splitlines() if re.match(r"^ +\d+ +[\d,]+ +[\d,]+ ", line)]
    assert len(rows) == sum(len(b.buckets) for b in plan.buffers)
    assert "lm_head.weight (128256x4096)" in out
    assert "buffer 1 (adamw, element-wise)" in out


@pytest.mark.parametrize(
    "preset,dp", [("gpt2-small", 4), ("llama3-8b", 64)], ids=["equal", "owners"]
)
def test_png_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], preset: str, dp: int
) -> None:
    png = tmp_path / "plan.png"
    code, out, _ = run(["--preset", preset, "--dp", str(dp), "--png", str(png)], capsys)
    assert code == 0 and f"wrote {png}" in out
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_png_with_json_keeps_stdout_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "plan.png"
    code, out, _ = run(
        ["--shapes", write(tmp_path, SMALL), "--dp", "32", "--json", "--png", str(png)], capsys
    )
    assert code == 0 and json.loads(out)["dp"] == 32
    assert png.stat().st_size > 0


@pytest.mark.parametrize(
    "content, message",
    [
        ({"params": [{"shape": [4, 4]}]}, r"params\[0\]: missing field 'name'"),
        ({"params": [{"name": "w"}]}, r"params\[0\]: missing field 'shape'"),
        ({"params": [{"name": "w", "shape": [4, -1]}]}, r"\('w'\): shape \[4, -1\] has a negative"),
        ({"params": [{"name": "w", "shape": [4, 0]}]}, "has no elements"),
        ({"params": [{"name": "w", "shape": "4x4"}]}, "shape must be a list of ints"),
        ({"params": [{"name": "w", "shape": [4.5]}]}, "shape must be a list of ints"),
        ({"params": [{"name": "w", "shape": [4], "matrix": "yes"}]}, "matrix must be true or"),
        ({"params": [{"name": "w", "shape": [4], "Muon": True}]}, r"unknown field\(s\) \['Muon'\]"),
        ({"params": [{"name": "", "shape": [4]}]}, "name must be a non-empty string"),
        ({"params": ["w"]}, r"params\[0\]: expected an object"),
        ({"param": []}, 'expected an object with a "params" list'),
        ([1, 2], 'expected an object with a "params" list'),
        ('{"params": [', r"not valid JSON \(line 1, column 13"),
        ("", "not valid JSON"),
        (
            {
                "params": [
                    {"name": "w", "shape": [4], "matrix": False},
                    {"name": "w", "shape": [2], "matrix": False},
                ]
            },
            "duplicate param name 'w'",
        ),
        (
            {"params": [{"name": "b", "shape": [4]}]},
            r"\('b'\): missing field \"matrix\"; add \"matrix\": false \(shape \[4\] has fewer",
        ),
        (
            {"params": [{"name": "h.0.fc.weight", "shape": [64, 32]}]},
            r"missing field \"matrix\".*add \"matrix\": true if it is the weight of a hidden layer"
            r".*\"matrix\": false if it is an embedding, the output head",
        ),
    ],
)
def test_bad_shapes_file_exits_2_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object, message: str
) -> None:
    code, out, err = run(["--shapes", write(tmp_path, content), "--dp", "2"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("wholeshard plan: error: ")
    assert re.search(message, err), err


def test_missing_shapes_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["--shapes", str(tmp_path / "nope.json"), "--dp", "2"], capsys)
    assert code == 2 and out == ""
    assert "cannot read shapes file" in err and "nope.json" in err


def test_shard_group_that_does_not_divide_dp(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["--preset", "gpt2-small", "--dp", "6", "--shard-group-size", "4"], capsys)
    assert code == 2 and "choose one of [1, 2, 3, 6]" in err


def test_auto_shard_groups_say_which_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "llama3-70b", "--dp", "256", "--shard-group-size", "auto", "--json"]
    code, out, _ = run(argv, capsys)
    doc = json.loads(out)
    choice = doc["shard_group_choice"]
    assert code == 0 and doc["shard_group_size"] == choice["k"] == 128 and choice["meets_targets"]
    assert choice["strategy"] == doc["strategy"] == "exchange"
    # k = 256 was passed over: equal shards by arithmetic, the exchange by its imbalance.
    assert (
        "256: exchange: imbalance" in choice["reason"]
        and "balanced: k x the widest" in choice["reason"]
    )
    assert choice["largest_bucket"] <= choice["bucket_limit"]
    specs = preset("llama3-70b")
    want = plan_exactly(
        specs,
        256,
        bucket_size=bucket_size_for(sum(s.numel for s in specs), 128, "exchange"),
        shard_group_size=128,
        strategy="exchange",
    )
    got = doc["buffers"][0]["buckets"]
    assert [(b["start"], b["end"]) for b in got] == [
        (b.start, b.end) for b in want.buffers[0].buckets
    ]
    assert {b["collectives"] for b in got} == {"reduce_scatter/all_gather, exchanged"}
    code, out, _ = run(argv[:-1], capsys)
    assert code == 0 and "\nplan               strategy exchange: one buffer" in out
    assert "chosen automatically: k=128 of dp 256: strategy exchange" in re.sub(r"\s+", " ", out)
    assert "reduce_scatter/all_gather, exchanged" in out


def test_owner_buckets_replace_equal_shards_where_a_bucket_would_pass_the_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The automatic strategy at k = dp: for llama3-8b equal shards at dp 8, the exchange at
    dp 64, where equal shards would make one bucket of most of the model."""
    code, out, _ = run(["--preset", "llama3-8b", "--dp", "8", "--shard-group-size", "8", "--json"],
                       capsys)  # fmt: skip
    small = json.loads(out)
    code2, out, _ = run(["--preset", "llama3-8b", "--dp", "64", "--shard-group-size", "64",
                         "--json"], capsys)  # fmt: skip
    large = json.loads(out)
    assert code == code2 == 0
    assert small["strategy"] == "balanced" and large["strategy"] == "exchange"
    choice = large["shard_group_choice"]
    assert "balanced: k x the widest matrix > the bucket limit" in choice["reason"]
    # One cost model: the choice measures the imbalance the planner balanced. At k = 64 the
    # exchange's is 1.109, just over the target (`--shard-group-size auto` picks k = 32).
    assert choice["ns_imbalance"] == large["ns_cost_imbalance"] > 1.10
    assert not choice["meets_targets"] and "exchange: imbalance 1.109" in choice["reason"]
    assert large["padding_fraction"] == 0
    buckets = large["buffers"][0]["buckets"]  # a layer each, and the head's and embedding's own
    layers = [b for b in buckets if b["end"] - b["start"] < 2 * 218_112_000]  # under 2 layers
    assert len(layers) == len(buckets) - 2 == 32
    assert all(64 * b["shard_numel"] == b["end"] - b["start"] for b in buckets)  # equal shards


@pytest.mark.parametrize(
    "argv",
    [
        ["--preset", "gpt2-small", "--dp", "4", "--shard-group-size", "most"],
        ["--dp", "4"],  # no source
        ["--preset", "gpt2-small", "--shapes", "x.json", "--dp", "4"],
        ["--preset", "gpt2-small"],  # no --dp
        ["--preset", "gpt2-small", "--dp", "0"],
        ["--preset", "gpt3", "--dp", "4"],
        ["--preset", "gpt2-small", "--dp", "4", "--strategy", "random"],
        ["--preset", "gpt2-small", "--dp", "4", "--bucket-size", "-1"],
        ["--preset", "gpt2-small", "--dp", "4", "--param-dtype", "int8"],
        ["--preset", "gpt2-small", "--dp", "4", "--grad-reduce-dtype", "bf16x"],
        ["--preset", "gpt2-small", "--dp", "4", "--fabric", "carrier-pigeon"],
        ["--preset", "gpt2-small", "--dp", "4", "--fabric", "pcie4-eth100", "--gpu", "tpu"],
        ["--model", "llama3-8b", "--dp", "4"],  # not hf:DIR
        ["--model", "hf:", "--dp", "4"],
        ["--model", "hf:x", "--preset", "gpt2-small", "--dp", "4"],
    ],
)
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(argv, capsys)
    assert exit_info.value.code == 2


def test_standalone_module_entry_point(tmp_path: Path) -> None:
    bad = write(tmp_path, {"params": [{"name": "w", "shape": [3, -2]}]})
    result = subprocess.run(
        [sys.executable, "-m", "wholeshard", "plan", "--shapes", bad, "--dp", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert "wholeshard plan: error:" in result.stderr and "negative size" in result.stderr


def test_tp_plans_each_ranks_slices_and_reports_newton_schulz_traffic(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--tp 2`: Megatron's split by name (q, k, v, gate, up by rows; o, down by columns), the
    plan of one rank's slices, and what each tp mode sends per step (the sums of
    `traffic_bytes`, which tests/optim/test_tensor_parallel_muon.py checks against the bytes
    really sent)."""
    from wholeshard.capacity.tp_traffic import local_specs, ns_traffic, traffic_bytes

    code, out, _ = run(["--preset", "llama3-8b", "--dp", "8", "--tp", "2", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    shapes = {p["name"]: tuple(p["shape"]) for p in doc["params"]}
    layer = "model.layers.0."
    assert shapes[layer + "self_attn.q_proj.weight"] == (2048, 4096)
    assert shapes[layer + "self_attn.o_proj.weight"] == (4096, 2048)
    assert shapes[layer + "mlp.down_proj.weight"] == (4096, 7168)
    assert shapes[layer + "input_layernorm.weight"] == (4096,)  # replicated
    per_layer = {
        mode: sum(
            traffic_bytes(shape, dim, 2, mode, 5) * count
            for shape, dim, count in [
                ((4096, 4096), 0, 1),
                ((1024, 4096), 0, 2),
                ((4096, 4096), 1, 1),
                ((14336, 4096), 0, 2),
                ((4096, 14336), 1, 1),
            ]
        )  # fmt: skip
        for mode in ("duplicated", "distributed")
    }
    assert doc["tensor_parallel"] == {
        "tp": 2,
        "duplicated_bytes": 32 * per_layer["duplicated"],
        "distributed_bytes": 32 * per_layer["distributed"],
    }
    assert per_layer["duplicated"] == 208 * 2**20  # docs/parallelism.md's table
    specs = preset("llama3-8b")
    assert ns_traffic(specs, 1, "duplicated") == 0 and local_specs(specs, 1) == specs
    code, out, _ = run(["--preset", "llama3-8b", "--dp", "8", "--tp", "2"], capsys)
    assert "Newton-Schulz sends duplicated 6.50 GiB, distributed 70.00 GiB per rank" in lead(out)
    assert out.startswith("llama3-8b (one tp rank's slices of 2): 4.54B params")
    code, _, err = run(["--preset", "llama3-8b", "--dp", "8", "--tp", "3"], capsys)
    assert code == 2 and "does not split evenly over tp=3" in err


def test_exchange_strategy_shows_its_buffer_all_to_alls_and_the_runner_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--strategy exchange`: one exchange buffer, two all-to-alls a step (to the owners and
    back) in the traffic line with their bytes, and the strategies line beside the others."""
    argv = ["--preset", "llama3-8b", "--dp", "64", "--strategy", "exchange"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    assert "buffer 0 (exchange, whole matrices exchanged to owners" in out
    traffic = " ".join(out.split("traffic per step")[1].split("\n\n")[0].split())
    assert "2 all_to_all" in traffic and "of it in the all-to-alls, rank" in traffic
    strategies = " ".join(out.split("strategies")[1].split("shard groups")[0].split())
    assert strategies.startswith("chosen exchange") and "runner-up" in strategies
    code, out, _ = run([*argv, "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and [b["kind"] for b in doc["buffers"]] == ["exchange"]
    assert doc["per_step"]["collectives"]["all_to_all"] == 2
    assert doc["per_step"]["bytes_sent_by_op"]["all_to_all"] > 0
    choice = doc["strategy_choice"]
    assert choice["chosen"] == "exchange" and choice["runner_up"] in ("balanced", "owners")
    exchange, owners = choice["figures"]["exchange"], choice["figures"]["owners"]
    assert exchange["step_s"] < owners["step_s"]
    assert exchange["newton_schulz_s"] == pytest.approx(owners["newton_schulz_s"])
