"""The DeepSeek-V3 671B and gpt-oss-120b presets fit the clusters their headers name, with headroom: by
``moeforge plan`` at full depth, and by the dry run (``moeforge plan --dry-run``) with the depth cut for CI, whose
state bytes equal the planner's and whose peak, with the full depth's state put back, still fits.

The dry runs keep every width, the expert count, the world size and the layout of the preset; only the number of
layers is cut (DeepSeek-V3: its 3 dense layers and one MoE layer, plus the MTP module; gpt-oss: one sliding and
one full layer) and one micro-batch of the step is run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeforge.cli import main
from moeforge.config import load_config
from moeforge.parallel.memory import STATE_KEYS, predict_state
from moeforge.plan.devices import get_device
from moeforge.plan.planner import make_plan

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "presets"
HEADROOM = 0.9  # a fit leaves at least 10% of the device's memory free

#: preset -> (world, device, the dry run's depth overrides, the rank it runs)
CLUSTERS = {
    "deepseek-v3-671b": (256, "h200", ["--model.n_layers=4"], 0),
    "gpt-oss-120b": (32, "h200", ["--model.n_layers=2", "--model.sliding_layers=[0]"], 31),
}


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_plan_says_the_preset_fits_its_cluster(name: str) -> None:
    world, device, _, _ = CLUSTERS[name]
    cfg = load_config(PRESETS / f"{name}.yaml")
    plan = make_plan(cfg, world, device)
    mine = [x for x in plan["layouts"] if (x["stack"], x["ep"]) == (cfg.parallel.stack, cfg.parallel.ep)]
    (layout,) = mine
    assert layout["fits_with_checkpointing"], layout["memory"]
    assert layout["memory"]["total_checkpointed"] <= HEADROOM * get_device(device).memory_bytes, layout["memory"]
    assert not any(x["fits"] for x in make_plan(cfg, 8, device)["layouts"])  # one node does not train it


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_dry_run_at_scale_fits_and_equals_the_planner(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    world, device, depth, rank = CLUSTERS[name]
    preset = str(PRESETS / f"{name}.yaml")
    argv = ["plan", preset, "--world", str(world), "--device", device, "--dry-run", "--ranks", str(rank)]
    assert main([*argv, "--dry-run-micro-batches", "1", "--json", *depth]) == 0  # the command's own fit verdict
    (rep,) = json.loads(capsys.readouterr().out)["ranks"]
    mem = get_device(device).memory_bytes
    cut = load_config(PRESETS / f"{name}.yaml", depth)
    predicted = predict_state(cut, world)[rank]
    for key in STATE_KEYS:
        assert rep[key] == predicted[key], (name, key, rep[key], predicted[key])
    assert rep["micro_batches_run"] == 1 < rep["micro_batches"]
    assert rep["peak_bytes"] <= HEADROOM * mem and rep["build_peak_bytes"] <= mem, rep["peak_bytes"]
    # the full depth: the cut run's peak with the whole model's state in place of the cut one's, and each extra
    # layer's checkpointed input (bf16, micro-batch x seq x d)
    full = load_config(PRESETS / f"{name}.yaml")
    full_state = sum(predict_state(full, world)[rank][k] for k in STATE_KEYS)
    inputs = (full.model.n_layers - cut.model.n_layers) * full.train.micro_batch_size * full.data.seq_len * 2
    peak = rep["peak_bytes"] - sum(rep[k] for k in STATE_KEYS) + full_state + inputs * full.model.d_model
    assert peak <= HEADROOM * mem, (name, peak / 1e9)


#: published parameter counts: DeepSeek-V3 671B (685B with its MTP module), 37B active; gpt-oss-120b 116.8B,
#: 5.1B active (the model card's count leaves the input embedding out)
PUBLISHED = {"deepseek-v3-671b": (671e9, 685e9, 37e9), "gpt-oss-120b": (116.8e9, 116.8e9, 5.13e9)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameters_match_the_published_counts(name: str) -> None:
    from moeforge.plan.flops import param_counts

    main_total, with_mtp, active = PUBLISHED[name]
    cfg = load_config(PRESETS / f"{name}.yaml")
    assert param_counts(cfg.model)["total"] == pytest.approx(with_mtp, rel=0.01)
    cfg.model.mtp_depth = 0
    counts = param_counts(cfg.model)
    assert counts["total"] == pytest.approx(main_total, rel=0.01)
    embedding_in = cfg.model.vocab_size * cfg.model.d_model
    assert counts["active"] - embedding_in == pytest.approx(active, rel=0.03)
