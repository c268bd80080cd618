"""Comments and docstrings in ``src/moeforge`` say why the code is as it is, not what a timing was on which CPU.

Every comment (``tokenize``) and every docstring or bare string statement (``ast``) of ``src/moeforge/**/*.py``
is scanned for a named CPU model or vendor machine and for a wall-time figure. Measurements belong in a dated
report under ``benchmarks/`` (e.g. ``benchmarks/2026-12-06-cpu-kernel-notes.md``), which the code points to.
Throughput units such as TFLOP/s or GB/s (the datasheet figures of ``plan/devices.py``) are not times and pass.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "moeforge"

#: a CPU model, a vendor's machine, or "the machine this was timed on"
MACHINE = re.compile(
    r"\b(?:EPYC|Xeon|AMX|Sapphire\s+Rapids|this\s+CPU|this\s+machine|the\s+development\s+machine)\b", re.IGNORECASE
)

#: a number followed by a unit of wall time (``16.0 ms``, ``0.84 ns``, ``3 s``, also with a line break between);
#: not ``2 spans``, ``s_t`` or ``GB/s``: the unit must follow the number itself and end at a word boundary
WALL_TIME = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:[ \t]?|[ \t]*\n[ \t]*)(?:ms|µs|us|ns|s)\b")

#: the marker of a comment line that continues the one above it
COMMENT_MARK = re.compile(r"^#+:?")


def _comments(source: str) -> list[tuple[int, str]]:
    """``(first line, text)`` of every block of comments on consecutive lines, the continuation lines' ``#`` removed."""
    blocks: list[tuple[int, list[str]]] = []
    last = -1
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if blocks and line == last + 1:
            blocks[-1][1].append(COMMENT_MARK.sub("", tok.string))
        else:
            blocks.append((line, [tok.string]))
        last = line
    return [(first, "\n".join(texts)) for first, texts in blocks]


def _docstrings(source: str) -> list[tuple[int, str]]:
    """``(first line, text)`` of every string statement: module, class and function docstrings, attribute docs."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            end = node.end_lineno or node.lineno
            found.append((node.lineno, "\n".join(lines[node.lineno - 1 : end])))
    return found


def offending(path: Path) -> list[str]:
    """``file:line: text`` for each comment or docstring line of ``path`` that names a machine or a wall time."""
    source = path.read_text(encoding="utf-8")
    hits = set()
    for first, text in _comments(source) + _docstrings(source):
        for pattern in (MACHINE, WALL_TIME):
            for match in pattern.finditer(text):
                line = first + text.count("\n", 0, match.start())
                hits.add((line, source.splitlines()[line - 1].strip()))
    name = path.relative_to(SRC.parents[1]) if path.is_relative_to(SRC.parents[1]) else path
    return [f"{name}:{line}: {text}" for line, text in sorted(hits)]


@pytest.mark.parametrize(
    ("text", "flagged"),
    [
        ("# took 16.0 to 18.1 ms with 8 MB blocks", True),
        ("# 0.84 ns an element", True),
        ("# 47 against 53 ms", True),
        ("# a 3 s warm-up", True),
        ("# 4x faster on this CPU", True),
        ("# scratch timing, AMD EPYC, one thread", True),
        ("# on the Intel Xeon development machine", True),
        ("# Sapphire Rapids with AMX", True),
        ("# cut into 4 spans", False),
        ("# s_t = sum_e p[t, e]", False),
        ("# 989.4 TFLOP/s BF16 dense, 900 GB/s", False),
        ("# parallel.timeout_s seconds", False),
        ("# bf16 and fp32 weights of 128 experts", False),
    ],
)
def test_patterns(tmp_path: Path, text: str, flagged: bool) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(f"{text}\nX = 1\n", encoding="utf-8")
    assert bool(offending(probe)) is flagged


def test_docstring_figure_split_over_lines_is_found(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('X = 1\n"""X took 16.0\n    ms on one thread."""\n\n# 1.5\n# ns an element\n', encoding="utf-8")
    assert offending(probe) == [f'{probe}:2: """X took 16.0', f"{probe}:5: # 1.5"]


def test_comments_say_why_not_timings() -> None:
    hits = [hit for path in sorted(SRC.rglob("*.py")) for hit in offending(path)]
    assert not hits, (
        "comments or docstrings name a CPU or machine, or state a wall time; say why the code is as it is and "
        "move the measurement into a dated report under benchmarks/:\n" + "\n".join(hits)
    )
