"""Expert re-placement (parallel.rebalance_every) changes where experts live, never the math; controlled routing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeforge.cli import main
from moeforge.config import ConfigError, MoEConfig, validate_config
from moeforge.model.moe.router import TopKRouter, zipf_log_weights
from moeforge.parallel.expert.placement import lpt_slots, rank_loads
from moeforge.testing import run_distributed_test
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import continue_from, tiny_config

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "shakespeare.yaml")
BASE = [
    "--train.max_steps=4",
    "--train.global_batch_size=16",
    "--train.micro_batch_size=4",
    "--train.eval_batches=1",
    "--parallel.ep=2",
    "--model.moe.num_experts=8",
]
ON = ["--parallel.rebalance_every=1"]
ROWWISE = ["--model.moe.dispatcher=rowwise", "--model.moe.capacity_factor=4"]


def test_lpt_packs_every_rank_near_the_mean() -> None:
    load = [40.0, 30.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]  # contiguous on 2 ranks: 80 vs 20
    slots = lpt_slots(load, 2)
    assert sorted(slots) == list(range(8))
    per_rank = rank_loads(torch.tensor(load), slots, 2)
    assert per_rank.tolist() == [55.0, 45.0]  # the two hot experts on different ranks
    assert rank_loads(torch.tensor(load), list(range(8)), 2).tolist() == [80.0, 20.0]
    with pytest.raises(ValueError, match="must divide"):
        lpt_slots(load, 3)


def test_zipf_routing_is_seeded_skewed_and_drifts() -> None:
    cfg = MoEConfig(num_experts=16, top_k=2, random_routing=True, random_routing_zipf=1.2, random_routing_drift_every=2)
    a, b = TopKRouter(8, cfg, 1, 0), TopKRouter(8, cfg, 1, 0)
    x = torch.randn(4096, 8)
    ra, rb = a(x), b(x)
    assert torch.equal(ra.indices, rb.indices)  # seeded: identical across runs
    counts = ra.tokens_per_expert
    assert float(counts.max() / counts.mean()) > 3.0  # Zipf(1.2) over 16: the hottest expert ~5x the mean
    assert (ra.indices[:, 0] != ra.indices[:, 1]).all()  # k distinct experts
    hottest = int(counts.argmax())
    assert int(zipf_log_weights(16, 1.2, a.base_seed, 0).argmax()) == hottest
    a.routing_step = 2  # a new drift period: another ranking
    assert int(a(x).tokens_per_expert.argmax()) == int(zipf_log_weights(16, 1.2, a.base_seed, 1).argmax())


@pytest.mark.parametrize(
    "args, field",
    [
        (["--parallel.rebalance_every=-1"], "parallel.rebalance_every"),
        (["--parallel.rebalance_every=2"], "parallel.rebalance_every"),  # the demo runs at ep=1 on one process
        (["--model.moe.random_routing_zipf=1.2"], "model.moe.random_routing_zipf"),
    ],
)
def test_bad_rebalance_config_is_one_line_exit_2(
    tmp_path: Path, args: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["train", DEMO, f"--train.run_dir={tmp_path / 'run'}", "--parallel.ep=1", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"moeforge: error: {field}"), err


def test_rebalance_needs_the_ddp_stack(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, *BASE, *ON)
    cfg.parallel.stack = "fsdp"
    with pytest.raises(ConfigError, match=r"parallel\.rebalance_every: moves experts between ep ranks"):
        validate_config(cfg)


def _runs(cfgs: dict) -> None:
    for name in ("plain", "rebal", "plain_rowwise", "rebal_rowwise", "plain_muon", "rebal_muon"):
        Trainer(cfgs[name]).fit()
    Trainer(cfgs["rebal_half"]).fit()  # stops at step 2 (async, overlapped save) ...
    Trainer(cfgs["rebal_resumed"]).fit()  # ... and resumes in the same run dir with its placement


def test_rebalancing_keeps_the_losses_and_checkpoints_reshard(tmp_path: Path) -> None:
    def cfg(run: str, *extra: str):
        return tiny_config(tmp_path, f"--train.run_dir={tmp_path / run}", *BASE, "--train.save_every=2", *extra)

    # Muon momentum, and bf16 weights with their fp32 masters, move with the experts too
    muon = ["--optim.name=muon", "--train.param_dtype=bf16", "--train.precision=bf16"]
    overlap = ["--train.async_save=true", "--train.async_save_overlap=true"]
    cfgs = {
        "plain": cfg("plain"),
        "rebal": cfg("rebal", *ON),
        "plain_rowwise": cfg("plain_rowwise", *ROWWISE),
        "rebal_rowwise": cfg("rebal_rowwise", *ROWWISE, *ON),
        "plain_muon": cfg("plain_muon", *muon),
        "rebal_muon": cfg("rebal_muon", *muon, *ON),
        "rebal_half": cfg("rebal_resumed", *ON, *overlap, "--train.max_steps=2"),
        "rebal_resumed": cfg("rebal_resumed", *ON, *overlap),
        "rebal_to_single": cfg("rebal_to_single", "--parallel.ep=1"),
    }
    ensure = tiny_config(tmp_path, f"--train.run_dir={tmp_path / 'prep'}", "--train.max_steps=1")
    Trainer(ensure).fit()  # prepares the shared data dir before the ranks start
    run_distributed_test(_runs, 2, args=(cfgs,))
    continue_from(cfgs, "rebal", "rebal_to_single")  # a re-placed run's checkpoint on one process

    def metrics(run: str) -> list[dict]:
        return read_metrics(tmp_path / run)

    for plain, rebal, tol in (("plain", "rebal", 1e-5), ("plain_rowwise", "rebal_rowwise", 1e-5)):
        ref, got = metrics(plain), metrics(rebal)
        assert len(got) == 4
        for a, b in zip(ref, got):
            assert abs(a["loss"] - b["loss"]) <= tol * a["loss"], (rebal, a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], rebal
        assert sum(r["experts_moved"] for r in got) > 0, rebal  # the placement did change
        assert got[-1]["moe/dropped_frac"] == 0.0
    for a, b in zip(metrics("plain_muon"), metrics("rebal_muon")):  # bf16 weights: their own round-off
        assert abs(a["loss"] - b["loss"]) <= 2e-3 * a["loss"], (a["loss"], b["loss"])

    rebal = metrics("rebal")
    placements = [r["expert_placement"] for r in rebal]
    assert placements[0] == [list(range(8))] * 2 and placements[1] != placements[0]
    # the balance metrics follow the placement: per-rank load summed as the ranks hold the experts
    loads, slots = torch.tensor(rebal[1]["expert_load"]), placements[1]
    assert rebal[1]["ep_rank_load"] == [rank_loads(row, s, 2).tolist() for row, s in zip(loads, slots)]

    manifest = json.loads((tmp_path / "rebal" / "checkpoints" / "step_00000002" / "manifest.json").read_text())
    saved = manifest["trainer_state"]["placement"]["slots"]
    assert [[saved[f"layer{i}"][f"slot{s}"] for s in range(8)] for i in range(2)] == rebal[2]["expert_placement"]
    assert [r["loss"] for r in metrics("rebal_resumed")] == [r["loss"] for r in rebal]  # exact resume
    single = metrics("rebal_to_single")
    for a, b in zip(rebal[2:], single):  # weights in logical order: resumes on one process as today
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a["loss"], b["loss"])
