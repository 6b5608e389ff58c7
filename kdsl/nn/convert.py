"""Put kdsl's quantized linears into a model: quantize_ (from float weights) and load_quantized (a checkpoint).

Both check everything before they change anything, so a refusal leaves the model as it was.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from kdsl.nn.modules import FP8Linear, W4A16Linear
from kdsl.schema import GPTQ, BlockFP8
from kdsl.schema.scheme import AWQ

FilterFn = Callable[[nn.Module, str], bool]


def _serves(scheme) -> FilterFn:
    """The default filter: nn.Linear layers whose shapes the scheme's kernels take."""
    def fits(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        k, n = module.in_features, module.out_features
        if isinstance(scheme, BlockFP8):
            return k % scheme.act_group == 0 and n % 8 == 0
        group = k if scheme.group_size == -1 else scheme.group_size
        return k % group == 0 and k % 8 == 0 and n % 8 == 0
    return fits


def _builder(scheme) -> Callable[[nn.Linear], nn.Module]:
    if isinstance(scheme, BlockFP8):
        return lambda linear: FP8Linear.from_float(linear, scheme)
    if isinstance(scheme, (GPTQ, AWQ)):
        return lambda linear: W4A16Linear.from_float(linear, scheme)
    raise TypeError(f"scheme: expected kdsl.BlockFP8, kdsl.GPTQ or kdsl.AWQ, got {type(scheme).__name__}")


def _swap(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put new where name is; returns what was there."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


def quantize_(model: nn.Module, scheme, filter_fn: FilterFn | None = None) -> nn.Module:
    """Replace, in place, each nn.Linear of model for which filter_fn(module, name) holds (default: every
    nn.Linear whose shapes the scheme serves) with FP8Linear (BlockFP8) or W4A16Linear (GPTQ, AWQ), as
    torchao's quantize_ does. GPTQ and AWQ weights come from round-to-nearest (kdsl.ops.gptq_quantize), not
    from a calibrated GPTQ/AWQ run. Every replacement is built before any is put in: an error changes nothing.
    Returns model (the replacement itself when model is an nn.Linear)."""
    build = _builder(scheme)
    keep = filter_fn or _serves(scheme)
    chosen = [(name, module) for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and keep(module, name)]
    built = [(name, build(module)) for name, module in chosen]
    for name, new in built:
        if name == "":
            return new
        _swap(model, name, new)
    return model


# --- checkpoints ----------------------------------------------------------------------------------------

class CheckpointError(ValueError):
    """The checkpoint does not fit the model: names the tensor, the expected and the found shape or dtype."""


@dataclass
class _Plan:
    quantized: dict[str, dict[str, str]] = field(default_factory=dict)  # module name -> {role: key}
    plain: dict[str, str] = field(default_factory=dict)  # model state_dict key -> checkpoint key


def _tensor_specs(scheme, k: int, n: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], bool]]:
    """role -> (shape, allowed safetensors dtypes, required) of one quantized linear in the published names."""
    if isinstance(scheme, BlockFP8):
        bn, bk = scheme.weight_block
        return {"weight": ((n, k), ("F8_E4M3",), True),
                "weight_scale_inv": ((-(-n // bn), -(-k // bk)), ("F32",), True),
                "bias": ((n,), ("BF16", "F16", "F32"), False)}
    groups = 1 if scheme.group_size == -1 else k // scheme.group_size
    halves = ("F16", "BF16")
    if isinstance(scheme, AWQ):
        return {"qweight": ((k, n // 8), ("I32",), True), "qzeros": ((groups, n // 8), ("I32",), True),
                "scales": ((groups, n), halves, True), "bias": ((n,), halves + ("F32",), False)}
    return {"qweight": ((k // 8, n), ("I32",), True), "qzeros": ((groups, n // 8), ("I32",), True),
            "scales": ((groups, n), halves, True), "g_idx": ((k,), ("I32",), False),
            "bias": ((n,), halves + ("F32",), False)}


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
                       "BF16": torch.bfloat16, "I32": torch.int32}


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


def _plan(model: nn.Module, shards: _Shards, scheme, skip: list[str]) -> _Plan:
    plan, problems = _Plan(), []
    quantized_modules = set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        specs = _tensor_specs(scheme, module.in_features, module.out_features)
        quantized_role = next(iter(specs))  # weight for FP8 (float8 there), qweight for int4
        key = f"{name}.{quantized_role}"
        is_quantized = key in shards.where and (not isinstance(scheme, BlockFP8) or shards.dtype(key) == "F8_E4M3")
        if not is_quantized or any(part in name for part in skip):
            continue
        roles = {}
        for role, (shape, dtypes, required) in specs.items():
            key = f"{name}.{role}"
            if key not in shards.where:
                if required:
                    problems.append(f"{key}: missing (expected shape {shape})")
                continue
            if shards.shape(key) != shape:
                problems.append(f"{key}: expected shape {shape} for {module.in_features} -> {module.out_features}, "
                                f"found {shards.shape(key)}")
            elif shards.dtype(key) not in dtypes:
                problems.append(f"{key}: expected dtype {' or '.join(dtypes)}, found {shards.dtype(key)}")
            roles[role] = key
        plan.quantized[name] = roles
        quantized_modules.add(name)
    for key, tensor in model.state_dict().items():
        owner = key.rpartition(".")[0]
        if owner in quantized_modules:
            continue
        if key not in shards.where:
            problems.append(f"{key}: missing (the model has it, shape {tuple(tensor.shape)})")
        elif shards.shape(key) != tuple(tensor.shape):
            problems.append(f"{key}: expected shape {tuple(tensor.shape)}, found {shards.shape(key)}")
        else:
            plan.plain[key] = key
    used = set(plan.plain) | {key for roles in plan.quantized.values() for key in roles.values()}
    problems += [f"{key}: in the checkpoint but not in the model" for key in sorted(set(shards.where) - used)]
    if problems:
        raise CheckpointError("the checkpoint does not fit the model:\n  " + "\n  ".join(problems))
    return plan


def _build(scheme, tensors: dict[str, torch.Tensor]) -> nn.Module:
    bias = tensors.get("bias")
    if isinstance(scheme, BlockFP8):
        return FP8Linear(tensors["weight"], tensors["weight_scale_inv"], bias, scheme)
    if isinstance(scheme, AWQ):
        return W4A16Linear.from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], bias, scheme)
    return W4A16Linear.from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"),
                                 bias, scheme)


TP_STYLES = ("column", "row")


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


def load_quantized(model: nn.Module, path, device=None, *, tp_plan: dict[str, str] | None = None,
                   group=None) -> nn.Module:
    """Load a quantized checkpoint folder (config.json with a quantization_config, *.safetensors shards in the
    published key names) into model, in place.

    Each nn.Linear with quantized tensors in the checkpoint becomes an FP8Linear (DeepSeek-V3 FP8:
    `<name>.weight` float8_e4m3fn + `<name>.weight_scale_inv`) or a W4A16Linear (GPTQ v1/v2 `qweight`,
    `qzeros`, `scales`, optional `g_idx`; AWQ `qweight`, `qzeros`, `scales`), with its `bias`, its weights
    prepared for `device` (default: CUDA if available, else the CPU). Every other tensor of the model,
    modules_to_not_convert included, is loaded from the checkpoint as it is. A missing, extra, mis-shaped or
    mis-typed tensor raises CheckpointError naming it before anything changes; layers are read one at a time.

    Tensor parallel: tp_plan maps module-name patterns (fnmatch: "layers.*.mlp.up_proj") to "column" or
    "row"; each quantized linear a pattern matches becomes a kdsl.parallel.ColumnParallelLinear (output
    gathered) or RowParallelLinear (takes the whole input, all-reduces) over `group` (default: the default
    process group), built from this rank's slice of its tensors, read with safetensors get_slice (GPTQ
    act-order row parallel reads the whole qweight, whose rows it re-orders by group). A layer that cannot
    be cut raises kdsl.parallel.ShardError and leaves the model as it was.
    """
    import kdsl

    folder = Path(path)
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_path}: unreadable ({error})") from None
    if not isinstance(config.get("quantization_config"), dict):
        raise CheckpointError(f"{config_path}: no quantization_config")
    quant = config["quantization_config"]
    for pattern, style in (tp_plan or {}).items():
        if style not in TP_STYLES:
            raise ValueError(f"tp_plan[{pattern!r}]: expected 'column' or 'row', got {style!r}")
    scheme = kdsl.scheme_from_hf(quant)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shards = _Shards(folder)
    plan = _plan(model, shards, scheme, list(quant.get("modules_to_not_convert") or []))

    swapped = []
    try:
        for name, roles in plan.quantized.items():
            style = _tp_style(name, tp_plan)
            if style is not None:
                swapped.append((name, _swap(model, name, _build_parallel(scheme, style, shards, roles, device,
                                                                           group))))
                continue
            tensors = {role: shards.load(key, device) for role, key in roles.items()}
            swapped.append((name, _swap(model, name, _build(scheme, tensors))))
            del tensors
    except Exception:
        for name, old in reversed(swapped):  # nothing half-replaced
            _swap(model, name, old)
        raise
    model.load_state_dict({key: shards.load(ckpt, device) for key, ckpt in plan.plain.items()},
                          strict=False, assign=True)
    return model
