"""Max |logit difference| of moeforge against transformers' DeepseekV3ForCausalLM (fp32, tiny random models),
and the per-token generation-cache size of latent attention against grouped-query attention; writes JSON.

Run: PYTHONPATH=src:. python benchmarks/probes/dsv3_parity.py OUT.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import transformers

from moeforge.interop import from_hf, to_hf
from tests.test_hf_deepseek_v3 import _deepseek

CASES = {
    "v3": {},
    "plain_q": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False),
}


@torch.no_grad()
def main(out: str) -> None:
    git = ["git", "-C", str(Path(__file__).resolve().parent)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
    results: dict = {"commit": commit, "dirty": dirty, "torch": torch.__version__, "transformers": transformers.__version__}
    results["parity"] = {}
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    for name, overrides in CASES.items():
        hf = _deepseek(**overrides)
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            ours = from_hf(tmp)
            want = hf(ids).logits
            exported = to_hf(ours, Path(tmp) / "out", "deepseek_v3")
            again = from_hf(exported)
        results["parity"][name] = {
            "max_abs_diff": (ours(ids) - want).abs().max().item(),
            "max_abs_logit": want.abs().max().item(),
            "round_trip_max_abs_diff": (again(ids) - ours(ids)).abs().max().item(),
        }
    # cached numbers per token and layer: MLA keeps kv_lora_rank + qk_rope_head_dim; GQA 2 * kv_heads * head_dim
    results["cache_per_token_layer"] = {
        "deepseek_v3_671b_mla": 512 + 64,
        "deepseek_v3_671b_as_mha_128_heads_x_192_and_128": 128 * (192 + 128),
        "deepseek_v3_tiny_mla": 64 + 16,
    }
    Path(out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
