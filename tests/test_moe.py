"""Block-FP8 MoE ops (issue 46) against the independent fp32 references in tests/reference_moe.py.

CPU tensors run the generated kernels through Triton's interpreter (conftest sets TRITON_INTERPRET=1); a few
tests turn it off to check the torch fallback against the same references. Shapes are small: E = 4-8 experts,
H = 256, I = 128-256, so the interpreter runs each op in about a second. GPU tests (marked gpu) repeat the
checks with the kernels compiled for the lent GPU, at DeepSeek-V3 and Qwen3-MoE-like sizes, and capture
moe_fp8 in a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from conftest import interpreting, run_described, wrap_launch
from reference import FP8, act_quant_ref, rel_fro_error
from reference_moe import expert_weights, grouped_gemm_ref, masked_gemm_ref, moe_layer, moe_ref, routing

import kdsl
from kdsl import registry
from kdsl.ops import moe as moe_ops

GROUPED = "fp8_grouped_gemm__e4m3_w128x128_a128_f32__portable"
MASKED = "fp8_grouped_gemm_masked__e4m3_w128x128_a128_f32__portable"
MOE = "moe_fp8__e4m3_w128x128_a128_f32__sorted"
# Relative Frobenius error against the fp32 references. Both GEMMs accumulate in fp32 as the references do; what
# is left is the output's rounding (the interpreter truncates fp32 -> bf16 instead of rounding: about twice the
# error of a GPU) and, in moe_fp8, the down projection rounded to x's dtype before the weighted sum.
LIMITS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def use_arch(monkeypatch, arch: str):
    monkeypatch.setenv("KDSL_ARCH", arch)
    registry.reset()


def expect_kernel(launched: list[str], name_part: str):
    if interpreting():
        assert launched and all(name_part in name for name in launched), launched
    else:
        assert launched == []


def activations(*shape: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return act_quant_ref(torch.randn(*shape, device=device) * 2.0)


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, defined: torch.Tensor, dtype: torch.dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    got, want = out[defined].float(), ref[defined]
    assert torch.isfinite(got).all()
    err = rel_fro_error(got, want)
    assert err < LIMITS[dtype], f"relative error {err:.3g} over {LIMITS[dtype]}"


# ---------------------------------------------------------------------------------------------------------------
# fp8_grouped_gemm (contiguous layout)

def contiguous_layout(counts: list[int], align: int) -> torch.Tensor:
    """group_ids of DeepGEMM's contiguous layout: expert e's counts[e] rows, then -1 up to a multiple of align."""
    ids = []
    for expert, count in enumerate(counts):
        ids += [expert] * count + [-1] * (-count % align)
    return torch.tensor(ids, dtype=torch.int32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_grouped_contiguous_layout_with_padding_and_empty_experts(out_dtype, launched):
    """Ragged groups padded to 128 rows with -1 rows, an expert with no rows; N off the 128 grid."""
    counts = [5, 0, 130, 17]
    group_ids = contiguous_layout(counts, 128)
    n, k = 200, 384
    a, a_s = activations(group_ids.numel(), k)
    b, b_s = expert_weights(len(counts), n, k)
    c = kdsl.ops.fp8_grouped_gemm(a, a_s, b, b_s, group_ids, out_dtype=out_dtype)
    ref, defined = grouped_gemm_ref(a, a_s, b, b_s, group_ids)
    assert_rows_close(c, ref, defined, out_dtype)
    expect_kernel(launched, GROUPED)


def test_grouped_rows_in_any_order(launched):
    """Unsorted rows: a tile holding rows of several experts makes one pass per expert and stores only its own."""
    group_ids = torch.randint(-1, 6, (70,), dtype=torch.int32)
    a, a_s = activations(70, 256)
    b, b_s = expert_weights(6, 64, 256)
    c = kdsl.ops.fp8_grouped_gemm(a, a_s, b, b_s, group_ids)
    ref, defined = grouped_gemm_ref(a, a_s, b, b_s, group_ids)
    assert_rows_close(c, ref, defined, torch.bfloat16)
    expect_kernel(launched, GROUPED)


def test_grouped_on_hopper_tiles(monkeypatch, launched):
    """The sm_90 variant's tiles (prefill: 128 rows) through the interpreter."""
    use_arch(monkeypatch, "sm_90")
    group_ids = contiguous_layout([3, 140, 0, 60], 128)
    a, a_s = activations(group_ids.numel(), 256)
    b, b_s = expert_weights(4, 128, 256)
    c = kdsl.ops.fp8_grouped_gemm(a, a_s, b, b_s, group_ids, out_dtype=torch.float32)
    ref, defined = grouped_gemm_ref(a, a_s, b, b_s, group_ids)
    assert_rows_close(c, ref, defined, torch.float32)
    expect_kernel(launched, GROUPED + "_sm90")


def test_grouped_empty_and_all_padding():
    b, b_s = expert_weights(3, 64, 128)
    a, a_s = activations(0, 128)
    c = kdsl.ops.fp8_grouped_gemm(a, a_s, b, b_s, torch.empty(0, dtype=torch.int32))
    assert c.shape == (0, 64) and c.dtype == torch.bfloat16
    a, a_s = activations(20, 128)
    c = kdsl.ops.fp8_grouped_gemm(a, a_s, b, b_s, torch.full((20,), -1, dtype=torch.int32))
    assert c.shape == (20, 64)  # every row padding: nothing to compare, and nothing fails


def test_grouped_refuses_bad_ids_by_name():
    a, a_s = activations(8, 128)
    b, b_s = expert_weights(3, 64, 128)
    for bad in (3, -2):
        group_ids = torch.tensor([0, 1, 2, bad, -1, 0, 0, 1], dtype=torch.int32)
        message = rf"group_ids: expected expert ids .* in \[-1, 3\), got 1 outside \(first: {bad}\)"
        with pytest.raises(ValueError, match=message):
            kdsl.ops.fp8_grouped_gemm(a, a_s, b, b_s, group_ids)
        # Unchecked, the row is dropped like a padding row: the others are still right.
        c = kdsl.ops.fp8_grouped_gemm(a, a_s, b, b_s, group_ids, check_ids=False)
        ref, defined = grouped_gemm_ref(a, a_s, b, b_s, group_ids)
        assert_rows_close(c, ref, defined, torch.bfloat16)


@pytest.mark.parametrize("change, error, match", [
    (lambda t: {**t, "a": t["a"].float()}, TypeError, r"a: expected dtype float8_e4m3fn, got float32"),
    (lambda t: {**t, "group_ids": t["group_ids"].long()}, TypeError, r"group_ids: expected dtype int32, got int64"),
    (lambda t: {**t, "group_ids": t["group_ids"][:5]}, ValueError, r"group_ids: expected shape \(8,\)"),
    (lambda t: {**t, "b": t["b"][0]}, ValueError, r"b: expected 3 dimensions"),
    (lambda t: {**t, "b_s": t["b_s"][:, :1]}, ValueError, r"b_s: expected shape \(3, 2, 2\)"),
    (lambda t: {**t, "a_s": t["a_s"][:, :1]}, ValueError, r"a_s"),
    (lambda t: {**t, "out_dtype": torch.int32}, TypeError, r"out_dtype: expected one of"),
], ids=["a-dtype", "ids-dtype", "ids-shape", "b-ndim", "b_s-shape", "a_s-shape", "out_dtype"])
def test_grouped_refuses_bad_arguments_by_name(change, error, match):
    a, a_s = activations(8, 256)
    b, b_s = expert_weights(3, 160, 256)
    args = change({"a": a, "a_s": a_s, "b": b, "b_s": b_s, "group_ids": torch.zeros(8, dtype=torch.int32)})
    with pytest.raises(error, match=match):
        kdsl.ops.fp8_grouped_gemm(**args)


def test_grouped_nan_code_reaches_its_rows_only():
    """A NaN code in a row of a makes that row NaN; in expert 1's b, the rows routed to expert 1, at its column."""
    a, a_s = activations(6, 128)
    b, b_s = expert_weights(2, 32, 128)
    a.view(torch.uint8)[2, 5] = 0x7F
    b.view(torch.uint8)[1, 7, 3] = 0x7F
    group_ids = torch.tensor([0, 1, 0, 1, 1, 0], dtype=torch.int32)
    c = kdsl.ops.fp8_grouped_gemm(a, a_s, b, b_s, group_ids, out_dtype=torch.float32)
    expected = torch.zeros(6, 32, dtype=torch.bool)
    expected[2] = True
    expected[[1, 3, 4], 7] = True
    assert torch.equal(c.isnan(), expected)


# ---------------------------------------------------------------------------------------------------------------
# fp8_grouped_gemm_masked

@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_masked_counts_zero_full_and_out_of_range(out_dtype, launched):
    """masked_m read on the device: 0 rows, a few, all max_m, and values past [0, max_m] (clamped)."""
    experts, max_m, n, k = 5, 24, 136, 256
    a, a_s = activations(experts, max_m, k)
    b, b_s = expert_weights(experts, n, k)
    masked_m = torch.tensor([0, 3, max_m, 40, -2], dtype=torch.int32)
    c = kdsl.ops.fp8_grouped_gemm_masked(a, a_s, b, b_s, masked_m, out_dtype=out_dtype)
    ref, defined = masked_gemm_ref(a, a_s, b, b_s, masked_m)
    assert_rows_close(c, ref, defined, out_dtype)
    expect_kernel(launched, MASKED)


@pytest.mark.parametrize("expected_m, block_m", [(None, 64), (2, 16)])
def test_masked_expected_m_picks_the_tile(expected_m, block_m, monkeypatch):
    calls = []
    entry = registry.select("fp8_grouped_gemm_masked", kdsl.BlockFP8(), arch="sm_89")
    wrap_launch(monkeypatch, entry.modules[entry.impl],
                lambda original: lambda *args: calls.append(args[-1]["BLOCK_M"]) or original(*args))
    a, a_s = activations(2, 40, 128)
    b, b_s = expert_weights(2, 64, 128)
    masked_m = torch.tensor([2, 1], dtype=torch.int32)
    c = kdsl.ops.fp8_grouped_gemm_masked(a, a_s, b, b_s, masked_m, expected_m=expected_m)
    ref, defined = masked_gemm_ref(a, a_s, b, b_s, masked_m)
    assert_rows_close(c, ref, defined, torch.bfloat16)
    assert calls == ([block_m] if interpreting() else [])


def test_masked_empty_and_refusals():
    b, b_s = expert_weights(2, 64, 128)
    a, a_s = activations(2, 0, 128)
    c = kdsl.ops.fp8_grouped_gemm_masked(a, a_s, b, b_s, torch.zeros(2, dtype=torch.int32))
    assert c.shape == (2, 0, 64)
    a, a_s = activations(2, 4, 128)
    with pytest.raises(ValueError, match=r"masked_m: expected shape \(2,\) \(one row count per expert\)"):
        kdsl.ops.fp8_grouped_gemm_masked(a, a_s, b, b_s, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"masked_m: expected dtype int32"):
        kdsl.ops.fp8_grouped_gemm_masked(a, a_s, b, b_s, torch.zeros(2))
    with pytest.raises(ValueError, match=r"b: expected 2 experts \(a's E\)"):
        kdsl.ops.fp8_grouped_gemm_masked(a, a_s, b[:1], b_s[:1], torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected_m: expected a positive integer or None, got 0"):
        kdsl.ops.fp8_grouped_gemm_masked(a, a_s, b, b_s, torch.zeros(2, dtype=torch.int32), expected_m=0)


# ---------------------------------------------------------------------------------------------------------------
# moe_fp8

def moe_case(tokens, experts, hidden, inter, topk, dtype=torch.bfloat16, skew=0.0, device="cpu"):
    w13, w13_s, w2, w2_s = moe_layer(experts, hidden, inter, device)
    topk_weights, topk_ids = routing(tokens, experts, topk, skew, device)
    x = (torch.randn(tokens, hidden, device=device) * 2.0).to(dtype)
    return x, w13, w13_s, w2, w2_s, topk_weights, topk_ids


# Tokens per routed expert ceil(T k / min(T k, E)) picks the sm_89 tile: <= 4 the unfused 16-row tile, <= 32 the
# fused 32-row one, above the fused 64-row one.
@pytest.mark.parametrize("tokens, experts, topk, dtype", [
    (1, 8, 2, torch.bfloat16),      # decode: one token, two of eight experts
    (5, 4, 2, torch.float16),       # decode tile (3 per expert), fp16
    (40, 4, 2, torch.bfloat16),     # fused 32-row tile (20 per expert)
    (70, 4, 3, torch.bfloat16),     # fused 64-row tile (53 per expert)
], ids=["t1-decode", "t5-fp16", "t40-fused", "t70-fused64"])
def test_moe_matches_reference(tokens, experts, topk, dtype, launched):
    args = moe_case(tokens, experts, 256, 128, topk, dtype, skew=0.7)
    y = kdsl.ops.moe_fp8(*args)
    assert y.dtype == dtype and y.shape == (tokens, 256)
    assert_rows_close(y, moe_ref(*args), torch.ones(tokens, dtype=torch.bool), dtype)
    expect_kernel(launched, MOE)


def test_moe_ragged_routing_with_idle_experts_and_repeated_ids():
    """Most tokens on two experts, experts 5..7 never routed to, a token naming one expert in two slots
    (each slot counts), and I = 256 (two activation groups)."""
    x, w13, w13_s, w2, w2_s, _, _ = moe_case(9, 8, 256, 256, 3)
    topk_ids = torch.tensor([[0, 1, 2], [0, 1, 3], [1, 0, 4], [0, 0, 1], [1, 3, 0],
                             [2, 0, 1], [0, 1, 2], [4, 1, 0], [1, 0, 3]], dtype=torch.int32)
    topk_weights = torch.rand(9, 3)
    y = kdsl.ops.moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids)
    assert_rows_close(y, moe_ref(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids), torch.ones(9, dtype=torch.bool),
                      torch.bfloat16)


def test_moe_on_hopper_tiles(monkeypatch, launched):
    """The sm_90 variant (its 16-row decode tile and the fused 128-row prefill tile) through the interpreter."""
    use_arch(monkeypatch, "sm_90")
    for tokens in (2, 140):
        args = moe_case(tokens, 2, 256, 128, 2)
        y = kdsl.ops.moe_fp8(*args)
        assert_rows_close(y, moe_ref(*args), torch.ones(tokens, dtype=torch.bool), torch.bfloat16)
    expect_kernel(launched, MOE + "_sm90")


def test_moe_strided_inputs():
    """x, topk_weights and topk_ids as views with other strides."""
    x, w13, w13_s, w2, w2_s, topk_weights, topk_ids = moe_case(6, 4, 256, 128, 2)
    wide = torch.zeros(6, 512, dtype=x.dtype)
    wide[:, 128:384] = x
    ids_t = topk_ids.t().contiguous().t()
    weights_wide = torch.zeros(6, 5)
    weights_wide[:, 1:3] = topk_weights
    y = kdsl.ops.moe_fp8(wide[:, 128:384], w13, w13_s, w2, w2_s, weights_wide[:, 1:3], ids_t)
    assert_rows_close(y, moe_ref(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids), torch.ones(6, dtype=torch.bool),
                      torch.bfloat16)


def test_moe_empty_inputs():
    x, w13, w13_s, w2, w2_s, topk_weights, topk_ids = moe_case(0, 4, 256, 128, 2)
    y = kdsl.ops.moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids)
    assert y.shape == (0, 256) and y.dtype == torch.bfloat16
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = kdsl.ops.moe_fp8(x, w13, w13_s, w2, w2_s, torch.empty(3, 0), torch.empty(3, 0, dtype=torch.int32))
    assert torch.equal(y, torch.zeros(3, 256, dtype=torch.bfloat16))  # no slot routed: nothing added


@pytest.mark.parametrize("bad", ["E", -1, 1000])
@pytest.mark.parametrize("tokens, experts", [(5, 4), (2, 16)], ids=["sorted", "one-per-block"])
def test_moe_refuses_bad_topk_ids_by_name(bad, tokens, experts):
    """Refused by name whether the routing kernel counts the bad ids or (T * k * 4 <= E: no routing kernel, each
    assignment a block of its own) torch does."""
    bad = experts if bad == "E" else bad
    x, w13, w13_s, w2, w2_s, topk_weights, topk_ids = moe_case(tokens, experts, 256, 128, 2)
    topk_ids[tokens - 1, 1] = bad
    with pytest.raises(ValueError, match=rf"topk_ids: expected expert ids \(w13 has {experts} experts\) in "
                                         rf"\[0, {experts}\), got 1 outside \(first: {bad}\)"):
        kdsl.ops.moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids)
    # check_ids=False (what a captured CUDA graph runs): the slot adds nothing, no read outside the weights.
    y = kdsl.ops.moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, check_ids=False)
    assert_rows_close(y, moe_ref(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids),
                      torch.ones(tokens, dtype=torch.bool), torch.bfloat16)


def _described_kernels(tokens, experts, topk) -> list[str]:
    """The kernels moe_fp8's decode launch describes for a call (described, not run)."""
    entry = registry.select("moe_fp8", kdsl.BlockFP8(), arch="sm_89")
    module = entry.modules[entry.impl]
    x, w13, w13_s, w2, w2_s, topk_weights, topk_ids = moe_case(tokens, experts, 256, 128, topk)
    launches = module.unit.launch(module.generated(), x, w13, w13_s, w2, w2_s, topk_weights, topk_ids,
                                  torch.empty_like(x), None, entry.tile_for(1))
    return [getattr(launch.kernel, "fn", launch.kernel).__name__ for launch in launches]


def sorted_routing_ref(topk_ids: torch.Tensor, experts: int, block_m: int):
    """What the routing kernels write, from its definition: expert by expert, the assignments t * k + j routed to
    it in increasing order, the run padded with -1 to a multiple of block_m; each block's expert; the ids outside
    [0, E); each expert's first row. (The rows used are the rows' length; each assignment's row is its place in
    them.)"""
    runs = [[] for _ in range(experts)]
    outside = 0
    for assignment, expert in enumerate(topk_ids.reshape(-1).tolist()):
        if 0 <= expert < experts:
            runs[expert].append(assignment)
        else:
            outside += 1
    rows, block_expert, starts = [], [], []
    for expert, run in enumerate(runs):
        starts.append(len(rows))
        run += [-1] * (-len(run) % block_m)
        rows += run
        block_expert += [expert] * (len(run) // block_m)
    return rows, block_expert, outside, starts


def check_routing_kernels(tokens, experts, topk, block_m, skew, device="cpu"):
    """The routing kernels' rows, block experts, meta and slot rows against sorted_routing_ref, with three ids
    outside [0, E) among the routing."""
    from kdsl.kernels.moe_routing import route
    _, topk_ids = routing(tokens, experts, topk, skew, device)
    topk_ids[1, 0], topk_ids[tokens - 1, topk - 1], topk_ids[tokens // 2, 0] = -1, experts, 1 << 20  # unrouted
    generated = registry.select("moe_fp8", kdsl.BlockFP8(), arch="sm_89").modules["sorted"].generated()
    routed = run_described(route(generated, topk_ids, experts, block_m, None))
    rows, block_expert, meta, slot_rows = routed.rows, routed.block_expert, routed.meta, routed.slot_rows
    want_rows, want_blocks, outside, starts = sorted_routing_ref(topk_ids, experts, block_m)
    used = len(want_rows)
    assert meta[:2 + experts].tolist() == [used, outside, *starts]
    assert rows[:used].tolist() == want_rows
    assert block_expert[:used // block_m].tolist() == want_blocks
    assert (block_expert[used // block_m:] == -1).all()
    row_of = {a: row for row, a in enumerate(want_rows) if a >= 0}
    assert slot_rows.tolist() == [row_of.get(a, -1) for a in range(tokens * topk)]


@pytest.mark.parametrize("tokens, experts, topk, block_m, skew", [
    (5, 8, 2, 16, 0.0),      # one chunk: one program
    (100, 8, 2, 16, 0.0),    # two chunks: count, scan, place
    (4200, 60, 2, 32, 3.0),  # 66 chunks (two steps of the scan), the last partial, E not a power of two, skewed
], ids=["one-chunk", "two-chunks", "66-chunks-skewed"])
def test_routing_kernels_sort_the_assignments_by_expert(tokens, experts, topk, block_m, skew):
    from kdsl.kernels.moe_routing import ALIGN_CHUNK
    assert (tokens * topk > ALIGN_CHUNK) == (tokens > 5)
    check_routing_kernels(tokens, experts, topk, block_m, skew)


def test_moe_routing_paths_agree_bit_for_bit(monkeypatch):
    """The same call with the routing kernel and without it (one block per assignment): every row is computed by
    the same K loop either way, so the layers agree bit for bit."""
    from kdsl.kernels.block_fp8 import moe_fp8_sorted
    args = moe_case(2, 16, 256, 128, 2)
    unsorted = kdsl.ops.moe_fp8(*args)
    monkeypatch.setattr(moe_fp8_sorted, "one_per_block", lambda assignments, experts: False)
    assert torch.equal(unsorted, kdsl.ops.moe_fp8(*args))


def test_moe_one_block_per_assignment_with_an_expert_shared_by_tokens():
    """T * k * 4 <= E: no routing kernel, each (token, slot) a block of its own, so an expert two tokens route to
    is computed twice, once per block."""
    assert not any(name.endswith("_align") for name in _described_kernels(2, 16, 2))
    assert any(name.endswith("_align") for name in _described_kernels(3, 16, 2))  # 3 * 2 * 4 > 16: sorted
    x, w13, w13_s, w2, w2_s, _, _ = moe_case(2, 16, 256, 128, 2)
    topk_ids = torch.tensor([[3, 5], [5, 3]], dtype=torch.int32)
    topk_weights = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    y = kdsl.ops.moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids)
    assert_rows_close(y, moe_ref(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids), torch.ones(2, dtype=torch.bool),
                      torch.bfloat16)


def test_moe_refuses_bad_ids_on_the_fallback_too(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w13, w13_s, w2, w2_s, topk_weights, topk_ids = moe_case(3, 4, 256, 128, 2)
    topk_ids[0, 0] = 7
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids"):
        kdsl.ops.moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids)


def _moe_args(**change):
    x, w13, w13_s, w2, w2_s, topk_weights, topk_ids = moe_case(4, 3, 256, 128, 2)
    args = dict(x=x, w13=w13, w13_s=w13_s, w2=w2, w2_s=w2_s, topk_weights=topk_weights, topk_ids=topk_ids)
    return {**args, **{name: fn(args) for name, fn in change.items()}}


@pytest.mark.parametrize("args, error, match", [
    (dict(topk_ids=lambda a: a["topk_ids"].long()), TypeError, r"topk_ids: expected dtype int32, got int64"),
    (dict(topk_ids=lambda a: a["topk_ids"][:3]), ValueError, r"topk_ids: expected shape \(4, k\)"),
    (dict(topk_weights=lambda a: a["topk_weights"].half()), TypeError, r"topk_weights: expected dtype float32"),
    (dict(topk_weights=lambda a: a["topk_weights"][:, :1]), ValueError, r"topk_weights: expected shape \(4, 2\)"),
    (dict(x=lambda a: a["x"].float()), TypeError, r"x: expected dtype bfloat16 or float16, got float32"),
    (dict(x=lambda a: a["x"][:, :128]), ValueError, r"w13: expected shape \(E, 2I, 128\)"),
    (dict(w13=lambda a: a["w13"].view(torch.uint8)), TypeError, r"w13: expected dtype float8_e4m3fn"),
    (dict(w2=lambda a: a["w2"][:, :, :64]), ValueError, r"w2: expected shape \(3, 256, 128\)"),
    (dict(w2_s=lambda a: a["w2_s"][:2]), ValueError, r"w2_s: expected shape \(3, 2, 1\)"),
    (dict(w13=lambda a: a["w13"][:, :192], w13_s=lambda a: a["w13_s"][:, :2]), ValueError,
     r"w13: expected \(E, 2I, H\), gate rows then up rows, with I a multiple of 128"),
], ids=["ids-int64", "ids-rows", "weights-fp16", "weights-shape", "x-fp32", "hidden", "w13-dtype", "w2-shape",
        "w2_s-shape", "inter"])
def test_moe_refuses_bad_arguments_by_name(args, error, match):
    with pytest.raises(error, match=match):
        kdsl.ops.moe_fp8(**_moe_args(**args))


def test_moe_requires_no_grad():
    args = _moe_args()
    args["topk_weights"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="topk_weights: requires grad"):
        kdsl.ops.moe_fp8(**args)


def test_moe_nan_reaches_the_tokens_that_read_it():
    """NaN in x poisons its token; a NaN code in an expert's w2 row, that column of the tokens routed there."""
    x, w13, w13_s, w2, w2_s, _, _ = moe_case(4, 3, 256, 128, 1)
    topk_ids = torch.tensor([[0], [1], [2], [1]], dtype=torch.int32)
    x[0, 3] = float("nan")
    w2.view(torch.uint8)[1, 10, 5] = 0x7F
    y = kdsl.ops.moe_fp8(x, w13, w13_s, w2, w2_s, torch.ones(4, 1), topk_ids)
    expected = torch.zeros(4, 256, dtype=torch.bool)
    expected[0] = True
    expected[[1, 3], 10] = True
    assert torch.equal(y.isnan(), expected)


def test_moe_torch_fallback_matches_the_reference(monkeypatch, launched):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args = moe_case(7, 4, 256, 128, 2, skew=0.5)
    y = kdsl.ops.moe_fp8(*args)
    assert_rows_close(y, moe_ref(*args), torch.ones(7, dtype=torch.bool), torch.bfloat16)
    assert launched == []


def test_grouped_torch_fallbacks_match_the_references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    group_ids = contiguous_layout([3, 0, 9], 16)
    a, a_s = activations(group_ids.numel(), 128)
    b, b_s = expert_weights(3, 48, 128)
    c = kdsl.ops.fp8_grouped_gemm(a, a_s, b, b_s, group_ids, out_dtype=torch.float32)
    assert_rows_close(c, *grouped_gemm_ref(a, a_s, b, b_s, group_ids), torch.float32)
    a, a_s = activations(3, 8, 128)
    masked_m = torch.tensor([0, 8, 5], dtype=torch.int32)
    c = kdsl.ops.fp8_grouped_gemm_masked(a, a_s, b, b_s, masked_m, out_dtype=torch.float32)
    assert_rows_close(c, *masked_gemm_ref(a, a_s, b, b_s, masked_m), torch.float32)


def test_tokens_per_expert_buckets():
    assert moe_ops.tokens_per_expert(1 * 8, 256) == 1  # DeepSeek-V3 decode, T = 1
    assert moe_ops.tokens_per_expert(128 * 8, 256) == 4
    assert moe_ops.tokens_per_expert(4096 * 8, 256) == 128
    assert moe_ops.tokens_per_expert(64 * 8, 128) == 4  # Qwen3-30B-A3B
    assert moe_ops.tokens_per_expert(0, 8) == 1


# ---------------------------------------------------------------------------------------------------------------
# registry

@pytest.mark.parametrize("op", ["fp8_grouped_gemm", "fp8_grouped_gemm_masked", "moe_fp8"])
def test_registry_refuses_sm80_and_picks_hopper_tiles(op):
    with pytest.raises(registry.NoKernelError, match=r"needs sm_89 or newer"):
        registry.select(op, kdsl.BlockFP8(), arch="sm_80")
    assert registry.select(op, kdsl.BlockFP8(), arch="sm_89").name.endswith("_sm89")
    assert registry.select(op, kdsl.BlockFP8(), arch="sm_90").name.endswith("_sm90")
    assert registry.select(op, kdsl.BlockFP8(), arch="sm_100").name.endswith("_sm89")  # Hopper's tiles are capped
    assert "CHOSEN" in registry.explain(op, arch="sm_90", m=4)


def test_moe_on_sm80_raises_no_kernel(monkeypatch):
    use_arch(monkeypatch, "sm_80")
    with pytest.raises(registry.NoKernelError, match="moe_fp8"):
        kdsl.ops.moe_fp8(**_moe_args())


def test_moe_decode_and_prefill_tiles():
    """On sm_90 the GPU's prefill calls take the Gluon unit; the CPU (no Gluon interpreter) the portable tile after
    it, tuned on an H200 at T = 4096."""
    entry = registry.select("moe_fp8", kdsl.BlockFP8(), arch="sm_90")
    decode = entry.tile_for(1)
    assert decode["impl"] == "sorted" and decode["BLOCK_M"] == 16 and decode["fuse_act"] is False
    for rows in (17, 32, 33, 128):
        gpu = entry.tile_for(rows, 2048, registry.Call(m=rows, n=2048))
        assert gpu["impl"] == "sorted_gluon" and gpu["BLOCK_M"] == 64, rows
        assert entry.tile_for(rows, 2048, registry.Call(m=rows, n=2048, align=8))["impl"] == "sorted", rows
        assert entry.tile_for(rows, 2048, registry.Call(m=rows, n=2048, stacked=False))["impl"] == "sorted", rows
        # DeepSeek-V3's TP-8 slice (I = 256) and 16 rows per expert measured faster on the portable tiles
        assert entry.tile_for(rows, 256, registry.Call(m=rows, n=256))["impl"] == "sorted", rows
    assert entry.tile_for(16, 2048, registry.Call(m=16, n=2048))["impl"] == "sorted"
    big = entry.tile_for(512, 2048, registry.Call(m=512, n=2048))
    assert entry.tile_for(256, 2048, registry.Call(m=256, n=2048))["BLOCK_M"] == 64 and big["BLOCK_M"] == 128
    assert big["impl"] == "sorted_gluon" and big["num_warps"] == 8
    cpu = {rows: entry.tile_for(rows, 2048, registry.Call(m=rows, n=2048, device_type="cpu")) for rows in (128, 129)}
    assert cpu[128]["impl"] == "sorted" and cpu[128]["BLOCK_M"] == 64 and cpu[128]["fuse_act"] is False
    assert cpu[129]["BLOCK_M"] == 64 and cpu[129]["fuse_act"] is True and cpu[129]["BLOCK_N"] == 128


def test_experts_stacked_says_whether_one_tma_matrix_reads_the_weights():
    w = torch.empty(4, 256, 128, dtype=FP8)
    assert moe_ops._experts_stacked(w) and moe_ops._experts_stacked(w[:1])
    assert not moe_ops._experts_stacked(w[::2])  # every other expert: a gap of one expert between slabs
    assert not moe_ops._experts_stacked(torch.empty(4, 512, 128, dtype=FP8)[:, :256])  # each expert's first rows
    assert moe_ops._experts_stacked(torch.empty(4, 256, 256, dtype=FP8)[:, :, :128])  # padded rows, stacked


def test_moe_tile_follows_the_intermediate_size(monkeypatch):
    """The layer tiles by I (the gate/up GEMM's width at decode), not by H: on sm_90 a decode call with I < 1024
    takes the four-stage swapped tile and one with I >= 1024 the six-stage one, whatever H is."""
    entry = registry.select("moe_fp8", kdsl.BlockFP8(), arch="sm_90")
    small, large = entry.tile_for(1, 256), entry.tile_for(1, 2048)
    assert (small["num_stages"], large["num_stages"]) == (4, 6) and small["swap_ab"] and large["swap_ab"]
    use_arch(monkeypatch, "sm_90")
    tiles = []
    sm90 = registry.dispatch("moe_fp8", kdsl.BlockFP8(), torch.device("cpu"))
    wrap_launch(monkeypatch, sm90.modules[sm90.impl],
                lambda original: lambda *args: tiles.append(args[-1]["num_stages"]) or original(*args))
    args = moe_case(2, 2, 1024, 128, 2)  # H = 1024 would pick the six-stage tile; I = 128 picks the four-stage one
    y = kdsl.ops.moe_fp8(*args)
    assert_rows_close(y, moe_ref(*args), torch.ones(2, dtype=torch.bool), torch.bfloat16)
    assert tiles == ([4] if interpreting() else [])


def parse_sorted_tile(tile: str):
    """A definition whose one moe_fp8/sorted variant has the one tile written (TOML inline table fields)."""
    from kdsl.schema import parse_definition
    return parse_definition("moe.toml", f"""
[[schemes]]
kind = "block_fp8"

[[variants]]
op = "moe_fp8"
impl = "sorted"
min_arch = "sm_89"
tiles = [{{ {tile} }}]
""")


def test_fused_activation_needs_block_n_of_one_group():
    with pytest.raises(Exception, match=r"tiles\[0\].block_n: fuse_act quantizes h per row over one 128-wide"):
        parse_sorted_tile("block_m = 16, block_n = 64, block_k = 128, num_stages = 2")


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("change", [dict(swap_ab=True), dict(SPLIT_K=3),
                                    dict(SPLIT_K=2, swap_ab=True, down_num_stages=2)],
                         ids=["swap", "split3", "split2-swap-down2"])
def test_moe_decode_tile_options(tokens, change):
    """The decode tile's options, alone and together: swap_ab (C^T = w A^T in both GEMMs, the weights on the MMA's
    wide side), split_k (the gate-up GEMM's K in slices whose partial products the activation kernel sums; here 3
    slices of K = 384 are one 128-wide step each) and the down GEMM's own stage count, against the fp32 reference
    and against the same tile without them, for one token and for a few per expert."""
    entry = registry.select("moe_fp8", kdsl.BlockFP8(), arch="sm_89")
    x, w13, w13_s, w2, w2_s, topk_weights, topk_ids = moe_case(tokens, 4, 384, 256, 2, skew=0.7)
    tile = entry.tile_for(1)
    assert tile["fuse_act"] is False and not tile["swap_ab"] and tile["SPLIT_K"] == 1
    run = entry.modules[entry.impl]

    def layer(**options):
        y = torch.empty_like(x)
        run.launch(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids, y, None, {**tile, **options})
        return y

    changed = layer(**change)
    assert_rows_close(changed, moe_ref(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids),
                      torch.ones(tokens, dtype=torch.bool), torch.bfloat16)
    # The GEMMs may sum in another order (on a GPU: a bf16 ulp here and there, about 4e-3 in all).
    assert rel_fro_error(changed.float(), layer().float()) < 1e-2


def test_swap_and_split_need_the_unfused_gemm():
    with pytest.raises(Exception, match=r"(?s)tiles\[0\].options.swap_ab: the fused gate-up epilogue keeps A's rows.*"
                                        r"tiles\[0\].split_k: the fused gate-up epilogue activates whole sums"):
        parse_sorted_tile("block_m = 16, block_n = 128, block_k = 128, num_stages = 2, split_k = 2, "
                          "options = { swap_ab = true }")


# ---------------------------------------------------------------------------------------------------------------
# kdsl.nn.FP8MoE

def test_fp8_moe_module(launched):
    experts, hidden, inter = 4, 256, 128
    gate, up = torch.randn(experts, inter, hidden) * 0.06, torch.randn(experts, inter, hidden) * 0.06
    down = torch.randn(experts, hidden, inter) * 0.09
    layer = kdsl.nn.FP8MoE.from_float(gate, up, down)
    launched.clear()  # weight_quant's
    assert layer.w13.shape == (experts, 2 * inter, hidden) and layer.w13.dtype == FP8
    assert "num_experts=4" in repr(layer) and "moe_fp8__" in repr(layer)
    x = torch.randn(2, 3, hidden, dtype=torch.bfloat16)
    topk_weights, topk_ids = routing(6, experts, 2)
    with torch.no_grad():
        y = layer.bfloat16()(x, topk_weights.view(2, 3, 2), topk_ids.view(2, 3, 2))
    assert layer.w13.dtype == FP8  # .bfloat16() leaves the quantized weights alone
    assert y.shape == (2, 3, hidden)
    ref = moe_ref(x.view(6, hidden), layer.w13, layer.w13_s, layer.w2, layer.w2_s, topk_weights, topk_ids)
    assert_rows_close(y.view(6, hidden), ref, torch.ones(6, dtype=torch.bool), torch.bfloat16)
    expect_kernel(launched, MOE)


def test_fp8_moe_module_refuses_mismatched_weights():
    w13, w13_s, w2, w2_s = moe_layer(2, 256, 128)
    with pytest.raises(ValueError, match=r"w2: expected shape \(2, 256, 128\)"):
        kdsl.nn.FP8MoE(w13, w13_s, w2[:, :128], w2_s)
    with pytest.raises(TypeError, match=r"w13_s: expected dtype float32"):
        kdsl.nn.FP8MoE(w13, w13_s.double(), w2, w2_s)


# ---------------------------------------------------------------------------------------------------------------
# torch.library: fake kernels, opcheck, torch.compile(fullgraph=True)

def _op_samples():
    def grouped():
        group_ids = contiguous_layout([3, 5], 4)  # -1 rows hold unspecified values: opcheck compares every row
        group_ids[group_ids < 0] = 1
        a, a_s = activations(group_ids.numel(), 128)
        b, b_s = expert_weights(2, 48, 128)
        return (a, a_s, b, b_s, group_ids, torch.bfloat16, True)

    def masked():
        a, a_s = activations(2, 5, 128)
        b, b_s = expert_weights(2, 32, 128)
        return (a, a_s, b, b_s, torch.tensor([5, 5], dtype=torch.int32), torch.float32, None)

    def moe():
        return (*moe_case(3, 4, 128, 128, 2), True)

    return [("fp8_grouped_gemm", grouped), ("fp8_grouped_gemm_masked", masked), ("moe_fp8", moe)]


@pytest.mark.parametrize("name, builder", _op_samples(), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, builder):
    args = builder()
    torch.library.opcheck(getattr(torch.ops.kdsl, name).default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("name", ["fp8_grouped_gemm", "fp8_grouped_gemm_masked", "moe_fp8"])
def test_compiles_fullgraph_to_one_op(name):
    args = dict(_op_samples())[name]()
    public = getattr(kdsl.ops, name)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    fn = lambda *t: public(*t)  # noqa: E731  (defaults for out_dtype / expected_m / check_ids)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    got = torch.compile(fn, backend=counter, fullgraph=True)(*tensors)
    want = fn(*tensors)
    assert counter.frame_count == 1
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)
    targets = [str(node.target) for node in counter.graphs[0].graph.nodes if node.op == "call_function"]
    assert [t.removesuffix(".default") for t in targets if t.startswith("kdsl.")] == [f"kdsl.{name}"]


# ---------------------------------------------------------------------------------------------------------------
# GPU (the lent GPU; KDSL_TEST_GPU=1 python -m pytest -m gpu tests/test_moe.py)

@pytest.mark.gpu
@pytest.mark.parametrize("experts, hidden, inter, topk", [(256, 7168, 256, 8), (128, 2048, 768, 8)],
                         ids=["deepseek-v3-tp8", "qwen3-30b-a3b"])
@pytest.mark.parametrize("tokens", [1, 16, 128, 600])
def test_gpu_moe_matches_reference(experts, hidden, inter, topk, tokens):
    torch.manual_seed(tokens)
    args = moe_case(tokens, experts, hidden, inter, topk, skew=0.02, device="cuda")
    y = kdsl.ops.moe_fp8(*args)
    ref = _gpu_moe_ref(*args)
    err = rel_fro_error(y, ref)
    assert torch.isfinite(y).all() and err < 8e-3, f"relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("experts, hidden, inter, topk, tokens", [
    (256, 7168, 2048, 8, 2048),  # DeepSeek-V3: 64 rows per expert
    (32, 2048, 1152, 8, 100),  # 25 rows per expert; I = 1152: an odd count of K blocks in the down GEMM
    (64, 1024, 1152, 4, 2048),  # 128 rows per expert
    (64, 1152, 1024, 4, 2048),  # 128 rows; H = 1152 = 9 x 128: an odd count of 128-column tiles in the down GEMM
    (32, 1024, 1024, 8, 1024),  # 256 rows per expert
    (16, 1024, 1024, 4, 2048),  # 512 rows per expert: the 128-row tile on two warpgroups
], ids=["deepseek-v3-t2048", "odd-k-t100", "odd-k-t2048", "h1152-t2048", "rows-256", "rows-512"])
def test_gpu_moe_gluon_prefill_matches_reference(experts, hidden, inter, topk, tokens):
    """The prefill calls the Gluon unit (moe_fp8/sorted_gluon) serves, against the fp32 per-expert reference."""
    entry = registry.dispatch("moe_fp8", kdsl.BlockFP8(), torch.device("cuda"))
    rows = moe_ops.tokens_per_expert(tokens * topk, experts)
    assert entry.tile_for(rows, inter, registry.Call(m=rows, n=inter))["impl"] == "sorted_gluon"
    torch.manual_seed(tokens + inter)
    args = moe_case(tokens, experts, hidden, inter, topk, skew=0.02, device="cuda")
    y = kdsl.ops.moe_fp8(*args)
    err = rel_fro_error(y, _gpu_moe_ref(*args))
    assert torch.isfinite(y).all() and err < 8e-3, f"relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, block_m, skew", [(16, 16, 0.0), (65, 16, 0.0), (4096, 64, 0.5)],
                         ids=["one-program", "three-steps", "deepseek-v3-t4096"])
def test_gpu_routing_kernels_sort_the_assignments_by_expert(tokens, block_m, skew):
    """The routing kernels compiled for the GPU, at DeepSeek-V3's 256 experts and top-8, against the reference."""
    torch.manual_seed(tokens)
    check_routing_kernels(tokens, 256, 8, block_m, skew, device="cuda")


def _full_fp32(fn, *args):
    """fn(*args) with true fp32 matmuls (no TF32), as the references need on the GPU."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return fn(*args)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _gpu_moe_ref(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids):
    return _full_fp32(moe_ref, x, w13, w13_s, w2, w2_s, topk_weights, topk_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, inter", [(16, 256), (1024, 1024)], ids=["decode", "prefill-gluon"])
def test_gpu_moe_captures_in_a_cuda_graph_and_replays_any_routing(tokens, inter):
    """One graph, captured with check_ids on (the check is skipped while capturing), replayed on new routing,
    including an id outside [0, E) (dropped, no fault)."""
    x, w13, w13_s, w2, w2_s, topk_weights, topk_ids = moe_case(tokens, 64, 1024, inter, 4, device="cuda")
    kdsl.ops.moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kdsl.ops.moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids)
    for skew in (0.0, 0.5):
        new_weights, new_ids = routing(tokens, 64, 4, skew, device="cuda")
        new_ids[0, 0] = 64 if skew else new_ids[0, 0]
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        err = rel_fro_error(y, _gpu_moe_ref(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids))
        assert err < 8e-3, f"skew {skew}: relative error {err:.3g}"
    with pytest.raises(ValueError, match="topk_ids"):
        kdsl.ops.moe_fp8(x, w13, w13_s, w2, w2_s, topk_weights, topk_ids)  # eager: refused


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_expert", [2, 40, 300])
def test_gpu_grouped_contiguous(rows_per_expert):
    experts, n, k = 16, 4096, 7168
    counts = torch.randint(0, 2 * rows_per_expert + 1, (experts,)).tolist()
    group_ids = contiguous_layout(counts, 128).cuda()
    a, a_s = activations(group_ids.numel(), k, device="cuda")
    b, b_s = expert_weights(experts, n, k, device="cuda")
    c = kdsl.ops.fp8_grouped_gemm(a, a_s, b, b_s, group_ids)
    ref, defined = _full_fp32(_gpu_grouped_ref, a, a_s, b, b_s, group_ids)
    assert_rows_close(c, ref, defined, torch.bfloat16)


def _gpu_grouped_ref(a, a_s, b, b_s, group_ids):
    from reference import fp8_gemm_ref
    ref = torch.zeros(a.shape[0], b.shape[1], device=a.device)
    for e in range(b.shape[0]):
        rows = (group_ids == e).nonzero().squeeze(1)
        if rows.numel():
            ref[rows] = fp8_gemm_ref(a[rows], a_s[rows], b[e], b_s[e])
    return ref, group_ids >= 0


@pytest.mark.gpu
def test_gpu_masked_in_a_cuda_graph():
    experts, max_m, n, k = 32, 64, 2048, 7168
    a, a_s = activations(experts, max_m, k, device="cuda")
    b, b_s = expert_weights(experts, n, k, device="cuda")
    masked_m = torch.randint(0, max_m + 1, (experts,), dtype=torch.int32).cuda()
    kdsl.ops.fp8_grouped_gemm_masked(a, a_s, b, b_s, masked_m, expected_m=8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c = kdsl.ops.fp8_grouped_gemm_masked(a, a_s, b, b_s, masked_m, expected_m=8)
    masked_m.copy_(torch.randint(0, max_m + 1, (experts,), dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref, defined = _full_fp32(masked_gemm_ref, a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu(), masked_m.cpu())
    assert_rows_close(c.cpu(), ref, defined, torch.bfloat16)
