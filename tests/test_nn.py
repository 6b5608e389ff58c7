"""kdsl.nn: quantized linears in a model, quantize_, and load_quantized on checkpoints written here in the
published key names, against references computed from the checkpoint tensors with tests/reference*.py."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import kdsl
import reference as fp8_ref
import reference_gptq as gptq_ref
from test_awq import pack_awq

DIM, HIDDEN, OUT = 256, 512, 72
# The model's bf16 LayerNorm and the reference's fp32 one can round an activation to the other side of an
# e4m3 step, which the next layer's fp8 quantization then keeps: FP8 models get more room.
TOL = {"fp8": 3e-2, "gptq": 2e-2, "gptq_v2": 2e-2, "awq": 2e-2}


class TinyMLP(nn.Module):
    """norm -> up (bias) -> silu -> down -> head (bias); head is left unquantized by the checkpoints."""

    def __init__(self, dtype=torch.float16):
        super().__init__()
        self.norm = nn.LayerNorm(DIM, dtype=dtype)
        self.up = nn.Linear(DIM, HIDDEN, bias=True, dtype=dtype)
        self.down = nn.Linear(HIDDEN, DIM, bias=False, dtype=dtype)
        self.head = nn.Linear(DIM, OUT, bias=True, dtype=dtype)

    def forward(self, x):
        return self.head(self.down(F.silu(self.up(self.norm(x)))))


def _layer_ref(kind, tensors, h, dtype):
    """One quantized layer from its checkpoint tensors: dequantize, then matmul in fp32."""
    if kind == "fp8":
        a, a_s = fp8_ref.act_quant_ref(h)
        y = fp8_ref.fp8_gemm_ref(a, a_s, tensors["weight"], tensors["weight_scale_inv"])
    elif kind == "awq":
        y = h.float() @ tensors["dense"]
    else:
        y = gptq_ref.gemm_ref(h, tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"),
                              group_size=128, checkpoint_format=kind)
    if "bias" in tensors:
        y = y + tensors["bias"].float()
    return y.to(dtype)


def reference(kind, ckpt, x):
    float_of = lambda name: ckpt[name].float()  # noqa: E731
    h = F.layer_norm(x.float(), (DIM,), float_of("norm.weight"), float_of("norm.bias")).to(x.dtype)
    layer = lambda name: {k.split(".", 1)[1]: v for k, v in ckpt.items() if k.startswith(name + ".")}  # noqa: E731
    h = F.silu(_layer_ref(kind, layer("up"), h, x.dtype).float()).to(x.dtype)
    h = _layer_ref(kind, layer("down"), h, x.dtype)
    return (h.float() @ float_of("head.weight").T + float_of("head.bias")).to(x.dtype)


def write_checkpoint(folder, kind):
    """A checkpoint of TinyMLP in the published names, and the quantization_config that goes with it."""
    dtype = torch.bfloat16 if kind == "fp8" else torch.float16
    ckpt = {"norm.weight": (torch.rand(DIM) + 0.5).to(dtype), "norm.bias": (torch.randn(DIM) * 0.1).to(dtype),
            "head.weight": (torch.randn(OUT, DIM) * 0.05).to(dtype), "head.bias": (torch.randn(OUT) * 0.1).to(dtype),
            "up.bias": (torch.randn(HIDDEN) * 0.1).to(dtype)}
    for name, (n, k) in (("up", (HIDDEN, DIM)), ("down", (DIM, HIDDEN))):
        if kind == "fp8":
            q, s = fp8_ref.weight_quant_ref(torch.randn(n, k) * 0.05)
            ckpt.update({f"{name}.weight": q, f"{name}.weight_scale_inv": s})
        elif kind == "awq":
            q, zeros = torch.randint(0, 16, (k, n)), torch.randint(0, 16, (k // 128, n))
            scales = (torch.rand(k // 128, n) * 0.01 + 0.001).half()
            ckpt.update({f"{name}.qweight": pack_awq(q), f"{name}.qzeros": pack_awq(zeros), f"{name}.scales": scales})
            ckpt[f"{name}.dense"] = (q - zeros.repeat_interleave(128, 0)).float() * scales.float().repeat_interleave(128, 0)
        else:  # "gptq" (act-order) or "gptq_v2"
            made = gptq_ref.make_checkpoint(k, n, checkpoint_format=kind, scale=0.002,
                                            g_idx="perm" if kind == "gptq" else "default")
            ckpt.update({f"{name}.{role}": made[role] for role in ("qweight", "qzeros", "scales", "g_idx")})
    configs = {
        "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False},
        "gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    }
    config = {**configs[kind], "modules_to_not_convert": ["head"]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny", "quantization_config": config}))
    on_disk = {k: v.contiguous() for k, v in ckpt.items() if not k.endswith(".dense")}
    names = sorted(on_disk)
    save_file({k: on_disk[k] for k in names[: len(names) // 2]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: on_disk[k] for k in names[len(names) // 2:]}, str(folder / "model-00002-of-00002.safetensors"))
    return ckpt, dtype


@pytest.mark.parametrize("kind", ["fp8", "gptq", "gptq_v2", "awq"])
def test_load_quantized_runs_eager_like_the_checkpoint(kind, tmp_path):
    ckpt, dtype = write_checkpoint(tmp_path / kind, kind)
    model = kdsl.load_quantized(TinyMLP(dtype), tmp_path / kind, device="cpu")
    expected = kdsl.nn.FP8Linear if kind == "fp8" else kdsl.nn.W4A16Linear
    assert isinstance(model.up, expected) and isinstance(model.down, expected)
    assert type(model.head) is nn.Linear and torch.equal(model.head.weight, ckpt["head.weight"])
    x = torch.randn(5, DIM).to(dtype)
    ref = reference(kind, ckpt, x)
    assert fp8_ref.rel_fro_error(model(x), ref) < TOL[kind]
    assert fp8_ref.rel_fro_error(model(x.reshape(1, 5, DIM)).reshape(5, OUT), ref) < TOL[kind]


def test_repr_shows_scheme_and_kernel(tmp_path):
    write_checkpoint(tmp_path, "gptq_v2")
    model = kdsl.load_quantized(TinyMLP(), tmp_path, device="cpu")
    text = repr(model.up)
    assert "scheme=gptq.int4.g128.gptq_v2" in text and "kernel=w4a16_gemm__int4_g128__mma_sm80" in text


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("down.qzeros"), r"down\.qzeros: missing"),
    (lambda c: c.__setitem__("up.scales", c["up.scales"][:, :-8].contiguous()), r"up\.scales: expected shape \(2, 512\)"),
    (lambda c: c.__setitem__("extra.weight", torch.zeros(3)), r"extra\.weight: in the checkpoint but not in the model"),
    (lambda c: c.pop("norm.bias"), r"norm\.bias: missing"),
])
def test_a_bad_checkpoint_is_refused_naming_the_tensor_and_changes_nothing(change, message, tmp_path):
    ckpt, _ = write_checkpoint(tmp_path / "good", "gptq_v2")
    tensors = {k: v for k, v in ckpt.items() if not k.endswith(".dense")}
    change(tensors)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(bad / "model.safetensors"))
    model = TinyMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(kdsl.nn.CheckpointError, match=message):
        kdsl.load_quantized(model, bad, device="cpu")
    assert all(type(getattr(model, name)) is nn.Linear for name in ("up", "down", "head"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("scheme", [kdsl.BlockFP8(), kdsl.GPTQ(), kdsl.AWQ()], ids=["fp8", "gptq", "awq"])
def test_quantize_replaces_the_linears_it_can_serve(scheme):
    dtype = torch.bfloat16 if isinstance(scheme, kdsl.BlockFP8) else torch.float16
    model = TinyMLP(dtype)
    model.odd = nn.Linear(DIM, 20, dtype=dtype)  # N = 20: no kernel takes it, so the default filter skips it
    dense = {name: getattr(model, name).weight.detach().clone() for name in ("up", "down", "head")}
    kdsl.quantize_(model, scheme)
    assert type(model.odd) is nn.Linear
    for name in ("up", "down", "head"):
        layer = getattr(model, name)
        x = torch.randn(3, layer.in_features).to(dtype)
        y = layer(x)
        expected = (x.float() @ dense[name].float().T + (0 if layer.bias is None else layer.bias.float())).to(dtype)
        # round-to-nearest int4 or fp8 weights (and fp8 activations): a few percent of the float layer
        assert fp8_ref.rel_fro_error(y, expected) < (0.08 if dtype == torch.float16 else 0.06), name


def test_quantize_filter_and_dtype_casts_keep_the_weights():
    model = TinyMLP(torch.bfloat16)
    kdsl.quantize_(model, kdsl.BlockFP8(), filter_fn=lambda module, name: name == "up")
    assert isinstance(model.up, kdsl.nn.FP8Linear) and type(model.down) is nn.Linear
    weight, scales = model.up.weight.clone(), model.up.weight_scale_inv.clone()
    model.to(torch.float32)
    assert model.up.weight.dtype == torch.float8_e4m3fn and torch.equal(model.up.weight.float(), weight.float())
    assert model.up.weight_scale_inv.dtype == torch.float32 and torch.equal(model.up.weight_scale_inv, scales)
    assert model.up.bias.dtype == torch.float32
    x = torch.randn(2, DIM)
    assert model(x).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "gptq", "gptq_v2", "awq"])
def test_load_quantized_on_the_gpu_eager_and_captured(kind, tmp_path):
    """The GPU's kernels (sm_90: TMA FP8, k_planes W4A16) from a loaded checkpoint, eager and replayed from a
    captured CUDA graph, against the checkpoint reference."""
    ckpt, dtype = write_checkpoint(tmp_path / kind, kind)
    model = kdsl.load_quantized(TinyMLP(dtype), tmp_path / kind, device="cuda")
    assert model.up.weight_scale_inv.is_cuda if kind == "fp8" else model.up.qweight.is_cuda
    for m in (1, 5, 64):
        x = torch.randn(m, DIM).to(dtype)
        ref = reference(kind, ckpt, x)
        static = x.cuda()
        eager = model(static)
        assert fp8_ref.rel_fro_error(eager.cpu(), ref) < TOL[kind], m
        model(static)  # warm: compile and pick every kernel before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(static)
        graph.replay()
        torch.cuda.synchronize()
        assert fp8_ref.rel_fro_error(captured, eager) < 1e-3, m  # split-K may add partials in another order


@pytest.mark.parametrize("kind", ["fp8", "gptq"])
def test_a_loaded_model_compiles_without_graph_breaks(kind, tmp_path):
    ckpt, dtype = write_checkpoint(tmp_path / kind, kind)
    model = kdsl.load_quantized(TinyMLP(dtype), tmp_path / kind, device="cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.no_grad():  # inference: the quantized ops have no backward
        for m in (3, 7):
            x = torch.randn(m, DIM).to(dtype)
            if kind == "fp8":  # eager runs the fused fp8_linear at few rows, compiled the two kernels: a rounding
                # apart after the first layer (bias added in fp32), which the second's quantization can amplify
                assert fp8_ref.rel_fro_error(compiled(x), model(x)) < TOL[kind], m
            else:
                assert torch.equal(compiled(x), model(x)), m
            assert fp8_ref.rel_fro_error(compiled(x), reference(kind, ckpt, x)) < TOL[kind]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "gptq", "awq"])
def test_a_loaded_model_compiles_with_cuda_graphs_on_the_gpu(kind, tmp_path):
    ckpt, dtype = write_checkpoint(tmp_path / kind, kind)
    model = kdsl.load_quantized(TinyMLP(dtype), tmp_path / kind, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    x = torch.randn(4, DIM).to(dtype)
    with torch.no_grad():
        for _ in range(3):  # warm-up, record, replay
            y = compiled(x.cuda()).clone()
    assert fp8_ref.rel_fro_error(y.cpu(), reference(kind, ckpt, x)) < TOL[kind]


def test_a_model_built_on_the_meta_device_loads_without_a_second_copy(tmp_path):
    """Built on 'meta', the model holds no weights of its own: every tensor it ends with is the one read from
    the checkpoint (assigned, not copied), so a large model is in memory once."""
    ckpt, dtype = write_checkpoint(tmp_path, "gptq_v2")
    with torch.device("meta"):
        model = TinyMLP(dtype)
    kdsl.load_quantized(model, tmp_path, device="cpu")
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    x = torch.randn(3, DIM).to(dtype)
    with torch.no_grad():
        assert fp8_ref.rel_fro_error(model(x), reference("gptq_v2", ckpt, x)) < TOL["gptq_v2"]
