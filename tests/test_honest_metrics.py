"""Numbers mean what they say: random routing resumes exactly and differs per rank, balance metrics count
every micro-batch and rank and agree with the bench, and the bench's async-save blocking time is only the
part that blocks."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from moeforge.bench.worker import build_parser, run_variant
from moeforge.config import save_config
from moeforge.testing import run_distributed_test
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import tiny_config

RANDOM = ["--model.moe.random_routing=true", "--train.max_steps=4", "--train.save_every=2", "--optim.warmup_steps=0"]


def _random_routing_resume(root: str, *extra: str) -> None:
    root_p = Path(root)
    whole = Trainer(tiny_config(root_p, f"--train.run_dir={root_p / 'whole'}", *RANDOM, *extra))
    whole.fit()
    half = Trainer(tiny_config(root_p, f"--train.run_dir={root_p / 'halves'}", *RANDOM, *extra))
    for _ in range(2):
        half.run_step(half.loader.next_step())
    half.save()
    Trainer(tiny_config(root_p, f"--train.run_dir={root_p / 'halves'}", *RANDOM, *extra)).fit()
    if whole.mesh.distributed:  # every rank draws its own routes from the same tokens
        router = whole.model.moe_layers()[0].router
        x = torch.ones(16, whole.cfg.model.d_model)
        mine = router(x).indices
        other = torch.empty_like(mine)
        dist.broadcast(other.copy_(mine), src=0)
        same = torch.tensor([int(torch.equal(mine, other))])
        dist.all_reduce(same)
        assert int(same) == 1, "rank 1's draws equal rank 0's"


def _check_resumed(root: Path) -> None:
    whole = [r["loss"] for r in read_metrics(root / "whole")]
    halves = {r["step"]: r["loss"] for r in read_metrics(root / "halves")}
    assert len(whole) == 4 and [halves[3], halves[4]] == whole[2:], (whole, halves)


def test_random_routing_resumes_exactly_on_one_rank(tmp_path: Path) -> None:
    _random_routing_resume(str(tmp_path))
    _check_resumed(tmp_path)


def test_random_routing_resumes_exactly_on_two_ranks(tmp_path: Path) -> None:
    tiny_config(tmp_path)  # the corpus, before the ranks start
    Trainer(tiny_config(tmp_path, "--train.max_steps=1", f"--train.run_dir={tmp_path / 'prep'}"))
    run_distributed_test(_random_routing_resume, 2, args=(str(tmp_path), "--parallel.ep=2"))
    _check_resumed(tmp_path)


def _demo_random(root: Path, run: Path, steps: int, optim: str) -> list[str]:
    """The demo config (bf16, grouped experts, its batch of 8 in micro-batches of 4, an evaluation at a run's
    last step) on the synthetic corpus with random routing and a constant learning rate, so a 4-step run
    resumed to 8 steps takes the same steps as 8 uninterrupted ones."""
    tiny = tiny_config(root)
    return [
        f"--data.sources=[{','.join(tiny.data.sources)}]",
        f"--data.data_dir={tiny.data.data_dir}",
        "--data.bpe_vocab_size=300",
        "--data.seq_len=64",
        "--data.val_fraction=0.2",
        "--model.moe.random_routing=true",
        f"--optim.name={optim}",
        "--optim.schedule=constant",
        "--optim.warmup_steps=0",
        f"--train.max_steps={steps}",
        "--train.eval_batches=1",
        "--train.save_every=0",
        "--train.sample_tokens=0",
        f"--train.run_dir={run}",
        "--logging.progress=false",
        "--parallel.ep=2",
    ]


def _demo_random_resume(root: str, optim: str) -> None:
    from moeforge.config import load_config

    root_p, demo = Path(root), Path(__file__).resolve().parents[1] / "configs" / "shakespeare.yaml"
    Trainer(load_config(demo, _demo_random(root_p, root_p / optim / "whole", 8, optim))).fit()
    halves = root_p / optim / "halves"
    Trainer(load_config(demo, _demo_random(root_p, halves, 4, optim))).fit()  # evaluates at its step 4
    Trainer(load_config(demo, _demo_random(root_p, halves, 8, optim))).fit()


def test_random_routing_resumes_exactly_on_the_demo_config_at_ep2(tmp_path: Path) -> None:
    """The demo at ep=2 on 2 ranks: 4 steps, an evaluation, a resume to 8 equal 8 uninterrupted steps, with Muon
    (the demo's optimizer) and AdamW. Evaluation used to draw routes from training's stream, so the resumed
    run's step 5 routed differently."""
    tiny_config(tmp_path)  # the corpus, before the ranks start
    Trainer(tiny_config(tmp_path, "--train.max_steps=1", f"--train.run_dir={tmp_path / 'prep'}"))
    for optim in ("muon", "adamw"):
        run_distributed_test(_demo_random_resume, 2, args=(str(tmp_path), optim))
        whole = [r["loss"] for r in read_metrics(tmp_path / optim / "whole")]
        halves = [r["loss"] for r in read_metrics(tmp_path / optim / "halves")]
        assert len(whole) == 8 and halves == whole, (optim, whole, halves)


def test_step_metrics_count_every_micro_batch(tmp_path: Path) -> None:
    """One step of 2 micro-batches: the logged per-expert load is the routes of the whole global batch."""
    cfg = tiny_config(tmp_path, "--train.max_steps=1", "--train.micro_batch_size=2")
    trainer = Trainer(cfg)
    rows = trainer.train_data.rows(trainer.loader.global_batch_indices())
    with torch.no_grad():
        trainer.model(rows[:, :-1])  # same weights as the step's forwards
    expected = [m.last_routing.tokens_per_expert.tolist() for m in trainer.model.moe_layers()]
    trainer.fit()
    record = read_metrics(cfg.train.run_dir)[0]
    assert record["expert_load"] == expected
    routes = rows[:, :-1].numel() * cfg.model.moe.top_k
    assert all(sum(layer) == routes for layer in record["expert_load"])


def _bench_and_fit(root: str, cfg_path: str) -> None:
    from moeforge.config import load_config

    flags = ["--warmup", "0", "--steps", "1", "--no-profile", "--no-checkpoint", "--probe-s", "0.02"]
    args = build_parser().parse_args(["--config", cfg_path, "--out", f"{root}/bench", "--name", "v", *flags])
    bench = run_variant(args)
    cfg = load_config(cfg_path)
    cfg.train.run_dir = f"{root}/fit"
    Trainer(cfg).fit()
    if dist.get_rank() == 0:
        Path(root, "bench.json").write_text(json.dumps(bench))


def test_trainer_metrics_agree_with_the_bench(tmp_path: Path) -> None:
    """Same config, same first step on 2 ranks with drops: metrics.jsonl and the bench report the same load."""
    cfg = tiny_config(
        tmp_path,
        "--parallel.ep=2",
        "--model.moe.dispatcher=rowwise",
        "--model.moe.capacity_factor=0.6",
        "--train.max_steps=1",
        "--train.micro_batch_size=2",
    )
    Trainer(tiny_config(tmp_path, "--train.max_steps=1", f"--train.run_dir={tmp_path / 'prep'}"))
    save_config(cfg, tmp_path / "cfg.yaml")
    run_distributed_test(_bench_and_fit, 2, args=(str(tmp_path), str(tmp_path / "cfg.yaml")))
    bench = json.loads((tmp_path / "bench.json").read_text())
    record = read_metrics(tmp_path / "fit")[0]
    assert record["moe/dropped_frac"] > 0  # the comparison covers drops
    assert bench["expert_load"] == record["expert_load"]
    assert bench["ep_rank_load"] == record["ep_rank_load"]
    assert bench["expert_load_max_over_mean_per_layer"] == record["expert_load_max_over_mean"]
    assert bench["expert_load_max_over_mean"] == max(record["expert_load_max_over_mean"])
    n_layers = len(record["expert_load"])
    rank = max(record[f"moe/layer{i}/rank_imbalance"] for i in range(n_layers))
    assert bench["ep_rank_load_max_over_mean"] == rank
    assert abs(bench["dropped_frac"] - record["moe/dropped_frac"]) < 1e-12
    assert bench["losses"][0] == record["loss"]


def test_bench_async_blocking_is_only_the_snapshot(tmp_path: Path) -> None:
    big = ["--model.d_model=128", "--model.moe.num_experts=16", "--model.moe.expert_hidden=1024"]
    results = {}
    for mode in ("false", "true"):
        cfg = tiny_config(tmp_path, *big, f"--train.async_save={mode}", "--train.max_steps=2")
        save_config(cfg, tmp_path / f"{mode}.yaml")
        flags = ["--warmup", "0", "--steps", "1", "--probe-s", "0.02"]  # profiling on, the default
        args = build_parser().parse_args(
            ["--config", str(tmp_path / f"{mode}.yaml"), "--out", str(tmp_path / mode), "--name", mode, *flags]
        )
        results[mode] = run_variant(args)
    sync, async_ = results["false"], results["true"]
    assert sync["ckpt_bytes"] > 50e6 and abs(sync["ckpt_bytes"] - async_["ckpt_bytes"]) < 1e5
    assert async_["ckpt_save_blocking_s"] < 0.5 * sync["ckpt_save_blocking_s"], (async_, sync)
    assert async_["ckpt_save_blocking_s"] < 0.5 * async_["ckpt_save_s"]
    assert abs(sync["ckpt_save_blocking_s"] - sync["ckpt_save_s"]) < 0.2 * sync["ckpt_save_s"]
    for r in (sync, async_):  # the figures are medians over the repeated saves, each with its own raw probe
        assert r["ckpt_repeats"] == 3 and all(len(r[f"ckpt_{k}_all"]) == 3 for k in ("save_s", "raw_write_s"))
        assert r["ckpt_save_s"] == statistics.median(r["ckpt_save_s_all"]) and min(r["ckpt_raw_write_s_all"]) > 0
        assert r["ckpt_first_save_blocking_s"] == r["ckpt_save_blocking_s_all"][0]
