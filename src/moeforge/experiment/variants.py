"""The experiments' variants: each a name, a one-line note and the config overrides that make it.

Every variant is an ordinary ``moeforge train`` run of the base config plus
its overrides (which the results table prints), so any one run can be
repeated by hand. The base config's own values decide the sizes (dense
widths, the top_k / num_experts lr scale), so the experiments follow a user's
config rather than the demo's numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moeforge.config import Config


@dataclass
class Variant:
    """One run of an experiment."""

    name: str  # run directory name under OUTDIR/runs/
    note: str  # what the variant is, for the table
    overrides: list[str] = field(default_factory=list)  # dotted overrides added to the base config
    nproc: int | None = None  # processes for this run (None: the experiment's --nproc-per-node)


def _ffn_width(cfg: Config, experts: int) -> int:
    """Hidden width of a dense SwiGLU with the parameters of ``experts`` routed experts plus the shared expert."""
    moe = cfg.model.moe
    return experts * moe.expert_hidden + moe.shared_expert_hidden


def dense_variants(cfg: Config) -> list[Variant]:
    """The MoE against a dense model of the same active parameters and one of the same total parameters.

    All three see the same tokens in the same order for the same steps (same
    seed, data and schedule); only the feed-forward of every layer changes.
    """
    m = cfg.model
    every = "[" + ",".join(str(i) for i in range(m.n_layers)) + "]"
    active, total = _ffn_width(cfg, m.moe.top_k), _ffn_width(cfg, m.moe.num_experts)
    return [
        Variant("moe", f"the MoE as configured ({m.moe.num_experts} experts, top-{m.moe.top_k})"),
        Variant(
            "dense-active",
            f"dense SwiGLU {active} wide: the MoE's active feed-forward parameters per token",
            [f"--model.dense_layers={every}", f"--model.dense_hidden={active}"],
        ),
        Variant(
            "dense-total",
            f"dense SwiGLU {total} wide: the MoE's total feed-forward parameters",
            [f"--model.dense_layers={every}", f"--model.dense_hidden={total}"],
        ),
    ]


def expert_lr_variants(cfg: Config) -> list[Variant]:
    """``optim.expert_lr_scale`` at 1.0, 0.5 and top_k / num_experts (the experts' share of the tokens)."""
    moe = cfg.model.moe
    share = moe.top_k / moe.num_experts
    scales = [(1.0, "the same lr as every other weight"), (0.5, "half the lr")]
    if share not in (1.0, 0.5):
        scales.append((share, f"top_k / num_experts = {moe.top_k}/{moe.num_experts}: lr in proportion to tokens seen"))
    return [Variant(f"expert-lr-{s:g}", note, [f"--optim.expert_lr_scale={s:g}"]) for s, note in scales]


def balance_variants(cfg: Config) -> list[Variant]:
    """Aux-loss balancing, aux-loss-free bias balancing, and no balancing at all."""
    moe = cfg.model.moe
    coef = moe.aux_loss_coef or 0.01
    rate = moe.bias_update_rate or 1e-3
    aux, bias = "--model.moe.aux_loss_coef", "--model.moe.bias_update_rate"
    return [
        Variant("aux-loss", f"aux loss {coef:g}, no bias", [f"{aux}={coef:g}", f"{bias}=0"]),
        Variant("bias", f"no aux loss, bias_update_rate {rate:g}", [f"{aux}=0", f"{bias}={rate:g}"]),
        Variant("none", "neither: the router is free to collapse", [f"{aux}=0", f"{bias}=0"]),
    ]


def gerrymander_variants(cfg: Config) -> list[Variant]:
    """Runs whose load is checked for token gerrymandering over 2 ep ranks.

    The aux-loss run; the same with a weak aux loss (a tenth of it, which lets
    the router game the metric more cheaply); and group-limited routing with
    one group per ep rank (``n_groups=2, topk_groups=1``: each token's experts
    all sit on one rank, so rank load moves in blocks the per-expert aux loss
    only sees indirectly).
    """
    moe = cfg.model.moe
    coef = moe.aux_loss_coef or 0.01
    base = ["--model.moe.bias_update_rate=0", "--model.moe.n_groups=1", "--model.moe.topk_groups=1"]
    out = [
        Variant("aux-loss", f"aux loss {coef:g}", [*base, f"--model.moe.aux_loss_coef={coef:g}"]),
        Variant("weak-aux", f"aux loss {coef / 10:g}", [*base, f"--model.moe.aux_loss_coef={coef / 10:g}"]),
    ]
    if moe.num_experts % 2 == 0:
        out.append(
            Variant(
                "group-per-rank",
                f"aux loss {coef:g}, n_groups=2 topk_groups=1 (a token's experts on one of 2 ranks)",
                [
                    "--model.moe.bias_update_rate=0",
                    f"--model.moe.aux_loss_coef={coef:g}",
                    "--model.moe.n_groups=2",
                    "--model.moe.topk_groups=1",
                ],
            )
        )
    return out


EXPERIMENTS: dict[str, tuple[Callable[[Config], list[Variant]], str]] = {
    "dense": (dense_variants, "MoE vs dense at the same active and the same total parameters, same tokens and steps"),
    "expert-lr": (expert_lr_variants, "optim.expert_lr_scale at 1.0, 0.5 and top_k/num_experts"),
    "balance": (balance_variants, "aux-loss vs aux-loss-free bias balancing vs none: val_bpb and load over training"),
    "gerrymander": (gerrymander_variants, "is the aux loss improving while the per-rank load gets worse?"),
}
