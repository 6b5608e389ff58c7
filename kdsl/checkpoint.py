"""Load a quantized checkpoint folder into a model: load_quantized, and from_pretrained for transformers users.

What the config means comes from kdsl.schema.read_hf_config; each format's tensors per quantized linear (names,
shapes, dtypes) and how they become an FP8Linear or a W4A16Linear are its scheme unit's (kdsl.nn.schemes: a
LayerFormat); here the folder is read against them. Everything is checked from the safetensors headers before
anything changes, then layers are read one at a time. With a tp_plan the layers it names become kdsl.parallel's
modules, which is why this loader stands above both kdsl.nn and kdsl.parallel.
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
from kdsl.nn.norm import swap_transformers_norms
from kdsl.nn.schemes import CheckpointError, LayerFormat, handler_for
from kdsl.nn.schemes.base import ACT_DTYPES
from kdsl.parallel import ColumnParallelLinear, ParallelMLP, RowParallelLinear
from kdsl.runtime.registry import require_served_scheme
from kdsl.schema import read_hf_config, scheme_from_hf

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


def _roles(shards: _Shards, prefix: str, specs: dict, what: str, problems: list[str]) -> dict[str, str]:
    """{role: checkpoint key} of one layer's tensors `prefix.<role>` against their specs; what does not fit (a
    required tensor missing, a shape or dtype other than the spec's) is appended to problems."""
    roles = {}
    for role, spec in specs.items():
        key = f"{prefix}.{role}"
        if key not in shards.where:
            if spec.required:
                problems.append(f"{key}: missing (expected shape {spec.shape})")
            continue
        if shards.shape(key) != spec.shape:
            problems.append(f"{key}: expected shape {spec.shape} for {what}, found {shards.shape(key)}")
        elif shards.dtype(key) not in spec.dtypes:
            problems.append(f"{key}: expected dtype {' or '.join(spec.dtypes)}, found {shards.dtype(key)}")
        roles[role] = key
    return roles


def _plan(model: nn.Module, shards: _Shards, fmt: LayerFormat) -> _Plan:
    plan, problems = _Plan(), []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        key = f"{name}.{fmt.marker}"
        if key not in shards.where or not fmt.marks(shards.dtype(key)) or _ignored(name, fmt.hf.ignore):
            continue
        plan.quantized[name] = _roles(shards, name, fmt.specs(module.in_features, module.out_features),
                                      f"{module.in_features} -> {module.out_features}", problems)
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
            plan.experts[name].append(_roles(shards, f"{name}.{e}", fmt.expert_specs(inter, hidden),
                                             f"expert {e} of {experts} (I = {inter}, H = {hidden})", problems))
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
    t = {role: shards.load(key, device) if role in ("g_idx", "bias") else shards.lazy(key, device)
         for role, key in roles.items()}
    cls = ColumnParallelLinear if style == "column" else RowParallelLinear
    return cls.from_checkpoint(t, group=group, scheme=scheme)


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


def _build_parallel_mlp(fmt: LayerFormat, shards: _Shards, plan: _Plan, linears: dict[str, str], device, group,
                        act_dtype: torch.dtype | None) -> nn.Module:
    """A ParallelMLP from this rank's slices of gate, up and down (g_idx and biases are read whole); tensors are
    converted as they are read where the format says (fmt.read_dtypes: int4 scales to act_dtype, default the
    checkpoint's; FP8 scales to float32)."""
    tensors = {}
    for role, linear in linears.items():
        t = {}
        for name, key in plan.quantized[linear].items():
            t[name] = shards.load(key, device) if name in ("g_idx", "bias") else shards.lazy(key, device)
        for name, dtype in fmt.read_dtypes(act_dtype).items():
            if name in t and t[name].dtype != dtype:
                t[name] = _AsDtype(t[name], dtype)
        tensors[role] = t
    return ParallelMLP.from_checkpoint(**tensors, group=group, scheme=fmt.scheme)


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
    fmt = handler_for(hf.scheme).formats[hf.source](hf)  # the scheme unit's reader of this checkpoint format
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
            swapped.append((name, _swap(model, name, _build_parallel_mlp(fmt, shards, plan, linears, device,
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


def from_pretrained(path, *, device=None, dtype: torch.dtype = torch.bfloat16, fused_norms: bool = True,
                    **config_kwargs) -> nn.Module:
    """A transformers causal LM built from the checkpoint folder's config.json (AutoModelForCausalLM.from_config:
    nothing is downloaded) in `dtype` on `device`, with every quantized linear loaded by load_quantized.

    fused_norms: transformers' Llama-family RMSNorms (kdsl.nn.norm.TRANSFORMERS_LLAMA_NORMS; several torch kernels
    each) become kdsl.nn.RMSNorm, one kernel computing the same roundings; other norms stay as they are.

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
    load_quantized(model, folder, device=device, dtype=dtype)
    if fused_norms:
        swap_transformers_norms(model)
    return model
