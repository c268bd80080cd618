"""The profile split behind scripts/profile_hf_step.py and profile_hf_layer.py: categories and the bound."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from moeforge.bench.profile_split import op_category, speedup_bound, time_split


def test_categories_and_bound() -> None:
    assert op_category("aten::mm") == "gemm" and op_category("aten::addmm") == "gemm"
    assert op_category("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert op_category("aten::_fused_adamw_") == "optimizer" and op_category("aten::_foreach_mul_") == "optimizer"
    assert op_category("aten::mul") == "other"

    def events(**ms: float) -> list[SimpleNamespace]:
        rows = [(k.replace("_", "::", 1), v * 1e3) for k, v in ms.items()]
        return [SimpleNamespace(key=k, count=2, self_cpu_time_total=us) for k, us in rows]

    ours = time_split(events(aten_mm=300.0, aten_mul=100.0), per=2)
    peer = time_split(events(aten_mm=400.0, aten_mul=50.0, aten__fused_adamw_=20.0), per=2)
    assert ours["self_ms"] == {"gemm": 150.0, "attention": 0.0, "optimizer": 0.0, "other": 50.0}
    assert ours["top"][0] == {"op": "aten::mm", "kind": "gemm", "calls": 1.0, "ms": 150.0}
    bound = speedup_bound(ours, peer, peer_step_s=0.3)
    assert bound["floor_s"] == 0.15  # the cheaper GEMM time; the optimizer's min is ours' zero
    assert abs(bound["bound"] - 2.0) < 1e-12


def test_time_split_of_a_real_profile() -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            (a @ b).relu()
    split = time_split(prof.key_averages(), per=3)
    assert split["self_ms"]["gemm"] > 0 and split["self_ms"]["other"] > 0
    assert abs(split["self_ms_total"] - sum(split["self_ms"].values())) < 1e-9
