"""Independent fp32 references for the block-FP8 ops (DeepSeek-V3 layout).

Written from the maths, not from kdsl: nothing here imports kdsl (in particular not
kdsl.ops.fallback), so a shared mistake cannot make a wrong kernel look right.

    act quant     s[t, g] = max(amax |x[t, g*128:(g+1)*128]|, 1e-10) / 448,  q = e4m3(x / s)
    weight quant  one scale per 128x128 block of w [N, K] (edge blocks are partial)
    dequant       w = q * s, the block scale broadcast over its block
    GEMM          C = (a * a_s) @ (b * b_s)^T, dequantized to fp32 first, then one fp32 matmul
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# A group of zeros would give s = 0 and q = 0 / 0 = NaN; the floor keeps s finite and q zero.
AMAX_FLOOR = 1e-10
GROUP = 128
BLOCK = (128, 128)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def divide_by_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, correctly rounded.

    On CUDA, torch divides a tensor by a Python scalar as a multiply by its reciprocal,
    which is off by one ulp for some amax; dividing by a tensor is a true division.
    """
    return amax / torch.full_like(amax, FP8_MAX)


def to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn with torch's own round-to-nearest-even cast."""
    return values.float().to(FP8)


def act_quant_ref(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per `group` elements along the last dim. Returns (q e4m3 [..., K], s fp32 [..., K/group])."""
    k = x.shape[-1]
    assert k % group == 0, "reference needs K to be a multiple of the group"
    xf = x.float()
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    s = torch.empty((*x.shape[:-1], k // group), dtype=torch.float32, device=x.device)
    for g in range(k // group):
        chunk = xf[..., g * group:(g + 1) * group]
        amax = torch.clamp(chunk.abs().amax(dim=-1), min=AMAX_FLOOR)
        scale = divide_by_fp8_max(amax)
        s[..., g] = scale
        q[..., g * group:(g + 1) * group] = to_e4m3(chunk / scale.unsqueeze(-1))
    return q, s


def assert_group_codes(q: torch.Tensor, s: torch.Tensor, values: torch.Tensor, group: int, scale_rtol: float,
                       off_by_one_share: float) -> None:
    """q, s (CPU) are act_quant_ref of the float `values` with NaN left out of each group's amax: scales within
    scale_rtol (infinite ones where the reference's are), codes equal or, on a rounding boundary, the neighbouring code
    (in at most off_by_one_share of them), NaN codes (byte 0x7F) exactly where the rule puts them: a NaN value, and
    every inf of a group holding one (inf / inf)."""
    width = values.shape[-1]
    assert q.dtype == FP8 and q.shape == values.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (*values.shape[:-1], width // group) and s.is_contiguous()
    q_ref, s_ref = act_quant_ref(torch.where(values.isnan(), 0.0, values), group)
    inf_group = s_ref.isinf()
    assert torch.equal(s.isinf(), inf_group)
    torch.testing.assert_close(s[~inf_group], s_ref[~inf_group], rtol=scale_rtol, atol=0)
    nan = q_ref.float().isnan() | values.isnan()
    codes = q.view(torch.uint8)
    assert torch.equal(q.float().isnan(), nan) and (codes[nan] == 0x7F).all()
    # +0 and -0 are different codes of one value (the interpreter's rounding drops the sign of a zero): by value
    steps = torch.where(q.float() == q_ref.float(), 0, (codes.int() - q_ref.view(torch.uint8).int()).abs())[~nan]
    assert (steps <= 1).all(), f"codes more than one step from the reference: {int((steps > 1).sum())}"
    assert steps.float().mean() <= off_by_one_share, f"{int((steps > 0).sum())} of {steps.numel()} codes off by one"


def weight_quant_ref(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] in (bn, bk) blocks. Returns (q e4m3 [N, K], s fp32 [ceil(N/bn), ceil(K/bk)])."""
    bn, bk = block
    n, k = w.shape
    wf = w.float()
    q = torch.empty((n, k), dtype=FP8, device=w.device)
    s = torch.empty((ceil_div(n, bn), ceil_div(k, bk)), dtype=torch.float32, device=w.device)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = wf[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale = divide_by_fp8_max(torch.clamp(blk.abs().max(), min=AMAX_FLOOR))
            s[i, j] = scale
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = to_e4m3(blk / scale)
    return q, s


def expand_block_scales(s: torch.Tensor, n: int, k: int, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """[ceil(N/bn), ceil(K/bk)] -> [N, K]: every element gets its block's scale."""
    bn, bk = block
    rows = torch.arange(n, device=s.device) // bn
    cols = torch.arange(k, device=s.device) // bk
    return s.float()[rows][:, cols]


def weight_dequant_ref(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """fp32 [N, K] = q * block scale (round to the wanted dtype afterwards)."""
    n, k = q.shape
    return q.float() * expand_block_scales(s, n, k, block)


def fp8_gemm_ref(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                 group: int = GROUP, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """fp32 [..., N] = (a * a_s expanded) @ (b * b_s expanded)^T, dequantize-then-matmul."""
    k = a.shape[-1]
    n = b.shape[0]
    cols = torch.arange(k, device=a.device) // group
    a_deq = a.float() * a_s.float()[..., cols]
    b_deq = weight_dequant_ref(b, b_s, block)
    return torch.matmul(a_deq, b_deq.T)


def rel_fro_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_F / ||expected||_F, in fp64 (0 when both are empty)."""
    if expected.numel() == 0:
        return 0.0
    diff = (actual.double() - expected.double()).norm()
    return (diff / expected.double().norm().clamp_min(1e-300)).item()


def random_fp8(*shape: int, scale: float = 64.0, device="cpu") -> torch.Tensor:
    """Random e4m3 values spread over most of the format's range (never all zero)."""
    return (torch.randn(*shape, device=device) * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def random_scales(*shape: int, device="cpu") -> torch.Tensor:
    """Arbitrary positive fp32 scales spanning a few decades (not produced by any quantizer)."""
    return torch.exp2(torch.empty(*shape, device=device).uniform_(-12.0, -2.0))
