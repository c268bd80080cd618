"""Trainer: learning, metrics, exact resume, non-finite steps, sampling (single process, fp32)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from moeforge.train.checkpoint.manager import complete_checkpoints
from moeforge.train.metrics import read_metrics
from moeforge.train.sampling import generate_from_run
from moeforge.train.trainer import Trainer, TrainingError

from .helpers import tiny_config

KEYS = {"step", "loss", "lm_loss", "aux_loss", "z_loss", "lr", "grad_norm", "tokens_per_s", "expert_load_max_over_mean"}


def test_loss_falls_and_metrics_are_written(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "--train.max_steps=30", "--train.eval_every=15")
    last = Trainer(cfg).fit()
    records = read_metrics(cfg.train.run_dir)
    assert len(records) == 30
    assert KEYS <= set(records[0])
    assert len(records[0]["expert_load_max_over_mean"]) == 2
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert "val_bpb" in records[14] and "val_bpb" in last
    assert math.isfinite(last["val_bpb"]) and last["val_bpb"] > 0
    assert (Path(cfg.train.run_dir) / "config.yaml").is_file()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_exact_resume(tmp_path: Path, optimizer: str) -> None:
    """Muon's momentum travels in AdamW's checkpoint keys (``exp_avg``) and resumes as exactly."""
    opt = f"--optim.name={optimizer}"
    straight = tiny_config(tmp_path / "a", "--train.max_steps=6", opt)
    Trainer(straight).fit()
    ref = [r["loss"] for r in read_metrics(straight.train.run_dir)]

    half = tiny_config(tmp_path / "b", "--train.max_steps=3", opt)
    Trainer(half).fit()
    full = tiny_config(tmp_path / "b", "--train.max_steps=6", opt)
    Trainer(full).fit()  # resumes from step 3 in the same run dir
    resumed = [r["loss"] for r in read_metrics(full.train.run_dir)]
    assert len(resumed) == 6
    assert resumed == ref  # bit-identical in fp32 on CPU


def test_checkpoints_are_published_and_pruned(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "--train.max_steps=6", "--train.save_every=2", "--train.keep_last=2")
    Trainer(cfg).fit()
    names = [p.name for p in complete_checkpoints(cfg.train.run_dir)]
    assert names == ["step_00000004", "step_00000006"]
    root = Path(cfg.train.run_dir) / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000006"
    assert not list(root.glob(".tmp_*"))
    manifest = json.loads((root / "step_00000006" / "manifest.json").read_text())
    state = manifest["trainer_state"]
    assert manifest["step"] == 6 and state["step"] == 6 and state["loader"]["position"] == 6


def test_corrupt_newest_checkpoint_falls_back(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "--train.max_steps=4", "--train.save_every=2")
    Trainer(cfg).fit()
    newest = complete_checkpoints(cfg.train.run_dir)[-1]
    data = sorted(newest.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])
    t = Trainer(tiny_config(tmp_path, "--train.max_steps=4", "--train.save_every=2"))
    assert t.maybe_resume()
    assert t.step == 2


def test_non_finite_steps_are_skipped_then_stop(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "--train.max_steps=2")
    Trainer(cfg).fit()
    good = complete_checkpoints(cfg.train.run_dir)[-1]
    data = sorted(good.glob("*.distcp"))[0]
    before = data.read_bytes()
    cfg2 = tiny_config(tmp_path, "--train.max_steps=10", "--train.max_consecutive_skips=3")
    trainer = Trainer(cfg2)
    trainer.model.register_forward_hook(lambda m, i, o: o * float("nan"))
    with pytest.raises(TrainingError, match="3 consecutive non-finite steps"):
        trainer.fit()
    records = read_metrics(cfg.train.run_dir)
    assert [r["skipped"] for r in records[-3:]] == [True, True, True]
    assert data.read_bytes() == before
    w = trainer.model.layers[0].self_attn.q_proj.weight
    assert torch.isfinite(w).all()


def test_generate_from_run(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "--train.max_steps=2")
    Trainer(cfg).fit()
    a = generate_from_run(cfg.train.run_dir, "the king", 12, 0.8, 20, seed=1)
    b = generate_from_run(cfg.train.run_dir, "the king", 12, 0.8, 20, seed=1)
    assert a == b and a.startswith("the king") and len(a) > len("the king")
    shutil.rmtree(Path(cfg.train.run_dir) / "checkpoints")
    from moeforge.train.checkpoint.manager import CheckpointError

    with pytest.raises(CheckpointError, match="no loadable checkpoint"):
        generate_from_run(cfg.train.run_dir, "x", 2, 0.8, 20, seed=1)


def test_callbacks_see_every_hook_in_order(tmp_path) -> None:
    """``Trainer(cfg, callbacks=...)``: each hook once per event, in the loop's order, on the trainer's state."""
    from moeforge.train.callbacks import Callback

    seen: list[tuple[str, int]] = []

    class Recorder(Callback):
        def pre_train(self, trainer) -> None:
            seen.append(("pre_train", trainer.step))

        def post_step(self, trainer, record) -> None:
            assert record["step"] == trainer.step
            seen.append(("post_step", trainer.step))

        def pre_checkpoint(self, trainer) -> None:
            seen.append(("pre_checkpoint", trainer.step))

        def post_train(self, trainer) -> None:
            seen.append(("post_train", trainer.step))

    cfg = tiny_config(tmp_path, "--train.max_steps=3", "--train.save_every=2")
    Trainer(cfg, callbacks=[Recorder()]).fit()
    assert seen == [
        ("pre_train", 0),
        ("post_step", 1),
        ("post_step", 2),
        ("pre_checkpoint", 2),
        ("post_step", 3),
        ("pre_checkpoint", 3),
        ("post_train", 3),
    ]


def test_a_run_dir_config_of_the_earlier_release_still_loads(tmp_path) -> None:
    """``train.debug_kill_at_step`` left the config (the test suite's fault injection is a callback now): an old
    RUN/config.yaml holding it at its default loads; any other value is refused, naming the key."""
    import yaml

    from moeforge.config import ConfigError, load_config, save_config

    cfg = tiny_config(tmp_path)
    data = cfg.to_dict()
    data["train"]["debug_kill_at_step"] = 0
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(data))
    old = load_config(tmp_path / "old.yaml")
    save_config(old, tmp_path / "new.yaml")
    assert "debug_kill_at_step" not in (tmp_path / "new.yaml").read_text()
    data["train"]["debug_kill_at_step"] = 3
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"train\.debug_kill_at_step: unknown key"):
        load_config(tmp_path / "old.yaml")
