"""Independent fp32 references for the MoE ops (block FP8, and W4A16 on dequantized weights), and random MoE inputs.

Written from the maths on top of tests/reference.py (nothing here imports kdsl): dequantize, then matmul in fp32.

    grouped GEMM   C[m] = (a[m] * a_s[m]) @ (b[g] * b_s[g])^T, g = group_ids[m], rows with g = -1 skipped
    masked GEMM    C[e, :masked_m[e]] = (a[e] * a_s[e]) @ (b[e] * b_s[e])^T
    MoE layer      per token t and slot j, e = topk_ids[t, j]:
                     gate, up = x_t' @ W1_e^T, x_t' @ W3_e^T        (x_t' = x_t through act quant, dequantized)
                     h = silu(gate) * up, then act quant of h, dequantized -> h'
                     y_t += topk_weights[t, j] * (h' @ W2_e^T)
    W4A16 layer    the same without activation quantization, on the int4 experts dequantized in fp32 (moe_dense_ref)
"""
from __future__ import annotations

import torch
from reference import (AMAX_FLOOR, FP8, GROUP, act_quant_ref, divide_by_fp8_max, fp8_gemm_ref, to_e4m3,
                       weight_dequant_ref)


def dequant_rows(q: torch.Tensor, s: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """fp32 [..., K] = q * s, each token's scale over its group."""
    cols = torch.arange(q.shape[-1], device=q.device) // group
    return q.float() * s.float()[..., cols]


def grouped_gemm_ref(a, a_s, b, b_s, group_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [M, N], bool [M] rows that are defined): rows with an id outside [0, E) stay zero and undefined."""
    m, n, experts = a.shape[0], b.shape[1], b.shape[0]
    out = torch.zeros(m, n, device=a.device)
    defined = (group_ids >= 0) & (group_ids < experts)
    for row in range(m):
        if defined[row]:
            e = int(group_ids[row])
            out[row] = fp8_gemm_ref(a[row:row + 1], a_s[row:row + 1], b[e], b_s[e])[0]
    return out, defined


def masked_gemm_ref(a, a_s, b, b_s, masked_m) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [E, max_m, N], bool [E, max_m] rows that are defined)."""
    experts, max_m, _ = a.shape
    out = torch.zeros(experts, max_m, b.shape[1], device=a.device)
    defined = torch.zeros(experts, max_m, dtype=torch.bool, device=a.device)
    for e in range(experts):
        rows = max(0, min(int(masked_m[e]), max_m))
        defined[e, :rows] = True
        if rows:
            out[e, :rows] = fp8_gemm_ref(a[e, :rows], a_s[e, :rows], b[e], b_s[e])
    return out, defined


def moe_ref(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids) -> torch.Tensor:
    """fp32 [T, H]; slots whose id is outside [0, E) add nothing."""
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w13.shape[1] // 2
    xq, xs = act_quant_ref(x)
    x_deq = dequant_rows(xq, xs)
    y = torch.zeros(tokens, hidden, device=x.device)
    for e in range(experts):
        w_up = weight_dequant_ref(w13[e], w13_s[e])  # [2I, H]
        w_down = weight_dequant_ref(w2[e], w2_s[e])  # [H, I]
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = x_deq[token] @ w_up.T
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        hq, hs = act_quant_ref(h)
        down = dequant_rows(hq, hs) @ w_down.T
        y.index_add_(0, token, topk_weights[token, slot, None].float() * down)
    return y


def blocks_quant(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] in block x block tiles at once (weight_quant_ref's rule, vectorized for large expert stacks):
    (q e4m3 [..., N, K], s fp32 [..., ceil(N/block), ceil(K/block)])."""
    n, k = w.shape[-2:]
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    tiles = padded.unflatten(-1, (kb, block)).unflatten(-3, (nb, block))  # [..., nb, bn, kb, bk]
    s = divide_by_fp8_max(torch.clamp(tiles.abs().amax(dim=(-3, -1)), min=AMAX_FLOOR))  # [..., nb, kb]
    q = to_e4m3(tiles / s[..., :, None, :, None]).flatten(-2).flatten(-3, -2)[..., :n, :k]
    return q.contiguous(), s


def expert_weights(experts: int, n: int, k: int, scale: float = 1.0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """E random weights [N, K] quantized in 128x128 blocks: (q [E, N, K] e4m3, s [E, ceil(N/128), ceil(K/128)])."""
    return blocks_quant(torch.randn(experts, n, k, device=device) * scale)


def moe_layer(experts: int, hidden: int, inter: int, device="cpu") -> tuple[torch.Tensor, ...]:
    """(w13, w13_s, w2, w2_s) of a random layer: gate and up rows ~ N(0, 1/H), down ~ N(0, 1/I)."""
    w13, w13_s = expert_weights(experts, 2 * inter, hidden, hidden ** -0.5, device)
    w2, w2_s = expert_weights(experts, hidden, inter, inter ** -0.5, device)
    return w13, w13_s, w2, w2_s


def routing(tokens: int, experts: int, topk: int, skew: float = 0.0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 [T, k] summing to 1, topk_ids int32 [T, k]): distinct experts per token, picked from
    router logits; skew > 0 favours the low-numbered experts (ragged groups, some experts without tokens)."""
    logits = torch.randn(tokens, experts, device=device) - skew * torch.arange(experts, dtype=torch.float32,
                                                                                device=device)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


__all__ = ["FP8", "dequant_rows", "grouped_gemm_ref", "masked_gemm_ref", "moe_ref", "moe_dense_ref", "blocks_quant",
           "expert_weights", "moe_layer", "routing"]


# --- W4A16 MoE (int4 experts): dequantized fp32 weights, then the layer in fp32 --------------------------------------

def moe_dense_ref(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """fp32 [T, H] of the gated-MLP experts on dense fp32 weights as y = x @ w: w13 [E, H, 2I] (gate columns, then
    up columns), w2 [E, I, H]; slots whose id is outside [0, E) add nothing."""
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w13.shape[2] // 2
    y = torch.zeros(tokens, hidden, device=x.device)
    for e in range(experts):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = x[token].float() @ w13[e].float()
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y.index_add_(0, token, topk_weights[token, slot, None].float() * (h @ w2[e].float()))
    return y
