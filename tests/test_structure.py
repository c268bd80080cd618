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
    "errors": 0,  # exit codes and error classes, imports nothing of moeforge
    "config": 1,  # sections, loading, validation; config.doc renders the sections module
    "ops": 2,
    "model": 3,
    "data": 4,
    "interop": 4,
    "optim": 4,  # update rules and schedules: they know no ranks
    "parallel": 5,
    "train": 6,
    "plan": 7,  # accounting and `moeforge plan`: reads parallel's layouts, never trains
    "report": 7,
    "bench": 8,  # its pages use the report's plots and the plan's peaks
    "experiment": 8,  # runs `moeforge train` per variant, tables from the report's readers
    "launch": 9,
    "cli": 10,
    "testing": 11,  # test helpers: gloo runs, the host-sync detector, fault injection around the CLI
    "__main__": 12,
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
    bad = [(f, a, b) for a, b, f in found if LEVELS[b] >= LEVELS[a] and b != "__init__"]
    assert not bad, f"upward or sideways imports: {bad}"


def _module_imports() -> dict[str, set[str]]:
    """Every moeforge module and the moeforge modules it imports, TYPE_CHECKING blocks included.

    ``from a.b import c`` counts as an import of ``a.b.c`` when that is a module, else of ``a.b``.
    """
    out: dict[str, set[str]] = {}
    for f in SRC.rglob("*.py"):
        name = ".".join(("moeforge", *f.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
        found: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moeforge"):
                for alias in node.names:
                    sub = SRC.joinpath(*node.module.split(".")[1:], alias.name)
                    found.add(f"{node.module}.{alias.name}" if sub.with_suffix(".py").exists() else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("moeforge")}
        out[name] = found - {name}
    return out


def test_no_file_imports_itself_through_others() -> None:
    """No circle of imports between files, not even one that only type checkers follow."""
    graph = _module_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            # a package's __init__ re-exporting its own modules is the package, not a circle
            if nxt not in graph or node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, f"import circles: {circles}"


# Sub-packages that carry the design (docs/architecture.md): a concept a folder.
SUBPACKAGES = {
    "config": {"sections", "loading", "validation", "doc"},
    "optim": {"adamw", "muon", "schedule"},
    "plan": {"planner", "activations", "pipeline", "tensor", "flops", "devices"},
    "parallel/expert": {"parallelize", "alltoall", "rowwise", "overlap"},
    "parallel/pipeline": {"stages", "schedule", "timing"},
    "parallel/tensor": {"parallelize"},
    "parallel/context": {"attention", "chunks"},
    "parallel/data_parallel": {"ddp", "fsdp", "buckets", "flat_shards", "distributed_optimizer"},
    "train/checkpoint": {"manager", "load", "policy", "state", "store"},
    "testing": {"distributed", "host_sync"},
}
# What stays flat in parallel/: the mesh, the stack interface and what applies across dimensions.
PARALLEL_FLAT = {
    "__init__",
    "mesh",
    "stack",
    "parallelize",
    "activation_checkpoint",
    "compile",
    "low_precision",
    "memory",
}


def test_subpackages_hold_their_concepts() -> None:
    for package, modules in SUBPACKAGES.items():
        here = {f.stem for f in (SRC / package).glob("*.py")}
        assert modules <= here, f"{package}/ lacks {sorted(modules - here)}"
    flat = {f.stem for f in (SRC / "parallel").glob("*.py")}
    assert flat <= PARALLEL_FLAT, f"parallel/ gains flat files {sorted(flat - PARALLEL_FLAT)}: give them a sub-package"
    stray = [f.name for f in (SRC / "train").glob("checkpoint*.py")]
    assert not stray, f"checkpoint modules belong in train/checkpoint/: {stray}"


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


def test_layout_rules_are_checked_once_at_validation() -> None:
    """The expert-parallel rule lives in config/validation.py; run-time code trusts it (an assertion at most).
    The planner, which enumerates candidate layouts, is validation's only other caller."""
    callers = sorted(
        str(f.relative_to(SRC))
        for f in SRC.rglob("*.py")
        if "check_ep(" in f.read_text() and f.relative_to(SRC).as_posix() not in {"config/validation.py"}
    )
    assert callers == ["plan/planner.py"], callers
