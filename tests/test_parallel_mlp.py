"""kdsl.parallel.ParallelMLP and the collectives under the parallel layers, on torch.distributed (gloo, 2 spawned
CPU processes), against the one-rank quantized MLP down(silu(gate(x)) * up(x)).

ParallelMLP computes h = silu(gate) * up in one kernel (fused_act: kdsl.ops.silu_mul_quant for FP8, which hands down
h already quantized, silu_mul for int4), in fp32 rounded once; the one-rank reference does the same in torch
(mlp_ref). Where the kernel does not run (two GEMMs, fused_act = False), torch's silu and mul in the activation
dtype, each rounded, as before: an e4m3 code of h is a 1/8 step, so the two orders are not interchangeable.

One spawn runs every case on the ops' torch fallbacks; a second runs the FP8 and GPTQ act-order MLPs on the
generated kernels through Triton's interpreter.
"""
import json
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
from kdsl.parallel import ColumnParallelLinear, ParallelMLP, RowParallelLinear, ShardError, comm
from kdsl.schema import GPTQ, BlockFP8
from kdsl.schema.scheme import AWQ
from reference import rel_fro_error
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


# --- load_quantized(tp_plan={"model.layers.*.mlp": "mlp"}) ------------------------------------------------------

LOAD_CONFIGS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False},
    "gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}
PLAN = {"model.layers.*.mlp": "mlp"}


class GatedMLP(nn.Module):
    """transformers' LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x))."""

    def __init__(self, dtype, inter=I, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(H, inter, bias=True, dtype=dtype)
        self.up_proj = nn.Linear(H, inter, bias=True, dtype=dtype)
        self.down_proj = nn.Linear(inter, H, bias=True, dtype=dtype)
        self.act_fn = act or nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Decoder(nn.Module):
    def __init__(self, dtype, **kw):
        super().__init__()
        self.norm = nn.LayerNorm(H, dtype=dtype)
        self.mlp = GatedMLP(dtype, **kw)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class GatedModel(nn.Module):
    """Two decoder layers named as transformers names them, an unquantized head."""

    def __init__(self, dtype, **kw):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([Decoder(dtype, **kw) for _ in range(2)])
        self.model.norm = nn.LayerNorm(H, dtype=dtype)
        self.lm_head = nn.Linear(H, 72, bias=False, dtype=dtype)

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def write_gated_checkpoint(folder, kind, inter=I):
    """GatedModel's checkpoint in the published names (layers' linears quantized, biases included)."""
    from safetensors.torch import save_file

    dtype = torch.bfloat16 if kind == "fp8" else torch.float16
    gen = torch.Generator().manual_seed(80)
    ckpt = {"model.norm.weight": (torch.rand(H, generator=gen) + 0.5).to(dtype),
            "model.norm.bias": (torch.randn(H, generator=gen) * 0.1).to(dtype),
            "lm_head.weight": (torch.randn(72, H, generator=gen) * 0.05).to(dtype)}
    for i in range(2):
        ckpt[f"model.layers.{i}.norm.weight"] = (torch.rand(H, generator=gen) + 0.5).to(dtype)
        ckpt[f"model.layers.{i}.norm.bias"] = (torch.randn(H, generator=gen) * 0.1).to(dtype)
        for seed, (name, (n, k)) in enumerate((("gate_proj", (inter, H)), ("up_proj", (inter, H)),
                                               ("down_proj", (H, inter))), 90 + 10 * i):
            if kind == "fp8":
                t = fp8_layer(n, k, seed)
            elif kind == "awq":
                t = awq_layer(n, k, seed)
            else:
                t = gptq_layer(n, k, seed, checkpoint_format=kind, act_order=kind == "gptq")
            if name == "up_proj" and "g_idx" in t:  # gate and up quantize the same input: one g_idx, one GEMM
                t["g_idx"] = ckpt[f"model.layers.{i}.mlp.gate_proj.g_idx"].clone()
            ckpt.update({f"model.layers.{i}.mlp.{name}.{role}": v for role, v in t.items()})
    folder.mkdir(parents=True, exist_ok=True)
    config = {**LOAD_CONFIGS[kind], "modules_to_not_convert": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny", "quantization_config": config}))
    save_file({k: v.contiguous() for k, v in ckpt.items()}, str(folder / "model.safetensors"))


def _unchanged(model, before, what):
    assert {name: type(m) for name, m in model.named_modules()} == before, what


def _load_cases(rank, folder):
    from kdsl import checkpoint

    one = [dist.new_group([r]) for r in range(WORLD)][rank]  # every rank creates every group
    torch.manual_seed(81)
    x = torch.randn(5, H)
    for kind, dtype in (("fp8", torch.bfloat16), ("gptq", torch.float16), ("gptq_v2", torch.float16),
                        ("awq", torch.float16), ("gptq", torch.bfloat16)):  # fp16 int4 scales into a bf16 model
        what = f"load_quantized mlp {kind} {dtype} TP={WORLD} rank {rank}"
        path = os.path.join(folder, kind)
        read_whole, load = [], checkpoint._Shards.load

        def spy(self, key, device, load=load, read_whole=read_whole):
            read_whole.append(key)
            return load(self, key, device)

        checkpoint._Shards.load = spy
        try:
            tp = kdsl.load_quantized(GatedModel(dtype), path, device="cpu", tp_plan=PLAN)
        finally:
            checkpoint._Shards.load = load
        mlps = [layer.mlp for layer in tp.model.layers]
        assert all(isinstance(m, ParallelMLP) and m.fused_act and m.world_size == WORLD for m in mlps), what
        assert mlps[0].intermediate_size == I and mlps[0].gate_up.out_features == 2 * I // WORLD, what
        # Only the MLPs' g_idx and biases are read whole; their weights and scales through get_slice.
        assert [k for k in read_whole if ".mlp." in k] == [
            k for k in read_whole if ".mlp." in k and k.endswith((".bias", ".g_idx"))], (what, read_whole)
        tp1 = kdsl.load_quantized(GatedModel(dtype), path, device="cpu", tp_plan=PLAN, group=one)
        plain = kdsl.load_quantized(GatedModel(dtype), path, device="cpu", dtype=dtype)
        xd = x.to(dtype)
        # Each MLP on the same input; the whole model (two residual layers, each re-quantizing inputs that the
        # reduction rounded differently) within 2% of TP = 1 in the Frobenius norm.
        for i, m in enumerate(mlps):
            check_close(m(xd), tp1.model.layers[i].mlp(xd), f"{what} layer {i} against a TP = 1 ParallelMLP")
        assert rel_fro_error(tp(xd), tp1(xd)) < 2e-2, what
        for i, m in enumerate(mlps):  # torch's silu and mul, as GatedMLP runs them
            m.fused_act = False
            check_close(m(xd), plain.model.layers[i].mlp(xd), f"{what} layer {i} (fused_act = False) against "
                        "the TP = 1 model's GatedMLP")
        assert rel_fro_error(tp(xd), plain(xd)) < 2e-2, what


def _load_refusals(rank, folder):
    fp8 = os.path.join(folder, "fp8")
    refusals = [
        ({"model.layers.*": "mlp"}, {}, r"matches model\.layers\.0, which holds no nn\.Linear gate_proj, up_proj, "
                                        r"down_proj \(it holds norm: LayerNorm, mlp: GatedMLP\)"),
        ({"model.layers.*.mlp.gate_proj": "mlp"}, {}, r"matches model\.layers\.0\.mlp\.gate_proj, an nn\.Linear"),
        ({"model.layer.*.mlp": "mlp"}, {}, r"tp_plan\['model\.layer\.\*\.mlp'\] = 'mlp' matches no module"),
        (PLAN, {"act": nn.GELU()}, r"whose act_fn: GELU is not SiLU"),
        ({**PLAN, "*.up_proj": "column"}, {}, r"model\.layers\.0\.mlp\.up_proj a style of its own"),
    ]
    for plan, kw, message in refusals:
        model = GatedModel(torch.bfloat16, **kw)
        before = {name: type(m) for name, m in model.named_modules()}
        with pytest.raises(kdsl.nn.CheckpointError, match=message):
            kdsl.load_quantized(model, fp8, device="cpu", tp_plan=plan)
        _unchanged(model, before, plan)
    with pytest.raises(ValueError, match=r"tp_plan\['x'\]: expected 'column', 'row' or 'mlp', got 'gated'"):
        kdsl.load_quantized(GatedModel(torch.bfloat16), fp8, device="cpu", tp_plan={"x": "gated"})
    # FP8 down needs whole 128-column activation groups per rank: I = 384 gives 192. The first MLP fails to cut,
    # and the model is left as it was.
    model = GatedModel(torch.bfloat16, inter=384)
    before = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(ShardError, match=r"K = 384 / 2 = 192 must be a whole number and a multiple of 128"):
        kdsl.load_quantized(model, os.path.join(folder, "fp8_384"), device="cpu", tp_plan=PLAN)
    _unchanged(model, before, "fp8 I = 384")


def _load_worker(rank, world, init_file, folder):
    os.environ.pop("TRITON_INTERPRET", None)  # torch fallbacks: the kernels are the interpreter tests' business
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        with torch.no_grad():
            _load_cases(rank, folder)
            _load_refusals(rank, folder)
    finally:
        dist.destroy_process_group()


def test_load_quantized_mlp_plan_matches_one_rank(tmp_path):
    """load_quantized(tp_plan={"model.layers.*.mlp": "mlp"}) on 2 ranks: ParallelMLPs from each rank's slices of
    FP8, GPTQ (act-order, v2) and AWQ checkpoints equal the one-rank ParallelMLPs and (with torch's silu and mul)
    the model loaded whole; what it cannot serve is refused by name and leaves the model as it was."""
    for kind in LOAD_CONFIGS:
        write_gated_checkpoint(tmp_path / kind, kind)
    write_gated_checkpoint(tmp_path / "fp8_384", "fp8", inter=384)
    mp.spawn(_load_worker, args=(WORLD, str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)


def test_parallel_mlp_through_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set by conftest on the CPU)")
    spawn(interpret=True)
