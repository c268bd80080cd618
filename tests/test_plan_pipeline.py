"""``moeforge plan`` accounts pipeline stages: parameters per pp rank and activations in flight per schedule."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from moeforge.config import load_config
from moeforge.plan.pipeline import in_flight
from moeforge.plan.planner import add_plan_arguments, make_plan, run_plan

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "shakespeare.yaml"
BASE = ["--model.vocab_size=4096", "--parallel.pp=2", "--train.global_batch_size=32", "--train.micro_batch_size=16"]


def test_1f1b_holds_up_to_pp_micro_batches_on_the_first_stage_gpipe_all() -> None:
    assert in_flight("1f1b", 4, 1, 8, 0) == {0: 4}
    assert in_flight("1f1b", 4, 1, 8, 3) == {3: 1}
    assert in_flight("1f1b", 4, 1, 2, 0) == {0: 2}
    assert in_flight("gpipe", 4, 1, 8, 2) == {2: 8}
    # torch's ZBV order on 2 ranks, 4 micro-batches, rank 0 (stages 0 and 3): F0 F1 F2 of stage 0, then
    # stage 3's F0 before its first backward: 3 + 1 held; a stage's activations go at its weight gradient
    assert in_flight("zbv", 2, 2, 4, 0) == {0: 3, 3: 1}
    flights = in_flight("interleaved_1f1b", 2, 2, 4, 0)
    assert set(flights) == {0, 2} and sum(flights.values()) <= 8


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("zbv", 2), ("interleaved_1f1b", 2)])
def test_plan_splits_the_parameters_over_the_stages(schedule: str, v: int) -> None:
    cfg = load_config(
        CONFIG,
        [
            *BASE,
            f"--parallel.pp_schedule={schedule}",
            f"--parallel.pp_stages_per_rank={v}",
            "--train.micro_batch_size=4",
        ],
    )
    plan = make_plan(cfg, world=2, device="cpu")
    pipe = plan["pipeline"]
    assert pipe["micro_batches"] == 8 and pipe["schedule"] == schedule
    assert sum(r["params"] for r in pipe["ranks"]) == plan["params_total"]
    assert [s for r in pipe["ranks"] for s in r["stages"]] != [] and all(
        r["activation_bytes_in_flight"] > 0 for r in pipe["ranks"]
    )
    first, last = pipe["ranks"]
    if schedule == "1f1b":
        assert first["micro_batches_in_flight"] == {"0": 2} and last["micro_batches_in_flight"] == {"1": 1}
    if schedule == "gpipe":
        assert first["micro_batches_in_flight"] == {"0": 8}
    if schedule == "zbv":
        assert first["stages"] == [0, 3] and last["stages"] == [1, 2]


def test_plan_without_pp_has_no_pipeline_and_the_text_shows_the_stages(capsys: pytest.CaptureFixture[str]) -> None:
    assert make_plan(load_config(CONFIG, ["--model.vocab_size=4096"]), world=2, device="cpu")["pipeline"] is None
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args, extra = parser.parse_known_args([str(CONFIG), "--world", "2", "--device", "cpu", *BASE])
    assert run_plan(args, extra) == 0
    out = capsys.readouterr().out
    assert "pipeline: pp 2 x dp 1, schedule 1f1b, 2 micro-batches" in out and "rank 1: stages [1]" in out
