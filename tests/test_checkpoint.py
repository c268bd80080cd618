"""Distributed checkpoints: resharding across layouts, exact resume, atomicity under SIGKILL,
automatic restart under torchrun, async save, safety checks and conversion (fp32, CPU, gloo).

Every run trains the tiny config of tests/helpers.py with router bias balancing
on (so the router biases are state that matters) and checkpoints at step 2.
Continuations are compared with uninterrupted runs, step by step.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeforge.config import save_config
from moeforge.model import build_model
from moeforge.parallel.data_parallel.flat_shards import flat_range_boxes
from moeforge.parallel.stack import LocalStack
from moeforge.testing import run_distributed_test
from moeforge.train.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    ResumeRefusedError,
    complete_checkpoints,
    verify_checkpoint,
)
from moeforge.train.checkpoint.store import read_metadata
from moeforge.train.data_setup import ensure_data
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import continue_from, tiny_config

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "--train.max_steps=4",
    "--train.save_every=2",
    "--train.global_batch_size=16",
    "--train.micro_batch_size=4",
    "--model.moe.bias_update_rate=0.01",
    "--train.eval_batches=1",
]
LAYOUTS = {
    "single": [],
    "ddp2": ["--parallel.ep=2"],
    "fsdp": ["--parallel.stack=fsdp"],
    "ddp4": ["--parallel.ep=4"],
}


def _cfg(root: Path, run: str, layout: str, *extra: str):
    return tiny_config(root, f"--train.run_dir={root / run}", *BASE, *LAYOUTS[layout], *extra)


def _losses(root: Path, run: str) -> list[float]:
    return [r["loss"] for r in read_metrics(root / run)]


def _close(got: list[float], ref: list[float], what: str) -> None:
    assert len(got) == len(ref), (what, got, ref)
    for a, b in zip(got, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (what, got, ref)


def _two_ranks(cfgs: dict) -> None:
    Trainer(cfgs["ddp2"]).fit()  # uninterrupted reference, checkpoints at 2 and 4
    Trainer(cfgs["ddp2_half"]).fit()  # stop at step 2 ...
    Trainer(cfgs["ddp2_resumed"]).fit()  # ... and resume in the same run dir
    continue_from(cfgs, "single", "single_to_ddp2")
    continue_from(cfgs, "ddp2", "ddp2_to_fsdp")
    Trainer(cfgs["fsdp"]).fit()
    continue_from(cfgs, "fsdp", "fsdp_to_ddp2")


def _four_ranks(cfgs: dict) -> None:
    continue_from(cfgs, "ddp2", "ddp2_to_ddp4")


def test_resharding_and_exact_resume(tmp_path: Path) -> None:
    # Configs are built here: tiny_config rewrites the corpus, which ranks must not race on.
    runs = {
        "single": "single",
        "ddp2": "ddp2",
        "ddp2_resumed": "ddp2",
        "single_to_ddp2": "ddp2",
        "ddp2_to_fsdp": "fsdp",
        "fsdp": "fsdp",
        "fsdp_to_ddp2": "ddp2",
        "ddp2_to_ddp4": "ddp4",
        "ddp2_to_single": "single",
    }
    cfgs = {run: _cfg(tmp_path, run, layout) for run, layout in runs.items()}
    cfgs["ddp2_half"] = _cfg(tmp_path, "ddp2_resumed", "ddp2", "--train.max_steps=2", "--train.async_save=true")
    cfgs["ddp2_resumed"] = _cfg(tmp_path, "ddp2_resumed", "ddp2", "--train.async_save=true")
    cfgs["fsdp"] = _cfg(tmp_path, "fsdp", "fsdp", "--train.max_steps=2")
    Trainer(cfgs["single"]).fit()  # also prepares the shared data dir
    run_distributed_test(_two_ranks, 2, args=(cfgs,))
    run_distributed_test(_four_ranks, 4, args=(cfgs,))
    continue_from(cfgs, "ddp2", "ddp2_to_single")

    ref = _losses(tmp_path, "ddp2")
    assert len(ref) == 4
    _close(_losses(tmp_path, "single"), ref, "single process vs ddp ep=2")
    assert _losses(tmp_path, "ddp2_resumed") == ref  # exact resume: bit-identical
    for run in ("single_to_ddp2", "ddp2_to_fsdp", "fsdp_to_ddp2", "ddp2_to_ddp4", "ddp2_to_single"):
        _close(_losses(tmp_path, run), ref[2:], run)
    manifest = json.loads((tmp_path / "ddp2" / "checkpoints" / "step_00000002" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["trainer_state"]["step"] == 2
    assert any(k.startswith("optim.") and k.endswith("exp_avg") for k in manifest["tensors"])


# ------------------------------------------------------------ kills and restarts

_KILL_SCRIPT = """
import os, signal, sys
import torch
from moeforge.config import load_config
from moeforge.train.checkpoint import store as checkpoint_store
from moeforge.train.trainer import Trainer
for cfg_path, phase_name in zip(sys.argv[1::2], sys.argv[2::2]):
    pid = os.fork()  # one import, one child per kill point
    if pid == 0:
        torch.set_num_threads(1)
        seen = []
        def hook(name):
            seen.append(name)
            if name == phase_name and seen.count(name) == 2:  # the second save (step 4)
                os.kill(os.getpid(), signal.SIGKILL)
        checkpoint_store.PHASE_HOOK = hook
        Trainer(load_config(cfg_path)).fit()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (phase_name, status)
"""
KILL_PHASES = {"staged": 2, "written": 2, "manifest": 2, "renamed": 4}  # phase -> step resume must find


def test_sigkill_during_save_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    args = []
    for name in KILL_PHASES:
        cfg = _cfg(tmp_path, name, "single", "--train.max_steps=6")
        if not args:
            ensure_data(cfg)
        save_config(cfg, tmp_path / f"{name}.yaml")
        args += [str(tmp_path / f"{name}.yaml"), name]
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, *args], cwd=ROOT, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    for name, step in KILL_PHASES.items():
        root = tmp_path / name / "checkpoints"
        assert (root / "latest").read_text().strip() == "step_00000002", name  # `latest` moves last
        assert [p.name for p in complete_checkpoints(tmp_path / name)][-1] == f"step_{step:08d}", name
        trainer = Trainer(_cfg(tmp_path, name, "single", "--train.max_steps=6"))
        assert trainer.maybe_resume() and trainer.step == step, name
        assert not list(root.glob(".tmp_*")), name  # the killed save's leftovers are gone
    trainer.fit()  # the run goes on from the kill
    assert [r["step"] for r in read_metrics(tmp_path / "renamed")][-2:] == [5, 6]


def test_the_launcher_restarts_a_killed_rank_and_resumes_to_the_same_loss(tmp_path: Path) -> None:
    # The documented command (docs/launch.md), its workers under the test suite's fault injection
    # (moeforge.testing.faults: `moeforge train` plus a callback that kills the last rank once).
    cfg = _cfg(tmp_path, "restart", "ddp2")
    ensure_data(cfg)
    save_config(cfg, tmp_path / "restart.yaml")
    cmd = [
        sys.executable,
        "-m",
        "moeforge.testing.faults",
        "--kill-at-step",
        "3",
        "train",
        str(tmp_path / "restart.yaml"),
    ]
    cmd += ["--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2"]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    assert (tmp_path / "restart" / ".fault_killed_at_step_3").is_file()  # rank 1 did die once
    # Rank 1 died entering the save of step 4; the restart resumed from step 2 and dropped the
    # records of steps 3-4 that it trained again, so metrics.jsonl holds every step once.
    got = read_metrics(tmp_path / "restart")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    Trainer(_cfg(tmp_path, "uninterrupted", "single")).fit()
    _close([r["loss"] for r in got], _losses(tmp_path, "uninterrupted"), "restarted vs uninterrupted")
    assert [p.name for p in complete_checkpoints(tmp_path / "restart")] == ["step_00000002", "step_00000004"]


# ------------------------------------------------------------ single-process safety and speed


def test_flat_range_boxes_tile_the_range() -> None:
    for shape in [(3, 5, 7), (6,), (2, 3), (4, 1, 3)]:
        n = torch.Size(shape).numel()
        full = torch.arange(n).view(shape)
        for a in range(n):
            for z in range(a + 1, n + 1):
                pieces = [
                    full[tuple(slice(o, o + s) for o, s in zip(off, sz))].reshape(-1)
                    for off, sz, _ in flat_range_boxes(shape, a, z)
                ]
                assert torch.equal(torch.cat(pieces), torch.arange(a, z)), (shape, a, z)
                assert len(pieces) <= 2 * len(shape) - 1


def _model_and_optimizer(tmp: Path, *extra: str):
    cfg = tiny_config(tmp, *extra)
    cfg.model.vocab_size = 300
    model = build_model(cfg.model, seed=0)
    stack = LocalStack(model, cfg)
    model(torch.randint(0, 300, (2, 16))).sum().backward()
    stack.optimizer.step()
    return model, stack


def test_async_save_blocks_less_than_sync_and_loads_the_same(tmp_path: Path) -> None:
    big = ["--model.d_model=128", "--model.moe.num_experts=8", "--model.moe.expert_hidden=512"]
    model, opt = _model_and_optimizer(tmp_path, *big)
    state = {"step": 7, "loader": {"epoch": 1, "position": 3}}
    sync = CheckpointManager(tmp_path / "sync").save(7, model, opt, state)
    manager = CheckpointManager(tmp_path / "async", async_save=True)
    stats = manager.save(7, model, opt, state)
    with torch.no_grad():  # training goes on while the background thread writes
        for p in model.parameters():
            p.add_(1.0)
    done = manager.wait()
    manager.close()
    assert done is stats and stats.bytes > 4 * 2**20 and abs(sync.bytes - stats.bytes) < 100
    assert stats.blocking_s < sync.total_s, (stats, sync)
    assert stats.blocking_s < stats.total_s
    fresh, fresh_opt = _model_and_optimizer(tmp_path, *big, "--train.seed=1")
    found = CheckpointManager(tmp_path / "async").resume(
        fresh, fresh_opt, {"step": 0, "loader": {"epoch": 0, "position": 0}}
    )
    assert found is not None and found[1] == state
    for (k, a), b in zip(model.named_parameters(), fresh.parameters()):  # the snapshot, not the later change
        torch.testing.assert_close(a.detach() - 1.0, b.detach(), rtol=0, atol=1e-6, msg=k)
    a_state = opt.optimizer.state[next(iter(model.parameters()))]
    b_state = fresh_opt.optimizer.state[next(iter(fresh.parameters()))]
    assert torch.equal(a_state["exp_avg_sq"], b_state["exp_avg_sq"]) and float(b_state["step"]) == 1.0


def test_mismatch_corruption_and_pickles_are_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _model_and_optimizer(tmp_path)
    manager = CheckpointManager(tmp_path / "run", keep_last=5)
    for step in (1, 2):
        manager.save(step, model, opt, {"step": step})
    other, other_opt = _model_and_optimizer(tmp_path, "--model.moe.num_experts=8", "--model.d_model=48")
    with pytest.raises(CheckpointMismatchError) as err:
        manager.resume(other, other_opt, {"step": 0})
    msg = str(err.value)
    assert "layers.0.mlp.experts.w1: checkpoint (4, 64, 32) vs model (8, 64, 48)" in msg
    assert "embed_tokens.weight" in msg and "shape mismatches" in msg

    newest, older = complete_checkpoints(tmp_path / "run")[::-1]
    data = sorted(newest.glob("*.distcp"))[0]
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # same size, one flipped byte
    data.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=f"{data}.*corrupt"):
        verify_checkpoint(newest)
    data.write_bytes(bytes(blob[:100]))
    with pytest.raises(CheckpointError, match=f"{data}.*truncated"):
        verify_checkpoint(newest)
    with caplog.at_level("WARNING"):
        found = manager.resume(model, opt, {"step": 0})
    assert found is not None and found[0] == older and found[1]["step"] == 1
    assert any(str(data) in r.getMessage() and "trying the previous" in r.getMessage() for r in caplog.records)
    assert (newest.parent / f"corrupt_{newest.name}").is_dir() and not newest.exists()  # kept, never overwritten

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (older / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"\.metadata is unreadable.*system is not allowed"):
        read_metadata(older)
    with pytest.raises(CheckpointError, match=r"\.metadata is truncated or corrupt"):
        verify_checkpoint(older)
    assert not marker.exists()
    with pytest.raises(ResumeRefusedError, match=r"no checkpoint of .* can be loaded .*step_00000001"):
        manager.resume(model, opt, {"step": 0})
    assert (older / ".metadata").is_file()  # the evidence stays


# ------------------------------------------------------------------ conversion


@pytest.mark.parametrize("flavor, qk_norm", [("olmoe", "full"), ("qwen3_moe", "per_head")])
def test_convert_to_hf_safetensors_and_back(tmp_path: Path, flavor: str, qk_norm: str) -> None:
    from transformers import AutoModelForCausalLM

    from moeforge.cli import main
    from moeforge.config import load_config
    from moeforge.interop.safetensors_io import load_safetensors, read_safetensors_config
    from moeforge.train.convert import load_run_model

    cfg = tiny_config(tmp_path, "--train.max_steps=2", f"--model.qk_norm={qk_norm}", "--model.n_kv_heads=2")
    Trainer(cfg).fit()
    run = Path(cfg.train.run_dir)
    ours = load_run_model(run)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(ids)

    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf", "--flavor", flavor]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, want, rtol=0, atol=1e-5)

    assert main(["convert", str(run), str(tmp_path / "m.safetensors"), "--to", "safetensors"]) == 0
    single = build_model(read_safetensors_config(tmp_path / "m.safetensors"), seed=5)
    load_safetensors(single, tmp_path / "m.safetensors")
    with torch.no_grad():
        assert torch.equal(single.eval()(ids), want)

    new_run = tmp_path / "from_hf"
    assert (
        main(
            [
                "convert",
                str(tmp_path / "hf"),
                str(new_run),
                "--to",
                "run",
                "--config",
                str(run / "config.yaml"),
                "--train.max_steps=3",
            ]
        )
        == 0
    )
    trainer = Trainer(load_config(new_run / "config.yaml"))
    assert trainer.maybe_resume() and trainer.step == 0
    with torch.no_grad():
        torch.testing.assert_close(trainer.model.eval()(ids), want, rtol=0, atol=1e-5)
    last = trainer.fit()
    assert last["step"] == 3 and [p.name for p in complete_checkpoints(new_run)][-1] == "step_00000003"


def test_parallel_crc32_equals_zlib_and_names_the_corrupt_file(tmp_path: Path) -> None:
    """describe_files checksums a directory's files in threads: each CRC32 is zlib's of that file (empty and
    multi-chunk files included), and verification names the one damaged file among several."""
    import zlib

    from moeforge.train.checkpoint import store

    sizes = {"a.distcp": 0, "b.distcp": 5_000_000, "c.distcp": 123_457, ".metadata": 10}
    for i, (name, size) in enumerate(sizes.items()):
        (tmp_path / name).write_bytes(
            bytes((i * 7 + j) % 251 for j in range(size)) if size < 200_000 else os.urandom(size)
        )
    files = store.describe_files(tmp_path)
    assert sorted(files) == sorted(sizes)
    for name, info in files.items():
        data = (tmp_path / name).read_bytes()
        assert info == {"bytes": len(data), "crc32": zlib.crc32(data)}
    assert store.files_crc32([tmp_path / n for n in sizes]) == [files[n]["crc32"] for n in sizes]
    (tmp_path / store.MANIFEST).write_text(json.dumps({"format": store.FORMAT, "files": files}))
    blob = bytearray((tmp_path / "c.distcp").read_bytes())
    blob[777] ^= 0x01
    (tmp_path / "c.distcp").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"c\.distcp is corrupt: CRC32"):
        verify_checkpoint(tmp_path)
