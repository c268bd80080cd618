"""The planner's activations of latent attention (MLA) and of the multi-token-prediction module against what the
trainer measures (``RUN/memory.json``'s saved bytes), one process, within the 10% the other layouts are held to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeforge.plan.planner import make_plan
from moeforge.train.trainer import Trainer

from .helpers import tiny_config
from .test_memory_accounting import BF16, NO_PAD

MLA = [
    "--model.attention_type=mla",
    "--model.mla.q_lora_rank=24",
    "--model.mla.kv_lora_rank=16",
    "--model.mla.qk_nope_head_dim=8",
    "--model.mla.qk_rope_head_dim=4",
    "--model.mla.v_head_dim=12",
]
CASES = {
    "mla": MLA,
    "mla_plain_q_autocast": [*MLA, "--model.mla.q_lora_rank=0", "--train.precision=bf16"],
    "mla_mtp_bf16_ac": [*MLA, "--model.mtp_depth=1", *BF16, "--train.activation_checkpointing=full"],
    "mha_mtp": ["--model.mtp_depth=1"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_mla_and_mtp_activations_are_planned(tmp_path: Path, name: str) -> None:
    cfg = tiny_config(tmp_path, f"--train.run_dir={tmp_path / name}", "--train.max_steps=1", *NO_PAD, *CASES[name])
    Trainer(cfg).fit()
    cfg.model.vocab_size = 300  # the tokenizer's, as the trainer sets it
    measured = json.loads((tmp_path / name / "memory.json").read_text())["ranks"][0]["activation_bytes"]
    predicted = make_plan(cfg, 1, mem_gb=1.0)["predicted"]["ranks"][0]["activation_bytes"]
    assert 0.95 <= predicted / measured <= 1.05, (name, measured, predicted)
