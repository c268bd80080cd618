"""The CUDA-capable subset (marked ``cuda``): grouped GEMM, MoE layer, rowwise dispatch and a training step on
the ``device`` fixture, each against the CPU fp32 pure-PyTorch reference.

By default they run on the CPU like every other test; ``pytest -m cuda --device cuda`` (what
``scripts/gpu_check.sh`` runs) puts them on the GPU, where the rowwise dispatcher also runs under
``torch.cuda.set_sync_debug_mode("error")``. On the CPU the host-sync detector stands in for it.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from moeforge.config import ModelConfig, MoEConfig
from moeforge.model import build_model
from moeforge.model.moe import MoELayer
from moeforge.ops import grouped_mm, grouped_mm_loop
from moeforge.parallel.expert.rowwise import RowwiseDispatcher
from moeforge.testing.host_sync import HostSyncDetector
from moeforge.train.losses import lm_loss_fn, moe_aux_terms

pytestmark = pytest.mark.cuda

D, F, E, K = 32, 48, 8, 2  # every dimension a multiple of 16 bytes in bf16, as CUDA's grouped GEMM needs


@pytest.fixture(autouse=True)
def _exact_fp32():
    """No TF32 on the GPU: fp32 means fp32 against the CPU reference."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _no_host_sync(device: torch.device):
    """CUDA's sync debug mode set to raise, or (on the CPU) the host-sync detector."""
    if device.type == "cuda":

        @contextlib.contextmanager
        def mode():
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield None
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return mode()
    return HostSyncDetector()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_mm_on_device_matches_cpu_loop(device, dtype, tol):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 9, 1, 0, 12, 20])
    x = torch.randn(int(counts.sum()), D, generator=g)
    w = torch.randn(E, F, D, generator=g)
    grad = torch.randn(x.shape[0], F, generator=g)
    offsets = counts.cumsum(0).to(torch.int32)

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    grouped_mm_loop(xr, wr.transpose(-2, -1), offsets).backward(grad)

    xd = x.to(device, dtype).requires_grad_()
    wd = w.to(device, dtype).requires_grad_()
    out = grouped_mm(xd, wd.transpose(-2, -1), offsets.to(device))
    out.backward(grad.to(device, dtype))
    assert wd.grad is not None and wd.grad.is_contiguous()  # the weight gradient comes in the weight's layout
    for got, want in ((xd.grad, xr.grad), (wd.grad, wr.grad)):
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol * 10)


def _layer(dispatcher: str) -> MoELayer:
    layer = MoELayer(D, MoEConfig(num_experts=E, top_k=K, expert_hidden=F, norm_topk_prob=True, dispatcher=dispatcher))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dispatcher", ["local", "rowwise"])
def test_moe_layer_on_device_matches_cpu_without_host_sync(device, dispatcher, dtype, tol):
    """Forward + backward against the CPU fp32 layer. No host sync: on the CPU by the detector (every
    dtype), on CUDA in bf16 by the sync debug mode (torch's fp32 grouped GEMM on CUDA reads the
    offsets on the host, so fp32 is checked for values only there)."""
    ref = _layer("local")
    g = torch.Generator().manual_seed(2)
    x, grad = torch.randn(4, 16, D, generator=g), torch.randn(4, 16, D, generator=g)
    # the reference sees the values the device sees (rounded to dtype), so the fp32 router picks alike
    x, grad = x.to(dtype).float(), grad.to(dtype).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(dtype).float())
    got = copy.deepcopy(ref).to(device, dtype)
    if dispatcher == "rowwise":
        got.dispatcher = RowwiseDispatcher(E, None, capacity_factor=float(E))  # ep = 1, nothing can drop
    xr = x.clone().requires_grad_()
    ref(xr).backward(grad)

    xd, gd = x.to(device, dtype).requires_grad_(), grad.to(device, dtype)
    check = device.type == "cpu" or dtype == torch.bfloat16
    with _no_host_sync(device) if check else contextlib.nullcontext() as det:
        out = got(xd)
        out.backward(gd)
    if det is not None:
        # on the CPU, bf16 experts pad their groups (aligned_groups, a CPU-only path), which reads the padded
        # buffer's exact size there: one read per layer forward, free where host and device are one; any other
        # read, and any read on another device, fails
        padded = [e for e in det.events if e.where.endswith("in aligned_groups")]
        assert len(padded) == (device.type == "cpu" and dtype == torch.bfloat16), padded
        det.events = [e for e in det.events if e not in padded]
        det.assert_none()
    assert torch.equal(got.last_routing.indices.cpu(), ref.last_routing.indices)
    _assert_near(out.detach(), ref(x).detach(), tol, "output")
    _assert_near(xd.grad, xr.grad, tol, "input grad")
    for (name, a), b in zip(got.named_parameters(), ref.parameters(), strict=True):
        _assert_near(a.grad, b.grad, tol, name)


def _assert_near(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """``|got - want| / |want|`` (Frobenius) within ``tol``: bf16 rounds every element, so elementwise
    relative error says nothing near zero; fp32 is held to ``tol`` elementwise as well."""
    got = got.float().cpu()
    err = float((got - want).norm() / want.norm())
    assert err <= tol, f"{what}: relative error {err:.2e} (allowed {tol})"
    if tol <= 1e-5:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=what)


def test_training_step_on_device_matches_cpu(device):
    cfg = ModelConfig(
        vocab_size=64,
        d_model=D,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        head_dim=16,
        qk_norm="per_head",
        max_seq_len=32,
        moe=MoEConfig(num_experts=E, top_k=K, expert_hidden=F, dispatcher="local"),
    )
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    losses = []
    for where in (torch.device("cpu"), device):
        model = build_model(cfg, seed=0, device="cpu").to(where)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = ids.to(where)
        seen = []
        for _ in range(3):
            opt.zero_grad()
            loss = lm_loss_fn(model(batch[:, :-1]), batch[:, 1:]) + moe_aux_terms(model)[0].to(where)
            loss.backward()
            opt.step()
            seen.append(float(loss.detach()))
        losses.append(seen)
    ref, got = losses
    assert ref[-1] < ref[0]  # the same batch three times: the loss falls
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-5)
