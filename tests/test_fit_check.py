"""train.memory_check: a model that cannot fit one rank's memory is refused in one line, exit 2, before it is built."""

from __future__ import annotations

import logging
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moeforge.cli import main
from moeforge.config import Config, ConfigError, ModelConfig, load_config, save_config
from moeforge.model import build_model
from moeforge.plan.planner import make_plan
from moeforge.train import fit_check
from moeforge.train import trainer as trainer_module
from moeforge.train.data_setup import ensure_data
from moeforge.train.distributed import pick_device
from moeforge.train.fit_check import (
    WARN_FRACTION,
    DeviceMemory,
    assess,
    check_fit,
    device_memory,
    fit_message,
    host_memory_bytes,
    predict_rank_bytes,
)

from .helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "shakespeare.yaml"
HUGE = "--model.d_model=262144"  # the issue's case: one attention matrix alone is 274 GB in fp32
H100 = DeviceMemory(80 * 10**9, "NVIDIA H100 80GB HBM3 memory")
H200 = DeviceMemory(141 * 10**9, "NVIDIA H200 memory")
CPU = torch.device("cpu")
NEEDS = re.compile(r"needs at least ([\d,.]+) GiB .*but has ([\d,.]+) GiB")
LOG = "moeforge.train.fit_check"


class ReachedBuildError(Exception):
    """Raised in place of building the model: the run got past the check."""


def _gib(text: str) -> float:
    return float(text.replace(",", ""))


def _demo(*overrides: str) -> Config:
    """The demo config with the vocabulary its tokenizer gives it (``data.bpe_vocab_size``)."""
    return load_config(DEMO, ["--model.vocab_size=4096", *overrides])


@pytest.fixture
def tiny_yaml(tmp_path: Path) -> Path:
    """A tiny config file with its data prepared, so that a ``train`` reaches the model build at once."""
    cfg = tiny_config(tmp_path, "--train.max_steps=1", "--train.eval_batches=1")
    ensure_data(cfg)
    save_config(cfg, tmp_path / "cfg.yaml")
    return tmp_path / "cfg.yaml"


@pytest.fixture
def build_spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record each model build of the trainer and stop there instead of allocating the model."""
    calls: list[int] = []

    def spy(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> None:
        calls.append(cfg.d_model)
        raise ReachedBuildError(cfg.d_model)

    monkeypatch.setattr(trainer_module, "build_model", spy)
    return calls


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err[-3000:]
    return [line for line in err.splitlines() if line.startswith("moeforge: error:")]


# ---------------------------------------------------------------- the issue, through the CLI


def test_too_big_model_is_one_line_exit_2_before_it_is_built(
    tiny_yaml: Path, build_spy: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.perf_counter()
    code = main(["train", str(tiny_yaml), HUGE])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2
    assert build_spy == []  # refused before the model was allocated
    assert elapsed < 10, elapsed  # a meta-device count, not an allocation
    lines = _error_lines(err)
    assert len(lines) == 1 and len(err.strip().splitlines()) == 1, err
    line = lines[0]
    needed, has = (_gib(g) for g in NEEDS.search(line).groups())
    device = device_memory(pick_device())  # the trainer's device: the host's RAM here, a GPU where there is one
    assert needed > 1000 and has == pytest.approx(device.bytes / 2**30, abs=0.1)
    assert line.startswith("moeforge: error: the model does not fit in memory: each rank needs at least")
    for name in ("model.d_model=262144", "model.n_layers=2", "model.moe.num_experts=4", "model.moe.expert_hidden=32"):
        assert name in line
    assert "parallel.stack=ddp" in line and "on 1 rank" in line and f"({device.source})" in line
    assert "activations not counted" in line and "--train.memory_check=warn tries anyway" in line


def test_the_console_script_exits_2(tiny_yaml: Path) -> None:
    cmd = [sys.executable, "-m", "moeforge", "train", str(tiny_yaml), HUGE]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = _error_lines(p.stderr)
    assert len(lines) == 1 and "model.d_model=262144" in lines[0]


def test_two_processes_share_the_host_and_exit_2(tiny_yaml: Path) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two ranks take two GPUs where there are GPUs")
    cmd = [sys.executable, "-m", "moeforge", "train", str(tiny_yaml), "--nproc-per-node", "2", "--parallel.ep=2", HUGE]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = _error_lines(p.stderr)
    assert len(lines) == 1, p.stderr[-3000:]  # rank 0 reports; the other rank stops with the same code
    shared = " memory)" if torch.cuda.is_available() else "/ 2 ranks on this host)"  # a GPU each, or the host's RAM
    assert shared in lines[0] and "parallel.ep=2 on 2 ranks" in lines[0]


@pytest.mark.parametrize("policy", ["warn", "off"])
def test_override_tries_the_too_big_model_anyway(
    tiny_yaml: Path, build_spy: list[int], policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG), pytest.raises(ReachedBuildError):
        main(["train", str(tiny_yaml), HUGE, f"--train.memory_check={policy}"])
    assert build_spy == [262144]  # past the check, at the build (stopped there by the spy)
    warned = [r.getMessage() for r in caplog.records if r.name == LOG]
    if policy == "warn":
        assert len(warned) == 1 and "needs at least" in warned[0] and "model.d_model=262144" in warned[0]
        assert warned[0].endswith("trying anyway (train.memory_check=warn)")
    else:
        assert warned == []


@pytest.mark.parametrize(("policy", "code"), [("refuse", 2), ("warn", 0), ("off", 0)])
def test_a_device_too_small_for_a_tiny_model(
    tiny_yaml: Path,
    policy: str,
    code: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The tiny model on a 64 KiB device: refused, or trained to the end when the override says so."""
    monkeypatch.setattr(fit_check, "device_memory", lambda device, local_ranks=1: DeviceMemory(2**16, "a 64 KiB fake"))
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert main(["train", str(tiny_yaml), f"--train.memory_check={policy}"]) == code
    out = capsys.readouterr()
    warned = [r.getMessage() for r in caplog.records if r.name == LOG]
    if policy == "refuse":
        (line,) = _error_lines(out.err)
        assert "but has 0.0 GiB (a 64 KiB fake)" in line
    else:
        assert "final:" in out.out  # it trained
        assert len(warned) == (policy == "warn")


# ---------------------------------------------------------------- the prediction and the margin


def test_refuses_only_above_the_device_and_warns_above_ninety_percent(caplog: pytest.LogCaptureFixture) -> None:
    cfg = _demo()
    needed = assess(cfg, 2, H100).needed
    with pytest.raises(ConfigError, match="does not fit in memory"):
        check_fit(cfg, 2, CPU, available=DeviceMemory(needed - 1, "a GPU one byte short"))
    for available, warns in ((needed, True), (math.ceil(needed / WARN_FRACTION) + 1, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOG):
            fit = check_fit(cfg, 2, CPU, available=DeviceMemory(available, "a GPU"))
        assert fit is not None and fit.fits
        assert bool([r for r in caplog.records if r.name == LOG]) is warns
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOG):
        warn = _demo("--train.memory_check=warn")
        assert check_fit(warn, 2, CPU, available=DeviceMemory(needed - 1, "x"), report=False).fits is False
    assert not caplog.records  # ranks other than 0 say nothing
    assert check_fit(_demo("--train.memory_check=off"), 2, CPU, available=DeviceMemory(1, "x")) is None


def test_the_issue_on_a_gpu_and_a_huge_host() -> None:
    cfg = _demo(HUGE)
    fit = assess(cfg, 1, H100)
    assert not fit.fits and fit.needed / 2**30 > 16_000
    line = fit_message(cfg, 1, fit)
    assert "but has 74.5 GiB (NVIDIA H100 80GB HBM3 memory)" in line and "\n" not in line
    assert "every rank builds all of it" in line  # the whole model alone is larger than the GPU
    ten_tb = DeviceMemory(10 * 2**40, "a fake 10 TiB host")
    assert not assess(cfg, 1, ten_tb).fits  # the state is 16 TiB
    assert check_fit(cfg, 1, CPU, available=DeviceMemory(20 * 2**40, "a fake 20 TiB host")).fits


def test_state_is_the_planners_prediction() -> None:
    for world, ep in ((1, 1), (2, 1), (2, 2)):
        cfg = _demo(f"--parallel.ep={ep}")
        ranks = make_plan(cfg, world, "cpu")["predicted"]["ranks"]
        parts = predict_rank_bytes(cfg, world)
        keys = {"weights": "params_bytes", "gradients": "grads_bytes", "masters": "master_bytes"}
        keys["optimizer"] = "optim_bytes"
        assert {k: parts[k] for k in keys} == {k: max(r[v] for r in ranks) for k, v in keys.items()}


def test_the_build_term_is_what_build_model_allocates(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "--model.vocab_size=300")
    model = build_model(cfg.model, device="cpu")
    assert predict_rank_bytes(cfg, 1)["build"] == sum(p.numel() * p.element_size() for p in model.parameters())
    piped = load_config(DEMO, ["--model.vocab_size=4096", "--parallel.pp=2"])
    whole, staged = predict_rank_bytes(load_config(DEMO, ["--model.vocab_size=4096"]), 2), predict_rank_bytes(piped, 2)
    assert staged["build"] == whole["build"]  # every rank builds the whole model before it is carved
    assert 0 < staged["weights"] < whole["weights"]  # but holds only its stage


def test_presets_on_gpus() -> None:
    """A GPU-sized preset fits its documented 8 H100s; moe-47b is refused because every rank builds it whole."""
    olmoe = load_config(ROOT / "configs" / "presets" / "olmoe-1b-7b.yaml", [])
    assert assess(olmoe, 8, H100).fits
    big = load_config(ROOT / "configs" / "presets" / "moe-47b.yaml", [])
    fit = assess(big, 8, H200)
    assert not fit.fits and fit.needed == fit.parts["build"]
    assert "building the whole model takes 175.3 GiB before it is sharded" in fit_message(big, 8, fit)


CONFIGS = sorted([*ROOT.glob("configs/*.yaml"), *ROOT.glob("configs/bench/*.yaml")])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_configs_pass_on_this_host(path: Path, world: int, caplog: pytest.LogCaptureFixture) -> None:
    """The demo and every CPU config, on 1 and 2 processes of this host: no refusal, no warning."""
    cfg = load_config(path, [])
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = cfg.data.bpe_vocab_size
    if world == 1:
        cfg.parallel.ep = 1
    with caplog.at_level(logging.WARNING, logger=LOG):
        fit = check_fit(cfg, world, CPU, local_ranks=world)
    assert fit is not None and fit.fits and fit.fraction <= WARN_FRACTION, fit
    assert not [r for r in caplog.records if r.name == LOG]


# ---------------------------------------------------------------- the device's memory and the field


def test_host_memory_is_shared_by_its_ranks() -> None:
    one, two = device_memory(CPU, 1), device_memory(CPU, 2)
    assert one.bytes == host_memory_bytes() and one.source == "host RAM"
    assert two.bytes == host_memory_bytes() // 2 and two.source.endswith("/ 2 ranks on this host")


def test_a_cgroup_limit_below_the_ram_is_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit, unlimited = tmp_path / "memory.max", tmp_path / "v2.max"
    limit.write_text(f"{2**30}\n")
    unlimited.write_text("max\n")
    monkeypatch.setattr(fit_check, "CGROUP_LIMITS", (unlimited, tmp_path / "missing"))
    physical = host_memory_bytes()
    assert physical > 2**30
    monkeypatch.setattr(fit_check, "CGROUP_LIMITS", (unlimited, limit))
    assert host_memory_bytes() == 2**30


def test_the_field_takes_three_values() -> None:
    assert _demo().train.memory_check == "refuse"
    with pytest.raises(ConfigError, match=r"train\.memory_check"):
        _demo("--train.memory_check=maybe")
