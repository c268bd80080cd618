"""configs/deepseek_v3_tiny.yaml trains: a few fp32 steps of its model on two plays of the embedded corpus.

The model is the config's (latent attention, a dense first layer, a shared expert, group-limited sigmoid
routing with routed scaling and the loss-free bias, multi-token prediction); only the data, the sequence
length and the schedule are cut so that it runs in seconds.
"""

from __future__ import annotations

import math
from pathlib import Path

from moeforge.config import load_config
from moeforge.data import embedded_corpus_files
from moeforge.model.mla import MLAttention
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "deepseek_v3_tiny.yaml"
STEPS = 8


def test_deepseek_v3_tiny_config_trains_and_its_loss_falls(tmp_path: Path) -> None:
    plays = [str(p) for p in embedded_corpus_files()[:2]]
    cfg = load_config(
        CONFIG,
        [
            "--data.sources=[" + ",".join(plays) + "]",
            f"--data.data_dir={tmp_path / 'data'}",
            "--data.bpe_vocab_size=300",
            "--data.seq_len=32",
            "--data.val_fraction=0.5",
            f"--train.max_steps={STEPS}",
            "--train.global_batch_size=4",
            "--train.micro_batch_size=4",
            "--train.precision=fp32",
            "--train.eval_every=0",
            "--train.eval_batches=1",
            "--train.sample_prompt=",
            f"--train.run_dir={tmp_path / 'run'}",
            "--optim.lr=0.01",
            "--optim.warmup_steps=2",
            "--logging.progress=false",
        ],
    )
    m = cfg.model
    assert m.attention_type == "mla" and m.mla.q_lora_rank > 0 and m.dense_layers == [0]
    assert m.moe.n_groups > 1 and m.moe.group_score == "top2_sum" and m.moe.shared_expert_hidden > 0
    assert m.mtp_depth == 1
    trainer = Trainer(cfg)
    assert sum(isinstance(mod, MLAttention) for mod in trainer.model.modules()) == m.n_layers + m.mtp_depth
    final = trainer.fit()
    records = [r for r in read_metrics(tmp_path / "run") if "grad_norm" in r]
    losses = [r["loss"] for r in records]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    # the loss carries the MTP term (0.3 x a cross-entropy of a few nats) beside the tiny aux loss
    assert all(r["loss"] - r["lm_loss"] > 0.3 for r in records)
    assert min(losses[-3:]) < 0.85 * losses[0], losses
    assert math.isfinite(final["val_loss"])
    biases = [layer.router.expert_bias for layer in trainer.model.moe_layers()]
    assert any(bool(b.any()) for b in biases)  # the loss-free balancing moved the selection bias
