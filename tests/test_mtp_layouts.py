"""Multi-token prediction on every layout, and gpt-oss on the pipeline and FSDP: each against one process (fp32).

MTP (two depths, MoE blocks with a shared expert, aux loss and the loss-free bias) trains 3 steps under pp=2
(gpipe, 1f1b), tp=2 and cp=2 on gloo; the losses (the MTP part included), grad norms, expert loads and every
parameter match the one-process run. A tiny gpt-oss (sinks, sliding windows, biased experts) does the same
under pp=2 and under the fsdp stack with its experts over ep=2.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from moeforge.config import ModelConfig, MoEConfig
from moeforge.model import build_model
from moeforge.model.moe.layer import routing_losses
from moeforge.model.mtp import future_tokens
from moeforge.testing import run_distributed_test
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import tiny_config
from .test_gpt_oss import _tiny_gpt_oss

AUX = 0.05
MTP = [
    "--model.mtp_depth=2",
    "--model.mtp_loss_weight=0.5",
    "--model.moe.shared_expert_hidden=16",
    f"--model.moe.aux_loss_coef={AUX}",
    "--model.moe.z_loss_coef=0.0",
    "--model.moe.bias_update_rate=0.01",
    "--train.max_steps=3",
    "--train.eval_batches=1",
    # AdamW divides each gradient element by its own size: at eps 1e-8 an element whose gradient is near zero
    # moves by a sizeable part of a step on round-off alone (test_pipeline.py's note); at 1e-4 the update stays
    # a smooth function of the gradient, so the parameters show gradient errors, not that
    "--optim.eps=1e-4",
]
MTP_LAYOUTS = {
    "pp2_gpipe": ["--parallel.pp=2", "--parallel.pp_schedule=gpipe"],
    "pp2_1f1b": ["--parallel.pp=2", "--parallel.pp_schedule=1f1b"],
    "tp2": ["--parallel.tp=2"],
    "cp2": ["--parallel.cp=2"],
}
GPT_OSS = ["--train.max_steps=3", "--model.moe.capacity_factor=4"]
GPT_OSS_LAYOUTS = {
    "oss_pp2": ["--parallel.pp=2", "--parallel.pp_schedule=1f1b"],
    "oss_fsdp_ep2": ["--parallel.stack=fsdp", "--parallel.ep=2"],
}


def test_masked_depths_equal_the_cut_ones() -> None:
    """The sequence-sharded way (every position, those without a target masked out of the routers and the loss)
    gives the whole-sequence way's MTP loss, router losses, counts and gradients, in one process."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=16, aux_loss_coef=0.1, z_loss_coef=0.01)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, dense_hidden=48, mtp_depth=2, moe=moe)
    batch = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    future = future_tokens(batch, 2, torch.arange(12))
    assert torch.equal(future[:, :, 0], batch[:, 1:]) and (future[:, -1, 1:] == -100).all()
    got = []
    for sharded in (False, True):
        model = build_model(cfg, seed=3).train()
        if sharded:
            model.sequence_sum_fn = lambda t: t  # a context-parallel group of one rank
        model(batch[:, :-1], mtp_labels=future)
        weighted, aux, z = routing_losses(model.moe_layers())
        (model.last_mtp_loss + weighted).backward()
        counts = torch.stack([m.last_routing.tokens_per_expert for m in model.moe_layers()])
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        got.append((model.last_mtp_loss.detach(), aux, z, counts, grads))
    (loss, aux, z, counts, grads), (loss2, aux2, z2, counts2, grads2) = got
    assert counts[-1].sum() == 2 * 2 * 10  # the last depth's block counts its 10 positions of each row only
    assert torch.equal(counts, counts2) and grads.keys() == grads2.keys()
    torch.testing.assert_close(loss2, loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(aux2, aux, atol=1e-6, rtol=0)
    torch.testing.assert_close(z2, z, atol=1e-6, rtol=0)
    for k, g in grads.items():
        torch.testing.assert_close(grads2[k], g, atol=1e-6, rtol=1e-5, msg=k)


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in trainer.model.state_dict().items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def _mtp_cfg(root: Path, name: str, *extra: str):
    return tiny_config(root, f"--train.run_dir={root / name}", *MTP, *extra)


def _oss_cfg(root: Path, name: str, *extra: str):
    return _tiny_gpt_oss(root / "oss", name, *GPT_OSS, *extra)  # its own data dir: other texts


def _train_all(root: str) -> None:
    base = Path(root)
    runs = [(n, _mtp_cfg, e) for n, e in MTP_LAYOUTS.items()] + [(n, _oss_cfg, e) for n, e in GPT_OSS_LAYOUTS.items()]
    for name, make, extra in runs:
        trainer = Trainer(make(base, name, *extra))
        trainer.fit()
        torch.save(_params(trainer), base / f"{name}.rank{dist.get_rank()}.pt")


def _mtp_part(row: dict, n_moe: int) -> float:
    """The MTP loss of a logged step: the loss less the main one and the weighted aux (z_loss_coef is 0)."""
    return row["loss"] - row["lm_loss"] - AUX * n_moe * row["aux_loss"]


def _assert_match(root: Path, run: Path, ref: list[dict], ref_params: dict, name: str, n_moe: int | None) -> None:
    got = read_metrics(run)
    assert len(got) == len(ref) == 3, name
    for a, b in zip(ref, got):
        for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "moe/expert_imbalance"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(abs(a[key]), 1e-6), (name, a["step"], key, a[key], b[key])
        if n_moe is not None:
            assert abs(_mtp_part(a, n_moe) - _mtp_part(b, n_moe)) <= 1e-5 * a["loss"], (name, a["step"])
    assert abs(ref[-1]["val_loss"] - got[-1]["val_loss"]) <= 1e-5 * ref[-1]["val_loss"], name
    params: dict[str, torch.Tensor] = {}
    for r in range(2):
        params.update(torch.load(root / f"{name}.rank{r}.pt"))
    assert params.keys() == ref_params.keys(), name
    for k, v in ref_params.items():
        err = (params[k] - v).abs().max().item()
        # + 1e-6: AdamW's rounding (test_pipeline.py) in the gpt-oss runs, trained at eps 1e-8
        assert err <= 1e-5 * max(v.abs().max().item(), 1e-6) + 1e-6, (name, k, err)


def test_mtp_and_gpt_oss_layouts_match_one_process(tmp_path: Path) -> None:
    refs = {}
    for key, cfg in (("mtp", _mtp_cfg(tmp_path, "mtp_ref")), ("oss", _oss_cfg(tmp_path, "oss_ref"))):
        trainer = Trainer(cfg)  # also prepares the data the ranks share
        trainer.fit()
        refs[key] = (read_metrics(cfg.train.run_dir), _params(trainer), len(trainer.model.moe_layers()))
    rows, _, n_moe = refs["mtp"]
    assert n_moe == 4 and any(k.startswith("mtp.1.block.mlp.shared_expert.") for k in refs["mtp"][1])
    assert all(_mtp_part(r, n_moe) > 0.5 for r in rows)  # the MTP loss is in the logged loss
    run_distributed_test(_train_all, 2, args=(str(tmp_path),))
    for name in MTP_LAYOUTS:
        _assert_match(tmp_path, tmp_path / name, rows, refs["mtp"][1], name, n_moe)
    for name in GPT_OSS_LAYOUTS:
        _assert_match(tmp_path, tmp_path / "oss" / name, refs["oss"][0], refs["oss"][1], name, None)
