"""``moeforge plan --dry-run`` on a tiny model: the trainer's build and step on fake tensors at world 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from moeforge.cli import main
from moeforge.config import Config, load_config
from moeforge.parallel.memory import STATE_KEYS, predict_state
from moeforge.plan.dryrun.collectives import CollectiveLog
from moeforge.plan.dryrun.command import default_ranks, dry_run, format_dry_run
from moeforge.plan.planner import make_plan
from moeforge.testing import run_distributed_test
from moeforge.train.trainer import Trainer

from .helpers import tiny_config, write_plan_config

NO_PAD = [
    "--model.moe.cpu_group_align=1",
    "--model.loss_implementation=default",
    "--model.attention_implementation=sdpa",
]


def test_dry_run_state_equals_the_planner_and_logs_the_step(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "--parallel.ep=2", "--parallel.bucket_size_mb=0.02", *NO_PAD)
    cfg.model.vocab_size = 300
    result = dry_run(cfg, 2, default_ranks(cfg, 2), steps=2)
    (rank0,) = result["ranks"]
    predicted = predict_state(cfg, 2)[0]
    for key in STATE_KEYS:
        assert rank0[key] == predicted[key], (key, rank0[key], predicted[key])
    split = rank0["peak_split"]
    assert rank0["peak_bytes"] >= sum(split.values()) >= 0.99 * rank0["peak_bytes"]
    assert split["params"] == rank0["params_bytes"] and split["activations"] > 0
    ops = [c["op"] for c in rank0["collectives"]]
    # per MoE layer: counts, dispatch and combine forward, then two row exchanges backward (2 layers)
    assert ops.count("alltoall_base_") == 2 * 3 + 2 * 2, ops
    assert "_reduce_scatter_base_" in ops and "_allgather_base_" in ops, ops
    assert all(c["ranks"] == [0, 1] for c in rank0["collectives"])


# ---------------------------------------------------------------- the dry run against the real gloo run

BF16 = ["--train.precision=bf16", "--train.param_dtype=bf16", "--parallel.bucket_size_mb=0.02"]
PARITY_LAYOUTS = {
    "ddp_ep2": ["--parallel.ep=2", "--parallel.bucket_size_mb=0.02"],
    "fsdp": ["--parallel.stack=fsdp"],
}


def _parity_config(root: Path, name: str, extra: list[str]) -> Config:
    return tiny_config(root, f"--train.run_dir={root / name}", "--train.max_steps=2", *NO_PAD, *extra)


def _real_steps(root: str, layouts: dict[str, list[str]]) -> None:
    """Each layout's first two real steps (the first writes RUN/memory.json); the second's collectives, logged by
    the dry run's own :class:`CollectiveLog`, go to ``root/NAME.RANK.json``."""
    for name, extra in layouts.items():
        trainer = Trainer(_parity_config(Path(root), name, extra))
        try:
            trainer.run_step(trainer.loader.next_step())
            with CollectiveLog() as log:
                trainer.run_step(trainer.loader.next_step())
        finally:
            trainer.close()
        out = Path(root) / f"{name}.{dist.get_rank()}.json"
        out.write_text(json.dumps([c.to_json() for c in log.records]))


def _routed(c: dict) -> bool:
    """A token all-to-all: how many rows each rank receives (and, backward, sends) follows the routing, which the
    dry run takes as balanced; what all ranks move together does not."""
    return c["op"].startswith("alltoall") and c["dtype"] != "int64"


def _assert_same_collectives(name: str, real: list[list[dict]], dry: list[list[dict]]) -> None:
    """Per rank the same calls in the same order (op, group, dtype), each with the same bytes; a token all-to-all's
    bytes summed over the ranks."""
    assert [len(r) for r in real] == [len(d) for d in dry], (name, [len(r) for r in real], [len(d) for d in dry])
    for i, calls in enumerate(zip(*real, *dry)):
        got, want = calls[: len(real)], calls[len(real) :]
        for g, w in zip(got, want):
            assert (g["op"], g["ranks"], g["dtype"]) == (w["op"], w["ranks"], w["dtype"]), (name, i, g, w)
            if not _routed(g):
                assert (g["in_bytes"], g["out_bytes"]) == (w["in_bytes"], w["out_bytes"]), (name, i, g, w)
        for key in ("in_bytes", "out_bytes"):
            assert sum(g[key] for g in got) == sum(w[key] for w in want), (name, i, key, got, want)


#: world 4: a pipeline and a tensor-parallel layout (bf16 parameters: masters and their own gradient dtype)
PARITY_LAYOUTS_4 = {
    "pp2_ep2": ["--parallel.pp=2", "--parallel.ep=2", "--train.micro_batch_size=2", *BF16],
    "tp2_ep2": ["--parallel.tp=2", "--parallel.ep=2", *BF16],
}


@pytest.mark.parametrize("world", [2, 4])
def test_dry_run_equals_the_real_gloo_run(tmp_path: Path, world: int) -> None:
    layouts = PARITY_LAYOUTS if world == 2 else PARITY_LAYOUTS_4
    run_distributed_test(_real_steps, world, args=(str(tmp_path), layouts))
    for name, extra in layouts.items():
        cfg = _parity_config(tmp_path, name, extra)
        cfg.model.vocab_size = 300  # the tokenizer's, as the trainer sets it
        result = dry_run(cfg, world, list(range(world)), steps=2)
        measured = json.loads((tmp_path / name / "memory.json").read_text())["ranks"]
        for m, d in zip(measured, result["ranks"], strict=True):
            for key in STATE_KEYS:
                assert m[key] == d[key], (name, m["rank"], key, m[key], d[key])
        real = [json.loads((tmp_path / f"{name}.{r}.json").read_text()) for r in range(world)]
        dry = [[{k: v for k, v in c.items() if k != "group"} for c in rep["collectives"]] for rep in result["ranks"]]
        assert all(real), name
        _assert_same_collectives(name, real, dry)


def test_a_step_of_two_micro_batches_stands_for_the_full_count(tmp_path: Path) -> None:
    for extra in PARITY_LAYOUTS.values():
        cfg = tiny_config(tmp_path, "--train.global_batch_size=16", "--train.micro_batch_size=2", *NO_PAD, *extra)
        cfg.model.vocab_size = 300
        full, short = (dry_run(cfg, 2, [0], steps=1, micro_batch_limit=n)["ranks"][0] for n in (0, 2))
        assert (full["micro_batches"], full["micro_batches_run"], short["micro_batches_run"]) == (4, 4, 2)
        for key in (*STATE_KEYS, "peak_bytes"):
            assert short[key] == full[key], (extra, key, short[key], full[key])
        assert short["collectives"] == full["collectives"], extra
        assert len({c["op"] for c in full["collectives"]}) >= 2, extra


# ---------------------------------------------------------------- the planner against the dry run, every layout

#: layouts tests/test_composition.py runs, at their world sizes (every dimension in at least one)
PLANNED_LAYOUTS = [
    (4, ["--parallel.pp=2", "--parallel.ep=2"]),
    (4, ["--parallel.tp=2", "--parallel.cp=2"]),
    (4, ["--parallel.pp=2", "--parallel.stack=fsdp", "--parallel.ep=2"]),
    (8, ["--parallel.pp=2", "--parallel.tp=2", "--parallel.ep=2"]),
    (8, ["--parallel.pp=2", "--parallel.cp=2", "--parallel.ep=2"]),
]


FAMILY_LAYOUTS = [
    ("deepseek_v3_tiny.yaml", ["--parallel.pp=2", "--parallel.tp=2"]),
    ("deepseek_v3_tiny.yaml", ["--parallel.tp=2", "--parallel.ep=2"]),
    ("gpt_oss_tiny.yaml", ["--parallel.tp=2", "--parallel.cp=2"]),
]


def test_the_planner_equals_the_dry_run_on_every_layout(tmp_path: Path) -> None:
    for world, extra in PLANNED_LAYOUTS:
        cfg = tiny_config(tmp_path, "--train.micro_batch_size=2", *BF16, *NO_PAD, *extra)
        cfg.model.vocab_size = 300
        predicted = make_plan(cfg, world, "h100")["predicted"]["ranks"]
        ranks = sorted({0, world - 1, 1 if cfg.parallel.tp > 1 else 0})  # first and last stage, both tp ranks
        for rep in dry_run(cfg, world, ranks)["ranks"]:
            for key in STATE_KEYS:
                assert rep[key] == predicted[rep["rank"]][key], (extra, rep["rank"], key, rep[key])
    configs = Path(__file__).resolve().parents[1] / "configs"
    for name, extra in FAMILY_LAYOUTS:  # latent attention and MTP on the last stage; sinks and windows
        cfg = load_config(configs / name, ["--model.vocab_size=512", *extra])
        predicted = predict_state(cfg, 4)
        for rep in dry_run(cfg, 4, [0, 1, 3])["ranks"]:
            for key in STATE_KEYS:
                assert rep[key] == predicted[rep["rank"]][key], (name, extra, rep["rank"], key, rep[key])
    staged = make_plan(tiny_config(tmp_path, *BF16, *NO_PAD, "--model.vocab_size=300", "--parallel.pp=2"), 2)
    first, last = staged["predicted"]["ranks"]
    assert first["params_bytes"] != last["params_bytes"]  # the stages differ: embedding first, head last


def test_the_last_pipeline_stage_holds_no_logits_of_finished_micro_batches(tmp_path: Path) -> None:
    """1F1B keeps at most pp micro-batches in flight. What the last stage's peak still grows by per micro-batch is
    torch's receive buffer of its input (one hidden state each), not the micro-batch's logits, which the schedule
    kept to the end of the step while it returned them."""
    peaks = []
    for batch in (8, 32):
        extra = [f"--train.global_batch_size={batch}", "--train.micro_batch_size=1", "--parallel.pp=2"]
        cfg = tiny_config(tmp_path, *NO_PAD, "--model.vocab_size=4096", *extra)
        (rep,) = dry_run(cfg, 2, [1])["ranks"]
        assert rep["micro_batches_run"] == batch, rep["micro_batches_run"]
        peaks.append(rep["peak_bytes"])
    hidden, logits = 32 * 32 * 4, 32 * 4096 * 4  # one micro-batch: 1 x seq 32 x d_model 32 / vocab 4096, fp32
    per_micro_batch = (peaks[1] - peaks[0]) / (32 - 8)
    assert 0 <= per_micro_batch <= hidden + 512 < logits, (peaks, per_micro_batch)


# ---------------------------------------------------------------- the presets at the world sizes they name

#: (preset, world, stack overrides, rank). Depth is cut to 4 layers (the 1.2T's three dense layers and one MoE
#: layer) to keep CI short: every layer's widths, the expert count and the world size are the preset's, and state
#: bytes are a sum over identical layers, so the planner's formula is checked at scale; the full-depth runs are
#: the commands of docs/dry-run.md.
PRESETS = [
    ("moe-47b.yaml", 8, [], 7),
    ("moe-47b.yaml", 8, ["--parallel.stack=fsdp", "--parallel.ep=1"], 7),
    ("moe-1.2t.yaml", 512, [], 511),
]


def test_presets_dry_run_at_scale_and_equal_the_planner() -> None:
    root = Path(__file__).resolve().parents[1] / "configs" / "presets"
    for preset, world, extra, rank in PRESETS:
        cfg = load_config(root / preset, ["--model.n_layers=4", *extra])
        result = dry_run(cfg, world, [rank])
        (rep,) = result["ranks"]
        text = format_dry_run(result, preset, 80e9)
        assert f"ran 2 of the step's {rep['micro_batches']} micro-batches" in text, text
        predicted = predict_state(cfg, world)[rank]
        for key in STATE_KEYS:
            assert rep[key] == predicted[key], (preset, extra, key, rep[key], predicted[key])
        assert rep["micro_batches_run"] == 2 < rep["micro_batches"], (preset, rep["micro_batches"])
        assert rep["peak_bytes"] > sum(rep[k] for k in STATE_KEYS), preset
        ops = {c["op"] for c in rep["collectives"]}
        assert ("alltoall_base_" in ops) == (cfg.parallel.ep > 1), (preset, ops)


def test_the_command_reports_and_exits_2_with_one_line_when_it_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_plan_config(tmp_path)
    plan = ["plan", str(config), "--world", "2", "--dry-run"]
    assert main([*plan, "--mem-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "micro-batches" not in out and "step peak (GB)" in out and "(fits)" in out, out
    assert main([*plan, "--mem-gb", "1e-6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit: rank 0 peaks at" in err[0], err
    assert main([*plan, "--ranks", "5"]) == 2
    assert "--ranks: each rank must be in [0, 2)" in capsys.readouterr().err
