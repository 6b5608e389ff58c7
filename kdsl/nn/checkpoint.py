"""Load a quantized checkpoint folder into a model: load_quantized, and from_pretrained for transformers users.

What the config means comes from kdsl.schema.read_hf_config; here each format's tensors per quantized linear
(names, shapes, dtypes), and how they become an FP8Linear or a W4A16Linear. Everything is checked from the
safetensors headers before anything changes, then layers are read one at a time.
"""
from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kdsl.nn.convert import _swap
from kdsl.nn.modules import FP8Linear, W4A16Linear
from kdsl.nn.moe import FP8Experts, W4A16Experts
from kdsl.ops.gptq_checkpoint import unpack_rows
from kdsl.ops.w4a16 import prepare
from kdsl.runtime.registry import require_served_scheme
from kdsl.schema import HFQuantization, read_hf_config, scheme_from_hf
from kdsl.schema.scheme import AWQ, BlockFP8

HALVES = ("F16", "BF16")
FLOATS = HALVES + ("F32",)
ACT_DTYPES = (torch.float16, torch.bfloat16)


class CheckpointError(ValueError):
    """The checkpoint does not fit the model: names the tensor, the expected and the found shape or dtype."""


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    required: bool = True


# --- the formats -----------------------------------------------------------------------------------------

class LayerFormat:
    """One checkpoint format's quantized linear: marker is the role whose tensor marks a layer as quantized."""

    marker = "weight"
    tp = False  # load_quantized's tp_plan can cut these layers (kdsl.parallel)
    experts = False  # reads per-expert tensors into transformers' fused experts modules (expert_specs, build_experts)

    def __init__(self, hf: HFQuantization):
        self.hf, self.scheme = hf, hf.scheme

    def marks(self, dtype: str) -> bool:
        return True

    def specs(self, k: int, n: int) -> dict[str, Spec]:
        raise NotImplementedError

    def build(self, t: dict[str, torch.Tensor], act_dtype: torch.dtype | None) -> nn.Module:
        raise NotImplementedError

    def check_values(self, key: str, role: str, tensor: torch.Tensor, k: int, n: int) -> None:
        """Checks on tensor values (read at build time): CheckpointError naming the tensor."""


def _act_dtype(scales: torch.Tensor, act_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype int4 layers compute in: the model's (or load_quantized's dtype=), else the scales'."""
    if act_dtype in ACT_DTYPES:
        return act_dtype
    return scales.dtype if scales.dtype in ACT_DTYPES else torch.float16


class DeepSeekFP8(LayerFormat):
    """quant_method "fp8": weight e4m3 [N, K], weight_scale_inv per block (a multiplier, or its reciprocal
    where the config says weight_scale_semantics "inverse")."""

    def marks(self, dtype: str) -> bool:
        return dtype == "F8_E4M3"  # float weights of the same name are unquantized layers

    scale_role = "weight_scale_inv"

    def specs(self, k, n):
        bn, bk = self.scheme.weight_block
        return {"weight": Spec((n, k), ("F8_E4M3",)),
                self.scale_role: Spec((-(-n // bn), -(-k // bk)), FLOATS),
                "bias": Spec((n,), FLOATS, False)}

    @property
    def tp(self):
        return not self.hf.scale_inverse

    def multiplier(self, scale: torch.Tensor) -> torch.Tensor:
        """The stored scale as the dequantization multiplier, float32."""
        if self.hf.scale_inverse:
            return scale.float().reciprocal()  # 448 / amax -> amax / 448; NaN stays NaN, inf gives 0 (a zero block)
        return scale.float()

    def build(self, t, act_dtype):
        return FP8Linear(t["weight"], self.multiplier(t[self.scale_role]), t.get("bias"), self.scheme)

    experts = True  # reads DeepSeek-V3's per-expert tensors into transformers' fused experts modules

    def expert_specs(self, inter: int, hidden: int) -> dict[str, Spec]:
        """One expert's tensors under <experts>.<e>.: gate and up [I, H], down [H, I], each with its block scales."""
        bn, bk = self.scheme.weight_block
        specs = {}
        for proj, (n, k) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            specs[f"{proj}.weight"] = Spec((n, k), ("F8_E4M3",))
            specs[f"{proj}.{self.scale_role}"] = Spec((-(-n // bn), -(-k // bk)), FLOATS)
        return specs

    def experts_problem(self, inter: int, hidden: int) -> str | None:
        """Why a fused experts module of this intermediate and hidden size cannot be built (None: it can)."""
        if inter % self.scheme.weight_block[0]:
            return (f"expert intermediate size {inter} is not a multiple of the weight block's "
                    f"{self.scheme.weight_block[0]} rows, so gate and up blocks cannot be stacked as w13")
        return None

    def build_experts(self, experts: list[dict[str, torch.Tensor]], act_dtype: torch.dtype | None = None) -> nn.Module:
        """FP8Experts from each expert's tensors: gate then up rows stacked as w13, their block scales likewise."""
        s = self.scale_role
        w13 = torch.stack([torch.cat([t["gate_proj.weight"], t["up_proj.weight"]]) for t in experts])
        w13_s = torch.stack([self.multiplier(torch.cat([t[f"gate_proj.{s}"], t[f"up_proj.{s}"]])) for t in experts])
        w2 = torch.stack([t["down_proj.weight"] for t in experts])
        w2_s = torch.stack([self.multiplier(t[f"down_proj.{s}"]) for t in experts])
        return FP8Experts(w13, w13_s, w2, w2_s)


class CompressedFP8Block(DeepSeekFP8):
    """compressed-tensors "float-quantized" with FP8_BLOCK's arguments: weight e4m3, weight_scale per block
    (a multiplier, often bf16); activations quantized per call, so no input_scale."""

    scale_role = "weight_scale"
    tp = False
    experts = False


class GPTQFormat(LayerFormat):
    marker = "qweight"
    tp = True

    def specs(self, k, n):
        groups = 1 if self.scheme.group_size == -1 else k // self.scheme.group_size
        return {"qweight": Spec((k // 8, n), ("I32",)), "qzeros": Spec((groups, n // 8), ("I32",)),
                "scales": Spec((groups, n), FLOATS), "g_idx": Spec((k,), ("I32",), False),
                "bias": Spec((n,), FLOATS, False)}

    def build(self, t, act_dtype):
        dtype = _act_dtype(t["scales"], act_dtype)
        return W4A16Linear.from_gptq(t["qweight"], t["qzeros"], t["scales"].to(dtype), t.get("g_idx"),
                                     t.get("bias"), self.scheme)

    experts = True  # per-expert qweight/qzeros/scales/g_idx (Qwen3-MoE GPTQ) into a fused experts module

    def expert_specs(self, inter: int, hidden: int) -> dict[str, Spec]:
        """One expert's tensors under <experts>.<e>.: gate and up [I, H] linears, down [H, I], as GPTQ stores them."""
        return _int4_expert_specs(self, inter, hidden)

    def experts_problem(self, inter: int, hidden: int) -> str | None:
        return _int4_experts_problem(self.scheme.group_size, inter, hidden)

    def build_experts(self, experts: list[dict[str, torch.Tensor]], act_dtype: torch.dtype | None = None) -> nn.Module:
        """W4A16Experts from each expert's tensors: each projection's stacked over the experts (gate and up as one
        w13, each half with its own g_idx), prepared on their device in the model's dtype."""
        projections = _stack_experts(experts)
        dtype = _act_dtype(projections["gate_proj"]["scales"], act_dtype)
        return W4A16Experts.from_gptq(projections["gate_proj"], projections["up_proj"], projections["down_proj"],
                                      self.scheme, dtype=dtype)


AWQ_SYMMETRIC_ZEROS = -0x77777778  # 0x88888888 as int32: a zero of 8 in every nibble, whatever the order


class AWQFormat(LayerFormat):
    marker = "qweight"

    @property
    def tp(self):
        return self.scheme.zero_point

    def specs(self, k, n):
        groups = k // self.scheme.group_size
        # Symmetric AWQ (zero_point false) may store qzeros (all 8) or leave them out.
        return {"qweight": Spec((k, n // 8), ("I32",)),
                "qzeros": Spec((groups, n // 8), ("I32",), self.scheme.zero_point),
                "scales": Spec((groups, n), FLOATS), "bias": Spec((n,), FLOATS, False)}

    def build(self, t, act_dtype):
        dtype = _act_dtype(t["scales"], act_dtype)
        qzeros = t.get("qzeros")
        if qzeros is None:
            qzeros = torch.full((t["scales"].shape[0], t["qweight"].shape[1]), AWQ_SYMMETRIC_ZEROS,
                                dtype=torch.int32, device=t["qweight"].device)
        return W4A16Linear.from_awq(t["qweight"], qzeros, t["scales"].to(dtype), t.get("bias"), self.scheme)

    experts = True  # per-expert qweight/qzeros/scales (Qwen3-MoE AWQ) into a fused experts module

    def expert_specs(self, inter: int, hidden: int) -> dict[str, Spec]:
        """One expert's tensors under <experts>.<e>.: gate and up [I, H] linears, down [H, I], as AWQ stores them."""
        return _int4_expert_specs(self, inter, hidden)

    def experts_problem(self, inter: int, hidden: int) -> str | None:
        return _int4_experts_problem(self.scheme.group_size, inter, hidden)

    def build_experts(self, experts: list[dict[str, torch.Tensor]], act_dtype: torch.dtype | None = None) -> nn.Module:
        """W4A16Experts from each expert's tensors (symmetric checkpoints may leave qzeros out: every zero 8)."""
        projections = _stack_experts(experts)
        dtype = _act_dtype(projections["gate_proj"]["scales"], act_dtype)
        return W4A16Experts.from_awq(projections["gate_proj"], projections["up_proj"], projections["down_proj"],
                                     self.scheme, dtype=dtype)


def _int4_expert_specs(fmt: LayerFormat, inter: int, hidden: int) -> dict[str, Spec]:
    """The format's tensors of each of an expert's linears (K, N): gate and up (H, I), down (I, H); no bias."""
    specs = {}
    for proj, (k, n) in (("gate_proj", (hidden, inter)), ("up_proj", (hidden, inter)), ("down_proj", (inter, hidden))):
        specs.update({f"{proj}.{role}": spec for role, spec in fmt.specs(k, n).items() if role != "bias"})
    return specs


def _int4_experts_problem(group_size: int, inter: int, hidden: int) -> str | None:
    """An int4 fused experts module stacks gate and up along N (whole int32 words of 8 columns) and groups K."""
    if inter % 8:
        return f"expert intermediate size {inter} is not a multiple of 8, so gate and up words cannot be stacked as w13"
    for what, k in (("hidden size", hidden), ("expert intermediate size", inter)):
        if group_size != -1 and k % group_size:
            return f"{what} {k} is not a multiple of group_size = {group_size}"
    return None


def _stack_experts(experts: list[dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """{projection: {role: [E, ...]}} from each expert's {"<projection>.<role>": tensor}: every role all experts
    store, stacked; a g_idx only some store is completed with k // group_size order for the others, any other
    optional role only some store (symmetric AWQ's qzeros) is left out."""
    stacked: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted({key for t in experts for key in t}):
        projection, _, role = key.rpartition(".")
        present = [t.get(key) for t in experts]
        if all(p is not None for p in present):
            stacked.setdefault(projection, {})[role] = torch.stack(present)
        elif role == "g_idx":
            k = next(p for p in present if p is not None).shape[0]
            scales = experts[0][f"{projection}.scales"]
            default = torch.arange(k, dtype=torch.int32, device=scales.device) // (k // scales.shape[0])
            stacked.setdefault(projection, {})[role] = torch.stack([default if p is None else p for p in present])
    return stacked


class CompressedPacked(LayerFormat):
    """compressed-tensors "pack-quantized" int4: weight_packed int32 [N, K / 8] (value i of a row in bits
    4 (i % 8) of word i // 8, stored as q + 8), weight_scale [N, G], weight_zero_point int32 [N / 8, G] packed
    along N the same way when asymmetric, weight_shape [N, K], weight_g_idx [K] with actorder "group".
    w[n, k] = (q - z) * s with q and z signed; symmetric means z = 0."""

    marker = "weight_packed"

    def specs(self, k, n):
        groups = 1 if self.scheme.group_size == -1 else k // self.scheme.group_size
        specs = {"weight_packed": Spec((n, k // 8), ("I32",)), "weight_scale": Spec((n, groups), FLOATS),
                 "weight_shape": Spec((2,), ("I64", "I32"))}
        if not self.scheme.sym:
            specs["weight_zero_point"] = Spec((-(-n // 8), groups), ("I32",))
        if self.hf.actorder:
            specs["weight_g_idx"] = Spec((k,), ("I32", "I64"))
        specs["bias"] = Spec((n,), FLOATS, False)
        return specs

    def check_values(self, key, role, tensor, k, n):
        if role == "weight_shape" and tensor.tolist() != [n, k]:
            raise CheckpointError(f"{key}: holds {tensor.tolist()}, but the model's layer is [{n}, {k}]")
        if role == "weight_g_idx" and tensor.numel():
            groups = k // self.scheme.group_size
            low, high = int(tensor.min()), int(tensor.max())
            if low < 0 or high >= groups:
                raise CheckpointError(f"{key}: groups span [{low}, {high}], expected [0, {groups})")

    def build(self, t, act_dtype):
        n = t["weight_packed"].shape[0]
        q = unpack_rows(t["weight_packed"].T.contiguous(), 4)  # [K, N], the stored q + 8
        scales = t["weight_scale"].T.contiguous()  # [G, N]
        if self.scheme.sym:
            zeros = torch.full(scales.shape, 8, dtype=torch.int32, device=q.device)
        else:
            zeros = unpack_rows(t["weight_zero_point"], 4)[:n].T.contiguous()  # [G, N], the stored z + 8
        g_idx = t.get("weight_g_idx")
        prepared = prepare(q, zeros, scales.to(_act_dtype(scales, act_dtype)),
                           None if g_idx is None else g_idx.to(torch.int32),
                           bits=4, group_size=self.scheme.group_size, source="compressed-tensors")
        bias = t.get("bias")
        return W4A16Linear(prepared, None if bias is None else bias.to(prepared.dtype), self.scheme)


FORMATS = {"fp8": DeepSeekFP8, "gptq": GPTQFormat, "awq": AWQFormat,
           "compressed-tensors/float-quantized": CompressedFP8Block,
           "compressed-tensors/pack-quantized": CompressedPacked}


# --- reading the folder ----------------------------------------------------------------------------------

class _Shards:
    """Every tensor's shard, shape and dtype, read from the safetensors headers (no tensor data)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors files")
        self.handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self.where: dict[str, int] = {}
        for index, handle in enumerate(self.handles):
            for key in handle.keys():
                if key in self.where:
                    raise CheckpointError(f"{key}: in both {files[self.where[key]].name} and {files[index].name}")
                self.where[key] = index

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.handles[self.where[key]].get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        return self.handles[self.where[key]].get_slice(key).get_dtype()

    def load(self, key: str, device) -> torch.Tensor:
        return self.handles[self.where[key]].get_tensor(key).to(device)

    def lazy(self, key: str, device) -> "_LazyTensor":
        return _LazyTensor(self.handles[self.where[key]].get_slice(key), device)


_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I32": torch.int32, "I64": torch.int64}


class _LazyTensor:
    """A checkpoint tensor that reads only what is indexed (safetensors get_slice): what the sharding helpers
    of kdsl.parallel cut from, so each rank reads its own slice of a tensor-parallel layer."""

    def __init__(self, handle, device):
        self._handle = handle
        self.shape = torch.Size(handle.get_shape())
        self.dtype = _SAFETENSORS_DTYPES[handle.get_dtype()]
        self.device = torch.device(device)

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self._handle[index].to(self.device)


@dataclass
class _Plan:
    quantized: dict[str, dict[str, str]] = field(default_factory=dict)  # module name -> {role: key}
    experts: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # experts module -> per expert {role: key}
    plain: dict[str, str] = field(default_factory=dict)  # model state_dict key -> checkpoint key


def _fused_experts(module: nn.Module) -> tuple[int, int, int] | None:
    """(E, I, H) of a transformers fused experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I]), or None."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3):
        return None
    experts, double_inter, hidden = gate_up.shape
    if double_inter % 2 or tuple(down.shape) != (experts, hidden, double_inter // 2):
        return None
    return experts, double_inter // 2, hidden


def _ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """modules_to_not_convert (a name or a part of one, as transformers matches it) and compressed-tensors'
    ignore ("re:" prefix: a regular expression matched from the start)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern == name or pattern in name:
            return True
    return False


def _plan(model: nn.Module, shards: _Shards, fmt: LayerFormat) -> _Plan:
    plan, problems = _Plan(), []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        key = f"{name}.{fmt.marker}"
        if key not in shards.where or not fmt.marks(shards.dtype(key)) or _ignored(name, fmt.hf.ignore):
            continue
        roles = {}
        for role, spec in fmt.specs(module.in_features, module.out_features).items():
            key = f"{name}.{role}"
            if key not in shards.where:
                if spec.required:
                    problems.append(f"{key}: missing (expected shape {spec.shape})")
                continue
            if shards.shape(key) != spec.shape:
                problems.append(f"{key}: expected shape {spec.shape} for {module.in_features} -> "
                                f"{module.out_features}, found {shards.shape(key)}")
            elif shards.dtype(key) not in spec.dtypes:
                problems.append(f"{key}: expected dtype {' or '.join(spec.dtypes)}, found {shards.dtype(key)}")
            roles[role] = key
        plan.quantized[name] = roles
    for name, module in model.named_modules():
        shape = _fused_experts(module) if fmt.experts else None
        key = f"{name}.0.gate_proj.{fmt.marker}"
        if (shape is None or key not in shards.where or not fmt.marks(shards.dtype(key))
                or _ignored(name, fmt.hf.ignore)):
            continue
        experts, inter, hidden = shape
        problem = fmt.experts_problem(inter, hidden)
        if problem:
            problems.append(f"{name}: {problem}")
            continue
        plan.experts[name] = []
        for e in range(experts):
            roles = {}
            for role, spec in fmt.expert_specs(inter, hidden).items():
                key = f"{name}.{e}.{role}"
                if key not in shards.where:
                    if spec.required:
                        problems.append(f"{key}: missing (expected shape {spec.shape})")
                    continue
                if shards.shape(key) != spec.shape:
                    problems.append(f"{key}: expected shape {spec.shape} for expert {e} of {experts} "
                                    f"(I = {inter}, H = {hidden}), found {shards.shape(key)}")
                elif shards.dtype(key) not in spec.dtypes:
                    problems.append(f"{key}: expected dtype {' or '.join(spec.dtypes)}, found {shards.dtype(key)}")
                roles[role] = key
            plan.experts[name].append(roles)
    for key, tensor in model.state_dict().items():
        if key.rpartition(".")[0] in plan.quantized or key.rpartition(".")[0] in plan.experts:
            continue
        if key not in shards.where:
            problems.append(f"{key}: missing (the model has it, shape {tuple(tensor.shape)})")
        elif shards.shape(key) != tuple(tensor.shape):
            problems.append(f"{key}: expected shape {tuple(tensor.shape)}, found {shards.shape(key)}")
        else:
            plan.plain[key] = key
    used = set(plan.plain) | {key for roles in plan.quantized.values() for key in roles.values()}
    used |= {key for experts in plan.experts.values() for roles in experts for key in roles.values()}
    problems += [f"{key}: in the checkpoint but not in the model" for key in sorted(set(shards.where) - used)]
    if problems:
        raise CheckpointError("the checkpoint does not fit the model:\n  " + "\n  ".join(problems))
    return plan


TP_STYLES = ("column", "row", "mlp")
MLP_ROLES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # ParallelMLP's roles: the linears' names
SILU_CLASSES = ("SiLU", "SiLUActivation")  # torch's nn.SiLU, and transformers' name for it in older versions


def _tp_style(name: str, tp_plan: dict[str, str] | None) -> str | None:
    """The tensor-parallel style of module name: the first tp_plan pattern (fnmatch) that matches it."""
    for pattern, style in (tp_plan or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def _build_parallel(scheme, style: str, shards: _Shards, roles: dict[str, str], device, group) -> nn.Module:
    """A Column/RowParallelLinear from this rank's slices of the layer (g_idx and bias are read whole)."""
    from kdsl.parallel import ColumnParallelLinear, RowParallelLinear

    t = {role: shards.load(key, device) if role in ("g_idx", "bias") else shards.lazy(key, device)
         for role, key in roles.items()}
    cls = ColumnParallelLinear if style == "column" else RowParallelLinear
    bias = t.get("bias")
    if isinstance(scheme, BlockFP8):
        return cls.from_fp8(t["weight"], t["weight_scale_inv"], bias, group=group, scheme=scheme)
    if isinstance(scheme, AWQ):
        return cls.from_awq(t["qweight"], t["qzeros"], t["scales"], bias, group=group, scheme=scheme)
    return cls.from_gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), bias, group=group, scheme=scheme)


class _AsDtype:
    """A lazily read checkpoint tensor converted to dtype as it is read (int4 scales into the model's dtype)."""

    def __init__(self, tensor, dtype: torch.dtype):
        self._tensor, self.dtype = tensor, dtype
        self.shape, self.device = tensor.shape, tensor.device

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self._tensor[index].to(self.dtype)


def _parallel_mlps(model: nn.Module, plan: _Plan, tp_plan: dict[str, str] | None) -> dict[str, dict[str, str]]:
    """{module name: {role: its linear's name}} for every module a tp_plan "mlp" pattern matches (the first
    matching pattern decides, as for linears), each checked to be a gated MLP ParallelMLP can replace: gate_proj,
    up_proj and down_proj quantized in the checkpoint, a SiLU activation if it names one, nothing else that holds
    a tensor. Anything else a pattern matches, and a pattern that matches no module, is refused by name."""
    patterns = [pattern for pattern, style in (tp_plan or {}).items() if style == "mlp"]
    if not patterns:
        return {}
    found, problems, matched, inside = {}, [], set(), None
    for name, module in model.named_modules():  # depth first: an MLP's submodules come right after it
        if not name or (inside is not None and name.startswith(inside)):
            continue
        pattern = next((p for p, style in tp_plan.items() if fnmatch.fnmatchcase(name, p)), None)
        if pattern is None or tp_plan[pattern] != "mlp":
            continue
        matched.add(pattern)
        where = f"tp_plan[{pattern!r}] = 'mlp' matches {name}"
        if isinstance(module, nn.Linear):
            problems.append(f"{where}, an nn.Linear: 'mlp' takes the module holding gate_proj, up_proj and "
                            "down_proj (use 'column' / 'row' for single linears)")
            continue
        children = dict(module.named_children())
        missing = [child for child in MLP_ROLES.values() if not isinstance(children.get(child), nn.Linear)]
        if missing:
            problems.append(f"{where}, which holds no nn.Linear {', '.join(missing)} (it holds "
                            f"{', '.join(f'{k}: {type(v).__name__}' for k, v in children.items()) or 'no modules'}); "
                            "narrow the pattern to the gated MLPs")
            continue
        linears = {role: f"{name}.{child}" for role, child in MLP_ROLES.items()}
        unquantized = [linear for linear in linears.values() if linear not in plan.quantized]
        if unquantized:
            problems.append(f"{where}, but {', '.join(unquantized)} is not quantized in the checkpoint "
                            "(ParallelMLP runs quantized gate, up and down)")
            continue
        others = {k: v for k, v in children.items() if k not in MLP_ROLES.values()}
        held = [k for k, v in others.items() if any(True for _ in v.parameters()) or any(True for _ in v.buffers())]
        held += [k for k, _ in module.named_parameters(recurse=False)]
        held += [k for k, _ in module.named_buffers(recurse=False)]
        if held:
            problems.append(f"{where}, which also holds tensors ({', '.join(held)}) that ParallelMLP would drop")
            continue
        act = [f"{k}: {type(v).__name__}" for k, v in others.items() if type(v).__name__ not in SILU_CLASSES]
        if act:
            problems.append(f"{where}, whose {', '.join(act)} is not SiLU: ParallelMLP computes "
                            "down(silu(gate(x)) * up(x))")
            continue
        claimed = [linear for linear in linears.values() if _tp_style(linear, tp_plan) not in (None, "mlp")]
        if claimed:
            problems.append(f"{where}, and tp_plan gives {', '.join(claimed)} a style of its own: one or the other")
            continue
        found[name], inside = linears, f"{name}."
    problems += [f"tp_plan[{p!r}] = 'mlp' matches no module of the model" for p in patterns if p not in matched]
    if problems:
        raise CheckpointError("tp_plan: cannot build kdsl.parallel.ParallelMLP:\n  " + "\n  ".join(problems))
    return found


def _build_parallel_mlp(scheme, shards: _Shards, plan: _Plan, linears: dict[str, str], device, group,
                        act_dtype: torch.dtype | None) -> nn.Module:
    """A ParallelMLP from this rank's slices of gate, up and down (g_idx and biases are read whole); int4 scales
    are converted to act_dtype (default: the checkpoint's) as they are read."""
    from kdsl.parallel import ParallelMLP

    tensors = {}
    for role, linear in linears.items():
        t = {}
        for name, key in plan.quantized[linear].items():
            t[name] = shards.load(key, device) if name in ("g_idx", "bias") else shards.lazy(key, device)
        if "scales" in t and act_dtype is not None and t["scales"].dtype != act_dtype:
            t["scales"] = _AsDtype(t["scales"], act_dtype)
        if "weight_scale_inv" in t and t["weight_scale_inv"].dtype != torch.float32:  # FP8 multipliers in float32
            t["weight_scale_inv"] = _AsDtype(t["weight_scale_inv"], torch.float32)
        tensors[role] = t
    if isinstance(scheme, BlockFP8):
        return ParallelMLP.from_fp8(**tensors, group=group, scheme=scheme)
    if isinstance(scheme, AWQ):
        return ParallelMLP.from_awq(**tensors, group=group, scheme=scheme)
    return ParallelMLP.from_gptq(**tensors, group=group, scheme=scheme)


def _read_config(folder: Path) -> dict:
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_path}: unreadable ({error})") from None
    if not isinstance(config.get("quantization_config"), dict):
        raise CheckpointError(f"{config_path}: no quantization_config")
    return config


def load_quantized(model: nn.Module, path, device=None, *, dtype: torch.dtype | None = None,
                   tp_plan: dict[str, str] | None = None, group=None) -> nn.Module:
    """Load a quantized checkpoint folder (config.json with a quantization_config, *.safetensors shards in the
    published key names) into model, in place.

    Each nn.Linear with quantized tensors in the checkpoint becomes an FP8Linear (DeepSeek-V3 / GPTQModel FP8
    `weight` + `weight_scale_inv`, and a transformers fused experts module (gate_up_proj, down_proj) whose
    experts are stored as `<name>.<e>.{gate,up,down}_proj.weight` + `weight_scale_inv` becomes a
    kdsl.nn.FP8Experts running kdsl.ops.moe_fp8; compressed-tensors FP8_BLOCK `weight` + `weight_scale`) or a W4A16Linear
    (GPTQ v1/v2 `qweight`, `qzeros`, `scales`, optional `g_idx`; AWQ `qweight`, `qzeros` (optional when
    symmetric), `scales`; compressed-tensors pack-quantized `weight_packed`, `weight_scale`, `weight_shape`,
    optional `weight_zero_point` and `weight_g_idx`; a fused experts module whose experts a GPTQ or AWQ checkpoint
    stores as `<name>.<e>.{gate,up,down}_proj.<those tensors>` (Qwen3-MoE) becomes a kdsl.nn.W4A16Experts running
    kdsl.ops.moe_w4a16), with its `bias`, its weights prepared for `device`
    (default: CUDA if available, else the CPU). Every other tensor of the model, modules_to_not_convert /
    ignore included, is loaded from the checkpoint.

    dtype (float16 or bfloat16): the dtype the int4 layers compute in; default: the dtype of each replaced
    nn.Linear's weight. int4 scales are converted to it at load time whatever dtype the checkpoint stored them
    in (fp16 scales in a bf16 model, say); every other float tensor takes the dtype the model gives it.

    A config key kdsl does not know, a missing, extra, mis-shaped or mis-typed tensor raises (ValueError /
    CheckpointError naming it) before anything changes; layers are read one at a time.

    Tensor parallel: tp_plan maps module-name patterns (fnmatch: "layers.*.mlp.up_proj") to "column",
    "row" or "mlp"; each quantized linear a pattern matches becomes a kdsl.parallel.ColumnParallelLinear (output
    gathered) or RowParallelLinear (takes the whole input, all-reduces) over `group` (default: the default
    process group), built from this rank's slice of its tensors (DeepSeek FP8, GPTQ and AWQ with zero points;
    other formats are refused under tp_plan). "mlp" ("model.layers.*.mlp") replaces each module it matches, a
    gated MLP holding gate_proj, up_proj and down_proj linears (and a SiLU act_fn), with a
    kdsl.parallel.ParallelMLP: one gate_up GEMM, SiLU * up in one kernel, row-parallel down, one all-reduce.
    A module it matches that is not such an MLP (other children holding tensors, another activation, a linear
    left unquantized) and a pattern that matches nothing are refused. A layer that cannot be cut raises
    kdsl.parallel.ShardError and leaves the model as it was.
    """
    folder = Path(path)
    config = _read_config(folder)
    for pattern, style in (tp_plan or {}).items():
        if style not in TP_STYLES:
            raise ValueError(f"tp_plan[{pattern!r}]: expected 'column', 'row' or 'mlp', got {style!r}")
    if dtype is not None and dtype not in ACT_DTYPES:
        raise TypeError(f"dtype: expected torch.float16 or torch.bfloat16, got {dtype}")
    hf = read_hf_config(config["quantization_config"])
    require_served_scheme(scheme_from_hf(config["quantization_config"]))
    fmt = FORMATS[hf.source](hf)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shards = _Shards(folder)
    plan = _plan(model, shards, fmt)
    mlps = _parallel_mlps(model, plan, tp_plan)
    in_mlps = {linear for linears in mlps.values() for linear in linears.values()}
    if tp_plan and not fmt.tp and (mlps or any(_tp_style(name, tp_plan) for name in plan.quantized)):
        raise CheckpointError(f"tp_plan: tensor-parallel loading does not read {hf.source} checkpoints"
                              f"{' with inverse scales' if hf.scale_inverse else ''} yet; load without tp_plan")

    swapped = []
    try:
        for name, linears in mlps.items():
            gate = model.get_submodule(linears["gate"])
            act_dtype = dtype or (gate.weight.dtype if gate.weight.dtype in ACT_DTYPES else None)
            swapped.append((name, _swap(model, name, _build_parallel_mlp(fmt.scheme, shards, plan, linears, device,
                                                                         group, act_dtype))))
        for name, roles in plan.quantized.items():
            if name in in_mlps:
                continue
            style = _tp_style(name, tp_plan)
            if style is not None:
                swapped.append((name, _swap(model, name, _build_parallel(fmt.scheme, style, shards, roles, device,
                                                                           group))))
                continue
            linear = model.get_submodule(name)
            k, n = linear.in_features, linear.out_features
            tensors = {}
            for role, key in roles.items():
                tensors[role] = shards.load(key, device)
                fmt.check_values(key, role, tensors[role], k, n)
            act_dtype = dtype or (linear.weight.dtype if linear.weight.dtype in ACT_DTYPES else None)
            swapped.append((name, _swap(model, name, fmt.build(tensors, act_dtype))))
            del tensors
        for name, experts in plan.experts.items():
            tensors = [{role: shards.load(key, device) for role, key in roles.items()} for roles in experts]
            gate_up = model.get_submodule(name).gate_up_proj
            act_dtype = dtype or (gate_up.dtype if gate_up.dtype in ACT_DTYPES else None)
            swapped.append((name, _swap(model, name, fmt.build_experts(tensors, act_dtype))))
            del tensors
    except Exception:
        for name, old in reversed(swapped):  # nothing half-replaced
            _swap(model, name, old)
        raise
    current = model.state_dict()
    plain = {}
    for key, ckpt in plan.plain.items():
        tensor = shards.load(ckpt, device)
        # The model's own dtype for that tensor, as load_state_dict's copy would give: dtype= sets the int4 layers'
        # compute dtype, not tensors the model keeps in float32 on purpose (DeepSeek-V3's router, say).
        target = current[key].dtype
        if tensor.is_floating_point() and current[key].is_floating_point() and tensor.dtype != target:
            tensor = tensor.to(target)
        plain[key] = tensor
    model.load_state_dict(plain, strict=False, assign=True)
    return model


def from_pretrained(path, *, device=None, dtype: torch.dtype = torch.bfloat16, **config_kwargs) -> nn.Module:
    """A transformers causal LM built from the checkpoint folder's config.json (AutoModelForCausalLM.from_config:
    nothing is downloaded) in `dtype` on `device`, with every quantized linear loaded by load_quantized.

    Needs transformers (`pip install kdsl[hf]`). The architecture is built dense first, so `device` must hold
    the unquantized model for a moment; each quantized linear then replaces its dense one."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ImportError("kdsl.from_pretrained needs transformers: pip install 'kdsl[hf]' "
                          "(or build the model yourself and call kdsl.load_quantized)") from None
    folder = Path(path)
    _read_config(folder)  # a folder without a quantization_config is refused before the model is built
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = AutoConfig.from_pretrained(str(folder), **config_kwargs)
    # transformers would apply its own quantizer for a quantization_config only in its from_pretrained;
    # from_config builds the plain architecture, whose linears load_quantized replaces.
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Inference only (kdsl's ops have no backward): parameters that require grad would make every activation
    # require it, and the ops refuse those under grad mode.
    model.eval().requires_grad_(False)
    return load_quantized(model, folder, device=device, dtype=dtype)
