"""docs/config.md is generated from the config dataclasses and documents every field."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeforge.cli import main
from moeforge.config.doc import COMMAND, render, sections

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_every_field_has_a_type_default_and_doc() -> None:
    found = sections()
    assert [s.path for s in found] == [
        "",
        "model",
        "model.moe",
        "model.mla",
        "model.yarn",
        "data",
        "optim",
        "train",
        "parallel",
        "logging",
    ]
    undocumented = [f"{s.path}.{f.name}" for s in found for f in s.fields if not f.doc]
    assert not undocumented, f"add a trailing '# ...' comment to these fields in config/sections.py: {undocumented}"
    names = {f"{s.path}.{f.name}" for s in found for f in s.fields}
    assert {"model.moe.shared_expert_gate", "model.attn_bias", "logging.wandb", "train.max_steps"} <= names
    text = render()
    assert '| `model.moe.score_func` | `"softmax" \\| "sigmoid"` | `"softmax"` |' in text
    assert "| `train.max_steps` | `int` | `200` | optimizer steps to train |" in text


def test_committed_reference_is_current() -> None:
    assert DOC.read_text() == render(), f"docs/config.md is stale: run `{COMMAND}`"


def test_train_help_points_to_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "docs/config.md" in capsys.readouterr().out
