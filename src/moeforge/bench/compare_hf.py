"""``moeforge bench --compare hf``: a full training step of moeforge against Hugging Face's Qwen3-MoE.

Both models are built from the same model config and hold the same weights (the HF one is the
moeforge model exported with ``to_hf`` and loaded with ``from_pretrained``, experts
``grouped_mm``, attention ``sdpa``). In one process, with the same thread count, each mode runs
both models on the same token batches with the same fused ``torch.optim.AdamW``, alternating step by
step (:func:`moeforge.bench.alternate.alternate_timed`); ``moeforge bench`` gives every mode a fresh
process of its own (``isolate``). A step is zero-grad, forward, loss
(each library's own next-token cross-entropy: moeforge's :func:`moeforge.train.losses.lm_loss_fn`,
HF's ``loss_function`` on the shifted labels, both in fp32 arithmetic; plus each model's own
load-balancing loss: moeforge's aux + z loss, HF's ``aux_loss``), backward and the optimizer step.

Modes: ``fp32`` (fp32 weights), ``bf16_autocast`` (fp32 weights under bf16 autocast),
``bf16_params`` (bf16 weights and
AdamW states, no autocast). Per mode it reports tokens/s of both, the ratio moeforge / HF, MFU
against the bf16 matmul peak, the hash of the batches each model consumed, and each model's
first-step loss (they agree in fp32: same weights, same tokens).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from moeforge.bench.alternate import alternate_timed, summarize
from moeforge.bench.energy import EnergyMeter, energy_record
from moeforge.bench.peers import hf_causal_lm, transformers_version
from moeforge.config import Config, ModelConfig
from moeforge.model import build_model
from moeforge.model.kernels import KernelChoice, apply_kernels, select_kernels
from moeforge.plan.flops import flops_per_token
from moeforge.train.losses import lm_loss_fn, moe_aux_terms

log = logging.getLogger(__name__)

MODES = ("fp32", "bf16_autocast", "bf16_params")


def token_batches(vocab: int, batch: int, seq_len: int, n: int, seed: int, device: torch.device) -> list[Tensor]:
    """``n`` batches ``(batch, seq_len + 1)`` of uniform token ids from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq_len + 1), generator=g).to(device) for _ in range(n)]


def batch_hash(batches: list[Tensor]) -> str:
    """sha256 of the batches' token ids (little-endian int64), in order."""
    h = hashlib.sha256()
    for b in batches:
        h.update(str(tuple(b.shape)).encode())
        h.update(b.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8", copy=False).tobytes())
    return h.hexdigest()


class _Contender:
    """One model + AdamW; ``step(i)`` trains on batch ``i`` and records the batches and losses it saw."""

    def __init__(self, model: nn.Module, is_hf: bool, mode: str, aux_coef: float, lr: float) -> None:
        self.model, self.is_hf, self.mode, self.aux_coef = model, is_hf, mode, aux_coef
        # torch's fused AdamW for both: transformers' Trainer default (``adamw_torch_fused``, torch >= 2.8)
        # and moeforge's (``optim.implementation=auto``)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        self.seen: list[Tensor] = []
        self.kernels: KernelChoice | None = None  # moeforge: its kernels, chosen as its trainer chooses them
        self.losses: list[float] = []
        self.lm_losses: list[float] = []

    def loss(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if self.is_hf:  # HF's own causal-LM loss, as a transformers user gets it (fp32 cross-entropy)
            out = self.model(input_ids=inputs, output_router_logits=True, use_cache=False)
            vocab = self.model.config.vocab_size
            lm = self.model.loss_function(out.logits, None, vocab, shift_labels=targets.contiguous())
            return lm + self.aux_coef * out.aux_loss.float(), lm
        if self.kernels is not None and self.kernels.fused_loss:
            lm = self.model(inputs, labels=targets)
        else:
            lm = lm_loss_fn(self.model(inputs), targets, upcast=self.mode != "bf16_autocast")
        weighted_aux, _, _ = moe_aux_terms(self.model)
        return lm + weighted_aux, lm

    def step(self, batch: Tensor) -> None:
        self.seen.append(batch)
        self.opt.zero_grad(set_to_none=True)
        dev = batch.device.type
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=self.mode == "bf16_autocast"):
            loss, lm = self.loss(batch)
        loss.backward()
        self.opt.step()
        self.losses.append(float(loss.detach()))
        self.lm_losses.append(float(lm.detach()))


def _contenders(
    cfg: ModelConfig, mode: str, seed: int, device: torch.device, lr: float, batch: int, seq: int
) -> dict[str, _Contender]:
    """Both models of ``mode`` from the same weights; moeforge's kernels chosen as its trainer chooses them
    (:func:`~moeforge.model.kernels.select_kernels` for ``mode``'s precision at sequence ``seq``), recorded in its
    contender's ``kernels``."""
    ours = build_model(cfg, seed=seed, device=device).train()
    hf = hf_causal_lm(copy.deepcopy(ours).cpu(), device)
    if mode == "bf16_params":
        ours, hf = ours.to(torch.bfloat16), hf.to(torch.bfloat16)
    contenders = {
        "moeforge": _Contender(ours, False, mode, cfg.moe.aux_loss_coef, lr),
        "hf": _Contender(hf, True, mode, cfg.moe.aux_loss_coef, lr),
    }
    run = Config(model=cfg)
    run.train.precision = "fp32" if mode == "fp32" else "bf16"
    run.train.param_dtype = "bf16" if mode == "bf16_params" else "fp32"
    run.data.seq_len = seq
    contenders["moeforge"].kernels = apply_kernels(ours, select_kernels(run, device))
    return contenders


def _mode_row(
    cfg: ModelConfig,
    mode: str,
    batches: list[Tensor],
    warmup: int,
    steps: int,
    seed: int,
    device: torch.device,
    peak_tflops: float | None,
    lr: float,
) -> dict[str, Any]:
    """Both contenders of ``mode`` trained side by side on ``batches``: their times, losses and the ratio."""
    log.info("compare hf: mode %s", mode)
    tokens = batches[0].shape[0] * (batches[0].shape[1] - 1)
    fpt = flops_per_token(cfg, batches[0].shape[1] - 1)
    meter = EnergyMeter(device)
    contenders = _contenders(cfg, mode, seed, device, lr, batches[0].shape[0], batches[0].shape[1] - 1)
    fns = {name: (lambda i, c=c: c.step(batches[i])) for name, c in contenders.items()}
    joules: dict[str, float | None] = {}
    times = alternate_timed(fns, warmup, steps, device, meter, joules)
    row: dict[str, Any] = {}
    for name, c in contenders.items():
        s = summarize(times[name], tokens)
        row[name] = {
            "tokens_per_s": s["per_s"],
            "step_s_median": s["median_s"],
            "step_s_min": s["min_s"],
            "step_s": times[name],
            "first_loss": c.losses[0],
            "first_lm_loss": c.lm_losses[0],
            "last_loss": c.losses[-1],
            "input_hash": batch_hash(c.seen),
            "mfu": None if not peak_tflops else s["per_s"] * fpt / 1e12 / peak_tflops,
            "energy": energy_record(joules[name], sum(times[name]), tokens * steps, meter, min(times[name])),
        }
    row["moeforge"]["kernels"] = contenders["moeforge"].kernels.to_dict()  # type: ignore[union-attr]
    row["ratio"] = row["moeforge"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
    row["same_inputs"] = row["moeforge"]["input_hash"] == row["hf"]["input_hash"]
    log.info("compare hf: %s: moeforge / hf = %.3fx", mode, row["ratio"])
    return row


def _mode_row_in_child(
    cfg: ModelConfig, mode: str, batch: int, seq_len: int, kw: dict[str, Any], threads: int, device: str
) -> dict[str, Any]:
    """:func:`_mode_row` in a fresh process (the batches rebuilt there from the same seed)."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    batches = token_batches(cfg.vocab_size, batch, seq_len, kw["warmup"] + kw["steps"], kw["seed"], dev)
    return _mode_row(cfg, mode, batches, device=dev, **kw)


def compare_steps(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    *,
    modes: tuple[str, ...] = MODES,
    warmup: int = 2,
    steps: int = 5,
    seed: int = 0,
    device: torch.device | str = "cpu",
    peak_tflops: float | None = None,
    lr: float = 1e-4,
    isolate: bool = False,
) -> dict[str, Any]:
    """Time moeforge and HF Qwen3-MoE training steps side by side in each of ``modes``; one result dict.

    ``peak_tflops`` (per device, the bf16 matmul peak) makes each mode report MFU. ``isolate`` runs
    each mode in a fresh (spawned) process, both contenders in it: what ran before in the process (the
    allocator's free lists, oneDNN's cache of kernels per shape, shared by both contenders) changes the
    ratio of a short run by up to 20% on the CPU (docs/benchmarks.md), so a mode's ratio should not
    depend on which modes ran before it.
    """
    device = torch.device(device)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"compare_steps: modes must be among {MODES}, got {bad}")
    kw = {"warmup": warmup, "steps": steps, "seed": seed, "peak_tflops": peak_tflops, "lr": lr}
    results: dict[str, Any] = {}
    if isolate:
        spawn = multiprocessing.get_context("spawn")
        for mode in modes:
            with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                args = (cfg, mode, batch, seq_len, kw, torch.get_num_threads(), str(device))
                results[mode] = pool.submit(_mode_row_in_child, *args).result()
    else:
        batches = token_batches(cfg.vocab_size, batch, seq_len, warmup + steps, seed, device)
        for mode in modes:
            results[mode] = _mode_row(cfg, mode, batches, device=device, **kw)
    return {
        "kind": "compare hf",
        "transformers": transformers_version(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "batch": batch,
        "seq_len": seq_len,
        "warmup": warmup,
        "steps": steps,
        "mode_isolation": "a fresh process per mode" if isolate else "one process",
        "flops_per_token": flops_per_token(cfg, seq_len),
        "peak_tflops_bf16": peak_tflops,
        "modes": results,
    }


def markdown(result: dict[str, Any]) -> str:
    """A table of :func:`compare_steps`' result."""
    lines = [
        f"moeforge vs transformers {result['transformers']} Qwen3-MoE, full training step, "
        f"{result['device']}, {result['threads']} thread(s), batch {result['batch']} x {result['seq_len']}",
        "",
        "| mode | moeforge tok/s | HF tok/s | moeforge / HF | moeforge MFU | HF MFU | same inputs "
        "| first loss (ours, HF) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for mode, row in result["modes"].items():
        ours, hf = row["moeforge"], row["hf"]
        mfu = lambda r: "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"  # noqa: E731
        lines.append(
            f"| {mode} | {ours['tokens_per_s']:.0f} | {hf['tokens_per_s']:.0f} | {row['ratio']:.2f}x | "
            f"{mfu(ours)} | {mfu(hf)} | {row['same_inputs']} | {ours['first_lm_loss']:.5f}, {hf['first_lm_loss']:.5f} |"
        )
    return "\n".join(lines) + "\n"
