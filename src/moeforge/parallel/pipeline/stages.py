"""Pipeline stages carved out of a built :class:`MoETransformer` (as torchtitan does).

Every rank builds the whole model, then :func:`carve_stages` keeps only its
stages (one, or several virtual stages: :func:`rank_stage_ids`): the blocks of
contiguous ranges of layers (``layers`` becomes a ModuleDict keyed by the
layer index, so parameter names stay those of the whole model and
checkpoints stay topology-neutral), the embedding on the first stage
only, the final norm and LM head on the last only, and with them the
multi-token-prediction modules (``model.mtp_depth``), which score with that
head: their MoE layers are the last rows of the model's MoE table, after the
trunk's. The split is ``parallel.pp_layers`` when given, else the one that
balances the stages' training FLOPs (:func:`balanced_split`), with the
embedding charged to the first stage and the head, the loss and the MTP
modules to the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moeforge.config import Config, ModelConfig
from moeforge.model import MoETransformer


def layer_train_flops(cfg: ModelConfig, seq_len: int) -> list[float]:
    """Training FLOPs per token (forward + backward, ``6 *`` the active matmul weights plus attention) of each layer."""
    d, moe = cfg.d_model, cfg.moe
    q, kv = cfg.n_heads * cfg.dim_head, cfg.kv_heads * cfg.dim_head
    attn = d * q + 2 * d * kv + q * d + seq_len * q  # projections + causal scores and values (half of 2 * T * q)
    out = []
    for i in range(cfg.n_layers):
        if i in cfg.dense_layers:
            ffn = 3 * d * cfg.dense_hidden
        else:
            ffn = moe.top_k * 3 * d * moe.expert_hidden + 3 * d * moe.shared_expert_hidden + d * moe.num_experts
        out.append(6.0 * (attn + ffn))
    return out


def head_train_flops(cfg: ModelConfig) -> float:
    """Training FLOPs per token of the LM head and the loss (the last stage's extra work)."""
    return 6.0 * cfg.d_model * cfg.vocab_size + 4.0 * cfg.vocab_size


def last_stage_train_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the last stage's parts besides its layers: the head and the loss, and per MTP
    depth a block (as costly as an MoE layer), its ``eh_proj`` and another pass through the head."""
    head = head_train_flops(cfg)
    if not cfg.mtp_depth:
        return head
    moe_layers = [c for i, c in enumerate(layer_train_flops(cfg, seq_len)) if i not in cfg.dense_layers]
    block = moe_layers[0] if moe_layers else max(layer_train_flops(cfg, seq_len))
    return head + cfg.mtp_depth * (block + 6.0 * 2 * cfg.d_model * cfg.d_model + head)


def balanced_split(costs: list[float], stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Layers per stage of the contiguous split with the smallest largest stage cost (every stage >= 1 layer)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, a: int, b: int) -> float:  # stage s runs layers [a, b)
        return prefix[b] - prefix[a] + (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][b]: stages 0..s-1 cover layers [0, b)
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for b in range(s, n - (stages - s) + 1):
            for a in range(s - 1, b):
                v = max(best[s - 1][a], cost(s - 1, a, b))
                if v < best[s][b]:
                    best[s][b], cut[s][b] = v, a
    counts, b = [], n
    for s in range(stages, 0, -1):
        a = cut[s][b]
        counts.append(b - a)
        b = a
    return counts[::-1]


def stage_layer_counts(cfg: Config) -> list[int]:
    """``parallel.pp_layers`` if given, else the FLOP-balanced split over ``pp * pp_stages_per_rank`` stages."""
    p = cfg.parallel
    stages = p.pp * p.pp_stages_per_rank
    if p.pp_layers:
        return list(p.pp_layers)
    m = cfg.model
    costs = layer_train_flops(m, cfg.data.seq_len)
    return balanced_split(costs, stages, last_extra=last_stage_train_flops(m, cfg.data.seq_len))


@dataclass(frozen=True)
class StageLayout:
    """Where one stage sits: its index, its layers ``[first_layer, end_layer)`` and its MoE layers' global rows
    (the last stage's include the MTP modules' MoE layers, the table's last rows)."""

    stage: int
    num_stages: int
    first_layer: int
    end_layer: int
    moe_offset: int  # index (among all MoE layers of the model) of this stage's first MoE layer
    moe_total: int  # MoE layers of the whole model
    moe_count: int = 0  # MoE layers of this stage

    @property
    def is_first(self) -> bool:
        """The stage that embeds the tokens."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """The stage that applies the final norm, the head and the loss."""
        return self.stage == self.num_stages - 1


def stage_layout(cfg: Config, stage: int) -> StageLayout:
    """The :class:`StageLayout` of ``stage`` under the config's split."""
    counts = stage_layer_counts(cfg)
    first = sum(counts[:stage])
    end = first + counts[stage]
    m = cfg.model
    moe = [i not in m.dense_layers for i in range(m.n_layers + m.mtp_depth)]  # the MTP blocks follow the layers
    end_rows = len(moe) if stage == len(counts) - 1 else end  # the last stage holds the MTP modules
    return StageLayout(stage, len(counts), first, end, sum(moe[:first]), sum(moe), sum(moe[first:end_rows]))


def rank_stage_ids(pp: int, stages_per_rank: int, schedule: str, pp_rank: int) -> list[int]:
    """The stages rank ``pp_rank`` of the pp group runs, in increasing order.

    One stage per rank: stage ``pp_rank``. ``interleaved_1f1b`` loops:
    ``pp_rank, pp_rank + pp, ...``. ``zbv`` is V-shaped (two stages per rank):
    ``pp_rank`` and ``2 * pp - 1 - pp_rank``, so rank 0 holds the first and the
    last stage.
    """
    if schedule == "zbv":
        return sorted({pp_rank, 2 * pp - 1 - pp_rank})
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stage_ranks(pp: int, stages_per_rank: int, schedule: str) -> dict[int, int]:
    """Which pp rank runs each stage (the inverse of :func:`rank_stage_ids`)."""
    return {s: r for r in range(pp) for s in rank_stage_ids(pp, stages_per_rank, schedule, r)}


@dataclass(frozen=True)
class RankStages:
    """The stages one rank runs (one, or several virtual stages) and where their MoE rows sit."""

    layouts: tuple[StageLayout, ...]

    @property
    def moe_rows(self) -> list[int]:
        """Rows (in the whole model's MoE-layer table) of this rank's MoE layers, in the model's layer order."""
        return [r for p in self.layouts for r in range(p.moe_offset, p.moe_offset + p.moe_count)]

    @property
    def has_first(self) -> bool:
        """This rank embeds the tokens (it runs stage 0)."""
        return any(p.is_first for p in self.layouts)

    @property
    def has_last(self) -> bool:
        """This rank applies the head and the loss (it runs the last stage)."""
        return any(p.is_last for p in self.layouts)


def rank_stages(cfg: Config, pp_rank: int) -> RankStages:
    """The :class:`RankStages` of ``pp_rank`` under the config's schedule and split."""
    p = cfg.parallel
    ids = rank_stage_ids(p.pp, p.pp_stages_per_rank, p.pp_schedule, pp_rank)
    return RankStages(tuple(stage_layout(cfg, s) for s in ids))


def carve_stages(model: MoETransformer, stages: RankStages) -> MoETransformer:
    """Keep only the parts of ``model`` the rank's stages run (in place; parameter names unchanged).

    ``layers`` becomes a ModuleDict of the stages' layers keyed by the layer
    index (in layer order); the embedding stays when a stage is the first, the
    final norm, head and MTP modules when one is the last.
    """
    blocks = list(model.layers)
    keep = sorted(i for p in stages.layouts for i in range(p.first_layer, p.end_layer))
    model.layers = nn.ModuleDict({str(i): blocks[i] for i in keep})
    if not stages.has_first:
        model.embed_tokens = None  # type: ignore[assignment]
    if not stages.has_last:
        model.norm = None  # type: ignore[assignment]
        model.lm_head = None  # type: ignore[assignment]
        model.mtp = None
    return model


def stage_view(model: MoETransformer, layout: StageLayout) -> MoETransformer:
    """A module that runs one stage of a carved ``model``, sharing its blocks and parameters.

    With several stages on a rank each :class:`PipelineStage` needs its own
    module; the views hold the same parameter objects as ``model`` (which the
    training stack and the checkpoints see), so nothing is copied.
    """
    view = MoETransformer.__new__(MoETransformer)
    nn.Module.__init__(view)
    view.cfg = model.cfg
    view.embed_tokens = model.embed_tokens if layout.is_first else None  # type: ignore[assignment]
    layers = model.layers
    view.layers = nn.ModuleDict({str(i): layers[str(i)] for i in range(layout.first_layer, layout.end_layer)})
    view.norm = model.norm if layout.is_last else None  # type: ignore[assignment]
    view.lm_head = model.lm_head if layout.is_last else None  # type: ignore[assignment]
    # hooks other parallelize_* functions set on the whole model
    view.positions_fn, view.logits_loss_fn = model.positions_fn, model.logits_loss_fn
    view.sequence_shard_fn, view.sequence_sum_fn = model.sequence_shard_fn, model.sequence_sum_fn
    view.mtp = model.mtp if layout.is_last else None  # multi-token prediction scores with the last stage's head
    view.last_mtp_loss = None
    return view
