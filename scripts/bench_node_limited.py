"""Node-limited routing's effect on expert parallelism: the same model, weights and tokens routed with and
without DeepSeek-V3's group limit (one expert group per ep rank, a token's experts from its best ``M`` groups),
on ``--ep`` gloo processes with the all-to-all dispatcher.

Per variant and MoE layer it records the all-to-all fan-out (distinct destination ranks per token, from the
routes the dispatcher sends), the bytes each rank's dispatch sends to other ranks (one row per route, as moeforge
sends them, and once per destination rank, as a deduplicating dispatcher would), the rows each rank receives, and
the tokens/s of a forward and backward (fp32). The variants take turns each round; the report is the median.

    PYTHONPATH=src python scripts/bench_node_limited.py OUT_DIR [--ep 4] [--topk-groups 2] [--rounds 5]

writes ``OUT_DIR/results.json`` with the environment (``env.git_commit``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeforge.config import ModelConfig, MoEConfig, ParallelConfig
from moeforge.model.transformer import build_model
from moeforge.parallel.expert.fanout import fanout_stats, group_rank_bound
from moeforge.parallel.expert.parallelize import parallelize_experts
from moeforge.parallel.mesh import build_mesh
from moeforge.testing import run_distributed_test
from moeforge.train.environment import collect_env

SHAPE = dict(vocab_size=512, d_model=256, n_layers=2, n_heads=4, max_seq_len=256)
EXPERTS, TOP_K, HIDDEN = 32, 8, 256  # DeepSeek-V3's top-8, a quarter of its 8 x 32 experts
BATCH, SEQ = 4, 256  # per rank


def model_config(ep: int, topk_groups: int | None) -> ModelConfig:
    """The bench model; ``topk_groups`` None: no group limit, else ``ep`` groups (one a rank), the best M kept."""
    limit = dict(n_groups=ep, topk_groups=topk_groups) if topk_groups else dict(n_groups=1, topk_groups=1)
    moe = MoEConfig(
        num_experts=EXPERTS,
        top_k=TOP_K,
        expert_hidden=HIDDEN,
        score_func="sigmoid",
        norm_topk_prob=True,
        group_score="top2_sum",
        routed_scaling_factor=2.5,
        **limit,
    )
    return ModelConfig(**SHAPE, moe=moe)


def _layer_stats(model: torch.nn.Module, ep: int, rank: int, row_bytes: int) -> list[dict[str, Any]]:
    out = []
    for layer in model.moe_layers():
        stats = fanout_stats(layer.last_routing.indices, EXPERTS, ep, rank, row_bytes)
        stats["rows_received"] = float(layer.dispatcher.stats.extra["rows_received"])
        out.append(stats)
    return out


def _rank_main(out: str, ep: int, topk_groups: int, rounds: int, warmup: int) -> None:
    torch.set_num_threads(1)
    mesh = build_mesh(ParallelConfig(ep=ep))
    rank = mesh.rank
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ + 1), generator=g)
    variants = {"no_limit": None, f"node_limited_M{topk_groups}": topk_groups}
    models = {name: parallelize_experts(build_model(model_config(ep, m), seed=7), mesh) for name, m in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    layers: dict[str, list[dict[str, Any]]] = {}

    def step(model: torch.nn.Module) -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        model.zero_grad(set_to_none=True)

    for r in range(warmup + rounds):
        for name, model in models.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(model)
            dist.barrier()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
            layers[name] = _layer_stats(model, ep, rank, 4 * SHAPE["d_model"])
    gathered: list[Any] = [None] * ep
    dist.all_gather_object(gathered, {"rank": rank, "times": times, "layers": layers})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


def summarize(per_rank: list[dict[str, Any]], ep: int, topk_groups: int) -> dict[str, Any]:
    """Per variant: the fan-out over all ranks' tokens, bytes and received rows per rank, median step tokens/s."""
    out = {}
    for name in per_rank[0]["times"]:
        step_s = statistics.median(
            max(r["times"][name][i] for r in per_rank) for i in range(len(per_rank[0]["times"][name]))
        )
        per_layer = []
        for li in range(len(per_rank[0]["layers"][name])):
            rows = [r["layers"][name][li] for r in per_rank]
            tokens = sum(x["tokens"] for x in rows)
            hist = [sum(x["tokens_by_ranks"][j] for x in rows) for j in range(ep + 1)]
            per_layer.append(
                {
                    "layer": li,
                    "mean_ranks_per_token": sum(j * n for j, n in enumerate(hist)) / tokens,
                    "max_ranks_per_token": max(x["max_ranks_per_token"] for x in rows),
                    "tokens_by_ranks": hist,
                    "bytes_sent_per_route_by_rank": [x["bytes_sent_per_route"] for x in rows],
                    "bytes_sent_per_destination_by_rank": [x["bytes_sent_per_destination"] for x in rows],
                    "rows_received_by_rank": [x["rows_received"] for x in rows],
                }
            )
        limited = name != "no_limit"
        bound = group_rank_bound(model_config(ep, topk_groups if limited else None).moe, ep)
        out[name] = {
            "n_groups": ep if limited else 1,
            "topk_groups": topk_groups if limited else 1,
            "rank_bound": bound,
            "within_bound": all(x["max_ranks_per_token"] <= bound for x in per_layer),
            "step_s_median": step_s,
            "step_s_all": [max(r["times"][name][i] for r in per_rank) for i in range(len(per_rank[0]["times"][name]))],
            "tokens_per_s": BATCH * SEQ * ep / step_s,
            "layers": per_layer,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--topk-groups", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = collect_env()
    raw = args.out / "per_rank.json"
    run_distributed_test(_rank_main, args.ep, args=(str(raw), args.ep, args.topk_groups, args.rounds, args.warmup))
    per_rank = json.loads(raw.read_text())
    raw.unlink()
    result = {
        "env": env,
        "command": " ".join(["python", "scripts/bench_node_limited.py", *sys.argv[1:]]),
        "setup": {
            "ep": args.ep,
            "backend": "gloo",
            "dispatcher": "alltoall",
            "precision": "fp32",
            "model": {**SHAPE, "num_experts": EXPERTS, "top_k": TOP_K, "expert_hidden": HIDDEN},
            "tokens_per_rank": BATCH * SEQ,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "threads_per_rank": 1,
        },
        "variants": summarize(per_rank, args.ep, args.topk_groups),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    for name, v in result["variants"].items():
        fan = [round(x["mean_ranks_per_token"], 3) for x in v["layers"]]
        sent = [sum(x["bytes_sent_per_route_by_rank"]) for x in v["layers"]]
        dedup = [sum(x["bytes_sent_per_destination_by_rank"]) for x in v["layers"]]
        print(
            f"{name}: ranks/token {fan}, max {[x['max_ranks_per_token'] for x in v['layers']]}, "
            f"bytes sent {sent}, deduplicated {dedup}, {v['tokens_per_s']:.0f} tokens/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
