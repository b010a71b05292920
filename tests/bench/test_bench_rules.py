"""Matrix rules in the bench (`wholeshard/bench/rule_optimizers.py`): rows per rule,
`ddp_kj_rule`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from wholeshard.bench import configs
from wholeshard.bench.builders import MATRIX_CLASSES, unavailable
from wholeshard.bench.configs import CONFIGS, MUON_KW
from wholeshard.bench.report import Row, fill_ratios, markdown
from wholeshard.bench.rule_optimizers import KJ_RULE, Rule, by_size, rule_optimizer, rule_sensitive
from wholeshard.cli import bench as cli
from wholeshard.optim import BatchedMuon, Muon, NorMuon


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_the_default_rule_builds_exactly_the_pre_rule_classes() -> None:
    assert Rule().label == "" and Rule().is_default
    for matrix, (cls, extra) in MATRIX_CLASSES.items():
        assert rule_optimizer(Rule(), matrix) == (
            cls,
            dict(MUON_KW, adjust_lr_fn="original", **extra),
        )


def test_rules_pick_their_class_and_newton_schulz_keywords() -> None:
    gram = Rule(ns_algorithm="gram")
    assert gram.label == "gram" and Rule("normuon", "gram", "polar_express").label == (
        "normuon+gram+polar_express"
    )
    cls, kwargs = rule_optimizer(gram)
    assert cls is Muon and kwargs["ns_algorithm"] == "gram"
    assert kwargs["ns_coefficients"] == "quintic"
    assert rule_optimizer(gram, "batched") == (
        BatchedMuon,
        dict(MUON_KW, adjust_lr_fn="original", ns_algorithm="gram"),
    )
    cls, kwargs = rule_optimizer(Rule("normuon", ns_coefficients="polar_express"))
    assert cls is NorMuon and kwargs["ns_coefficients"] == "polar_express"
    with pytest.raises(ValueError, match="matrix optimizer"):
        Rule("adam")


def test_rules_that_cannot_run_a_configuration_get_a_reason() -> None:
    normuon = Rule("normuon")
    reason = unavailable(CONFIGS["ws_batched_muon"], None, normuon)
    assert reason is not None and "BatchedMuon" in reason
    assert unavailable(CONFIGS["ws_overlap"], None, normuon) is None
    soap_gram = unavailable(CONFIGS[KJ_RULE], None, Rule("soap", "gram"))
    assert soap_gram is not None and "ns_algorithm" in soap_gram


def test_only_wholeshard_configurations_and_ddp_kj_rule_run_per_rule() -> None:
    sensitive = {name for name, c in CONFIGS.items() if rule_sensitive(c)}
    assert KJ_RULE in sensitive and "ddp_kj_muon" not in sensitive
    assert sensitive - {KJ_RULE} == {n for n, c in CONFIGS.items() if c.parallel is not None}
    args = _args("--ns-algorithm", "standard", "gram", "--matrix-optimizer", "muon", "normuon")
    assert len(cli._rules(args, "ws_overlap")) == 4
    assert cli._rules(args, "ddp_torch_muon") == [Rule()]
    assert cli._rules(_args(), "ws_overlap") == [Rule()]


def test_the_cli_choices_are_the_optimizers_names() -> None:
    from wholeshard.optim import gram_ns, normuon, rules

    assert configs.MATRIX_RULES == rules.MATRIX_RULES
    assert configs.NS_ALGORITHMS == gram_ns.NS_ALGORITHMS
    assert configs.NS_COEFFICIENTS == normuon.SCHEDULES


def test_round_robin_order_is_muon_with_aux_adams() -> None:
    params = [torch.zeros(2, 3), torch.zeros(4, 4), torch.zeros(2, 3), torch.zeros(3, 8)]
    assert [tuple(p.shape) for p in by_size(params)] == [(4, 4), (3, 8), (2, 3), (2, 3)]


def test_rows_compare_with_ddp_kj_rule_under_the_same_rule() -> None:
    rows = [
        Row("mlp", KJ_RULE, step_s=2.0, optimizer_s=1.0),
        Row("mlp", KJ_RULE, step_s=4.0, optimizer_s=3.0, rule="gram"),
        Row("mlp", "ws_overlap", step_s=1.0, optimizer_s=0.5),
        Row("mlp", "ws_overlap", step_s=1.0, optimizer_s=0.9, rule="gram"),
    ]
    fill_ratios(rows)
    assert [r.ratio_vs_kj_rule for r in rows] == [1.0, 1.0, 0.5, 0.25]
    assert rows[3].optimizer_share == 0.9
    table = markdown(rows, [])
    assert "| mlp | ws_overlap[gram] |" in table and "vs ddp_kj_rule" in table


def test_a_quick_run_benches_every_rule_and_labels_its_rows(tmp_path) -> None:
    out = tmp_path / "b.json"
    argv = ["--quick", "--steps", "1", "--workload", "mlp", "--config", KJ_RULE]
    argv += ["--config", "ws_overlap", "--ns-algorithm", "standard", "gram", "--json", str(out)]
    command = [sys.executable, "-m", "wholeshard", "bench", *argv]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    named = {(r["config"], r["rule"]): r for r in results}
    assert set(named) == {(c, r) for c in (KJ_RULE, "ws_overlap") for r in ("", "gram")}
    assert all(r["error"] is None and r["ratio_vs_kj_rule"] > 0 for r in results), results
    assert named[KJ_RULE, ""]["gather_bytes_per_rank"] > 0  # the owners' broadcasts
    assert "ws_overlap[gram]" in proc.stdout and "WARNING" not in proc.stdout
