"""The documentation site builds with ``mkdocs build --strict`` (every warning an error) and renders the API
reference from the docstrings (mkdocs, mkdocs-material and mkdocstrings come with the docs extra, which
``make setup`` installs). docs/config.md against its generator: tests/test_config_doc.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _build(site: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner, not a build warning
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = _build(out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert "WARNING" not in done.stderr, done.stderr
    return out


def test_the_site_builds_strict_with_every_nav_page(site: Path) -> None:
    for page in ("index.html", "concepts/index.html", "getting-started/first-run/index.html", "config/index.html"):
        assert (site / page).is_file(), page
    assert (site / "reference" / "api" / "parallel-expert" / "index.html").is_file()
    assert not (site / "_hooks").exists()  # the build's hooks are not published


def test_the_api_reference_is_rendered_from_the_docstrings(site: Path) -> None:
    config = (site / "reference" / "api" / "config" / "index.html").read_text()
    # moeforge.config.validation.validate_config's docstring, and its signature
    assert "Raise one ConfigError for the first violated constraint." in config
    assert "validate_config" in config
    rowwise = (site / "reference" / "api" / "parallel-expert" / "index.html").read_text()
    assert "fixed-capacity buffers, no host sync" in rowwise
    # reST roles are shown as their targets: ':func:`~moeforge.x.f`' becomes 'f' in code
    model = (site / "reference" / "api" / "model" / "index.html").read_text()
    assert ":func:" not in model and ":class:" not in model


def test_links_out_of_docs_are_checked_and_broken_links_fail(tmp_path: Path) -> None:
    """A link to a repository file outside docs/ is accepted (and rewritten); one to a missing file, inside or
    outside docs/, fails the strict build."""
    docs = tmp_path / "docs"
    (docs / "_hooks").mkdir(parents=True)
    (docs / "_hooks" / "site_hooks.py").write_text((ROOT / "docs" / "_hooks" / "site_hooks.py").read_text())
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "README.md").write_text("# results\n")
    (docs / "index.md").write_text("# home\n\n[results](../benchmarks/README.md) [folder](../benchmarks/)\n")
    cfg = tmp_path / "mkdocs.yml"
    cfg.write_text(
        "site_name: t\ndocs_dir: docs\nstrict: true\nhooks: [docs/_hooks/site_hooks.py]\n"
        "exclude_docs: /_hooks/\nvalidation:\n  links:\n    not_found: warn\n"
    )
    good = _build(tmp_path / "site", cfg)
    assert good.returncode == 0, good.stderr
    page = (tmp_path / "site" / "index.html").read_text()
    assert 'href="../benchmarks/README.md"' in page  # site/ sits beside benchmarks/ in this checkout

    for broken in ("[gone](../benchmarks/missing.md)", "[gone](missing.md)"):
        (docs / "index.md").write_text(f"# home\n\n{broken}\n")
        bad = _build(tmp_path / "site", cfg)
        assert bad.returncode != 0, broken
        assert "missing.md" in bad.stderr
