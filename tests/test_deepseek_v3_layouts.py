"""A DeepSeek-V3-shaped model (latent attention, MTP, sigmoid group-limited routing, shared expert, a dense first
layer) trains on 2 gloo processes with ep=2, on the ddp and the fsdp stack, as on one process (fp32)."""

from __future__ import annotations

from pathlib import Path

from moeforge.testing import run_distributed_test
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import MLA_ARGS, tiny_config

DEEPSEEK = [
    *MLA_ARGS,
    "--model.mtp_depth=1",
    "--model.dense_layers=[0]",
    "--model.moe.score_func=sigmoid",
    "--model.moe.n_groups=2",
    "--model.moe.topk_groups=1",
    "--model.moe.group_score=top2_sum",
    "--model.moe.routed_scaling_factor=2.0",
    "--model.moe.shared_expert_hidden=32",
    "--model.moe.bias_update_rate=0.01",
    "--train.max_steps=3",
]
LAYOUTS = {"ddp_ep2": ["--parallel.ep=2"], "fsdp_ep2": ["--parallel.stack=fsdp", "--parallel.ep=2"]}


def _train_all(root: str) -> None:
    for name, extra in LAYOUTS.items():
        Trainer(tiny_config(Path(root), f"--train.run_dir={Path(root) / name}", *DEEPSEEK, *extra)).fit()


def test_deepseek_v3_layouts_match_single_process(tmp_path: Path) -> None:
    ref_cfg = tiny_config(tmp_path, f"--train.run_dir={tmp_path / 'ref'}", *DEEPSEEK)
    Trainer(ref_cfg).fit()  # also prepares the shared data dir before the ranks start
    ref = [r for r in read_metrics(ref_cfg.train.run_dir) if "grad_norm" in r]
    assert len(ref) == 3 and ref[-1]["loss"] - ref[-1]["lm_loss"] > 0.3  # the MTP loss is in it
    run_distributed_test(_train_all, 2, args=(str(tmp_path),))
    for name in LAYOUTS:
        got = [r for r in read_metrics(tmp_path / name) if "grad_norm" in r]
        assert len(got) == 3, name
        for a, b in zip(ref, got):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (name, a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], name
            assert a["expert_load"] == b["expert_load"], name  # the same routes, the MTP block's included
