"""kdsl.parallel.ParallelMLP and the collectives under the parallel layers, on torch.distributed (gloo, 2 spawned
CPU processes), against the one-rank quantized MLP down(silu(gate(x)) * up(x)).

ParallelMLP computes h = silu(gate) * up in one kernel (fused_act: kdsl.ops.silu_mul_quant for FP8, which hands down
h already quantized, silu_mul for int4), in fp32 rounded once; the one-rank reference does the same in torch
(mlp_ref). Where the kernel does not run (two GEMMs, fused_act = False), torch's silu and mul in the activation
dtype, each rounded, as before: an e4m3 code of h is a 1/8 step, so the two orders are not interchangeable.

One spawn runs every case on the ops' torch fallbacks; a second runs the FP8 and GPTQ act-order MLPs on the
generated kernels through Triton's interpreter.
"""
import os
import tempfile
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import kdsl
from kdsl.nn import FP8Linear, W4A16Linear
from kdsl.parallel import ColumnParallelLinear, ParallelMLP, RowParallelLinear, comm
from kdsl.schema import GPTQ, BlockFP8
from kdsl.schema.scheme import AWQ
from test_parallel import awq_layer, check_close, fp8_layer, gptq_layer

WORLD = 2
H, I = 256, 512  # hidden, intermediate: I / 2 = 256 is whole 128-blocks (FP8 row shards need it)


def one_rank(kind, t, scheme):
    if kind == "fp8":
        return FP8Linear(t["weight"], t["weight_scale_inv"], t.get("bias"), scheme)
    if kind == "gptq":
        return W4A16Linear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), t.get("bias"), scheme)
    return W4A16Linear.from_awq(t["qweight"], t["qzeros"], t["scales"], t.get("bias"), scheme)


def reference(kind, tensors, scheme, x, fused=True):
    gate, up, down = (one_rank(kind, tensors[role], scheme) for role in ("gate", "up", "down"))
    return mlp_ref(gate, up, down, x, fused)


def mlp_ref(gate, up, down, x, fused=True):
    """The one-rank MLP. fused: h = silu(gate(x)) * up(x) in fp32, rounded once: an FP8 down quantizes the fp32 h
    (what silu_mul_quant hands it), an int4 down reads h rounded to x's dtype (silu_mul). Not fused: torch's silu
    and mul in x's dtype."""
    if not fused:
        return down(F.silu(gate(x)) * up(x))
    h = F.silu(gate(x).float()) * up(x).float()
    return down(h).to(x.dtype) if isinstance(down, FP8Linear) else down(h.to(x.dtype))


class OpSpy:
    """Records the last dimension of each call of the named kdsl.ops functions (what ParallelMLP and FP8Linear
    look up at call time)."""

    def __init__(self, *names):
        self.names, self.calls, self.saved = names, [], {}

    def __enter__(self):
        for name in self.names:
            original = self.saved[name] = getattr(kdsl.ops, name)

            def wrapped(x, *args, _name=name, _original=original, **kwargs):
                self.calls.append((_name, x.shape[-1]))
                return _original(x, *args, **kwargs)

            setattr(kdsl.ops, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(kdsl.ops, name, original)


def mlp_tensors(kind, seed, **kw):
    if kind == "fp8":
        return {"gate": fp8_layer(I, H, seed), "up": fp8_layer(I, H, seed + 1), "down": fp8_layer(H, I, seed + 2)}
    if kind == "awq":
        return {"gate": awq_layer(I, H, seed), "up": awq_layer(I, H, seed + 1), "down": awq_layer(H, I, seed + 2)}
    t = {"gate": gptq_layer(I, H, seed, **kw), "up": gptq_layer(I, H, seed + 1, **kw),
         "down": gptq_layer(H, I, seed + 2, **kw)}
    return t


def build(kind, tensors, scheme, **kw):
    return {"fp8": ParallelMLP.from_fp8, "gptq": ParallelMLP.from_gptq, "awq": ParallelMLP.from_awq}[kind](
        tensors["gate"], tensors["up"], tensors["down"], scheme=scheme, **kw)


class Spy:
    """Counts calls of torch.distributed collectives and records the dtypes they carry."""

    def __init__(self, *names):
        self.names, self.calls, self.saved = names, [], {}

    def __enter__(self):
        for name in self.names:
            original = self.saved[name] = getattr(dist, name)

            def wrapped(tensor, *args, _name=name, _original=original, **kwargs):
                self.calls.append((_name, tensor.dtype))
                return _original(tensor, *args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def _reduce_dtypes_carried(rank):
    """The partials reach comm.all_reduce_ in the activation dtype (fp16 here; gloo carries bf16 as fp32)
    or in float32 on request; an FP8 row shard never converts x to float32 (act_quant reads bf16)."""
    seen, original = [], comm.all_reduce_
    comm.all_reduce_ = lambda t, *a, **k: (seen.append(t.dtype), original(t, *a, **k))[1]
    try:
        t = mlp_tensors("gptq", 40, group_size=32)
        x = torch.randn(3, H, generator=torch.Generator().manual_seed(41)).half()
        for reduce_dtype, carried in ((None, torch.float16), (torch.float32, torch.float32)):
            seen.clear()
            build("gptq", t, GPTQ(group_size=32, desc_act=True), reduce_dtype=reduce_dtype)(x)
            assert seen == [carried], (reduce_dtype, seen)
        fp8 = fp8_layer(H, I, 42)
        row = RowParallelLinear.from_fp8(fp8["weight"], fp8["weight_scale_inv"], None, input_is_parallel=True,
                                         reduce_dtype=torch.float32)
        quantized, act_quant = [], kdsl.ops.act_quant
        kdsl.ops.act_quant = lambda x, *a, **k: (quantized.append(x.dtype), act_quant(x, *a, **k))[1]
        try:
            seen.clear()
            row(torch.randn(3, I // WORLD).bfloat16())
        finally:
            kdsl.ops.act_quant = act_quant
        assert quantized == [torch.bfloat16] and seen == [torch.float32], (quantized, seen)
    finally:
        comm.all_reduce_ = original


def _column_gathers_once(rank):
    """Gathered: one all_gather_into_tensor per call, whatever the leading dims (3-D x, M = 1); sharded: none."""
    t = fp8_layer(576, 256, 43)  # off the 128 grid at TP = 2: rank 1's shard carries padding rows
    whole = one_rank("fp8", t, BlockFP8())
    for gather in (True, False):
        layer = ColumnParallelLinear.from_fp8(t["weight"], t["weight_scale_inv"], t["bias"], gather_output=gather)
        for shape in ((2, 3, 256), (1, 256)):
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(44)).bfloat16()
            with Spy("all_gather_into_tensor", "all_gather", "all_reduce") as spy:
                y = layer(x)
            expected = whole(x) if gather else whole(x)[..., rank * 288:(rank + 1) * 288]
            assert y.is_contiguous()
            check_close(y, expected, f"column gather={gather} x {shape} rank {rank}")
            assert [c[0] for c in spy.calls] == (["all_gather_into_tensor"] if gather else []), spy.calls


def _mlp_cases(rank, interpret):
    fp8, gptq32 = BlockFP8(), GPTQ(group_size=32, desc_act=True)
    x_bf16 = torch.randn(3, H, generator=torch.Generator().manual_seed(7)).bfloat16()
    x_fp16 = x_bf16.half()
    # gate and up of a GPTQ act-order checkpoint share g_idx (both quantize the same input): one GEMM
    shared = mlp_tensors("gptq", 10, group_size=32)
    shared["up"]["g_idx"] = shared["gate"]["g_idx"]
    cases = [("fp8", mlp_tensors("fp8", 0), fp8, x_bf16, True),
             ("gptq", shared, gptq32, x_fp16, True)]
    if not interpret:
        cases += [("gptq", mlp_tensors("gptq", 20, group_size=32), gptq32, x_fp16, False),  # g_idx differ: 2 GEMMs
                  ("gptq", mlp_tensors("gptq", 25, act_order=False), GPTQ(), x_fp16, True),
                  ("awq", mlp_tensors("awq", 30), AWQ(), x_fp16, True)]
    for kind, tensors, scheme, x, fused in cases:
        expected = {act: reference(kind, tensors, scheme, x, act) for act in (True, False)}
        for reduce_dtype in (None, torch.float32):
            what = f"{kind} {scheme.name} MLP reduce={reduce_dtype} TP={WORLD} rank {rank}"
            mlp = build(kind, tensors, scheme, reduce_dtype=reduce_dtype)
            assert (mlp.up is None) == fused, what
            assert mlp.fused_act == fused, what  # the kernel runs wherever gate and up are one GEMM
            assert mlp.hidden_size == H and mlp.intermediate_size == I
            with Spy("all_reduce", "all_gather_into_tensor", "all_gather") as spy, \
                    OpSpy("silu_mul_quant", "silu_mul", "act_quant") as ops_spy:
                y = mlp(x)
            assert [c[0] for c in spy.calls] == ["all_reduce"], (what, spy.calls)  # one all-reduce, no gather
            # h's one kernel, on gate_up's [M, 2 I / T]; no act_quant of h (FP8: down takes silu_mul_quant's codes)
            act = ("silu_mul_quant" if kind == "fp8" else "silu_mul", 2 * I // WORLD)
            assert [c for c in ops_spy.calls if c[1] != H] == ([act] if fused else []), (what, ops_spy.calls)
            check_close(y, expected[fused], what)
            check_close(mlp(x.unsqueeze(0)), expected[fused].unsqueeze(0), what + " (3-D x)")
            if fused:  # the same weights with torch's silu and mul: the unfused reference
                mlp.fused_act = False
                check_close(mlp(x), expected[False], what + " (fused_act = False)")


def _from_float(rank):
    """ParallelMLP.from_float equals the one-rank MLP that kdsl.quantize_ makes of the same nn.Linear layers."""
    torch.manual_seed(50)  # the same float layers on every rank
    for scheme, dtype in ((BlockFP8(), torch.bfloat16), (GPTQ(group_size=64), torch.float16), (AWQ(), torch.float16)):
        layers = {"gate": nn.Linear(H, I, bias=False), "up": nn.Linear(H, I, bias=False), "down": nn.Linear(I, H)}
        layers = {role: linear.to(dtype) for role, linear in layers.items()}
        x = torch.randn(4, H, generator=torch.Generator().manual_seed(51)).to(dtype)
        quantized = {}
        for role, linear in layers.items():  # quantize_ replaces in place: quantize copies
            copy = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None).to(dtype)
            copy.load_state_dict(linear.state_dict())
            quantized[role] = kdsl.quantize_(copy, scheme)
        expected = mlp_ref(quantized["gate"], quantized["up"], quantized["down"], x)
        mlp = ParallelMLP.from_float(layers["gate"], layers["up"], layers["down"], scheme)
        check_close(mlp(x), expected, f"from_float {scheme.name} rank {rank}")


def _symm_mem_falls_back(rank):
    """all_reduce='symm_mem' where it cannot run (CPU tensors, gloo): NCCL's path (here gloo), one warning."""
    t = mlp_tensors("fp8", 60)
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(61)).bfloat16()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = build("fp8", t, BlockFP8(), all_reduce="symm_mem")(x)
    assert any("symm_mem' unavailable" in str(w.message) for w in caught), [str(w.message) for w in caught]
    check_close(y, reference("fp8", t, BlockFP8(), x), f"symm_mem fallback rank {rank}")
    with pytest.raises(ValueError, match="all_reduce: expected one of 'nccl', 'symm_mem', got 'mpi'"):
        build("fp8", t, BlockFP8(), all_reduce="mpi")
    bad = dict(t, up={**t["up"], "weight": t["up"]["weight"][:128]})
    with pytest.raises(ValueError, match=r"up.weight: expected shape \(512, 256\)"):
        build("fp8", bad, BlockFP8())


def _worker(rank, world, init_file, interpret):
    if not interpret:
        os.environ.pop("TRITON_INTERPRET", None)  # the ops read it per call: torch fallbacks
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        with torch.no_grad():
            _mlp_cases(rank, interpret)
            if not interpret:
                _reduce_dtypes_carried(rank)
                _column_gathers_once(rank)
                _from_float(rank)
                _symm_mem_falls_back(rank)
    finally:
        dist.destroy_process_group()


def spawn(interpret):
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(WORLD, os.path.join(folder, "store"), interpret), nprocs=WORLD, join=True)


def test_parallel_mlp_matches_one_rank():
    """FP8, GPTQ act-order (gate and up fused, and not where their g_idx differ), plain GPTQ and AWQ MLPs with
    one all-reduce and no gather, reduced in the activation dtype and in float32; from_float against
    kdsl.quantize_; the dtypes the reduction carries; the column layer's one all_gather_into_tensor; the
    symm_mem option's fallback off CUDA."""
    spawn(interpret=False)


def test_parallel_mlp_through_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set by conftest on the CPU)")
    spawn(interpret=True)
