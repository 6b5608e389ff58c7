"""W4A16 MoE (issue 46): gptq_moe_prepare / awq_moe_prepare + moe_w4a16 against an fp32 per-expert reference.

The experts are built from random integers by tests/reference_gptq.py (GPTQ v1/v2, symmetric or not, act-order
g_idx) and by an AutoAWQ packer written here; the reference dequantizes them apart from kdsl (reference_gptq.
dequant_ref, the integers for AWQ) and runs the layer in fp32 (reference_moe.moe_dense_ref). CPU tensors run the
generated kernels through Triton's interpreter (conftest); a few tests turn it off for the torch fallback. Shapes are
tiny (E = 2-4, H = 256, I = 128-256); GPU tests (marked gpu) run Qwen3-30B-A3B's shapes and a CUDA graph.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch._dynamo.testing
from conftest import interpreting, run_described, wrap_launch
from reference import rel_fro_error
from reference_moe import moe_dense_ref, routing

import kdsl
import reference_gptq as rg
from kdsl import registry
from kdsl.kernels.moe_routing import route
from kdsl.kernels.w4a16 import moe_sorted

MOE = "moe_w4a16__int4_g128__sorted"
# The kernels round each dequantized weight, h = silu(gate) * up and each slot's down projection to x's dtype (and
# the interpreter truncates fp32 -> bf16): relative Frobenius error against the fp32 reference.
LIMITS = {torch.float16: 3e-3, torch.bfloat16: 3e-2}  # bf16: the interpreter truncates (biased); a GPU ~0.4%
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def use_arch(monkeypatch, arch: str):
    monkeypatch.setenv("KDSL_ARCH", arch)
    registry.reset()


# --- experts built from integers, apart from kdsl -------------------------------------------------------------------

def gptq_experts(experts: int, k: int, n: int, parts: int = 1, *, fmt="gptq", sym=False, g_idx="default",
                 group_size=128, dtype=torch.float16, device="cpu"):
    """One projection of E GPTQ experts, stacked: (qweight, qzeros, scales, g_idx [E, parts, K] or None, dense fp32
    [E, K, N]). parts > 1: N in that many column segments quantized as separate linears (gate and up), each with
    its own g_idx."""
    qweight, qzeros, scales, groups, dense = [], [], [], [], []
    for _ in range(experts):
        made = [rg.make_checkpoint(k, n // parts, group_size=group_size, checkpoint_format=fmt, sym=sym, g_idx=g_idx,
                                   scale_dtype=dtype) for _ in range(parts)]
        qweight.append(torch.cat([c["qweight"] for c in made], 1))
        qzeros.append(torch.cat([c["qzeros"] for c in made], 1))
        scales.append(torch.cat([c["scales"] for c in made], 1))
        if g_idx != "none":
            groups.append(torch.stack([c["g_idx"] for c in made]))
        dense.append(torch.cat([rg.dequant_ref(c["qweight"], c["qzeros"], c["scales"], c["g_idx"],
                                               group_size=group_size, checkpoint_format=fmt) for c in made], 1))
    stacked = [torch.stack(t).to(device) for t in (qweight, qzeros, scales)]
    return (*stacked, torch.stack(groups).to(device) if groups else None, torch.stack(dense).to(device))


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] in [0, 16) -> int32 [R, C / 8] in AutoAWQ's order: nibble i of word j holds column 8j + order[i]."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for nibble, column in enumerate(AWQ_ORDER):
        words |= values[:, column::8].long() << (4 * nibble)
    return (words - ((words >> 31) << 32)).to(torch.int32)


def awq_experts(experts: int, k: int, n: int, *, zeros=True, group_size=128, dtype=torch.float16):
    """(qweight [E, K, N/8], qzeros [E, G, N/8] or None (symmetric: every zero 8), scales, dense fp32 [E, K, N])."""
    groups = k // group_size
    q = torch.randint(0, 16, (experts, k, n))
    zero = torch.randint(0, 16, (experts, groups, n)) if zeros else torch.full((experts, groups, n), 8)
    scales = ((torch.rand(experts, groups, n) + 0.5) * 0.01).to(dtype)
    rows = torch.arange(k) // group_size
    dense = (q - zero[:, rows]).float() * scales.float()[:, rows]
    qweight = torch.stack([pack_awq(q[e]) for e in range(experts)])
    qzeros = torch.stack([pack_awq(zero[e]) for e in range(experts)]) if zeros else None
    return qweight, qzeros, scales, dense


def gptq_layer(experts=4, hidden=256, inter=128, **kw):
    """(w13, w2) prepared, and their dense fp32 [E, H, 2I], [E, I, H]."""
    qw, qz, s, g, dense13 = gptq_experts(experts, hidden, 2 * inter, 2, **kw)
    qw2, qz2, s2, g2, dense2 = gptq_experts(experts, inter, hidden, 1, **kw)
    opts = dict(group_size=kw.get("group_size", 128), checkpoint_format=kw.get("fmt", "gptq"))
    w13 = kdsl.ops.gptq_moe_prepare(qw, qz, s, g, **opts)
    w2 = kdsl.ops.gptq_moe_prepare(qw2, qz2, s2, None if g2 is None else g2[:, 0], **opts)
    return w13, w2, dense13, dense2


def check_layer(w13, w2, dense13, dense2, tokens, topk, skew=0.0):
    experts, hidden, dtype = w13.experts, w13.k, w13.dtype
    topk_weights, topk_ids = routing(tokens, experts, topk, skew)
    x = torch.randn(tokens, hidden).to(dtype)
    y = kdsl.ops.moe_w4a16(x, w13, w2, topk_weights, topk_ids)
    assert y.dtype == dtype and y.shape == (tokens, hidden)
    ref = moe_dense_ref(x, dense13, dense2, topk_weights, topk_ids)
    assert torch.isfinite(y).all()
    err = rel_fro_error(y, ref)
    assert err < LIMITS[dtype], f"relative error {err:.3g} over {LIMITS[dtype]}"
    return y


def expect_kernel(launched: list[str], name_part: str):
    if interpreting():
        assert launched and all(name_part in name for name in launched), launched
    else:
        assert launched == []


# --- the layer against the reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, sym, g_idx, dtype", [
    ("gptq", False, "default", torch.float16),
    ("gptq_v2", False, "none", torch.bfloat16),
    ("gptq", True, "default", torch.bfloat16),
    ("gptq", False, "perm", torch.float16),     # act-order: every expert (and gate, up) its own permutation
], ids=["v1-asym-fp16", "v2-asym-bf16", "v1-sym-bf16", "v1-act-order"])
def test_gptq_experts_match_reference(fmt, sym, g_idx, dtype, launched):
    # I = 256: two groups in the down projection, so its act-order permutation is not the identity either
    w13, w2, dense13, dense2 = gptq_layer(4, 256, 256, fmt=fmt, sym=sym, g_idx=g_idx, dtype=dtype)
    assert w13.source == fmt and w13.scheme == "w4a16.int4.g128" and w13.dtype == dtype
    assert (w13.perm is not None, w2.perm is not None) == ((True, True) if g_idx == "perm" else (False, False))
    if g_idx == "perm":
        assert w13.perm.shape == (4, 2, 256) and w2.perm.shape == (4, 1, 256)
    check_layer(w13, w2, dense13, dense2, tokens=5, topk=2, skew=0.5)
    expect_kernel(launched, MOE)


def test_one_group_over_k(launched):
    """group_size -1 (one group over all of K): served by the gall kernels."""
    w13, w2, dense13, dense2 = gptq_layer(3, 256, 128, group_size=-1)
    assert w13.scheme == "w4a16.int4.gall"
    check_layer(w13, w2, dense13, dense2, tokens=3, topk=2)
    expect_kernel(launched, "moe_w4a16__int4_gall__sorted")


def test_group_32_inside_a_k_tile():
    """group_size 32 is smaller than the tiles' K blocks: each row looks its group up."""
    w13, w2, dense13, dense2 = gptq_layer(2, 256, 128, group_size=32, fmt="gptq_v2", dtype=torch.bfloat16)
    check_layer(w13, w2, dense13, dense2, tokens=3, topk=2)


@pytest.mark.parametrize("zeros", [True, False], ids=["zero-point", "symmetric-no-qzeros"])
def test_awq_experts_match_reference(zeros, launched):
    hidden, inter, experts = 256, 128, 4
    qw, qz, s, dense13 = awq_experts(experts, hidden, 2 * inter, zeros=zeros)
    qw2, qz2, s2, dense2 = awq_experts(experts, inter, hidden, zeros=zeros)
    w13 = kdsl.ops.awq_moe_prepare(qw, qz, s)
    w2 = kdsl.ops.awq_moe_prepare(qw2, qz2, s2)
    assert w13.source == "awq" and w13.perm is None and w13.qweight.shape == (experts, hidden // 8, 2 * inter)
    check_layer(w13, w2, dense13, dense2, tokens=4, topk=2)
    expect_kernel(launched, MOE)


# Tokens per routed expert ceil(T k / min(T k, E)) picks the sm_80 tile: <= 8 the 16-row tile, <= 32 the 32-row one,
# <= 64 the 64-row one, above the 128-row prefill tile.
@pytest.mark.parametrize("tokens, experts, topk", [(40, 4, 2), (70, 4, 3), (140, 2, 2)],
                         ids=["t40-32rows", "t70-64rows", "t140-prefill"])
def test_larger_tiles(tokens, experts, topk, monkeypatch):
    calls = []
    entry = registry.select("moe_w4a16", "w4a16.int4.g128", arch="sm_89")
    wrap_launch(monkeypatch, entry.modules[entry.impl],
                lambda original: lambda *args: calls.append(args[-1]["BLOCK_M"]) or original(*args))
    w13, w2, dense13, dense2 = gptq_layer(experts, 256, 128, dtype=torch.bfloat16)
    check_layer(w13, w2, dense13, dense2, tokens, topk)
    want = {40: 32, 70: 64, 140: 128}[tokens]
    assert calls == ([want] if interpreting() else [])


def test_hopper_tiles(monkeypatch, launched):
    use_arch(monkeypatch, "sm_90")
    w13, w2, dense13, dense2 = gptq_layer(2, 256, 128, g_idx="perm")
    check_layer(w13, w2, dense13, dense2, tokens=3, topk=2)
    expect_kernel(launched, MOE + "_sm90")


def test_act_order_one_permutation_for_gate_and_up_and_k_not_a_power_of_two():
    """One g_idx for all of w13 (S = 1: gate and up read one gathered copy of x), H = 384 (the gather pads K to
    512 and masks the rest), prefill-sized routing (the 128-row tile)."""
    hidden, inter, experts = 384, 128, 3
    qw, qz, s, g, dense13 = gptq_experts(experts, hidden, 2 * inter, 1, g_idx="perm")
    qw2, qz2, s2, g2, dense2 = gptq_experts(experts, inter, hidden, 1, g_idx="perm")
    w13 = kdsl.ops.gptq_moe_prepare(qw, qz, s, g[:, 0])
    w2 = kdsl.ops.gptq_moe_prepare(qw2, qz2, s2, g2[:, 0])
    assert w13.perm.shape == (experts, 1, hidden) and w2.perm is None  # one group over I: nothing to sort
    check_layer(w13, w2, dense13, dense2, tokens=3, topk=2)
    check_layer(w13, w2, dense13, dense2, tokens=140, topk=2)


def _sorted_generated():
    """The sm_89 moe_w4a16 module as its unit's host code reads it."""
    entry = registry.select("moe_w4a16", "w4a16.int4.g128", arch="sm_89")
    return entry.modules[entry.impl].generated()


@pytest.mark.skipif(not interpreting(), reason="calls the generated module's gather kernel on CPU tensors")
@pytest.mark.parametrize("segments, k", [(2, 256), (1, 200)], ids=["gate-up-2-perms", "k-200-padded"])
def test_gather_writes_each_sorted_row_in_its_experts_order(segments, k):
    """The act-order gather kernel, on its own: every sorted row of a routed expert is x[token] (or the sorted row
    of h) through that expert's permutation, bit for bit; padding rows are left alone."""
    generated = _sorted_generated()
    tokens, experts, topk, block_m = 5, 3, 2, 16
    _, topk_ids = routing(tokens, experts, topk, 0.5)
    x = torch.randn(tokens, k).half()
    perm = torch.stack([torch.stack([torch.randperm(k) for _ in range(segments)]) for _ in range(experts)])
    perm = perm.to(torch.int32)
    rows, block_expert, meta, max_rows = run_described(route(generated, topk_ids, experts, block_m, None))[:4]
    gathered, launch = moe_sorted._gather(generated, x, perm, rows, block_expert, meta, topk, block_m, by_token=True)
    run_described(launch)
    assert gathered.shape == (segments, max_rows, k)
    h = torch.randn(max_rows, k).half()
    gathered_h, launch = moe_sorted._gather(generated, h, perm, rows, block_expert, meta, topk, block_m,
                                            by_token=False)
    run_described(launch)
    live = 0
    for p in range(int(meta[0])):
        assignment = int(rows[p])
        if assignment < 0:
            continue
        live += 1
        e = int(block_expert[p // block_m])
        assert e == int(topk_ids.flatten()[assignment])
        for s in range(segments):
            assert torch.equal(gathered[s, p], x[assignment // topk, perm[e, s].long()])
            assert torch.equal(gathered_h[s, p], h[p, perm[e, s].long()])
    assert live == tokens * topk


def test_act_order_gathers_once_and_the_gemms_read_rows_contiguously(monkeypatch):
    """With act-order the GEMMs take the gathered rows (GATHERED) and no permutation; the gather runs once before
    each GEMM whose projection has one (x with both of gate and up's permutations, h with down's)."""
    if not interpreting():
        pytest.skip("watches the generated module's kernel launches")
    seen = []
    gather = moe_sorted._gather

    def watched(generated, src, perm, *args, by_token):
        seen.append((tuple(perm.shape), by_token))
        return gather(generated, src, perm, *args, by_token=by_token)

    monkeypatch.setattr(moe_sorted, "_gather", watched)
    w13, w2, dense13, dense2 = gptq_layer(2, 256, 256, g_idx="perm")
    check_layer(w13, w2, dense13, dense2, tokens=3, topk=2)
    assert seen == [((2, 2, 256), True), ((2, 1, 256), False)]
    seen.clear()
    w13, w2, dense13, dense2 = gptq_layer(2, 256, 128)
    check_layer(w13, w2, dense13, dense2, tokens=3, topk=2)
    assert seen == []


def test_ragged_routing_repeated_ids_and_strided_inputs():
    """Experts never routed to, a token naming one expert twice (each slot counts), x and the routing as views."""
    w13, w2, dense13, dense2 = gptq_layer(6, 256, 128)
    topk_ids = torch.tensor([[0, 1, 2], [0, 0, 1], [1, 3, 0], [2, 0, 1]], dtype=torch.int32)
    topk_weights = torch.rand(4, 3)
    x = torch.randn(4, 256).half()
    wide = torch.zeros(4, 512, dtype=torch.float16)
    wide[:, 128:384] = x
    y = kdsl.ops.moe_w4a16(wide[:, 128:384], w13, w2, topk_weights.t().contiguous().t(),
                           topk_ids.t().contiguous().t())
    ref = moe_dense_ref(x, dense13, dense2, topk_weights, topk_ids)
    assert rel_fro_error(y, ref) < LIMITS[torch.float16]


def test_empty_inputs():
    w13, w2, _, _ = gptq_layer(2, 256, 128)
    y = kdsl.ops.moe_w4a16(torch.empty(0, 256).half(), w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32))
    assert y.shape == (0, 256) and y.dtype == torch.float16
    y = kdsl.ops.moe_w4a16(torch.randn(3, 256).half(), w13, w2, torch.empty(3, 0), torch.empty(3, 0, dtype=torch.int32))
    assert torch.equal(y, torch.zeros(3, 256, dtype=torch.float16))


@pytest.mark.parametrize("bad", ["E", -1])
@pytest.mark.parametrize("tokens, experts", [(5, 4), (2, 16)], ids=["sorted", "one-per-block"])
def test_refuses_bad_topk_ids_by_name(bad, tokens, experts):
    """Refused by name with the routing kernel and without it (T * k * 4 <= E: each assignment a block)."""
    bad = experts if bad == "E" else bad
    w13, w2, dense13, dense2 = gptq_layer(experts, 256, 128)
    x = torch.randn(tokens, 256).half()
    topk_weights, topk_ids = routing(tokens, experts, 2)
    topk_ids[tokens - 1, 1] = bad
    with pytest.raises(ValueError, match=rf"topk_ids: expected expert ids \(w13 has {experts} experts\) in "
                                         rf"\[0, {experts}\), got 1 outside \(first: {bad}\)"):
        kdsl.ops.moe_w4a16(x, w13, w2, topk_weights, topk_ids)
    y = kdsl.ops.moe_w4a16(x, w13, w2, topk_weights, topk_ids, check_ids=False)  # the slot adds nothing
    assert rel_fro_error(y, moe_dense_ref(x, dense13, dense2, topk_weights, topk_ids)) < LIMITS[torch.float16]


def test_routing_paths_agree_bit_for_bit(monkeypatch):
    """The same call with the routing kernel and without it (one block per assignment) agrees bit for bit."""
    from kdsl.kernels.w4a16 import moe_sorted
    w13, w2, _, _ = gptq_layer(16, 256, 128)
    x = torch.randn(2, 256).half()
    topk_weights, topk_ids = routing(2, 16, 2)
    unsorted = kdsl.ops.moe_w4a16(x, w13, w2, topk_weights, topk_ids)
    monkeypatch.setattr(moe_sorted, "one_per_block", lambda assignments, experts: False)
    assert torch.equal(unsorted, kdsl.ops.moe_w4a16(x, w13, w2, topk_weights, topk_ids))


def test_one_block_per_assignment_with_an_expert_shared_by_tokens():
    """T * k * 4 <= E: no routing kernel; an expert two tokens route to is computed once per block."""
    w13, w2, dense13, dense2 = gptq_layer(16, 256, 128)
    x = torch.randn(2, 256).half()
    topk_ids = torch.tensor([[3, 5], [5, 3]], dtype=torch.int32)
    topk_weights = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    y = kdsl.ops.moe_w4a16(x, w13, w2, topk_weights, topk_ids)
    assert rel_fro_error(y, moe_dense_ref(x, dense13, dense2, topk_weights, topk_ids)) < LIMITS[torch.float16]


def test_torch_fallback_matches_the_reference(monkeypatch, launched):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w13, w2, dense13, dense2 = gptq_layer(4, 256, 256, g_idx="perm", fmt="gptq_v2")
    check_layer(w13, w2, dense13, dense2, tokens=7, topk=2, skew=0.5)
    assert launched == []
    x = torch.randn(2, 256).half()
    topk_weights, topk_ids = routing(2, 4, 2)
    topk_ids[0, 0] = 9
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids"):
        kdsl.ops.moe_w4a16(x, w13, w2, topk_weights, topk_ids)


# --- refusals naming the argument --------------------------------------------------------------------------------

def test_prepare_refuses_bad_checkpoints_by_name():
    qw, qz, s, g, _ = gptq_experts(2, 256, 64, g_idx="perm")
    with pytest.raises(ValueError, match=r"qzeros: expected shape \(2, 2, 8\)"):
        kdsl.ops.gptq_moe_prepare(qw, qz[:, :1], s, g)
    with pytest.raises(ValueError, match=r"scales: expected shape \(2, 2, 64\)"):
        kdsl.ops.gptq_moe_prepare(qw, qz, s[:, :, :32], g)
    with pytest.raises(ValueError, match=r"g_idx: expected shape \(2, 256\) or \(2, S, 256\)"):
        kdsl.ops.gptq_moe_prepare(qw, qz, s, g[:, :, :128])
    with pytest.raises(ValueError, match=r"g_idx: values must lie in \[0, 2\)"):
        kdsl.ops.gptq_moe_prepare(qw, qz, s, g + 1)
    lopsided = g.clone()
    lopsided[1, 0] = (torch.arange(256) >= 200).to(torch.int32)  # expert 1: 200 rows in group 0, 56 in group 1
    with pytest.raises(ValueError, match=r"g_idx: expert 1 has groups of \[56, 200\] rows; moe_w4a16 needs every "
                                         r"group to hold group_size = 128 rows"):
        kdsl.ops.gptq_moe_prepare(qw, qz, s, lopsided)
    with pytest.raises(TypeError, match=r"qweight: expected dtype int32, got int64"):
        kdsl.ops.gptq_moe_prepare(qw.long(), qz, s, g)
    with pytest.raises(ValueError, match=r"qweight: expected 3 dimensions"):
        kdsl.ops.gptq_moe_prepare(qw[0], qz, s, g)
    with pytest.raises(ValueError, match=r"checkpoint_format: expected 'gptq' or 'gptq_v2'"):
        kdsl.ops.gptq_moe_prepare(qw, qz, s, g, checkpoint_format="awq")
    with pytest.raises(registry.SchemeNotServedError, match=r"moe_w4a16: bits = 4, group_size = 256 selects scheme "
                                                            r"w4a16.int4.g256, which no generated kernel serves"):
        kdsl.ops.gptq_moe_prepare(qw, qz[:, :1], s[:, :1], None, group_size=256)
    aw, az, as_, _ = awq_experts(2, 256, 64)
    with pytest.raises(ValueError, match=r"qzeros: expected shape \(2, 2, 8\)"):
        kdsl.ops.awq_moe_prepare(aw, az[:, :1], as_)
    with pytest.raises(ValueError, match=r"group_size: expected a power of two >= 16, got -1"):
        kdsl.ops.awq_moe_prepare(aw, az, as_, group_size=-1)


def _layer_args(**change):
    w13, w2, _, _ = gptq_layer(3, 256, 128)
    topk_weights, topk_ids = routing(4, 3, 2)
    args = dict(x=torch.randn(4, 256).half(), w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    return {**args, **{name: fn(args) for name, fn in change.items()}}


@pytest.mark.parametrize("change, error, match", [
    (dict(x=lambda a: a["x"].bfloat16()), TypeError, r"x: expected dtype float16 \(the experts were prepared"),
    (dict(x=lambda a: a["x"][:, :128]), ValueError, r"w13: expected K = 128 \(x's hidden size H\)"),
    (dict(w13=lambda a: a["w13"].qweight), TypeError, r"w13: expected experts from kdsl.ops.gptq_moe_prepare"),
    (dict(w2=lambda a: a["w13"]), ValueError, r"w2: expected 3 experts with K = 128 \(I, from w13\) and N = 256"),
    (dict(w2=lambda a: gptq_layer(3, 256, 128, dtype=torch.bfloat16)[1]), ValueError,
     r"w2: prepared as w4a16.int4.g128 .* bfloat16, but w13 as w4a16.int4.g128 .* float16"),
    (dict(topk_ids=lambda a: a["topk_ids"].long()), TypeError, r"topk_ids: expected dtype int32, got int64"),
    (dict(topk_ids=lambda a: a["topk_ids"][:3]), ValueError, r"topk_ids: expected shape \(4, k\)"),
    (dict(topk_weights=lambda a: a["topk_weights"].half()), TypeError, r"topk_weights: expected dtype float32"),
    (dict(topk_weights=lambda a: a["topk_weights"][:, :1]), ValueError, r"topk_weights: expected shape \(4, 2\)"),
], ids=["x-dtype", "hidden", "w13-type", "w2-shape", "w2-dtype", "ids-int64", "ids-rows", "weights-fp16",
        "weights-shape"])
def test_refuses_bad_arguments_by_name(change, error, match):
    with pytest.raises(error, match=match):
        kdsl.ops.moe_w4a16(**_layer_args(**change))


def test_requires_no_grad():
    args = _layer_args()
    args["topk_weights"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="topk_weights: requires grad"):
        kdsl.ops.moe_w4a16(**args)


# --- registry -----------------------------------------------------------------------------------------------------

def test_registry_serves_sm80_up_and_picks_hopper_tiles():
    assert registry.select("moe_w4a16", "w4a16.int4.g128", arch="sm_80").name == MOE + "_sm80"
    assert registry.select("moe_w4a16", "w4a16.int4.g128", arch="sm_89").name == MOE + "_sm80"
    assert registry.select("moe_w4a16", "w4a16.int4.g128", arch="sm_90").name == MOE + "_sm90"
    assert registry.select("moe_w4a16", "w4a16.int4.g128", arch="sm_100").name == MOE + "_sm80"
    entry = registry.select("moe_w4a16", "w4a16.int4.g128", arch="sm_90")
    assert entry.tile_for(1)["BLOCK_M"] == 16 and entry.tile_for(256)["BLOCK_M"] == 128
    assert "CHOSEN" in registry.explain("moe_w4a16", arch="sm_90", m=4)
    with pytest.raises(registry.NoKernelError, match="needs sm_80 or newer"):
        registry.select("moe_w4a16", "w4a16.int4.g128", arch=75)


def test_layout_must_be_checkpoint_words():
    from kdsl.schema import parse_definition
    text = """
[[schemes]]
kind = "w4a16"

[[variants]]
op = "moe_w4a16"
impl = "sorted"
min_arch = "sm_90"
max_arch = "sm_90"
layout = { zeros = "paired", weights = "k_planes" }
tiles = [{ block_m = 16, block_n = 64, block_k = 128 }]
"""
    with pytest.raises(Exception, match=r"variants\[0\].tiles\[0\].layout: reads the layout"):
        parse_definition("moe.toml", text)


# --- kdsl.nn.W4A16MoE / W4A16Experts -------------------------------------------------------------------------------

def _projection(parts_k_n, **kw):
    qweight, qzeros, scales, g_idx, dense = gptq_experts(*parts_k_n, **kw)
    g_idx = None if g_idx is None else g_idx[:, 0]
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}, dense


def test_w4a16_moe_module_from_gptq_tensors(launched):
    """gate, up and down as a checkpoint stores them (each with its own act-order g_idx), stacked over experts."""
    experts, hidden, inter = 3, 256, 256
    gate, dense_gate = _projection((experts, hidden, inter), g_idx="perm")
    up, dense_up = _projection((experts, hidden, inter), g_idx="perm")
    down, dense_down = _projection((experts, inter, hidden), g_idx="perm")
    layer = kdsl.nn.W4A16MoE.from_gptq(gate, up, down, kdsl.GPTQ(group_size=128, desc_act=True))
    assert layer.w13_perm.shape == (experts, 2, hidden) and layer.w2_perm.shape == (experts, 1, inter)
    assert "num_experts=3" in repr(layer) and "act_order=True" in repr(layer) and "moe_w4a16__" in repr(layer)
    x = torch.randn(2, 3, hidden).half()
    topk_weights, topk_ids = routing(6, experts, 2)
    with torch.no_grad():
        y = layer.bfloat16()(x, topk_weights.view(2, 3, 2), topk_ids.view(2, 3, 2))
    assert layer.w13_scales.dtype == torch.float16  # .bfloat16() leaves the prepared experts alone
    assert y.shape == (2, 3, hidden)
    ref = moe_dense_ref(x.view(6, hidden), torch.cat([dense_gate, dense_up], 2), dense_down, topk_weights, topk_ids)
    assert rel_fro_error(y.view(6, hidden), ref) < LIMITS[torch.float16]
    expect_kernel(launched, MOE)


def test_w4a16_experts_takes_transformers_call_and_awq():
    experts, hidden, inter = 2, 256, 128
    projections = [awq_experts(experts, k, n, zeros=False, dtype=torch.bfloat16)
                   for k, n in ((hidden, inter), (hidden, inter), (inter, hidden))]
    gate, up, down = ({"qweight": qw, "qzeros": qz, "scales": s} for qw, qz, s, _ in projections)
    layer = kdsl.nn.W4A16Experts.from_awq(gate, up, down, kdsl.AWQ(zero_point=False))
    x = torch.randn(5, hidden).bfloat16()
    topk_weights, topk_ids = routing(5, experts, 2)
    with torch.no_grad():
        y = layer(x, topk_ids.long(), topk_weights.bfloat16())  # transformers' order and dtypes
    dense13 = torch.cat([projections[0][3], projections[1][3]], 2)
    ref = moe_dense_ref(x, dense13, projections[2][3], topk_weights.bfloat16().float(), topk_ids)
    assert rel_fro_error(y, ref) < LIMITS[torch.bfloat16]


def test_w4a16_moe_from_float_is_close_to_the_float_layer():
    experts, hidden, inter = 2, 256, 128
    gate, up = torch.randn(experts, inter, hidden) * 0.06, torch.randn(experts, inter, hidden) * 0.06
    down = torch.randn(experts, hidden, inter) * 0.09
    layer = kdsl.nn.W4A16MoE.from_float(gate.half(), up.half(), down.half())
    x = torch.randn(4, hidden).half()
    topk_weights, topk_ids = routing(4, experts, 2)
    with torch.no_grad():
        y = layer(x, topk_weights, topk_ids)
    # the same round-to-nearest checkpoint (kdsl.ops.gptq_quantize), dequantized apart from kdsl
    def dense(w):
        made = [kdsl.ops.gptq_quantize(w_e.half(), group_size=128) for w_e in w]
        return torch.stack([rg.dequant_ref(m["qweight"], m["qzeros"], m["scales"]) for m in made])  # [E, K, N]

    ref = moe_dense_ref(x, torch.cat([dense(gate), dense(up)], 2), dense(down), topk_weights, topk_ids)
    assert rel_fro_error(y, ref) < LIMITS[torch.float16]
    floats = moe_dense_ref(x, torch.cat([gate, up], 1).transpose(1, 2), down.transpose(1, 2), topk_weights, topk_ids)
    assert rel_fro_error(y, floats) < 0.3  # int4 round-to-nearest, through two GEMMs and the gating


def test_w4a16_moe_module_refuses_mismatched_experts():
    w13, w2, _, _ = gptq_layer(2, 256, 128)
    other13, _, _, _ = gptq_layer(3, 256, 128)
    with pytest.raises(ValueError, match=r"w2: expected 3 experts"):
        kdsl.nn.W4A16MoE(other13, w2)
    with pytest.raises(TypeError, match=r"w2: expected experts from kdsl.ops.gptq_moe_prepare"):
        kdsl.nn.W4A16MoE(w13, w2.qweight)


# --- torch.library: fake kernel, opcheck, torch.compile(fullgraph=True) ------------------------------------------

def _op_args(g_idx="perm"):
    w13, w2, _, _ = gptq_layer(2, 256, 256, g_idx=g_idx)
    topk_weights, topk_ids = routing(3, 2, 2)
    return torch.randn(3, 256).half(), w13, w2, topk_weights, topk_ids


def test_opcheck():
    from kdsl.ops import w4a16_moe
    x, w13, w2, topk_weights, topk_ids = _op_args()
    args = (x, *w4a16_moe.prepared_args(w13, w2), topk_weights, topk_ids, True)
    torch.library.opcheck(torch.ops.kdsl.moe_w4a16.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_compiles_fullgraph_to_one_op():
    x, w13, w2, topk_weights, topk_ids = _op_args(g_idx="default")
    fn = lambda x, tw, ti: kdsl.ops.moe_w4a16(x, w13, w2, tw, ti)  # noqa: E731
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    got = torch.compile(fn, backend=counter, fullgraph=True)(x, topk_weights, topk_ids)
    want = fn(x, topk_weights, topk_ids)
    assert counter.frame_count == 1 and torch.equal(got, want)
    targets = [str(node.target) for node in counter.graphs[0].graph.nodes if node.op == "call_function"]
    assert [t.removesuffix(".default") for t in targets if t.startswith("kdsl.")] == ["kdsl.moe_w4a16"]


# --- GPU (KDSL_TEST_GPU=1 python -m pytest -m gpu tests/test_moe_w4a16.py) ----------------------------------------

def _full_fp32(fn, *args):
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return fn(*args)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@functools.lru_cache(maxsize=2)  # one layer per act-order mode, built once for the cases that share it
def _gpu_layer(experts, hidden, inter, g_idx="none", dtype=torch.bfloat16):
    """A random GPTQ layer built on the device (vectorized: Qwen3-30B-A3B's 128 experts in seconds)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for k, n, parts in ((hidden, 2 * inter, 2), (inter, hidden, 1)):
        groups = k // 128
        q = torch.randint(0, 16, (experts, k, n), device="cuda", generator=gen)
        zero = torch.randint(1, 16, (experts, groups, n), device="cuda", generator=gen)
        scales = ((torch.rand(experts, groups, n, device="cuda", generator=gen) + 0.5) * (2 / k) ** 0.5 / 8).to(dtype)
        shifts = torch.arange(8, device="cuda") * 4
        words = (q.view(experts, k // 8, 8, n) << shifts[None, None, :, None]).sum(2)
        qweight = (words - ((words >> 31) << 32)).to(torch.int32)
        zwords = ((zero - 1).view(experts, groups, n // 8, 8) << shifts).sum(-1)
        qzeros = (zwords - ((zwords >> 31) << 32)).to(torch.int32)
        rows = (torch.arange(k, device="cuda") // 128).to(torch.int32)
        g = None
        if g_idx == "perm":  # act-order: each expert and each of gate / up its own permutation
            g = torch.stack([torch.stack([rows[torch.randperm(k, device="cuda", generator=gen)]
                                          for _ in range(parts)]) for _ in range(experts)])
            groups_of = g.repeat_interleave(n // parts, dim=1).transpose(1, 2).long()  # [E, K, N]
        else:
            groups_of = rows.long()[None, :, None].expand(experts, k, n)
        dense = (q - torch.gather(zero, 1, groups_of)).float() * torch.gather(scales.float(), 1, groups_of)
        prepared = kdsl.ops.gptq_moe_prepare(qweight, qzeros, scales, g)
        layers.append((prepared, dense))
    return layers[0][0], layers[1][0], layers[0][1], layers[1][1]


# Qwen3-30B-A3B (E = 128, top-8): tokens per routed expert 1 (T = 1, 16: the decode tile), 32 (T = 512), 64
# (T = 1024) and 128 (T = 2048: the prefill tile and its PTX unpack); with and without act-order.
@pytest.mark.gpu
@pytest.mark.parametrize("tokens, g_idx", [(1, "none"), (16, "perm"), (512, "none"), (1024, "perm"), (2048, "none"),
                                           (2048, "perm")])
def test_gpu_qwen3_moe_matches_reference(tokens, g_idx):
    w13, w2, dense13, dense2 = _gpu_layer(128, 2048, 768, g_idx)
    topk_weights, topk_ids = routing(tokens, 128, 8, device="cuda")
    x = torch.randn(tokens, 2048, device="cuda").to(torch.bfloat16)
    y = kdsl.ops.moe_w4a16(x, w13, w2, topk_weights, topk_ids)
    ref = _full_fp32(moe_dense_ref, x, dense13, dense2, topk_weights, topk_ids)
    err = rel_fro_error(y, ref)
    assert torch.isfinite(y).all() and err < 1e-2, f"relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("g_idx", ["none", "perm"])  # act-order: the gathered rows' buffers are captured too
def test_gpu_captures_in_a_cuda_graph_and_replays_any_routing(g_idx):
    w13, w2, dense13, dense2 = _gpu_layer(32, 1024, 256, g_idx=g_idx, dtype=torch.float16)
    assert (w13.perm is None) == (g_idx == "none")
    x = torch.randn(16, 1024, device="cuda").half()
    topk_weights, topk_ids = routing(16, 32, 4, device="cuda")
    kdsl.ops.moe_w4a16(x, w13, w2, topk_weights, topk_ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kdsl.ops.moe_w4a16(x, w13, w2, topk_weights, topk_ids)
    for skew in (0.0, 0.5):
        new_weights, new_ids = routing(16, 32, 4, skew, device="cuda")
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        err = rel_fro_error(y, _full_fp32(moe_dense_ref, x, dense13, dense2, topk_weights, topk_ids))
        assert err < 5e-3, f"skew {skew}: relative error {err:.3g}"
