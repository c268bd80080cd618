"""Generate the config reference (docs/config.md) from the dataclasses of :mod:`moeforge.config`.

Each field's one-line doc is the comment at the end of its line in ``config/sections.py``::

    top_k: int = 2  # experts each token is routed to

Run ``python -m moeforge.config.doc > docs/config.md`` after changing a field; a test
compares the committed file with this output.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeforge.config import sections as config_module
from moeforge.config.loading import _hints

COMMAND = "python -m moeforge.config.doc > docs/config.md"


@dataclass
class FieldDoc:
    """One documented field."""

    name: str
    type: str
    default: str
    doc: str


@dataclass
class SectionDoc:
    """One dataclass of the config, reached at ``path`` (e.g. ``model.moe``)."""

    path: str
    cls: str
    doc: str
    fields: list[FieldDoc]


def _source() -> str:
    return Path(config_module.__file__).read_text()


def _line_comments(source: str) -> dict[int, str]:
    """Line number -> text of the comment ending that line."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _annotations(source: str) -> dict[str, dict[str, tuple[str, int]]]:
    """Class name -> field name -> (annotation as written, line of the field)."""
    out: dict[str, dict[str, tuple[str, int]]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            fields = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    fields[item.target.id] = (ast.unparse(item.annotation), item.end_lineno or item.lineno)
            out[node.name] = fields
    return out


def _type_text(annotation: str) -> str:
    """``Literal['a', 'b']`` as ``"a" | "b"``; other annotations as written."""
    if annotation.startswith("Literal["):
        values = ast.literal_eval("(" + annotation[len("Literal[") : -1] + ",)")
        return " | ".join(json.dumps(v) for v in values)
    return annotation


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:  # pragma: no cover - every config field has a default
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(section)"
    return json.dumps(value)


def sections() -> list[SectionDoc]:
    """Every section reachable from :class:`~moeforge.config.Config`, depth first, in field order."""
    source = _source()
    comments, annotations = _line_comments(source), _annotations(source)
    out: list[SectionDoc] = []

    def visit(cls: type, path: str) -> None:
        docs = []
        nested: list[tuple[type, str]] = []
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            annotation, line = annotations[cls.__name__][f.name]
            docs.append(FieldDoc(f.name, _type_text(annotation), _default_text(f), comments.get(line, "")))
            if dataclasses.is_dataclass(hints[f.name]):
                nested.append((hints[f.name], f"{path}.{f.name}" if path else f.name))
        out.append(SectionDoc(path, cls.__name__, (cls.__doc__ or "").strip(), docs))
        for sub, sub_path in nested:
            visit(sub, sub_path)

    visit(config_module.Config, "")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The whole reference as Markdown."""
    lines = [
        "# Config reference",
        "",
        f"Generated from `src/moeforge/config/sections.py` by `{COMMAND}`; do not edit by hand.",
        "",
        "Set a field in a YAML file under its section (`model:` / `moe:` ...) or on the command line as",
        "`--section.field=value`, e.g. `moeforge train configs/shakespeare.yaml --model.moe.top_k=4`.",
        "The effective config of a run is written to `RUN_DIR/config.yaml`.",
        "",
    ]
    for sec in sections():
        if not sec.path:
            continue
        lines += [f"## `{sec.path}`", "", f"`{sec.cls}`: {sec.doc}", ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        for f in sec.fields:
            name = f"`{sec.path}.{f.name}`"
            if f.default == "(section)":
                lines.append(
                    f"| {name} | section | see [`{sec.path}.{f.name}`](#{sec.path}{f.name}) | {_cell(f.doc)} |"
                )
            else:
                lines.append(f"| {name} | `{_cell(f.type)}` | `{_cell(f.default)}` | {_cell(f.doc)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    """Write the reference to stdout."""
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
