"""Config: YAML + dotted overrides, type checks, one clear error per mistake."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from moeforge.config import ConfigError, load_config, validate_layout

CFG = Path(__file__).resolve().parents[1] / "configs" / "shakespeare.yaml"


def test_loads_demo_and_applies_overrides() -> None:
    cfg = load_config(CFG, ["--model.moe.top_k=4", "--train.max_steps", "7", "--train.precision=fp32"])
    assert cfg.model.moe.top_k == 4
    assert cfg.train.max_steps == 7
    assert cfg.train.precision == "fp32"


def test_list_override() -> None:
    cfg = load_config(CFG, ["--model.dense_layers=[0,1]"])
    assert cfg.model.dense_layers == [0, 1]


@pytest.mark.parametrize(
    "override,field",
    [
        ("--model.moe.top_k=9", "model.moe.top_k"),
        ("--model.d_model=250", "model.d_model"),
        ("--model.moe.bogus=1", "model.moe.bogus"),
        ("--train.max_steps=ten", "train.max_steps"),
        ("--train.precision=fp16", "train.precision"),
        ("--data.sources=[/nope/missing.txt]", "data.sources[0]"),
        ("--parallel.ep=3", "parallel.ep"),
        ("--parallel.pp=0", "parallel.pp"),
        ("--model.moe.n_groups=3", "model.moe.n_groups"),
        ("--model.dense_layers=[99]", "model.dense_layers"),
        ("--train.async_save_overlap=true", "train.async_save_overlap"),
        ("--model.moe", "model.moe"),
        ("oops", "oops"),
    ],
)
def test_errors_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(CFG, [override, "--model.moe.num_experts=8"] if "ep=3" in override else [override])
    assert str(err.value).startswith(field), str(err.value)


def test_layout_checks_need_world_size() -> None:
    cfg = load_config(CFG, ["--parallel.ep=2"])
    validate_layout(cfg, 2)
    with pytest.raises(ConfigError, match=r"^parallel.ep: must divide the world size"):
        validate_layout(cfg, 3)
    cfg = load_config(CFG, ["--parallel.ep=2", "--model.moe.dispatcher=local"])
    with pytest.raises(ConfigError, match=r"^model\.moe\.dispatcher"):
        validate_layout(cfg, 2)


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nope.yaml")


def test_ep_overlap_chunks_needs_the_alltoall_over_ep() -> None:
    """Chunked all-to-all overlap: >= 1, and > 1 only where an all-to-all over ep ranks exists."""
    cfg = load_config(CFG, ["--parallel.ep=2", "--parallel.ep_overlap_chunks=2", "--model.moe.dispatcher=alltoall"])
    assert cfg.parallel.ep_overlap_chunks == 2
    with pytest.raises(ConfigError, match=r"^parallel\.ep_overlap_chunks: must be >= 1"):
        load_config(CFG, ["--parallel.ep_overlap_chunks=0"])
    for bad in (["--parallel.ep=1"], ["--parallel.ep=2", "--model.moe.dispatcher=rowwise"]):
        with pytest.raises(ConfigError, match=r"^parallel\.ep_overlap_chunks: overlaps the all-to-all"):
            load_config(CFG, [*bad, "--parallel.ep_overlap_chunks=2"])


def test_compile_is_refused_with_the_quantized_gemms() -> None:
    load_config(CFG, ["--train.compile=true"])  # bf16: fine
    for precision in ("mxfp8", "fp8_rowwise"):
        with pytest.raises(ConfigError, match=r"^train\.compile: train\.precision=\w+: the quantized GEMMs"):
            load_config(CFG, ["--train.compile=true", f"--train.precision={precision}"])


def test_duplicate_yaml_keys_are_refused_naming_key_and_lines(tmp_path: Path) -> None:
    """YAML lets the last of two equal keys win silently; a config refuses it: `moeforge train` exits 2, one line."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model:\n"  # 1
        "  d_model: 64\n"  # 2
        "train:\n"  # 3
        "  max_steps: 10\n"  # 4
        "  seed: 2\n"  # 5
        "model:\n"  # 6: the whole section again
        "  n_layers: 2\n"  # 7
    )
    with pytest.raises(
        ConfigError, match=rf"^config: duplicate key model at lines 1 and 6 of {re.escape(str(bad))}; keep one of them$"
    ):
        load_config(bad)
    bad.write_text("model:\n  d_model: 64\ntrain:\n  max_steps: 10\n  seed: 3\n\n\n\n  max_steps: 20\n")
    with pytest.raises(ConfigError, match=r"^config: duplicate key train\.max_steps at lines 4 and 9 of "):
        load_config(bad)
    p = subprocess.run(
        [sys.executable, "-m", "moeforge", "train", str(bad), f"--train.run_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    expected = f"moeforge: error: config: duplicate key train.max_steps at lines 4 and 9 of {bad}; keep one of them"
    assert p.stderr.strip().splitlines() == [expected]
    assert not (tmp_path / "run").exists()
