"""The code's shape: dependencies point one way, and parameter roles come from modules, not names."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch import nn

from moeforge.config import MoEConfig
from moeforge.model.layers import RMSNorm
from moeforge.model.moe.layer import MoELayer
from moeforge.model.params import DECAY, EXPERT, NO_DECAY, named_parameter_roles
from moeforge.parallel.stack import optim_param_groups

SRC = Path(__file__).resolve().parents[1] / "src" / "moeforge"

# Lower layers never import higher ones; packages of one level never import each other.
LEVELS = {
    "__init__": 0,  # the root package: only the version string
    "config": 0,
    "config_validation": 0,
    "config_doc": 1,  # python -m moeforge.config_doc: renders the config module
    "errors": 0,  # exit codes and error classes, imports nothing of moeforge
    "ops": 1,
    "model": 2,
    "data": 3,
    "interop": 3,
    "parallel": 4,
    "train": 5,
    "report": 6,
    "bench": 7,  # its pages use the report's plots
    "experiment": 7,  # runs `moeforge train` per variant, tables from the report's readers
    "testing": 8,
    "launch": 8,
    "cli": 9,
    "__main__": 10,
}


def _imports() -> list[tuple[str, str, str]]:
    """``(importing package, imported package, file)`` for every moeforge import, TYPE_CHECKING blocks excluded."""
    out = []
    for f in SRC.rglob("*.py"):
        rel = f.relative_to(SRC).with_suffix("")
        here = rel.parts[0]
        tree = ast.parse(f.read_text())
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moeforge"):
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("moeforge")]
            for name in names:
                parts = name.split(".")
                there = parts[1] if len(parts) > 1 else "__init__"
                if there != here:
                    out.append((here, there, str(rel)))
    return out


def test_dependencies_point_one_way() -> None:
    found = _imports()
    unknown = sorted({p for a, b, _ in found for p in (a, b) if p not in LEVELS})
    assert not unknown, f"add {unknown} to LEVELS"
    config = {"__init__", "config", "config_validation", "errors"}
    bad = [(f, a, b) for a, b, f in found if LEVELS[b] >= LEVELS[a] and not {a, b} <= config]
    assert not bad, f"upward or sideways imports: {bad}"


class _Renamed(nn.Module):
    """Names that fooled the old substring rules: no 'experts.w', a matrix called 'embed', a norm not called so."""

    def __init__(self) -> None:
        super().__init__()
        self.ffn = MoELayer(8, MoEConfig(num_experts=2, top_k=1, expert_hidden=4))
        self.embed_proj = nn.Linear(8, 8, bias=False)
        self.scale = RMSNorm(8)
        self.vocab = nn.Embedding(10, 8)


def test_parameter_roles_follow_modules_not_names() -> None:
    model = _Renamed()
    model.ffn.routed = model.ffn.experts  # a second name for the experts
    roles = {name: role for name, _, role in named_parameter_roles(model)}
    assert roles == {
        "ffn.router.weight": DECAY,
        "ffn.experts.w1": EXPERT,
        "ffn.experts.w2": EXPERT,
        "embed_proj.weight": DECAY,
        "scale.weight": NO_DECAY,
        "vocab.weight": NO_DECAY,
    }
    decay, no_decay = optim_param_groups(model, 0.1)
    assert {id(p) for p in decay["params"]} == {id(model.embed_proj.weight), id(model.ffn.router.weight)} | {
        id(model.ffn.experts.w1),
        id(model.ffn.experts.w2),
    }
    assert len(no_decay["params"]) == 2 and torch.is_tensor(no_decay["params"][0])
