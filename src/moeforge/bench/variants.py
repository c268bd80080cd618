"""The variants ``moeforge bench`` runs: named comparisons, sweeps and ``--variant`` specs.

Each :class:`Variant` is a name, a process count and config overrides; the
first variant of a comparison is the reference the others are divided by.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from moeforge.config import ConfigError

COMPARISONS = (
    "stacks",
    "stacks_tuned",
    "dispatchers",
    "overlap",
    "ep_overlap",
    "precision",
    "routing",
    "node_limited",
    "pipeline",
    "tensor",
    "context",
    "hf",
    "hf_layer",
)
DEFAULT_CONFIGS = {
    "stacks": "stacks.yaml",
    "stacks_tuned": "moe47b_scaled.yaml",
    "dispatchers": "stacks.yaml",
    "overlap": "stacks.yaml",
    "ep_overlap": "stacks.yaml",
    "precision": "stacks.yaml",
    "routing": "stacks.yaml",
    "node_limited": "stacks.yaml",
    "pipeline": "stacks.yaml",
    "hf": "hf.yaml",
    "hf_layer": "hf.yaml",
    "tensor": "stacks.yaml",
    "context": "stacks.yaml",
    "sweep": "experts.yaml",
    None: "stacks.yaml",
}
SWEEP_KEYS = {
    "num_experts": ("model.moe.num_experts", "E"),
    "top_k": ("model.moe.top_k", "k"),
    "expert_hidden": ("model.moe.expert_hidden", "F"),
    "capacity_factor": ("model.moe.capacity_factor", "cf"),
    "ep": ("parallel.ep", "ep"),
    "tp": ("parallel.tp", "tp"),
    "micro_batch_size": ("train.micro_batch_size", "mb"),
}


@dataclass
class Variant:
    """One launch: a name, a process count and the overrides applied on top of the base config."""

    name: str
    nproc: int
    overrides: list[str] = field(default_factory=list)


def comparison_variants(kind: str, nproc: int, ep: int, fp8: bool = False) -> list[Variant]:
    """The variants of ``--compare KIND``; the first is the reference the others are divided by.

    ``fp8``: the machine runs FP8 (``precision`` adds an fp8_rowwise variant)."""
    ddp = ["--parallel.stack=ddp", f"--parallel.ep={ep}"]
    base = f"ddp+ep{ep}"
    if kind == "stacks":
        return [Variant("fsdp", nproc, ["--parallel.stack=fsdp", "--parallel.ep=1"]), Variant(base, nproc, ddp)]
    if kind == "stacks_tuned":  # each stack in each of its settings; the headline is best over best
        fsdp = ["--parallel.stack=fsdp", "--parallel.ep=1"]
        return [
            Variant("fsdp", nproc, [*fsdp, "--parallel.fsdp_reshard_after_forward=true"]),
            Variant("fsdp+keep_gathered", nproc, [*fsdp, "--parallel.fsdp_reshard_after_forward=false"]),
            Variant(base, nproc, [*ddp, "--parallel.bucket_size_mb=25"]),
            Variant(f"{base}+per_block", nproc, [*ddp, "--parallel.bucket_size_mb=0"]),
        ]
    if kind == "dispatchers":
        return [
            Variant(base, nproc, [*ddp, "--model.moe.dispatcher=alltoall"]),
            Variant(f"{base}+rowwise", nproc, [*ddp, "--model.moe.dispatcher=rowwise"]),
        ]
    if kind == "overlap":
        return [
            Variant(f"{base}+overlap_off", nproc, [*ddp, "--parallel.overlap_grad_reduce=false"]),
            Variant(base, nproc, [*ddp, "--parallel.overlap_grad_reduce=true"]),
            # one bucket per block: a small model's gradients otherwise fill one 25 MB bucket that
            # completes only at the end of backward, so "overlap" would have nothing to overlap
            Variant(
                f"{base}+per_block", nproc, [*ddp, "--parallel.overlap_grad_reduce=true", "--parallel.bucket_size_mb=0"]
            ),
        ]
    if kind == "ep_overlap":  # the token all-to-all in chunks, each overlapped with another chunk's experts
        return [
            Variant(base, nproc, [*ddp, "--model.moe.dispatcher=alltoall", "--parallel.ep_overlap_chunks=1"]),
            *(
                Variant(
                    f"{base}+a2a_chunks{c}",
                    nproc,
                    [*ddp, "--model.moe.dispatcher=alltoall", f"--parallel.ep_overlap_chunks={c}"],
                )
                for c in (2, 4)
            ),
        ]
    if kind == "precision":  # bf16 is the reference, mxfp8 last (the headline: mxfp8 / bf16)
        names = ["bf16", "fp32", *(["fp8_rowwise"] if fp8 else []), "mxfp8"]
        return [Variant(f"{base}+{p}", nproc, [*ddp, f"--train.precision={p}"]) for p in names]
    if kind == "routing":
        return [
            Variant(f"{base}+learned", nproc, [*ddp, "--model.moe.random_routing=false"]),
            Variant(f"{base}+random", nproc, [*ddp, "--model.moe.random_routing=true"]),
        ]
    if kind == "node_limited":  # DeepSeek-V3's group-limited routing, one group per ep rank: a token reaches <= M
        groups = [*ddp, "--model.moe.score_func=sigmoid", f"--model.moe.n_groups={ep}"]
        m = max(1, ep // 2)
        return [
            Variant(f"{base}+any_rank", nproc, [*groups, f"--model.moe.topk_groups={ep}"]),
            Variant(f"{base}+ranks{m}", nproc, [*groups, f"--model.moe.topk_groups={m}"]),
        ]
    if kind == "pipeline":  # pp=1 (dp = nproc) against pp=2 with each schedule, the same global batches
        pp2 = ["--parallel.stack=ddp", "--parallel.ep=1", "--parallel.pp=2"]
        virtual = [*pp2, "--parallel.pp_stages_per_rank=2"]
        return [
            Variant("pp1", nproc, ["--parallel.stack=ddp", "--parallel.ep=1", "--parallel.pp=1"]),
            Variant("pp2+gpipe", nproc, [*pp2, "--parallel.pp_schedule=gpipe"]),
            Variant("pp2+1f1b", nproc, [*pp2, "--parallel.pp_schedule=1f1b"]),
            Variant("pp2+interleaved_1f1b", nproc, [*virtual, "--parallel.pp_schedule=interleaved_1f1b"]),
            Variant("pp2+zbv", nproc, [*virtual, "--parallel.pp_schedule=zbv"]),
        ]
    if kind == "tensor":  # expert parallelism over data ranks vs tensor parallelism (dp = nproc / 2)
        return [
            Variant(base, nproc, ddp),
            Variant("tp2", nproc, ["--parallel.stack=ddp", "--parallel.ep=1", "--parallel.tp=2"]),
        ]
    if kind == "context":  # the same global batches, each sequence split over 2 ranks (dp halves)
        return [
            Variant(base, nproc, [*ddp, "--parallel.cp=1"]),
            Variant(f"{base}+cp2", nproc, [*ddp, "--parallel.cp=2"]),
        ]
    raise ConfigError(f"--compare: must be one of {', '.join(COMPARISONS)}, got {kind!r}")


def sweep_variants(spec: str, nproc: int) -> list[Variant]:
    """``KEY=v1,v2,...`` (a short key like ``num_experts`` or any dotted config field) -> one variant per value."""
    if "=" not in spec:
        raise ConfigError(f"--sweep: expected KEY=v1,v2,..., e.g. num_experts=8,32,128; got {spec!r}")
    key, _, values = spec.partition("=")
    dotted, short = SWEEP_KEYS.get(key, (key, key.rsplit(".", 1)[-1]))
    points = [v.strip() for v in values.split(",") if v.strip()]
    if len(points) < 2:
        raise ConfigError(f"--sweep: give at least two values for {key}, e.g. {key}=8,32; got {values!r}")
    return [Variant(f"{short}={p}", nproc, [f"--{dotted}={p}"]) for p in points]


def parse_variant(spec: str, nproc: int) -> Variant:
    """``NAME: --a.b=1 --c.d=2 [--nproc=N]`` -> a :class:`Variant`."""
    name, sep, rest = spec.partition(":")
    if not sep or not name.strip():
        raise ConfigError(f"--variant: expected 'NAME: --section.field=value ...', got {spec!r}")
    overrides, procs = [], nproc
    for token in shlex.split(rest):
        if token.startswith("--nproc="):
            value = token.split("=", 1)[1]
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--variant {name.strip()!r}: --nproc must be an integer >= 1, got {value!r}")
            procs = int(value)
        else:
            overrides.append(token)
    return Variant(name.strip(), procs, overrides)


def default_config(kind: str | None) -> Path:
    """``configs/bench/<file>`` for a comparison: in the working directory, else next to the package."""
    name = DEFAULT_CONFIGS[kind]
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        path = root / "configs" / "bench" / name
        if path.is_file():
            return path
    raise ConfigError(f"config: the default configs/bench/{name} was not found; pass a CONFIG file")
