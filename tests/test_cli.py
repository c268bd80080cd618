"""CLI: help texts, one-line errors with exit code 2 and no run dir, prepare/train/generate end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moeforge.cli import main

from .helpers import write_corpus

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "shakespeare.yaml")


@pytest.mark.parametrize("command", ["train", "prepare", "generate", "plan"])
def test_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "usage: moeforge " + command in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,field",
    [
        (["--model.moe.top_k=20"], "model.moe.top_k"),
        (["--model.d_model=100", "--model.n_heads=3"], "model.d_model"),
        (["--model.nope=1"], "model.nope"),
        (["--train.max_steps=1.5"], "train.max_steps"),
        (["--data.sources=[/missing/file.txt]"], "data.sources[0]"),
    ],
)
def test_bad_config_is_one_line_exit_2_no_run_dir(
    tmp_path: Path, args: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    code = main(["train", DEMO, f"--train.run_dir={run_dir}", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"moeforge: error: {field}"), err
    assert not run_dir.exists()


def test_launcher_validates_the_config_once(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "moeforge", "train", DEMO, "--nproc-per-node", "2", "--model.moe.top_k=20"]
    p = subprocess.run([*cmd, f"--train.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "moeforge: error: model.moe.top_k: must be <= model.moe.num_experts (8), got 20"
    ]
    layout = [sys.executable, "-m", "moeforge", "train", DEMO, "--nproc-per-node", "3", "--parallel.ep=2"]
    p = subprocess.run(layout, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("moeforge: error: parallel.ep: must divide the world size (3)")
    assert not (tmp_path / "run").exists()


def test_end_to_end_subprocess(tmp_path: Path) -> None:
    sources = write_corpus(tmp_path / "corpus", n_docs=4, words_per_doc=1500)
    data_dir = tmp_path / "data"
    run = [sys.executable, "-m", "moeforge"]
    common = [
        f"--data.data_dir={data_dir}",
        "--data.bpe_vocab_size=300",
        "--data.seq_len=32",
        "--data.val_fraction=0.25",
    ]
    p = subprocess.run([*run, "prepare", "--sources", *sources, *common], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "prepared" in p.stdout and (data_dir / "meta.json").is_file()
    train = [
        *run,
        "train",
        DEMO,
        *common,
        f"--train.run_dir={tmp_path / 'run'}",
        "--data.sources=[" + ",".join(sources) + "]",
        "--model.d_model=32",
        "--model.n_layers=1",
        "--model.n_heads=2",
        "--model.max_seq_len=64",
        "--model.moe.expert_hidden=16",
        "--train.max_steps=3",
        "--train.global_batch_size=4",
        "--train.micro_batch_size=2",
        "--train.eval_batches=1",
        "--train.sample_prompt=the",
        "--train.sample_tokens=5",
        "--logging.progress=false",
    ]
    p = subprocess.run(train, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "val_bpb" in p.stdout and "--- sample ---" in p.stdout
    p = subprocess.run(
        [*run, "generate", str(tmp_path / "run"), "--prompt", "the king", "--max-tokens", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("the king")
    p = subprocess.run([*run, "generate", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "config.yaml" in p.stderr
