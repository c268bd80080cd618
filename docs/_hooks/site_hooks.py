"""mkdocs hooks of the moeforge site (``hooks:`` in mkdocs.yml; this folder is excluded from the site).

1. Links from a page to a file outside ``docs/`` (``../benchmarks/README.md``, ``../configs/x.yaml``): mkdocs
   cannot resolve them and would warn, so the strict build would fail. Here they are checked against the
   repository instead: a target that exists becomes a link to it (``repo_url``/blob/main/PATH when mkdocs.yml
   sets ``repo_url``, else a relative link from the built page to the file in this checkout); a target that does
   not exist is a warning, which fails ``mkdocs build --strict`` as a broken link inside ``docs/`` does.
2. The API reference renders docstrings written in reST-style text: of a role (``:func:`~moeforge.x.f```) the
   prefix is dropped, and a ``~`` target shows only its last name, as Sphinx shows it; a reST simple table
   (columns under ``====  ====`` borders) becomes an HTML table, and the ``::`` that introduces a literal block
   is shown as ``:``.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit
from xml.etree.ElementTree import Element

from markdown import Markdown
from markdown.extensions import Extension
from markdown.treeprocessors import Treeprocessor

log = logging.getLogger("mkdocs.hooks.site_hooks")

_state: dict = {"page": None, "config": None}
_SCHEME = "moeforge-repo"


def _outside_target(src_uri: str, path: str) -> str | None:
    """The repository path (posix, relative to the repository root) of ``path`` linked from docs page
    ``src_uri``, when it leads out of ``docs/``; else None."""
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(src_uri), path))
    if not joined.startswith("../"):
        return None
    return joined[3:]


class _OutsideLinks(Treeprocessor):
    """Rewrite links that leave docs_dir (runs before mkdocs' own link resolution)."""

    def run(self, root: Element) -> None:
        page, config = _state["page"], _state["config"]
        if page is None or config is None:
            return
        docs_dir = Path(config.docs_dir).resolve()
        repo_root = docs_dir.parent
        for el in root.iter():
            attr = "href" if el.tag == "a" else "src" if el.tag == "img" else None
            if attr is None or not el.get(attr):
                continue
            scheme, netloc, path, query, anchor = urlsplit(el.get(attr))
            if scheme or netloc or not path or path.startswith("/"):
                continue
            rel = _outside_target(page.file.src_uri, path)
            if rel is None:
                continue
            target = repo_root / rel
            if rel.startswith("../") or not target.exists():
                log.warning(
                    "Doc file '%s' links to '%s', which is outside docs/ and not in the repository ('%s').",
                    page.file.src_uri,
                    path,
                    rel,
                )
            # A placeholder scheme, so that mkdocs' own link check leaves the link alone; on_page_content
            # turns it into the final URL once the page's location in the site is known.
            el.set(attr, urlunsplit((_SCHEME, "", rel + ("/" if target.is_dir() else ""), query, anchor)))


class _OutsideLinksExtension(Extension):
    def extendMarkdown(self, md: Markdown) -> None:  # noqa: N802 (python-markdown's name)
        # mkdocs resolves relative links in its "relpath" treeprocessor at priority 0; run just before it.
        md.treeprocessors.register(_OutsideLinks(md), "moeforge_outside_links", 1)


def on_config(config):
    _state["config"] = config
    config.markdown_extensions.append(_OutsideLinksExtension())
    return config


def on_page_markdown(markdown, page, config, files):
    _state["page"] = page
    return markdown


_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|data|attr|exc|obj|const):(<code>)(~?)([^<]*)(</code>)")


def _role(m: re.Match) -> str:
    name = m[3].rsplit(".", 1)[-1] if m[2] else m[3]
    return f"{m[1]}{name}{m[4]}"


_PLACEHOLDER = re.compile(rf'(href|src)="{_SCHEME}:([^"#?]*)([^"]*)"')


def _repo_url(rel: str, page, config) -> str:
    """Where a link to repository path ``rel`` (a folder when it ends in ``/``) points from ``page``."""
    if config.repo_url:
        kind = "tree" if rel.endswith("/") else "blob"
        branch = config.extra.get("repo_branch", "main")
        return f"{config.repo_url.rstrip('/')}/{kind}/{branch}/{rel}"
    # The file in this checkout, relative to the built page: up to the site root, then to the repository root.
    site_dir = Path(config.site_dir).resolve()
    repo_root = Path(config.docs_dir).resolve().parent
    up_to_site = "../" * page.url.count("/")
    site_to_repo = posixpath.relpath(repo_root.as_posix(), site_dir.as_posix())
    return f"{up_to_site}{site_to_repo}/{rel}"


_LITERAL_INTRO = re.compile(r"(?<=\S)::</p>(?=\s*<(?:div|pre)\b)")
_SIMPLE_TABLE = re.compile(r"<p>(=+(?: +=+)+)\n(.*?)\n\1</p>", re.DOTALL)


def _simple_table(m: re.Match) -> str:
    """A reST simple table (no header row) as HTML; a line whose first column is blank continues the row above."""
    starts = [c.start() for c in re.finditer(r"=+", m[1])]
    rows: list[list[str]] = []
    for line in m[2].split("\n"):
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
        if rows and not cells[0]:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells)]
        else:
            rows.append(cells)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tbody>{body}</tbody></table>"


def on_page_content(html, page, config, files):
    html = _PLACEHOLDER.sub(lambda m: f'{m[1]}="{_repo_url(m[2], page, config)}{m[3]}"', html)
    html = _SIMPLE_TABLE.sub(_simple_table, html)
    html = _LITERAL_INTRO.sub(":</p>", html)
    return _ROLE.sub(_role, html)
