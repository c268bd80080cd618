"""Kernel selection at model build (:mod:`moeforge.model.kernels`): fixed rules from the config and the device
kind, the same numerics whatever the machine's load, and checkpoints of the release that timed its kernels."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from moeforge.config import load_config
from moeforge.model import build_model
from moeforge.model.attention import Attention
from moeforge.model.kernels import KernelChoice, apply_kernels, select_kernels
from moeforge.model.moe.experts import GroupedExperts
from moeforge.ops.bf16_gemm import native_bf16_gemm
from moeforge.ops.eager_attention import EAGER_MAX_SEQ
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer
from tests.helpers import tiny_config

CPU_GROUP_ALIGN = 64  # model.moe.cpu_group_align's default
EMULATED = not native_bf16_gemm()  # bf16 CPU GEMMs computed in fp32 on this CPU (model.cpu_bf16_gemm=auto)
ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "checkpoint_1ed638f"


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


@pytest.mark.parametrize(
    ("overrides", "device", "want"),
    [
        (("--train.precision=bf16",), "cpu", KernelChoice("eager", False, True, CPU_GROUP_ALIGN, EMULATED)),
        (
            ("--train.precision=bf16", "--train.param_dtype=bf16"),
            "cpu",
            KernelChoice("eager", False, True, CPU_GROUP_ALIGN, EMULATED),
        ),
        (("--train.precision=fp32",), "cpu", KernelChoice("sdpa", False, True, 1)),
        (("--train.precision=bf16",), "cuda", KernelChoice("sdpa", False, False, 1)),
        (("--train.precision=bf16", "--model.attention_precision=fp32"), "cuda", KernelChoice("sdpa", True, False, 1)),
        (
            ("--train.precision=bf16", "--model.attention_implementation=eager"),
            "cuda",
            KernelChoice("eager", False, False, 1),
        ),
        (
            ("--train.precision=bf16", "--model.loss_implementation=fused_linear"),
            "cuda",
            KernelChoice("sdpa", False, True, 1),
        ),
        (
            ("--train.precision=bf16", "--model.loss_implementation=default", "--model.moe.cpu_group_align=16"),
            "cpu",
            KernelChoice("eager", False, False, 16, EMULATED),
        ),
        # P grows with the square of the sequence: eager only up to EAGER_MAX_SEQ positions per rank
        (
            (
                "--train.precision=bf16",
                f"--data.seq_len={2 * EAGER_MAX_SEQ}",
                f"--model.max_seq_len={2 * EAGER_MAX_SEQ}",
            ),
            "cpu",
            KernelChoice("sdpa", False, True, CPU_GROUP_ALIGN, EMULATED),
        ),
        # the vocab-parallel head has its own loss
        (
            ("--train.precision=bf16", "--parallel.tp=2"),
            "cpu",
            KernelChoice("eager", False, False, CPU_GROUP_ALIGN, EMULATED),
        ),
    ],
)
def test_the_rules(overrides: tuple[str, ...], device: str, want: KernelChoice) -> None:
    cfg = _cfg(*overrides)
    assert select_kernels(cfg, device) == want
    assert select_kernels(cfg, torch.device(device)) == want  # a function of the device kind only


def test_apply_sets_every_layer() -> None:
    cfg = _cfg("--train.precision=bf16", "--model.n_layers=2", "--model.d_model=32", "--model.vocab_size=64")
    model = build_model(cfg.model, seed=0)
    choice = apply_kernels(model, KernelChoice("eager", True, True, 16))
    assert choice.to_dict() == {
        "attention": "eager",
        "attention_upcast": True,
        "fused_loss": True,
        "expert_row_align": 16,
        "bf16_gemm_fp32": False,
    }
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert attn and all(m.eager and m.upcast for m in attn)
    assert experts and all(m.cpu_align == 16 for m in experts)


def _demo(tmp: Path, name: str):
    """The demo config (its model, bf16 autocast, every kernel setting ``auto``), a few short steps."""
    tiny = tiny_config(tmp / name)  # the synthetic corpus, prepared once per run dir
    return load_config(
        ROOT / "configs" / "shakespeare.yaml",
        [
            f"--data.sources=[{','.join(tiny.data.sources)}]",
            f"--data.data_dir={tiny.data.data_dir}",
            "--data.bpe_vocab_size=300",
            "--data.seq_len=64",
            "--train.max_steps=3",
            "--train.global_batch_size=2",
            "--train.micro_batch_size=2",
            "--train.eval_every=0",
            "--train.eval_batches=1",
            "--train.save_every=0",
            "--train.sample_tokens=0",
            f"--train.run_dir={tmp / name / 'run'}",
            "--logging.progress=false",
        ],
    )


def test_the_demo_trains_the_same_whatever_the_timings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs of the demo config, the second on a 'machine' whose every timing reads 100x slower and whose
    attention timer fails if called: the same kernels and bit-identical losses."""
    quiet = Trainer(_demo(tmp_path, "quiet"))
    quiet.fit()
    assert quiet.kernels == KernelChoice("eager", False, True, CPU_GROUP_ALIGN, EMULATED)  # the demo's CPU rule

    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: 100 * real())

    def no_timing(*args, **kwargs):
        raise AssertionError("kernel selection timed something")

    monkeypatch.setattr("moeforge.bench.tune.time_sdpa", no_timing)
    loaded = Trainer(_demo(tmp_path, "loaded"))
    loaded.fit()
    assert loaded.kernels == quiet.kernels
    losses = {name: [r["loss"] for r in read_metrics(tmp_path / name / "run")] for name in ("quiet", "loaded")}
    assert len(losses["quiet"]) == 3 and losses["quiet"] == losses["loaded"]


def _resume_fixture(tmp: Path, name: str) -> list[float]:
    cfg = tiny_config(tmp / name)
    ckpts = Path(cfg.train.run_dir) / "checkpoints"
    shutil.copytree(FIXTURE / "step_00000004", ckpts / "step_00000004")
    (ckpts / "latest").write_text("step_00000004\n")
    trainer = Trainer(cfg)
    trainer.fit()
    assert trainer.kernels == select_kernels(cfg, "cpu")  # the rules decide, not the state the release saved
    return [r["loss"] for r in read_metrics(cfg.train.run_dir)]


def test_a_checkpoint_of_the_release_that_timed_its_kernels_resumes_exactly(tmp_path: Path) -> None:
    """The fixture is step 4 of ``tiny_config(..., --train.save_every=4)`` (8 steps) written by commit
    1ed638f, whose trainer state also held ``attention_upcast`` and ``attention_eager``: it resumes, twice to the
    same bits, and steps 5-8 follow the uninterrupted run's. Those agree to fp32 round-off, not to the bit: the
    fixture's first four steps ran on another CPU, whose GEMM kernels sum in another order."""
    manifest = (FIXTURE / "step_00000004" / "manifest.json").read_text()
    assert '"attention_upcast"' in manifest and '"attention_eager"' in manifest
    straight = tiny_config(tmp_path / "straight")
    Trainer(straight).fit()
    want = [r["loss"] for r in read_metrics(straight.train.run_dir)][4:]
    got = _resume_fixture(tmp_path, "resumed")
    assert got == _resume_fixture(tmp_path, "again")
    assert len(got) == 4 and got == pytest.approx(want, rel=1e-5, abs=0)
