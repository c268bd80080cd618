# Measures: bf16 error against fp32 of eager and torch.compile'd blocks (logits and gradients).
"""How far bf16 autocast lands from fp32, eager against ``train.compile``: the demo model at its seeded
init, one batch of 8 x 256 real training tokens, logits and every parameter's gradient (loss =
cross-entropy + the routers' aux and z losses), each compared with the fp32 eager model's.

    PYTHONPATH=src python benchmarks/probes/compile_precision.py OUT.json
"""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import torch

from moeforge.config import load_config
from moeforge.model import build_model
from moeforge.parallel.compile import apply_compile
from moeforge.train.environment import collect_env
from moeforge.train.losses import lm_loss_fn, moe_aux_terms


def _run(model: torch.nn.Module, batch: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(batch[:, :-1])
    loss = lm_loss_fn(logits, batch[:, 1:], upcast=not bf16) + moe_aux_terms(model)[0]  # type: ignore[arg-type]
    loss.backward()
    return logits.float().detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main(out: str) -> None:
    """Write the relative errors of eager and compiled bf16 against fp32 to ``out``; print them."""
    torch.set_num_threads(2)
    cfg = load_config("configs/shakespeare.yaml", ["--model.vocab_size=4096"])
    ref = build_model(cfg.model, seed=0)
    eager, compiled = copy.deepcopy(ref), apply_compile(copy.deepcopy(ref), True)
    tokens = np.memmap("data/shakespeare/train.bin", dtype=np.uint16, mode="r")
    batch = torch.from_numpy(np.stack([tokens[i * 257 : (i + 1) * 257].astype(np.int64) for i in range(100, 108)]))
    logits32, grads32 = _run(ref, batch, bf16=False)
    result: dict = {"command": f"PYTHONPATH=src python benchmarks/probes/compile_precision.py {out}"}
    _run(compiled, batch, bf16=True)  # compiles
    for name, model in (("eager_bf16", eager), ("compiled_bf16", compiled)):
        logits, grads = _run(model, batch, bf16=True)
        per_param = {n: float((grads[n] - g).norm() / g.norm()) for n, g in grads32.items()}
        result[name] = {
            "logits_rel_err": float((logits - logits32).norm() / logits32.norm()),
            "grad_rel_err_mean": sum(per_param.values()) / len(per_param),
            "grad_rel_err": per_param,
        }
        r = result[name]
        sys.stdout.write(f"{name}: logits {r['logits_rel_err']:.4f}, mean gradient {r['grad_rel_err_mean']:.4f}\n")
    result["env"] = collect_env()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
