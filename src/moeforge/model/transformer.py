"""MoETransformer: embed -> blocks (attention, MoE or dense FFN) -> norm -> lm_head."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from moeforge.config import ModelConfig
from moeforge.model.attention import Attention, KVCache
from moeforge.model.layers import RMSNorm, SwiGLU
from moeforge.model.mla import MLAttention
from moeforge.model.moe.layer import MoELayer
from moeforge.model.mtp import MTPModule, join_stream, mtp_loss, split_stream
from moeforge.ops.cross_entropy import linear_cross_entropy
from moeforge.ops.rope import model_rope_tables


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)); x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, seed: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn: Attention | MLAttention = (
            MLAttention(cfg, layer_idx) if cfg.attention_type == "mla" else Attention(cfg, layer_idx)
        )
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = layer_idx not in cfg.dense_layers
        self.mlp: nn.Module = (
            MoELayer(cfg.d_model, cfg.moe, layer_idx, seed) if self.is_moe else SwiGLU(cfg.d_model, cfg.dense_hidden)
        )

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None, token_mask: Tensor | None = None
    ) -> Tensor:
        """``token_mask`` ``(B * T,)``: the positions an MoE router counts in its statistics (None: all)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        if token_mask is not None and self.is_moe:
            return x + self.mlp(self.post_attention_layernorm(x), token_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoETransformer(nn.Module):
    """Decoder-only MoE language model; ``forward(input_ids)`` returns logits ``(B, T, V)``."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (> 0) before building the model")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i, seed) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # multi-token prediction (moeforge.model.mtp): one block per depth after the model's, sharing its head
        self.mtp: nn.ModuleList | None = None
        if cfg.mtp_depth:
            blocks = (Block(cfg, cfg.n_layers + k, seed) for k in range(cfg.mtp_depth))
            self.mtp = nn.ModuleList(MTPModule(cfg, b) for b in blocks)
        self.last_mtp_loss: Tensor | None = None  # the weighted MTP loss of the last training forward
        # ``fn(T, device) -> (T,)`` global positions of the T tokens fed without a cache; None: 0..T-1.
        # A ``parallelize_*`` function sets it when the input is a part of each sequence (context parallelism).
        self.positions_fn: Callable[[int, torch.device], Tensor] | None = None
        # Hooks of layouts that split sequences, read by multi-token prediction (moeforge.model.mtp), None without:
        # ``fn((B, T)) -> (B, T / tp)``: the positions of a per-token tensor this rank's residual stream holds
        # (sequence parallelism); ``fn(t) -> t`` summed over the ranks holding the other chunks of the same
        # sequences (context parallelism); ``fn(logits, targets)``: the mean cross-entropy of logits that are
        # not a plain tensor (tensor parallelism's vocab-sharded ones).
        self.sequence_shard_fn: Callable[[Tensor], Tensor] | None = None
        self.sequence_sum_fn: Callable[[Tensor], Tensor] | None = None
        self.logits_loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None

    def forward(
        self,
        input_ids: Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
        labels: Tensor | None = None,
        mtp_labels: Tensor | None = None,
    ) -> Tensor:
        """Logits ``(B, T, V)`` of token ids ``(B, T)`` (a pipeline stage: see :meth:`blocks`); with ``labels``
        ``(B, T)``, the mean cross-entropy against them instead, the head fused into it (:meth:`fused_lm_loss`).

        A training forward of a model with ``mtp_depth`` and targets (``mtp_labels``, else ``labels``: next-token
        labels of whole sequences or :func:`~moeforge.model.mtp.future_tokens`) sets :attr:`last_mtp_loss` where
        the MTP modules are, which the trainer adds to the loss; pipeline stages before them pass the hidden
        states on with the depths' embeddings (:func:`~moeforge.model.mtp.join_stream`)."""
        T = input_ids.shape[1]
        if self.positions_fn is not None and cache is None:
            positions = self.positions_fn(T, input_ids.device)
        else:
            positions = torch.arange(start_pos, start_pos + T, device=input_ids.device)
        cos, sin = model_rope_tables(self.cfg, positions)
        targets = mtp_labels if mtp_labels is not None else labels
        with_mtp = self.cfg.mtp_depth > 0 and self.training and targets is not None and cache is None
        embeds = None  # a later pipeline stage's MTP embeddings, received with the hidden states
        if self.embed_tokens is not None:
            h = self.embed_tokens(input_ids)
        else:
            h = input_ids
            if with_mtp:
                h, embeds = split_stream(h, self.cfg)
        for block in self.blocks():
            h = block(h, cos, sin, cache)
        self.last_mtp_loss = None
        if with_mtp and self.mtp is not None:
            self.last_mtp_loss = mtp_loss(self, h, input_ids, targets, cos, sin, labels is not None, embeds)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is None:
            return join_stream(self, h, embeds, targets) if with_mtp else h  # type: ignore[arg-type]
        if labels is not None:
            return self.fused_lm_loss(h, labels)
        logits = self.lm_head(h)
        cap = self.cfg.logit_softcap
        return cap * torch.tanh(logits / cap) if cap > 0 else logits

    def fused_lm_loss(self, h: Tensor, labels: Tensor) -> Tensor:
        """Mean cross-entropy of ``lm_head(h)`` against ``labels``, as an fp32 scalar, computed by
        :func:`linear_cross_entropy` (``model.loss_implementation=fused_linear``): the logits never exist whole.
        The head's products run in autocast's dtype when it is on, else in the weight's, as ``lm_head`` would."""
        head = self.lm_head
        if type(head) is not nn.Linear or head.bias is not None or self.cfg.logit_softcap > 0:
            raise ValueError(
                "model.loss_implementation=fused_linear needs a plain bias-free nn.Linear lm_head, no logit softcap, "
                f"got {type(head).__name__} (softcap {self.cfg.logit_softcap}); use loss_implementation=default"
            )
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
        return linear_cross_entropy(h.reshape(-1, h.shape[-1]), head.weight, labels.reshape(-1), dtype)

    def blocks(self) -> list[Block]:
        """The blocks this module holds, in layer order.

        A pipeline stage (``moeforge.parallel.pipeline.stages``) keeps only its own
        blocks in ``layers`` (a ModuleDict keyed by the layer index, so the
        parameter names stay those of the whole model) and sets the parts it
        does not run (``embed_tokens``, ``norm``, ``lm_head``) to None; the
        forward then takes and returns hidden states where those parts are
        missing.
        """
        layers = self.layers
        return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)  # type: ignore[arg-type]

    def moe_layers(self) -> list[MoELayer]:
        """The MoE feed-forward modules, in layer order."""
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    @contextlib.contextmanager
    def routing_streams_kept(self) -> Iterator[None]:
        """Forwards inside leave the random-routing generators as they found them: evaluation and sampling
        draw routes without moving training's stream, so a run that evaluated at some step (its last, say)
        resumes into the same routes as one that did not."""
        routers = [m.router for m in self.moe_layers() if m.router.cfg.random_routing]
        states = [r.generator_state() for r in routers]
        try:
            yield
        finally:
            for router, state in zip(routers, states):
                router.set_generator_state(state)

    def set_routing_step(self, step: int) -> None:
        """Tell every router which optimizer step it routes for (synthetic Zipf routing drifts by it)."""
        for layer in self.moe_layers():
            layer.router.routing_step = step

    @torch.no_grad()
    def post_batch(self, expert_counts: Tensor) -> None:
        """End-of-batch bookkeeping of every MoE layer this module holds (OLMo-core's ``post_batch``), after an
        optimizer step that was taken: ``expert_counts`` is ``(moe layers here, E)``, each layer's routes per
        expert over the whole step."""
        layers = self.moe_layers()
        if len(layers) != len(expert_counts):
            raise ValueError(f"post_batch: {len(expert_counts)} rows of counts for {len(layers)} MoE layers")
        for layer, counts in zip(layers, expert_counts):
            layer.post_batch(counts)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std); output projections scaled by 1/sqrt(2 * n_layers); norms to 1; biases to 0."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith((".bias", "experts.b1", "experts.b2")):
                p.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
                p.normal_(0.0, out_std, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)
        for m in self.moe_layers():
            m.router.expert_bias.zero_()


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> MoETransformer:
    """Build and initialise a model from its config (``device='meta'`` allocates nothing)."""
    with torch.device(device):
        model = MoETransformer(cfg, seed)
    if str(device) != "meta":
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        model.init_weights(g)
    return model
