"""``moeforge bench --compare hf`` / ``hf_layer`` and the GPU check, on tiny sizes: the peers hold the same
weights (fp32 losses and outputs agree), see the same inputs, and the GPU check without a GPU is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeforge.bench.compare_hf import batch_hash, compare_steps, token_batches
from moeforge.bench.compare_layer import compare_layer
from moeforge.cli import main
from moeforge.config import ModelConfig, MoEConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    qk_norm="per_head",
    norm_eps=1e-6,
    max_seq_len=32,
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, norm_topk_prob=True, dispatcher="local"),
)


def test_compare_steps_same_weights_same_inputs() -> None:
    r = compare_steps(TINY, 2, 16, warmup=1, steps=2, peak_tflops=1.0)
    expected_hash = batch_hash(token_batches(96, 2, 16, 3, 0, torch.device("cpu")))
    assert set(r["modes"]) == {"fp32", "bf16_autocast", "bf16_params"}
    for mode, row in r["modes"].items():
        ours, hf = row["moeforge"], row["hf"]
        assert row["same_inputs"] and ours["input_hash"] == hf["input_hash"] == expected_hash, mode
        assert len(ours["step_s"]) == len(hf["step_s"]) == 2
        assert row["ratio"] == pytest.approx(ours["tokens_per_s"] / hf["tokens_per_s"])
        assert 0 < ours["mfu"] < 1
        tol = 1e-5 if mode == "fp32" else 2e-2
        assert ours["first_lm_loss"] == pytest.approx(hf["first_lm_loss"], rel=tol), mode
        # the kernels as moeforge's trainer chooses them on the CPU, recorded: eager attention in bf16, the fused head
        assert ours["kernels"]["attention"] == ("sdpa" if mode == "fp32" else "eager"), mode
        assert ours["kernels"]["fused_loss"] and not ours["kernels"]["attention_upcast"], mode


def test_compare_steps_isolated_modes_match_one_process() -> None:
    """A mode in its own spawned process sees the same batches and starts from the same weights and losses."""
    kw = {"modes": ("fp32", "bf16_params"), "warmup": 0, "steps": 2, "peak_tflops": 1.0}
    one, isolated = compare_steps(TINY, 2, 16, **kw), compare_steps(TINY, 2, 16, isolate=True, **kw)
    assert one["mode_isolation"] == "one process" and isolated["mode_isolation"] == "a fresh process per mode"
    assert list(isolated["modes"]) == ["fp32", "bf16_params"]
    for mode, row in isolated["modes"].items():
        ref = one["modes"][mode]
        assert row["same_inputs"] and row["hf"]["input_hash"] == ref["hf"]["input_hash"], mode
        for name in ("moeforge", "hf"):
            assert len(row[name]["step_s"]) == 2
            assert row[name]["first_lm_loss"] == pytest.approx(ref[name]["first_lm_loss"], rel=1e-6), (mode, name)


def test_compare_layer_outputs_agree_fp32() -> None:
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=16, norm_topk_prob=True, dispatcher="local")
    r = compare_layer(32, moe, 64, dtype=torch.float32, warmup=0, steps=1)
    a = r["agreement"]
    assert a["same_routes"] == 1.0
    assert a["output_max_err_over_rms"] < 1e-5 and a["input_grad_max_err_over_rms"] < 1e-5
    assert r["ratio"] > 0 and r["torchtitan"] is None and "triton" in r["torchtitan_note"]


def test_bench_compare_hf_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "hf.yaml"
    cfg.write_text(
        "model: {vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 2, head_dim: 16, qk_norm: per_head, "
        "max_seq_len: 16, moe: {num_experts: 4, top_k: 2, expert_hidden: 16, dispatcher: local}}\n"
        "data: {seq_len: 8}\ntrain: {micro_batch_size: 2, global_batch_size: 2}\n"
    )
    out = tmp_path / "out"
    rc = main(["bench", str(cfg), "--compare", "hf", "--warmup", "0", "--steps", "1", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    assert result["threads"] == 1 and result["batch"] == 2 and result["seq_len"] == 8
    assert result["env"]["torch_version"] == torch.__version__
    assert "--compare hf" in result["command"]
    assert "| fp32 |" in capsys.readouterr().out
    cfg.write_text(cfg.read_text().replace("vocab_size: 64, ", ""))
    assert main(["bench", str(cfg), "--compare", "hf", "--steps", "1", "--out", str(out)]) == 2


def test_gpu_check_without_cuda_is_one_line() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU"), proc.stdout
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "moeforge.bench.cuda_check", "--out", "/nonexistent/never-written"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("gpu_check: no CUDA device"), proc.stdout + proc.stderr
    assert len(proc.stdout.splitlines()) == 1
