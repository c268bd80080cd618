"""``moeforge experiment``: the shortest version of every experiment, end to end, and the gerrymandering check.

Each experiment trains its variants for a few steps of a tiny model through the
real command (one ``moeforge train`` process per variant) and must leave a
results table (markdown + JSON) with every run's numbers, commit and config.
The gerrymandering check is shown on constructed metrics, one series that
games the aux loss and one that does not, then on the HTML report.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moeforge.cli import main
from moeforge.config import save_config
from moeforge.report import load_run, write_report
from moeforge.report.balance_check import balance_trend
from tests.helpers import tiny_config

STEPS = ["--train.max_steps=5", "--train.eval_every=0", "--train.eval_batches=1", "--train.log_every=0"]


@pytest.fixture(scope="module")
def base_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("exp")
    cfg = tiny_config(root)
    path = root / "tiny.yaml"
    save_config(cfg, path)
    from moeforge.data import prepare_data

    prepare_data(cfg.data)  # once, before the runs (they reuse it)
    return path


def _run(name: str, out: Path, config: Path, *extra: str) -> dict:
    assert main(["experiment", name, str(out), "--config", str(config), *STEPS, *extra]) == 0
    result = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert result["experiment"] == name and result["commit"]
    for run in result["runs"]:
        assert (out / "runs" / run["name"] / "metrics.jsonl").is_file()
        assert run["steps"] == 5 and run["tokens"] == 5 * 8 * 32
        assert math.isfinite(run["val_bpb"]) and run["val_bpb"] > 0
        assert run["median_tokens_per_s"] > 0 and run["commit"]  # each run records the commit it ran at
        assert run["config"]["train"]["max_steps"] == 5
        assert f"| {run['name']} |" in md and run["command"] in md
    return result


def test_dense_compares_equal_active_and_equal_total(base_config: Path, tmp_path: Path) -> None:
    result = _run("dense", tmp_path / "dense", base_config)
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["moe", "dense-active", "dense-total"]
    moe, act, tot = runs["moe"], runs["dense-active"], runs["dense-total"]
    assert act["config"]["model"]["dense_layers"] == [0, 1]
    router = 2 * 32 * 4  # the MoE's router weights (2 layers x d_model x experts) are its only extra
    assert moe["params_active"] - act["params_active"] == router
    assert moe["params_total"] - tot["params_total"] == router
    assert moe["balance"] is not None and act["balance"] is None  # a dense model logs no expert load


def test_expert_lr_runs_three_scales(base_config: Path, tmp_path: Path) -> None:
    result = _run("expert-lr", tmp_path / "lr", base_config, "--model.moe.top_k=1")
    scales = [r["config"]["optim"]["expert_lr_scale"] for r in result["runs"]]
    assert scales == [1.0, 0.5, 0.25]
    bpb = [r["val_bpb"] for r in result["runs"]]
    assert len(set(bpb)) == 3  # the scale changed the training


def test_balance_and_gerrymander_write_load_over_training(base_config: Path, tmp_path: Path) -> None:
    result = _run("balance", tmp_path / "bal", base_config)
    runs = {r["name"]: r for r in result["runs"]}
    assert runs["bias"]["config"]["model"]["moe"]["bias_update_rate"] > 0
    assert runs["none"]["config"]["model"]["moe"]["aux_loss_coef"] == 0
    for run in runs.values():
        assert run["balance"]["ep"] == 2 and run["balance"]["hypothetical"]
        assert len(run["load_snapshots"]) == 5 and len(run["load_snapshots"][0]["expert_load"]) == 2
        assert set(run["balance_series"]) == {"step", "aux_loss", "expert_max_over_mean", "rank_max_over_mean_ep2"}
    result = _run("gerrymander", tmp_path / "ger", base_config)
    assert [r["name"] for r in result["runs"]] == ["aux-loss", "weak-aux", "group-per-rank"]
    assert "Gerrymandering flagged in:" in (tmp_path / "ger" / "results.md").read_text()


def test_bad_override_is_refused_before_any_run(base_config: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bad"
    assert main(["experiment", "dense", str(out), "--config", str(base_config), "--optim.expert_lr_scale=-1"]) == 2
    assert "optim.expert_lr_scale" in capsys.readouterr().err
    assert not (out / "runs").exists()


def _write_run(root: Path, loads: list[list[float]], aux: list[float]) -> Path:
    root.mkdir(parents=True)
    with (root / "metrics.jsonl").open("w") as fh:
        for step, (load, a) in enumerate(zip(loads, aux), start=1):
            fh.write(json.dumps({"step": step, "loss": 5.0, "moe/aux_loss": a, "expert_load": [load]}) + "\n")
    return root


def test_gerrymandering_is_flagged_only_when_aux_improves_and_rank_load_worsens(tmp_path: Path) -> None:
    early, late = [4, 1, 4, 1, 1, 4, 1, 4], [2, 2, 2, 2, 1, 1, 1, 1]  # experts evener, ranks 10:10 -> 8:4
    gamed = _write_run(tmp_path / "gamed", [early] * 5 + [late] * 5, [1.5] * 5 + [1.1] * 5)
    trend = balance_trend(load_run(gamed))
    assert trend is not None and trend.gerrymandering and trend.hypothetical and trend.ep == 2
    assert trend.rank_imbalance == (1.0, pytest.approx(8 / 6))
    assert trend.expert_imbalance[1] < trend.expert_imbalance[0]
    healthy = _write_run(tmp_path / "healthy", [late] * 5 + [[1.0] * 8] * 5, [1.5] * 5 + [1.1] * 5)
    assert not balance_trend(load_run(healthy)).gerrymandering  # ranks got evener too
    assert balance_trend(load_run(gamed), ep=3) is None  # 3 ranks cannot split 8 experts
    page = write_report(gamed).read_text()
    assert "TOKEN GERRYMANDERING" in page
    assert json.loads((gamed / "report" / "summary.json").read_text())["balance"]["gerrymandering"] is True
    assert "TOKEN GERRYMANDERING" not in write_report(healthy).read_text()
