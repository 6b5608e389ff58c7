"""A candidate M = 1 kernel for prepared GPTQ weights (sm_90 k_planes), and the floor of its structure.

The shipped fp16 GEMV spends ~25 SASS instructions per packed word. This kernel feeds the dequantized
words to mma.sync (m16n8k16) instead, with x as the n = 8 operand (its columns all read row 0):
- a CTA takes 16 columns; its warps split K (warp s takes K tiles [s * TPS, (s + 1) * TPS)), each in
  chunks of CH tiles with the next chunk's loads in flight; one batched mma_v2 [S, 16, K] x [S, K, 8]
  runs per chunk, and the warps' partials are summed in shared memory at the end (no split-K round trip);
- within each 128-row tile, the MMA's K slots are a permutation of the rows, the same on both operands:
  thread (g, t) takes the four contiguous words 4t..4t+3 of its two columns (one 16-byte load each) and
  x's rows 8t..8t+7 of each 32-row span (one 16-byte load each), and both are reordered in registers.

Ablations measure the structure alone: NO_DEQUANT feeds the raw words to the MMA (result meaningless),
NO_X also replaces x's loads by a constant. Graph timing next to fp16 cuBLAS and the dispatched kdsl
kernel, in one process; correctness against the fp32 reference of the same inputs.

    python benchmarks/gptq_gemv_mma_floor.py
"""
import itertools

import torch
import triton
import triton.testing
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

import kdsl.ops as ops
from kdsl.bench import timing as T
from kdsl.runtime import registry

PLANE_TILE_K = gl.constexpr(128)  # rows of a k_planes tile
PLANE_ROWS = gl.constexpr(16)  # words of one column in a tile
FULL, NO_DEQUANT, NO_X = 0, 1, 2


@gluon.constexpr_function
def _words_layout(num_warps, ch):
    """[S, 16 columns, CH tiles, 16 words]: lane 4g + t holds words 4t..4t+3 of columns g and g + 8."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 8, 0, 0]] + [[0, 0, 1 << i, 0] for i in range(ch.bit_length() - 1)],
        lane_bases=[[0, 0, 0, 4], [0, 0, 0, 8], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[1 << i, 0, 0, 0] for i in range(num_warps.bit_length() - 1)],
        block_bases=[], shape=[num_warps, 16, ch, 16])


@gluon.constexpr_function
def _x_layout(num_warps, ch):
    """[S, CH * 128 rows, 8]: lane 4g + t holds rows 8t..8t+7 of each 32-row span; lanes g are the columns."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 32, 0], [0, 64, 0]]
        + [[0, 128 << i, 0] for i in range(ch.bit_length() - 1)],
        lane_bases=[[0, 8, 0], [0, 16, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        warp_bases=[[1 << i, 0, 0] for i in range(num_warps.bit_length() - 1)],
        block_bases=[], shape=[num_warps, 128 * ch, 8])


@gluon.jit
def _load_chunk(strip, p_ptr, x_ptr, kt0, first_col, stride_pg, TPS: gl.constexpr, CH: gl.constexpr,
                PLANE_TILE_N: gl.constexpr, MODE: gl.constexpr, num_warps: gl.constexpr):
    """Words, (scale, zero) pairs and x, in MMA-slot order, of tiles kt0..kt0+CH of every warp's K range."""
    wl: gl.constexpr = _words_layout(num_warps, CH)
    l3: gl.constexpr = gl.SliceLayout(3, wl)
    s = gl.arange(0, num_warps, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
    n = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    c = gl.arange(0, CH, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    kk = gl.arange(0, PLANE_ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, wl))))
    tile = s[:, None, None] * TPS + kt0 + c[None, None, :]
    at = tile * (PLANE_TILE_N * PLANE_ROWS) + n[None, :, None] * PLANE_ROWS
    words = gl.load(strip + at[:, :, :, None] + kk[None, None, None, :])
    pairs = gl.load(p_ptr + tile * stride_pg + (first_col + n)[None, :, None])

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1, 1],
                                                  instr_shape=[1, 16, 8])
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    if MODE == 2:
        x = gl.full([num_warps, PLANE_TILE_K * CH, 8], 0.001, gl.float16, b_layout)
    else:
        xl: gl.constexpr = _x_layout(num_warps, CH)
        sx = gl.arange(0, num_warps, layout=gl.SliceLayout(1, gl.SliceLayout(2, xl)))
        rx = gl.arange(0, PLANE_TILE_K * CH, layout=gl.SliceLayout(0, gl.SliceLayout(2, xl)))
        nx = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, xl)))
        x = gl.load(x_ptr + (sx[:, None, None] * TPS + kt0) * PLANE_TILE_K + rx[None, :, None] + nx[None, None, :] * 0)
        # Row 128 c + 64 p1 + 32 p0 + 8 t + 4 i1 + 2 i0 + h goes to slot 128 c + 64 p1 + 32 p0 + 16 i1 + 8 i0 + 2 t + h.
        x = gl.permute(gl.reshape(x, (num_warps, CH, 2, 2, 4, 2, 2, 2, 8)), (0, 1, 2, 3, 5, 6, 4, 7, 8))
        x = gl.convert_layout(gl.reshape(x, (num_warps, PLANE_TILE_K * CH, 8)), b_layout)
    return words, pairs, x


@gluon.jit
def _chunk_mma(words, pairs, x, acc, MODE: gl.constexpr):
    S: gl.constexpr = words.shape[0]
    CH: gl.constexpr = words.shape[2]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    if MODE == 0:
        scale = gl.broadcast((pairs & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)[:, :, :, None], words)[0]
        zero = gl.broadcast((pairs >> 16).to(gl.int16).to(gl.float16, bitcast=True)[:, :, :, None], words)[0]
        w0, w1, w2, w3, w4, w5, w6, w7 = _nibbles_asm(words, scale, zero, True)
    else:
        w0 = (words & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)
        w4 = (words >> 16).to(gl.int16).to(gl.float16, bitcast=True)
        w1, w2, w3, w5, w6, w7 = w4, w0, w4, w0, w4, w0
    # Nibble p + 4 h of word 4 t + 2 i1 + i0: [s, n, c, t, i1, i0, h, p0, p1] -> slots [s, n, c, p1, p0, i1, i0, t, h].
    w = gl.join(gl.join(gl.join(w0, w4), gl.join(w1, w5)), gl.join(gl.join(w2, w6), gl.join(w3, w7)))
    w = gl.permute(gl.reshape(w, (S, 16, CH, 4, 2, 2, 2, 2, 2)), (0, 1, 2, 8, 7, 4, 5, 3, 6))
    return mma_v2(gl.convert_layout(gl.reshape(w, (S, 16, PLANE_TILE_K * CH)), a_layout), x, acc)


@gluon.jit
def gemv_mma_kernel(x_ptr, w_ptr, p_ptr, y_ptr, N, stride_pg, K: gl.constexpr, CH: gl.constexpr,
                    PLANE_TILE_N: gl.constexpr, MODE: gl.constexpr, num_warps: gl.constexpr):
    K_TILES: gl.constexpr = K // PLANE_TILE_K
    TPS: gl.constexpr = K_TILES // num_warps
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1, 1],
                                                  instr_shape=[1, 16, 8])
    first_col = gl.program_id(0) * 16
    strip = (w_ptr + (first_col // PLANE_TILE_N).to(gl.int64) * K_TILES * (PLANE_TILE_N * PLANE_ROWS)
             + (first_col % PLANE_TILE_N) * PLANE_ROWS)
    acc = gl.zeros([num_warps, 16, 8], gl.float32, mma)
    words, pairs, x = _load_chunk(strip, p_ptr, x_ptr, 0, first_col, stride_pg, TPS, CH, PLANE_TILE_N, MODE, num_warps)
    for kt0 in gl.static_range(CH, TPS, CH):
        following = _load_chunk(strip, p_ptr, x_ptr, kt0, first_col, stride_pg, TPS, CH, PLANE_TILE_N, MODE,
                                num_warps)
        acc = _chunk_mma(words, pairs, x, acc, MODE)
        words, pairs, x = following
    acc = _chunk_mma(words, pairs, x, acc, MODE)
    total = gl.sum(acc, axis=0)  # the warps' K ranges, through shared memory
    out: gl.constexpr = gl.SliceLayout(0, mma)
    cols = first_col + gl.arange(0, 16, layout=gl.SliceLayout(1, out))
    m = gl.arange(0, 8, layout=gl.SliceLayout(0, out))
    gl.store(y_ptr + m[None, :] * 0 + cols[:, None], total.to(gl.float16), mask=(m == 0)[None, :] & (cols < N)[:, None])


def launch(x, prep, y, ch, warps, mode):
    K, N = x.shape[1], y.shape[1]
    assert x.shape[0] == 1 and K % (128 * warps * ch) == 0 and N % 16 == 0
    pairs = _scale_zero_pairs(prep.scales)
    gemv_mma_kernel[(N // 16,)](x, prep.qweight, pairs, y, N, pairs.stride(0), K=K, CH=ch,
                                PLANE_TILE_N=PLANE_TILE_N, MODE=mode, num_warps=warps)


if __name__ == "__main__":
    g = lambda fn: triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          "graph-timed medians in us", flush=True)
    empty = torch.empty(1, device="cuda")
    print(f"one-element zero_: {g(lambda: empty.zero_()):.2f} us")
    for k, n in [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]:
        inp = T.gptq_gemm_inputs(1, n, k)
        prep = ops.gptq_prepare(inp.qweight, inp.qzeros, inp.scales, None, bits=4, group_size=128)
        module = registry.dispatch("gptq_gemm_prepared", prep.scheme, torch.device("cuda")).load()
        _nibbles_asm, _scale_zero_pairs = module._nibbles_asm, module._scale_zero_pairs
        PLANE_TILE_N = module.PLANE_TILE_N.value
        w16 = inp.w_ref.half()
        t_cublas = g(lambda: torch.matmul(inp.x, w16))
        t_kdsl = g(lambda: ops.gptq_gemm(inp.x, prep))
        print(f"M=1 K={k} N={n}: fp16 cuBLAS {t_cublas:.2f}, kdsl {t_kdsl:.2f} ({t_cublas / t_kdsl:.2f}x)", flush=True)
        y = torch.empty(1, n, device="cuda", dtype=torch.float16)
        modes = (FULL, NO_DEQUANT, NO_X) if k == n == 4096 else (FULL,)
        for mode, (ch, warps) in itertools.product(modes, [(4, 4), (2, 8), (4, 8)]):
            if k % (128 * warps * ch):
                continue
            fn = lambda: launch(inp.x, prep, y, ch, warps, mode)
            fn()
            err = float((y.float() - inp.ref).norm() / inp.ref.norm())
            t = g(fn)
            what = ["mma GEMV", "  no dequant", "  no dequant, no x"][mode]
            check = f"rel err {err:.0e}" if mode == FULL else "(result not checked)"
            print(f"  {what}, CH {ch}, {warps} warps: {t:.2f} ({t_cublas / t:.2f}x) {check}", flush=True)
