"""Plain-torch implementations the ops run on CPU tensors when Triton's interpreter is off.

They compute what the generated kernels compute, in the same precision, and are
not the references the tests compare against (those live in tests/).
"""
from __future__ import annotations

import torch

from kdsl.ops.gptq_checkpoint import unpack_rows, unpack_zeros

FP8_MAX = 448.0
AMAX_FLOOR = 1e-10  # same floor as the kernels: an all-zero group keeps a finite scale
E4M3_NAN = 0x7F  # the NaN code the kernels write (torch's cast may keep a NaN's sign: 0xFF)


def _amax(values: torch.Tensor, dim) -> torch.Tensor:
    """max |values| over dim with NaN left out, floored like the kernels' (an inf gives inf)."""
    return torch.where(values.isnan(), 0.0, values.abs()).amax(dim=dim).clamp_min(AMAX_FLOOR)


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 with every NaN (a NaN input, or inf / inf) as the code E4M3_NAN."""
    code = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(y.isnan(), E4M3_NAN, code).view(torch.float8_e4m3fn)


def act_quant(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = x.float().unflatten(-1, (-1, group_size))
    scale = _amax(groups, -1) / FP8_MAX
    q = _to_e4m3(groups / scale.unsqueeze(-1)).flatten(-2)
    return q, scale


def _expand_blocks(s: torch.Tensor, block_n: int, block_k: int, n: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(block_n, 0).repeat_interleave(block_k, 1)[:n, :k]


def weight_quant(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % block_k, 0, -n % block_n))
    blocks = padded.unflatten(0, (-1, block_n)).unflatten(2, (-1, block_k))  # [nb, bn, kb, bk]
    scale = _amax(blocks, (1, 3)) / FP8_MAX
    q = _to_e4m3(w.float() / _expand_blocks(scale, block_n, block_k, n, k))
    return q, scale


def weight_dequant(q: torch.Tensor, s: torch.Tensor, block_n: int, block_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    n, k = q.shape
    return (q.float() * _expand_blocks(s, block_n, block_k, n, k)).to(out_dtype)


def fp8_gemm(a, a_s, b, b_s, act_group: int, block_n: int, block_k: int, out_dtype: torch.dtype,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    # Same order of operations as the kernel: per K step, dot then both scales, in fp32 (from bias, if any).
    m, k = a.shape
    n = b.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    if bias is not None:
        acc += bias.float()
    b_scale_rows = b_s.repeat_interleave(block_n, 0)[:n]  # [n, k / block_k]
    step = min(act_group, block_k)
    for start in range(0, k, step):
        partial = a[:, start:start + step].float() @ b[:, start:start + step].float().T
        acc += partial * a_s[:, start // act_group, None] * b_scale_rows[None, :, start // block_k]
    return acc.to(out_dtype)


def fp8_linear(x, w, w_s, bias, act_group: int, block_n: int, block_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """act_quant then fp8_gemm, bias added to the fp32 accumulator (the fused kernel's order)."""
    q, s = act_quant(x, act_group)
    return fp8_gemm(q, s, w, w_s, act_group, block_n, block_k, out_dtype, bias)


def fp8_bmm(a, a_s, b, b_s, act_group: int, block_n: int, block_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """[B, M, N]: fp8_gemm's math for each batch (any strides; the result is contiguous)."""
    return torch.stack([fp8_gemm(a[g], a_s[g], b[g], b_s[g], act_group, block_n, block_k, out_dtype)
                        for g in range(a.shape[0])])


def gptq_dequant(qweight, qzeros, scales, g_idx, bits: int, zero_offset: int, out_dtype: torch.dtype) -> torch.Tensor:
    """w [N, K] in out_dtype from checkpoint tensors (g_idx [K] always given here)."""
    q = unpack_rows(qweight, bits)  # [K, N]
    zeros = unpack_zeros(qzeros, bits, zero_offset)
    groups = g_idx.long()
    w = (q - zeros[groups]).float() * scales[groups].float()
    return w.T.to(out_dtype)


def gptq_gemm(x, qweight, qzeros, scales, g_idx, bits: int, zero_offset: int) -> torch.Tensor:
    w = gptq_dequant(qweight, qzeros, scales, g_idx, bits, zero_offset, x.dtype)
    return (x.float() @ w.float().T).to(x.dtype)


def gptq_gemm_sorted(x, qweight, zeros, scales, groups, perm, bits: int) -> torch.Tensor:
    """Prepared weights: rows of qweight in sorted order (row k is x's column perm[k]), zeros [G, N] real values."""
    groups = groups.long()
    w = (unpack_rows(qweight, bits).float() - zeros.float()[groups]) * scales.float()[groups]  # [K, N]
    xs = x if perm is None else x[:, perm.long()]
    return (xs.float() @ w).to(x.dtype)


def fp8_grouped_gemm(a, a_s, b, b_s, group_ids, act_group: int, block_n: int, block_k: int,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """[M, N]: each row by its expert's b (fp8_gemm's math); rows whose id is outside [0, E) are left zero."""
    c = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    for expert in group_ids.unique().tolist():
        if 0 <= expert < b.shape[0]:
            rows = (group_ids == expert).nonzero().squeeze(1)
            c[rows] = fp8_gemm(a[rows], a_s[rows], b[expert], b_s[expert], act_group, block_n, block_k, out_dtype)
    return c


def fp8_grouped_gemm_masked(a, a_s, b, b_s, masked_m, act_group: int, block_n: int, block_k: int,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """[E, max_m, N]: the first masked_m[e] rows (clamped to [0, max_m]) of each expert; the rest left zero."""
    experts, max_m, _ = a.shape
    c = torch.zeros(experts, max_m, b.shape[1], dtype=out_dtype, device=a.device)
    for expert, rows in enumerate(masked_m.clamp(0, max_m).tolist()):
        c[expert, :rows] = fp8_gemm(a[expert, :rows], a_s[expert, :rows], b[expert], b_s[expert], act_group,
                                    block_n, block_k, out_dtype)
    return c


def moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, act_group: int, block_n: int, block_k: int) -> torch.Tensor:
    """The MoE layer in the kernels' order: x quantized per token, gate-up in fp32, h = silu(gate) * up quantized
    per token, down in x's dtype, then each token's slots weighted and summed in fp32 (j = 0 .. k - 1)."""
    tokens, hidden = x.shape
    experts, topk = w13.shape[0], topk_ids.shape[1]
    inter = w13.shape[1] // 2
    q, s = act_quant(x, act_group)
    down = torch.zeros(tokens, topk, hidden, dtype=x.dtype, device=x.device)
    routed = (topk_ids >= 0) & (topk_ids < experts)
    for expert in topk_ids[routed].unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = fp8_gemm(q[token], s[token], w13[expert], w13_s[expert], act_group, block_n, block_k, torch.float32)
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        hq, hs = act_quant(h, act_group)
        down[token, slot] = fp8_gemm(hq, hs, w2[expert], w2_s[expert], act_group, block_n, block_k, x.dtype)
    weights = torch.where(routed, topk_weights, 0.0)
    y = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    for j in range(topk):
        y += weights[:, j, None] * down[:, j].float()
    return y.to(x.dtype)


def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float, round_normalized: bool) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim in fp32, not yet rounded (round_normalized:
    x * rsqrt(...) rounded to x's dtype before the weight)."""
    xf = x.float()
    normalized = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if round_normalized:
        normalized = normalized.to(x.dtype).float()
    return normalized * weight.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_normalized: bool) -> torch.Tensor:
    """The norm in fp32, rounded once to x's dtype."""
    return _rms_norm_fp32(x, weight, eps, round_normalized).to(x.dtype)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                   round_normalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm in fp32, quantized as act_quant quantizes."""
    return act_quant(_rms_norm_fp32(x, weight, eps, round_normalized), group_size)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 round_normalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual in x's dtype, then rms_norm of h: (y, h)."""
    h = x + residual
    return rms_norm(h, weight, eps, round_normalized), h


def add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                       round_normalized: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = x + residual in x's dtype, then rms_norm_quant of h: (q, s, h)."""
    h = x + residual
    return (*rms_norm_quant(h, weight, eps, group_size, round_normalized), h)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32 (gate_up's first half, then its second), rounded once to gate_up's dtype."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def silu_mul_quant(gate_up: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up in fp32, quantized as act_quant quantizes."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    return act_quant(torch.nn.functional.silu(gate) * up, group_size)


def moe_w4a16(x, expert_weights, topk_weights, topk_ids, experts: int) -> torch.Tensor:
    """The W4A16 MoE layer in the kernels' order. expert_weights(e) -> (w13 fp32 [H, 2I], perm13 [S, H] or None,
    w2 fp32 [I, H], perm2 [1, I] or None), K in prepared order (x's column perm[s, k] is row k of segment s's
    columns). gate-up in fp32, h = silu(gate) * up in x's dtype, down in x's dtype, then each token's slots weighted
    and summed in fp32 (j = 0 .. k - 1)."""
    tokens, hidden = x.shape
    topk = topk_ids.shape[1]
    down = torch.zeros(tokens, topk, hidden, dtype=x.dtype, device=x.device)
    routed = (topk_ids >= 0) & (topk_ids < experts)
    for expert in topk_ids[routed].unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        w13, perm13, w2, perm2 = expert_weights(expert)
        inter = w13.shape[1] // 2
        xs = x[token].float()
        x_gate = xs if perm13 is None else xs[:, perm13[0].long()]
        x_up = xs if perm13 is None else xs[:, perm13[-1].long()]
        h = (torch.nn.functional.silu(x_gate @ w13[:, :inter]) * (x_up @ w13[:, inter:])).to(x.dtype).float()
        if perm2 is not None:
            h = h[:, perm2[0].long()]
        down[token, slot] = (h @ w2).to(x.dtype)
    weights = torch.where(routed, topk_weights, 0.0)
    y = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    for j in range(topk):
        y += weights[:, j, None] * down[:, j].float()
    return y.to(x.dtype)
