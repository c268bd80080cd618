"""``moeforge report``: one self-contained HTML page whose every embedded plot decodes and has data."""

from __future__ import annotations

import base64
import io
import json
import math
from html.parser import HTMLParser
from pathlib import Path

import pytest

from moeforge.cli import main
from moeforge.config import Config, save_config
from moeforge.report import write_report

from .helpers import CapturedWarnings

LAYERS, EXPERTS, EP, STEPS = 2, 8, 2, 30


def fake_run(root: Path, steps: int = STEPS) -> Path:
    """A run directory as an ep=2 run with per-expert counts, MFU, drops and skipped steps would leave."""
    root.mkdir(parents=True)
    cfg = Config()
    cfg.parallel.ep = EP
    cfg.train.run_dir = str(root)
    save_config(cfg, root / "config.yaml")
    (root / "env.json").write_text(json.dumps({"torch_version": "2.x", "device_type": "cpu"}))
    lines = []
    for s in range(1, steps + 1):
        load = [[10.0 + ((e * 7 + s * (layer + 1)) % 9) for e in range(EXPERTS)] for layer in range(LAYERS)]
        skipped = s in (7, 19)
        rec = {
            "step": s,
            "loss": 6.0 / math.sqrt(s),
            "lm_loss": 5.9 / math.sqrt(s),
            "lr": 1e-3 * min(1.0, s / 5),
            "grad_norm": "nan" if skipped else 1.0 + 1.0 / s,
            "skipped": skipped,
            "tokens_per_s": 1000.0 + s,
            "mfu": 0.3,
            "expert_load": load,
            "expert_load_max_over_mean": [max(r) / (sum(r) / EXPERTS) for r in load],
            "moe/dropped_frac": 0.01 / s,
        }
        for layer in range(LAYERS):
            rec[f"moe/layer{layer}/expert_imbalance"] = rec["expert_load_max_over_mean"][layer]
            rec[f"moe/layer{layer}/rank_imbalance"] = 1.05
            rec[f"moe/layer{layer}/dropped_frac"] = 0.01 / s
        if s % 10 == 0:
            rec["val_bpb"] = 2.0 / s
        lines.append(json.dumps(rec))
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return root


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href") and value:
                (self.srcs if value.startswith("data:image/png;base64,") else self.external).append(value)


def _decoded_images(page: Path) -> list:
    import matplotlib.image as mpimg

    parser = _Images()
    parser.feed(page.read_text())
    assert not parser.external, parser.external  # self-contained
    images = []
    for src in parser.srcs:
        png = base64.b64decode(src.split(",", 1)[1], validate=True)
        images.append(mpimg.imread(io.BytesIO(png), format="png"))
    return images


def test_report_embeds_every_plot_with_data(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run")
    page = write_report(run)
    assert page == run / "report" / "index.html"
    summary = json.loads((run / "report" / "summary.json").read_text())
    expected = {"loss", "throughput", "lr", "grad_norm", "expert_load", "rank_load", "drops"}
    assert set(summary["plots"]) == expected and summary["omitted"] == []
    assert all(n > 0 for n in summary["plots"].values()), summary
    assert summary["plots"]["expert_load"] == LAYERS * EXPERTS * STEPS
    assert summary["plots"]["rank_load"] == LAYERS * EP * STEPS
    assert summary["plots"]["grad_norm"] == STEPS - 2 + 2  # finite norms + the two skipped marks
    images = _decoded_images(page)
    assert len(images) == len(expected)
    for img in images:
        assert img.shape[0] > 100 and img.shape[1] > 300
        assert float(img[..., :3].std()) > 0.01  # not blank
    text = page.read_text()
    assert "num_experts: 8" in text and "torch_version" in text  # config and environment


def test_report_without_per_expert_counts_uses_layer_keys(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run", steps=5)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        del r["expert_load"], r["mfu"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_report(run, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["plots"]["expert_load"] == LAYERS * 5 and summary["plots"]["rank_load"] == LAYERS * 5
    assert len(_decoded_images(tmp_path / "out" / "index.html")) == len(summary["plots"])


def test_report_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = fake_run(tmp_path / "run", steps=3)
    assert main(["report", str(run), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "index.html").is_file()
    assert "index.html" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no metrics.jsonl" in err
    assert not (empty / "report").exists()


def test_report_skips_torn_and_garbage_metrics_lines(tmp_path: Path) -> None:
    """A killed run leaves a truncated last line; a garbage middle line too: report still works, warns once."""
    run = fake_run(tmp_path / "run", steps=6)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines.insert(2, "\x00\x00garbage{")  # line 3
    torn = json.dumps({"step": 7, "loss": 1.0})[:9]  # line 8: what a kill mid-write leaves
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + torn)
    with CapturedWarnings("moeforge.train.metrics") as caught:
        assert main(["report", str(run), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "index.html").is_file()
    warnings = [m for m in caught.messages if "metrics.jsonl" in m]
    assert len(warnings) == 1 and "skipped unreadable lines 3, 8" in warnings[0], warnings
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["records"] == 6


def test_metrics_writer_starts_a_new_line_after_a_torn_one(tmp_path: Path) -> None:
    from moeforge.train.metrics import MetricsWriter, read_metrics

    (tmp_path / "env.json").write_text("{}")
    good = json.dumps({"step": 1, "loss": 2.0})
    (tmp_path / "metrics.jsonl").write_text(good + "\n" + '{"step": 2, "lo')
    w = MetricsWriter(tmp_path)
    w.write({"step": 2, "loss": 1.5})
    w.write({"step": 3, "loss": 1.25})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    assert text.splitlines()[1] == '{"step": 2, "lo'  # the torn line stays alone, not glued to the record
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    # a resume drops the later steps and keeps the good records; the torn line goes too
    assert w.truncate_after(2) == 1
    assert (tmp_path / "metrics.jsonl").read_text() == good + "\n" + json.dumps({"step": 2, "loss": 1.5}) + "\n"
