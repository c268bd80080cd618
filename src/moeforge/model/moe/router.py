"""Top-k token router.

Scores come from a linear gate, computed in fp32 (softmax or sigmoid). The
router picks ``top_k`` experts per token, optionally within the best
``topk_groups`` of ``n_groups`` expert groups (a group ranked by its best
score, or by its best two's sum as in DeepSeek-V3), optionally renormalises the
chosen weights, scales them by ``routed_scaling_factor``, and computes the auxiliary load-balancing loss
``E * sum_i f_i * P_i`` and the router z-loss ``mean(logsumexp(logits)^2)``.

Synthetic routing (``random_routing``, tests and benchmarks only) draws each token's
experts from this rank's seeded stream: uniform, or Zipf-skewed over a seeded popularity
ranking that can change every ``random_routing_drift_every`` steps (:func:`zipf_log_weights`).

Auxiliary-loss-free balancing keeps a per-expert ``expert_bias`` that is added
to the scores for selection only (DeepSeek-V3's ``e_score_correction_bias``);
:meth:`TopKRouter.update_bias` moves it after each optimizer step from that
step's token counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeforge.config import MoEConfig
from moeforge.ops.router_scores import softmax_router_scores


@dataclass
class RouterOutput:
    """What the router decides for ``N`` tokens."""

    indices: Tensor  # (N, k) int64 expert ids
    weights: Tensor  # (N, k) fp32 combine weights
    aux_loss: Tensor  # scalar, unscaled
    z_loss: Tensor  # scalar, unscaled
    tokens_per_expert: Tensor  # (E,) routes per expert (detached, float)


def zipf_log_weights(num_experts: int, exponent: float, seed: int, epoch: int = 0) -> Tensor:
    """Log-probabilities ``(E,)`` of a Zipf popularity: the expert of rank ``r`` (0 hottest) weighs
    ``1 / (r + 1) ** exponent``. Which expert holds which rank is a permutation seeded by ``seed`` (the
    layer's) and ``epoch`` (the drift period), the same on every rank, run and layout."""
    g = torch.Generator().manual_seed(seed * 7919 + epoch * 104_729 + 17)
    ranking = torch.randperm(num_experts, generator=g)  # ranking[r]: the expert of popularity rank r
    logw = -exponent * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float32))
    out = torch.empty(num_experts)
    out[ranking] = logw - torch.logsumexp(logw, dim=0)
    return out


class TopKRouter(nn.Module):
    """Linear gate + top-k selection + balancing losses."""

    def __init__(self, d_model: int, cfg: MoEConfig, layer_idx: int = 0, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, d_model))
        # a learned bias on the logits (gpt-oss), unlike expert_bias, which moves the selection only
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.router_bias else None
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        self.base_seed = seed * 1000 + layer_idx
        self.random_seed = self.base_seed
        self._generator: torch.Generator | None = None
        self.routing_step = 0  # the optimizer step being trained (the trainer sets it): Zipf drift follows it
        self._zipf_cache: tuple[int, Tensor] | None = None
        # Sums per-token statistics over every part of the batch when its tokens are split over
        # several modules (set by parallel code, e.g. sequence parallelism); None: this forward sees them all.
        self.token_stats_reduce: Callable[[Tensor], Tensor] | None = None
        # ``fn(counts) -> counts`` summed over the ranks that hold other tokens of the same sequences
        # (set by context parallelism), so the aux loss's route fractions are those of whole sequences.
        self.reduce_counts: Callable[[Tensor], Tensor] | None = None

    def set_random_stream(self, stream: int) -> None:
        """Draw random routes from stream ``stream`` of this layer (parallelize code passes the rank)."""
        self.random_seed = self.base_seed * 1_000_003 + stream
        self._generator = None

    def _random_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.random_seed)
        return self._generator

    def generator_state(self) -> Tensor:
        """The random-routing generator's state (a CPU byte tensor), for checkpoints."""
        return self._random_generator(self.expert_bias.device).get_state()

    def set_generator_state(self, state: Tensor) -> None:
        """Restore what :meth:`generator_state` returned."""
        self._random_generator(self.expert_bias.device).set_state(state)

    def _select(self, scores: Tensor) -> Tensor:
        """Indices of the chosen experts ``(N, k)`` from fp32 scores (bias used here only)."""
        # the bias is zero unless loss-free balancing moved it or a checkpoint (DeepSeek-V3's) brought one
        biased = scores + self.expert_bias
        if self.cfg.n_groups > 1:
            n, e = biased.shape
            grouped = biased.view(n, self.cfg.n_groups, e // self.cfg.n_groups)
            if self.cfg.group_score == "top2_sum":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            keep = torch.topk(group_scores, self.cfg.topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            biased = grouped.masked_fill(~mask[..., None], float("-inf")).view(n, e)
        return torch.topk(biased, self.top_k, dim=-1, sorted=True).indices

    def _random_indices(self, n: int, device: torch.device) -> Tensor:
        noise = torch.rand(n, self.num_experts, generator=self._random_generator(device), device=device)
        if self.cfg.random_routing_zipf <= 0:
            return torch.topk(noise, self.top_k, dim=-1).indices
        # Gumbel-top-k: k distinct experts, drawn without replacement with probabilities ~ the Zipf weights
        gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
        return torch.topk(self._zipf_weights(device) + gumbel, self.top_k, dim=-1).indices

    def _zipf_weights(self, device: torch.device) -> Tensor:
        drift = self.cfg.random_routing_drift_every
        epoch = self.routing_step // drift if drift > 0 else 0
        if self._zipf_cache is None or self._zipf_cache[0] != epoch or self._zipf_cache[1].device != device:
            w = zipf_log_weights(self.num_experts, self.cfg.random_routing_zipf, self.base_seed, epoch)
            self._zipf_cache = (epoch, w.to(device))
        return self._zipf_cache[1]

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> RouterOutput:
        """Route ``x: (N, D)``; ``token_mask`` ``(N,)`` bool (None: all): the tokens the losses and the counts
        include (multi-token prediction's positions without a target are routed but not counted)."""
        if self.training and self.cfg.jitter_eps > 0:
            x = x * torch.empty_like(x).uniform_(1 - self.cfg.jitter_eps, 1 + self.cfg.jitter_eps)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        # the softmax router's weights and losses in one autograd node (ops.router_scores): probs without autograd
        fused = self.cfg.score_func == "softmax" and self.token_stats_reduce is None and x.shape[0] > 0
        fused = fused and token_mask is None
        if fused:
            scores = probs = logits.detach().softmax(dim=-1)
        elif self.cfg.score_func == "softmax":
            scores = logits.softmax(dim=-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        if self.cfg.random_routing:
            indices = self._random_indices(x.shape[0], x.device)
        else:
            indices = self._select(scores.detach())
        counts = torch.zeros(self.num_experts, device=x.device, dtype=torch.float32)
        if token_mask is None:
            counts.scatter_add_(0, indices.reshape(-1), torch.ones(indices.numel(), device=x.device))
        else:
            kept = token_mask[:, None].expand(indices.shape).reshape(-1).float()
            counts.scatter_add_(0, indices.reshape(-1), kept)
        if not fused:
            weights = scores.gather(1, indices)
            if self.cfg.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        scale = self.cfg.routed_scaling_factor
        if not fused and scale != 1.0:
            weights = weights * scale
        if token_mask is not None:
            aux, z = self._masked_losses(logits, probs, counts, token_mask)
            return RouterOutput(indices, weights, aux, z, counts)
        if self.token_stats_reduce is not None:
            aux, z = self._reduced_losses(logits, probs, counts)
            return RouterOutput(indices, weights, aux, z, counts)
        if self.reduce_counts is None:
            seq_counts, n_routes = counts, max(indices.numel(), 1)
        else:  # every route of the sequences counted once (equal token counts per rank)
            seq_counts = self.reduce_counts(counts.clone())
            n_routes = seq_counts.sum().clamp_min(1.0)
        if fused:
            weights, aux, z = softmax_router_scores(
                logits, probs, indices, seq_counts / n_routes, self.cfg.norm_topk_prob
            )
            return RouterOutput(indices, weights * scale if scale != 1.0 else weights, aux, z, counts)
        aux = self.num_experts * (seq_counts / n_routes * probs.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).square().mean() if x.shape[0] else logits.sum()
        return RouterOutput(indices, weights, aux, z, counts)

    def _reduced_losses(self, logits: Tensor, probs: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """The aux and z losses of the whole batch from this part's sums and :attr:`token_stats_reduce`."""
        n = torch.full((1,), float(logits.shape[0]), device=logits.device)
        z_sum = torch.logsumexp(logits, dim=-1).square().sum().reshape(1)
        stats = self.token_stats_reduce(torch.cat([counts, probs.sum(dim=0), z_sum, n]))  # type: ignore[misc]
        e = self.num_experts
        counts_all, probs_sum, z_all, n_all = stats[:e], stats[e : 2 * e], stats[2 * e], stats[2 * e + 1]
        n_all = n_all.clamp(min=1.0)
        fractions = counts_all / (n_all * self.top_k)
        if self.reduce_counts is not None:  # the route fractions of the whole sequences (equal tokens per part)
            seq_counts = self.reduce_counts(counts_all.detach().clone())  # counts: no gradient
            fractions = seq_counts / seq_counts.sum().clamp_min(1.0)
        aux = e * (fractions * (probs_sum / n_all)).sum()
        return aux, z_all / n_all

    def _masked_losses(self, logits: Tensor, probs: Tensor, counts: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """The aux and z losses over the tokens ``keep`` marks (``counts`` are theirs already).

        The parts of a batch hold different numbers of such tokens, so the sums are divided by the mean count
        of the parts that share sequences (:attr:`reduce_counts`), not by this part's own: the mean of the parts'
        losses is then the loss of the marked tokens of whole sequences."""
        w = keep.to(torch.float32)
        probs_sum = (probs * w[:, None]).sum(dim=0)
        z_sum = (torch.logsumexp(logits, dim=-1).square() * w).sum().reshape(1)
        e, n = self.num_experts, w.sum().reshape(1)
        if self.token_stats_reduce is not None:  # the parts of one sequence slice (sequence parallelism)
            stats = self.token_stats_reduce(torch.cat([counts, probs_sum, z_sum, n]))
            counts, probs_sum, z_sum, n = stats[:e], stats[e : 2 * e], stats[2 * e : 2 * e + 1], stats[2 * e + 1 :]
        routes = counts.sum().clamp_min(1.0)
        per_part = n.clamp_min(1.0)
        if self.reduce_counts is not None:  # the chunks of the same sequences (context parallelism)
            seq = self.reduce_counts(torch.cat([counts, n, torch.ones_like(n)]).detach())
            counts, routes, per_part = seq[:e], seq[:e].sum().clamp_min(1.0), seq[e] / seq[e + 1]
        aux = e * (counts / routes * (probs_sum / per_part)).sum()
        return aux, (z_sum / per_part).squeeze(0)

    @torch.no_grad()
    def update_bias(self, counts: Tensor) -> None:
        """Synthetic routing (``random_routing``, tests and benchmarks only) draws each token's
        experts from this rank's seeded stream: uniform, or Zipf-skewed over a seeded popularity
        ranking that can change every ``random_routing_drift_every`` steps (:func:`zipf_log_weights`).

        Auxiliary-loss-free balancing: raise under-loaded experts' bias, lower over-loaded ones'.

                ``counts`` are the routes per expert of the whole optimizer step (the
                trainer sums them over micro-batches and data-parallel ranks first).
        """
        if self.cfg.bias_update_rate > 0:
            self.expert_bias += self.cfg.bias_update_rate * torch.sign(counts.mean() - counts)
