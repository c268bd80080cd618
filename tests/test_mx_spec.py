"""torchao's MXFP8 quantizer against an independent plain-PyTorch reference of the OCP MX v1.0 spec.

The reference (``ref_mxfp8``) follows section 6.3 of the spec for MXFP8 E4M3:
per block of 32 values, the shared e8m0 exponent is ``X = floor(log2(max|v|)) - 8``
(8 = the largest power of two of E4M3), clamped to e8m0's range [-127, 127];
each element is ``v / 2^X`` saturated to +-448 and rounded to the nearest E4M3
value, ties to even (normals: 3 mantissa bits; subnormals: steps of 2^-9).
All arithmetic is float64 (exact here). Inf and NaN, which the spec leaves to
the implementation, follow what torchao documents and does:

- a block holding a NaN gets the NaN scale 0xFF (the whole block decodes to NaN);
- +-inf counts as 2^128 for the exponent (X = 120) and saturates to +-448;
- an all-zero block gets scale byte 0 and zero elements.

One documented difference: torchao divides by ``max(2^X, 2^-126)`` (fp32's
smallest normal) where the spec divides by ``2^X``: in blocks whose max is
below 2^-118 (X = -127, scale byte 0) the elements are ``v / 2^-126``, half
the spec's ``v / 2^-127``. The test checks those blocks against that rule.
"""

from __future__ import annotations

import math

import torch
from torchao.prototype.mx_formats.mx_tensor import to_mx  # the lowp extra; scripts/setup.sh installs it

E4M3_MAX = 448.0
E4M3_EMAX = 8  # floor(log2(448))
TINY = 2.0**-118  # below this block max torchao's divisor is 2^-126, not the stored 2^-127


def _e4m3_rne(y: torch.Tensor) -> torch.Tensor:
    """float64 -> nearest E4M3 value (ties to even), inputs already saturated to +-448."""
    a = y.abs()
    exp = torch.floor(torch.log2(a.clamp(min=2.0**-300)))
    # log2 of float64 can be off by one ulp near powers of two: fix the exponent exactly
    exp = torch.where(2.0**exp > a, exp - 1, exp)
    exp = torch.where(2.0 ** (exp + 1) <= a, exp + 1, exp)
    quantum = torch.where(a >= 2.0**-6, 2.0 ** (exp - 3), torch.full_like(a, 2.0**-9))
    return torch.round(y / quantum) * quantum  # torch.round: half to even


def ref_mxfp8(x: torch.Tensor, divisor_floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale bytes (..., K/32) uint8, elements (..., K) float64)`` of fp32 ``x`` per the OCP MX spec.

    ``divisor_floor`` > 0 replaces the divisor ``2^X`` by ``max(2^X, divisor_floor)`` (torchao's tiny-block rule).
    """
    v = x.double().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    nan_block = torch.isnan(v).any(-1)
    finite = torch.where(torch.isinf(v), torch.full_like(v, 2.0**128), v)
    amax = torch.nan_to_num(finite, nan=0.0).abs().amax(-1)
    log2 = torch.floor(torch.log2(amax.clamp(min=2.0**-300)))
    log2 = torch.where(2.0**log2 > amax, log2 - 1, log2)  # exact floor(log2) (float64 log2 rounding)
    log2 = torch.where(2.0 ** (log2 + 1) <= amax, log2 + 1, log2)
    X = torch.where(amax > 0, log2 - E4M3_EMAX, torch.full_like(amax, -127.0)).clamp(-127, 127)
    scale = (X + 127).to(torch.uint8)
    scale = torch.where(nan_block, torch.full_like(scale, 255), scale)
    divisor = (2.0**X).clamp(min=divisor_floor).unsqueeze(-1)
    y = torch.where(torch.isinf(v), torch.sign(v) * E4M3_MAX, (v / divisor).clamp(-E4M3_MAX, E4M3_MAX))
    return scale, _e4m3_rne(y).reshape(x.shape)


def _torchao(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale, data = to_mx(x.contiguous(), torch.float8_e4m3fn, 32)
    return scale.view(torch.uint8), data.to(torch.float64)


def _check(x: torch.Tensor) -> int:
    """Compare block by block; return how many blocks were checked bit-exactly against the spec."""
    x = x.float().reshape(-1, 32)
    scale, elems = _torchao(x)
    ref_scale, ref_elems = ref_mxfp8(x)
    _, floor_elems = ref_mxfp8(x, divisor_floor=2.0**-126)
    amax = torch.nan_to_num(x.double().abs(), nan=0.0).amax(-1)
    nan_block = torch.isnan(x).any(-1)
    assert torch.equal(scale.flatten(), ref_scale.flatten()), "e8m0 scales differ from the spec"
    tiny = (amax < TINY) & ~nan_block
    spec = ~tiny & ~nan_block
    assert torch.equal(elems[spec], ref_elems[spec]), "elements differ from the spec"
    assert torch.equal(elems[tiny], floor_elems[tiny]), "tiny blocks differ from torchao's documented rule"
    return int(spec.sum())


def test_random_blocks_bit_exact() -> None:
    g = torch.Generator().manual_seed(0)
    n = 4096
    mags = 2.0 ** torch.randint(-60, 60, (n, 1), generator=g).double()
    x = (torch.randn(n, 32, generator=g, dtype=torch.float64) * mags).float()
    assert _check(x) == n
    assert _check(x.bfloat16().float()) == n  # what training feeds it: bf16 values
    heavy = torch.randn(n, 32, generator=g) ** 5  # heavy tails: values far below the block max
    assert _check(heavy) == n


def _midpoints() -> torch.Tensor:
    """Exact ties between neighbouring E4M3 values (in the block's scaled domain), normals and subnormals."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    pos = torch.unique(vals[torch.isfinite(vals) & (vals >= 0)])
    mids = (pos[1:] + pos[:-1]) / 2  # 448 is the block max below, so 2^X = 1 when 256 <= max < 512
    blocks = []
    for i in range(0, len(mids), 31):
        chunk = mids[i : i + 31]
        chunk = torch.cat([chunk, torch.full((31 - len(chunk),), 0.5, dtype=torch.float64)])
        blocks.append(torch.cat([torch.tensor([448.0], dtype=torch.float64), chunk]))
    return torch.stack(blocks).float()


def test_adversarial_blocks_bit_exact() -> None:
    f32 = torch.finfo(torch.float32)
    rows = {
        "zeros": torch.zeros(32),
        "one nonzero": torch.cat([torch.tensor([3.0]), torch.zeros(31)]),
        "max e4m3": torch.full((32,), 448.0),
        "saturating (max in [448, 512))": torch.linspace(-511.0, 511.0, 32),
        "max a power of two": torch.cat([torch.tensor([2.0**20]), torch.randn(31)]),
        "max just below a power of two": torch.cat([torch.tensor([math.nextafter(2.0**20, 0)]), torch.randn(31)]),
        "e4m3 subnormals after scaling": torch.cat([torch.tensor([256.0]), torch.linspace(-(2**-6), 2**-6, 31)]),
        "fp32 max": torch.cat([torch.tensor([f32.max, -f32.max]), torch.randn(30)]),
        "fp32 denormals": torch.full((32,), 2.0**-140),
        "tiny normals": torch.linspace(2.0**-125, 2.0**-120, 32),
        "just above the tiny bound": torch.full((32,), 2.0**-118),
        "inf": torch.cat([torch.tensor([float("inf"), -float("inf")]), torch.randn(30)]),
        "nan": torch.cat([torch.tensor([float("nan")]), torch.randn(31)]),
        "negative zero": torch.full((32,), -0.0),
    }
    x = torch.stack(list(rows.values()))
    checked = _check(x)
    # by the tiny-block rule: both zero rows, fp32 denormals, tiny normals; the NaN row: its scale byte
    assert checked == len(rows) - 5
    assert _check(_midpoints()) == len(_midpoints())
    # the documented specials, spelled out
    scale, elems = _torchao(x)
    names = list(rows)
    assert scale[names.index("nan"), 0] == 255
    i = names.index("inf")
    assert scale[i, 0] == 127 + 120 and elems[i, 0] == 448 and elems[i, 1] == -448
    assert scale[names.index("zeros"), 0] == 0 and elems[names.index("zeros")].abs().sum() == 0


def test_reference_is_not_vacuous() -> None:
    """The reference catches a wrong rounding mode and a wrong exponent: it is not a copy of the quantizer."""
    x = _midpoints().double()
    _, ref = ref_mxfp8(x.float())
    truncated = torch.trunc(x * 8) / 8  # not ties-to-even
    assert not torch.equal(ref, truncated.reshape(ref.shape))
    scale, _ = ref_mxfp8(torch.full((1, 32), 1.0))
    assert scale.item() == 127 - 8  # 1.0 -> X = -8
