"""The repository's documentation stays small, current and linked: the README's size and commit hashes,
the size of what docs/ and benchmarks/ track, and every relative link of the markdown pages."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS_PAGE = ROOT / "docs" / "benchmarks.md"

MAX_README_WORDS = 1200
MAX_README_HASHES = 3
MAX_TRACKED_BYTES = 5 * 1024 * 1024

#: a word of 7 to 40 lowercase hex digits, not inside a longer word or path component
HEX_WORD = re.compile(r"(?<![0-9A-Za-z_])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
#: a markdown link or image: [text](target) or [text](target "title")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def commit_hashes(text: str) -> list[str]:
    """Words that look like commit hashes: 7 to 40 hex digits with at least one digit and one letter
    (so neither a number nor a word such as ``decade`` counts)."""
    return [w for w in HEX_WORD.findall(text) if re.search(r"[0-9]", w) and re.search(r"[a-f]", w)]


def relative_links(page: Path) -> list[str]:
    """The link targets of ``page`` outside code, without ``#anchors``, that point into the repository."""
    text = INLINE_CODE.sub("", FENCE.sub("", page.read_text()))
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s), mailto and the like; anchors within the page
        target = target.split("#", 1)[0].split("?", 1)[0]
        if target:
            targets.append(target)
    return targets


def markdown_pages() -> list[Path]:
    """README.md, docs/*.md and the pages under benchmarks/. The ``results.md`` files under
    benchmarks/results/ are raw `moeforge bench` output, kept as written: they link to per-variant report
    pages that were not kept, so they are not checked."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    results = ROOT / "benchmarks" / "results"
    pages += sorted(p for p in (ROOT / "benchmarks").rglob("*.md") if results not in p.parents)
    return pages


def tracked_files(*paths: str) -> list[Path]:
    """Files git tracks under ``paths`` (skips the test outside a git checkout)."""
    try:
        proc = subprocess.run(
            ["git", "ls-files", "-z", "--", *paths], cwd=ROOT, capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()}")
    return [ROOT / name for name in proc.stdout.split("\0") if name]


def test_commit_hashes_are_recognised() -> None:
    text = "at commit b5876f4 (fresh clone), 1810646 runs, 2026 sha256 deadbeef 0123456 b5876f4eb680db38"
    assert commit_hashes(text) == ["b5876f4", "b5876f4eb680db38"]
    assert commit_hashes("docs/results/2026-12-06/demo_b5876f4/, 12345678 and facade") == []


def test_readme_is_short_and_names_few_commits() -> None:
    text = README.read_text()
    words = len(text.split())
    assert words < MAX_README_WORDS, f"README.md has {words} words; keep it under {MAX_README_WORDS}"
    hashes = commit_hashes(text)
    assert len(hashes) <= MAX_README_HASHES, f"README.md names {len(hashes)} commit hashes: {hashes}"


def test_tracked_docs_and_benchmarks_stay_small() -> None:
    files = tracked_files("docs", "benchmarks")
    assert files, "git tracks nothing under docs/ or benchmarks/"
    total = sum(f.stat().st_size for f in files if f.is_file())
    assert total < MAX_TRACKED_BYTES, f"docs/ and benchmarks/ track {total / 1e6:.2f} MB; keep them under 5 MB"


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(page: Path) -> None:
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing paths: {missing}"


def test_raw_results_linked_from_the_benchmarks_page_exist_and_name_their_commit() -> None:
    raw = [t for t in relative_links(BENCHMARKS_PAGE) if "results/" in t]
    assert len(raw) >= 10, f"docs/benchmarks.md links only {len(raw)} raw results"
    for target in raw:
        path = (BENCHMARKS_PAGE.parent / target).resolve()
        assert path.is_file(), f"docs/benchmarks.md links to a missing raw result: {target}"
        assert (ROOT / "benchmarks" / "results") in path.parents, f"raw result outside benchmarks/results/: {target}"
        if path.suffix == ".json":
            record = json.loads(path.read_text())
            commit = (record.get("env") or {}).get("git_commit") or record.get("commit")
            assert commit, f"{target} does not name the commit it ran"


def test_readme_rows_link_raw_results_that_name_their_commit() -> None:
    raw = [t for t in relative_links(README) if t.startswith("benchmarks/results/") and t.endswith(".json")]
    assert raw, "README.md links no raw result"
    for target in raw:
        record = json.loads((ROOT / target).read_text())
        assert (record.get("env") or {}).get("git_commit") or record.get("commit"), target
