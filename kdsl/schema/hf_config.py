"""What a Hugging Face ``quantization_config`` means: the kdsl scheme, and how its checkpoint stores it.

Formats read here (each the published writer's own):
  quant_method "fp8"                 DeepSeek-V3 / transformers FineGrainedFP8: `weight` e4m3 and
                                     `weight_scale_inv`, the dequantization multiplier per block; GPTQModel
                                     writes the same names with `weight_scale_semantics: "inverse"`: there
                                     `weight_scale_inv` holds 448 / amax, the reciprocal of the multiplier.
  quant_method "gptq"                GPTQ v1/v2 (AutoGPTQ, GPTQModel, optimum).
  quant_method "awq"                 AutoAWQ "gemm" packing, with zero points or symmetric (GPTQModel's default).
  quant_method "compressed-tensors"  llm-compressor: format "float-quantized" with FP8_BLOCK's arguments, or
                                     "pack-quantized" int4 weights (group or channel, symmetric or not,
                                     actorder), each config group mapped on its own and all required to agree.

A key is either read, listed as harmless (it records how the checkpoint was calibrated, not what a tensor
means), or listed as harmless only while unset; any other key is refused by name, since a key kdsl does
not know may change what a tensor means and ignoring it could give a silently wrong model.
"""
from __future__ import annotations

from dataclasses import dataclass

from kdsl.naming import is_gptq_group_size
from kdsl.schema.scheme import AWQ, GPTQ, SUPPORTED_GPTQ_BITS, BlockFP8

PREFIX = "quantization_config"

# Provenance and calibration settings that tools write beside the format (AutoGPTQ, GPTQModel, AutoAWQ,
# optimum, transformers): how the weights were found, never how they are stored.
CALIBRATION_KEYS = frozenset({
    "damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "model_name_or_path",
    "model_file_base_name", "meta", "quantizer", "lm_head", "use_exllama", "exllama_config", "use_cuda_fp16",
    "max_input_length", "cache_block_outputs", "batch_size", "tokenizer", "dataset",
    "module_name_preceding_first_block", "block_name_to_quantize", "modules_in_block_to_quantize",
    "mse", "act_group_aware", "gptaq", "foem", "v2", "v2_alpha", "v2_memory_device", "hyb_act",
    "offload_to_disk", "offload_to_disk_path", "failsafe", "fallback", "device", "vram_strategy", "gc_mode",
    "moe", "buffered_fwd", "wait_for_submodule_finalizers", "auto_forward_data_parallel", "weight_only",
    "preprocessors", "smooth", "pack_impl", "calibration", "duo_scaling", "modules_to_fuse",
    "do_fuse", "fuse_max_seq_len", "exllama_version", "use_marlin", "pack_dtype",
    # transformers' own configs: run-time choices and what the quantizer was given, not how tensors are stored
    "model_seqlen", "pad_token_id", "modules_to_convert", "dequantize",
})
# Keys that are harmless while unset (None, False, empty) and change what tensors mean otherwise.
UNSET_ONLY = {
    "dynamic": "per-module overrides of bits and group size",
    "adapter": "a LoRA adapter stored with the weights",
    "rotation": "weights stored in a rotated (Hadamard) basis",
    "is_marlin_format": "Marlin-repacked weights",
    "sparsity_config": "sparse weights",
    "transform_config": "weights stored in a transformed (rotated) basis",
    "moe_sparsity_config": "pruned experts",
    "kv_cache_scheme": "a quantized KV cache, which kdsl does not run",
}


@dataclass(frozen=True)
class HFQuantization:
    """A quantization_config, read: the scheme, the checkpoint's storage and the modules left unquantized."""

    scheme: BlockFP8 | GPTQ | AWQ
    source: str  # "fp8", "gptq", "awq", "compressed-tensors/float-quantized", "compressed-tensors/pack-quantized"
    scale_inverse: bool = False  # FP8 weight_scale_inv holds 1 / the dequantization multiplier (GPTQModel)
    ignore: tuple[str, ...] = ()  # module names ("re:" prefix: a regular expression) stored unquantized
    actorder: bool = False  # compressed-tensors: a weight_g_idx per layer


def _refuse(key: str, value, why: str) -> ValueError:
    return ValueError(f"{PREFIX}.{key} = {value!r} is not supported: {why}")


def _check_keys(config: dict, read: set[str], where: str = PREFIX) -> None:
    """Refuse a key that is neither read, nor harmless, nor harmless while unset (and unset)."""
    for key, value in config.items():
        if key in read or key in CALIBRATION_KEYS:
            continue
        if key in UNSET_ONLY:
            if value in (None, False, {}, [], ""):
                continue
            raise ValueError(f"{where}.{key} = {value!r} is not supported: it stores {UNSET_ONLY[key]}")
        raise ValueError(f"{where}.{key} is not a key kdsl knows for this format (value {value!r}); it could "
                         f"change what the checkpoint's tensors mean, so the checkpoint is refused rather than "
                         f"loaded with the key ignored")


def _int(config: dict, key: str, default, *aliases: str) -> int:
    for name in (key, *aliases):
        if name in config:
            value = config[name]
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{PREFIX}.{name} must be an integer, got {value!r}")
            return value
    return default


def _bool(config: dict, key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{PREFIX}.{key} must be true or false, got {value!r}")
    return value


def _ignore_list(config: dict, key: str) -> tuple[str, ...]:
    value = config.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{PREFIX}.{key} must be a list of module names, got {value!r}")
    return tuple(value)


def _bits(config: dict, *aliases: str) -> int:
    bits = _int(config, "bits", 4, *aliases)
    if bits not in SUPPORTED_GPTQ_BITS:
        raise _refuse("bits", bits, f"supported: {list(SUPPORTED_GPTQ_BITS)}")
    return bits


def _pack_dtype(config: dict) -> None:
    value = config.get("pack_dtype", "int32")
    if value not in ("int32", "torch.int32"):
        raise _refuse("pack_dtype", value, "kdsl reads int4 values packed in int32 words")


def read_hf_config(config: dict) -> HFQuantization:
    """Read a Hugging Face ``quantization_config`` dict; ValueError names the key kdsl cannot serve."""
    if not isinstance(config, dict):
        raise TypeError(f"{PREFIX} must be a dict, got {type(config).__name__}")
    method = config.get("quant_method", config.get("method"))
    readers = {"fp8": _fp8, "gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}
    if method not in readers:
        raise ValueError(f"{PREFIX}.quant_method = {method!r} is not supported; supported: "
                         f"{', '.join(repr(m) for m in readers)}")
    if "method" in config and "quant_method" in config and config["method"] != config["quant_method"]:
        raise ValueError(f"{PREFIX}.method = {config['method']!r} and quant_method = {config['quant_method']!r} "
                         "disagree")
    return readers[method](config)


def scheme_from_hf(config: dict) -> BlockFP8 | GPTQ | AWQ:
    """Map a Hugging Face ``quantization_config`` dict to a kdsl scheme (read_hf_config(config).scheme)."""
    return read_hf_config(config).scheme


# --- quant_method "fp8" --------------------------------------------------------------------------------

FP8_NAMES = ("e4m3", "float8_e4m3fn", "fp8", "e4m3fn")


def _fp8(config: dict) -> HFQuantization:
    _check_keys(config, {"quant_method", "method", "fmt", "format", "checkpoint_format", "activation_scheme",
                         "weight_block_size", "weight_scale_semantics", "weight_scale_method",
                         "modules_to_not_convert", "bits", "group_size", "desc_act", "sym", "scale_fmt",
                         "expert_dtype"})
    expert_dtype = config.get("expert_dtype")
    if expert_dtype is not None and str(expert_dtype).lower() not in FP8_NAMES:
        raise _refuse("expert_dtype", expert_dtype, "kdsl loads experts in the same block FP8 as the other layers")
    scale_fmt = config.get("scale_fmt")
    if scale_fmt not in (None, "float", "float32"):
        raise _refuse("scale_fmt", scale_fmt, "kdsl's block FP8 keeps float32 scales; power-of-two (ue8m0) "
                                              "activation scales are not served yet")
    for key in ("fmt", "format", "checkpoint_format"):
        if key in config and str(config[key]).lower() not in FP8_NAMES:
            raise _refuse(key, config[key], "kdsl's block FP8 is e4m3 (float8_e4m3fn)")
    activation = config.get("activation_scheme", "dynamic")
    if activation != "dynamic":
        raise _refuse("activation_scheme", activation, "block FP8 quantizes activations per token ('dynamic')")
    method = config.get("weight_scale_method", "block")
    if method != "block":
        raise _refuse("weight_scale_method", method, "kdsl serves block scales ('block'), not per-row or "
                                                      "per-tensor FP8")
    semantics = config.get("weight_scale_semantics", "multiplier")
    if semantics not in ("inverse", "multiplier"):
        raise _refuse("weight_scale_semantics", semantics, "known: 'inverse' (weight_scale_inv holds 448 / amax, "
                                                            "GPTQModel) and 'multiplier'")
    if _int(config, "bits", 8) != 8:
        raise _refuse("bits", config["bits"], "FP8 weights have 8 bits")
    if config.get("desc_act"):
        raise _refuse("desc_act", config["desc_act"], "FP8 weights have no act-order")
    block = config.get("weight_block_size")
    if block is None:
        raise ValueError(f"{PREFIX}.weight_block_size is missing: per-tensor FP8 is not a block-FP8 scheme")
    if not (isinstance(block, (list, tuple)) and len(block) == 2):
        raise ValueError(f"{PREFIX}.weight_block_size must be [n, k], got {block!r}")
    # DeepSeek-V3 quantizes activations in groups as wide as the weight block's K side.
    scheme = BlockFP8(weight_block=tuple(block), act_group=block[1])
    return HFQuantization(scheme, "fp8", scale_inverse=semantics == "inverse",
                          ignore=_ignore_list(config, "modules_to_not_convert"))


# --- quant_method "gptq" -------------------------------------------------------------------------------

def _gptq(config: dict) -> HFQuantization:
    # backend: which GPTQ kernel transformers/optimum should run ("auto", "marlin", ...), not the storage
    _check_keys(config, {"quant_method", "method", "bits", "group_size", "desc_act", "sym", "checkpoint_format",
                         "format", "modules_to_not_convert", "backend"})
    _pack_dtype(config)
    formats = {config[key] for key in ("checkpoint_format", "format") if key in config}
    if len(formats) > 1:
        raise ValueError(f"{PREFIX}.checkpoint_format and format disagree: {sorted(formats)}")
    fmt = formats.pop() if formats else "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "supported: 'gptq', 'gptq_v2'")
    group_size = _int(config, "group_size", 128)
    if not is_gptq_group_size(group_size):
        raise ValueError(f"{PREFIX}.group_size = {group_size} must be a power of two >= 16 or -1")
    scheme = GPTQ(bits=_bits(config), group_size=group_size, sym=_bool(config, "sym", True),
                  desc_act=_bool(config, "desc_act", False), checkpoint_format=fmt)
    return HFQuantization(scheme, "gptq", ignore=_ignore_list(config, "modules_to_not_convert"))


# --- quant_method "awq" --------------------------------------------------------------------------------

def _awq(config: dict) -> HFQuantization:
    _check_keys(config, {"quant_method", "method", "bits", "w_bit", "group_size", "q_group_size", "zero_point",
                         "sym", "version", "format", "checkpoint_format", "backend", "desc_act",
                         "modules_to_not_convert"})
    _pack_dtype(config)
    for key in ("version", "format", "checkpoint_format"):
        value = config.get(key, "gemm")
        if not isinstance(value, str) or value.lower() != "gemm":
            raise _refuse(key, value, "supported: 'gemm' (AutoAWQ's 'gemv', 'gemv_fast' and 'marlin' pack "
                                      "the weights differently)")
    backend = config.get("backend")  # GPTQModel: who packed the weights; transformers: which kernel to run
    if backend not in (None, "auto", "autoawq"):
        raise _refuse("backend", backend, "llm-awq packs its weights for its GEMV kernel; supported: 'autoawq' "
                                          "(or transformers' 'auto')")
    if config.get("desc_act"):
        raise _refuse("desc_act", config["desc_act"], "AWQ checkpoints have no act-order")
    # zero_point decides: GPTQModel writes sym = not zero_point, and transformers' AwqConfig carries its parent
    # GPTQConfig's sym = true beside zero_point = true, which means nothing for AWQ.
    zero_point = _bool(config, "zero_point", True)
    group_size = _int(config, "group_size", 128, "q_group_size")
    if group_size == -1 or not is_gptq_group_size(group_size):
        raise ValueError(f"{PREFIX}.group_size = {group_size} must be a power of two >= 16")
    scheme = AWQ(bits=_bits(config, "w_bit"), group_size=group_size, zero_point=zero_point)
    return HFQuantization(scheme, "awq", ignore=_ignore_list(config, "modules_to_not_convert"))


# --- quant_method "compressed-tensors" -----------------------------------------------------------------

ARG_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
            "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}
SERVED_CT = "kdsl serves FP8_BLOCK (format float-quantized) and int4 weight-only W4A16 (format pack-quantized)"


def _args(group: str, role: str, args) -> dict:
    where = f"{PREFIX}.config_groups.{group}.{role}"
    if not isinstance(args, dict):
        raise ValueError(f"{where} must be an object, got {args!r}")
    unknown = sorted(set(args) - ARG_KEYS)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not a quantization argument kdsl knows; refused rather than "
                         "ignored")
    return args


def _ct_refuse(group: str, field_path: str, value, why: str = SERVED_CT) -> ValueError:
    return ValueError(f"{PREFIX}.config_groups.{group}.{field_path} = {value!r} is not served: {why}")


def _ct_group(name: str, group: dict, default_format: str | None) -> tuple[str, BlockFP8 | GPTQ, bool]:
    """One config group -> (format, scheme, actorder)."""
    if not isinstance(group, dict):
        raise ValueError(f"{PREFIX}.config_groups.{name} must be an object, got {group!r}")
    unknown = sorted(set(group) - {"targets", "weights", "input_activations", "output_activations", "format"})
    if unknown:
        raise ValueError(f"{PREFIX}.config_groups.{name}.{unknown[0]} is not a key kdsl knows; refused rather "
                         "than ignored")
    fmt = group.get("format") or default_format
    if group.get("output_activations") is not None:
        raise _ct_refuse(name, "output_activations", group["output_activations"])
    weights = group.get("weights")
    if weights is None:
        raise _ct_refuse(name, "weights", None, "a group without weight quantization has nothing for kdsl to run")
    w = _args(name, "weights", weights)
    inputs = group.get("input_activations")
    a = None if inputs is None else _args(name, "input_activations", inputs)
    wtype, bits, strategy = w.get("type", "int"), w.get("num_bits", 8), w.get("strategy")
    if w.get("dynamic", False) is not False:
        raise _ct_refuse(name, "weights.dynamic", w.get("dynamic"), "weights must be stored quantized")
    if wtype == "float":
        if bits != 8:
            raise _ct_refuse(name, "weights.num_bits", bits, "FP4 and other float formats (nvfp4, mxfp4) are not "
                                                             "served; " + SERVED_CT)
        if strategy != "block":
            raise _ct_refuse(name, "weights.strategy", strategy, "FP8 with per-tensor or per-channel scales is not "
                                                                 "served; " + SERVED_CT)
        block = w.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block)):
            raise ValueError(f"{PREFIX}.config_groups.{name}.weights.block_structure must be [n, k], got {block!r}")
        if not w.get("symmetric", True):
            raise _ct_refuse(name, "weights.symmetric", False, "FP8 weights are symmetric")
        if fmt not in (None, "float-quantized"):
            raise _ct_refuse(name, "format", fmt, "block-FP8 weights are read in format 'float-quantized'")
        if a is None:
            raise _ct_refuse(name, "input_activations", None, "FP8 weights with unquantized activations are not "
                                                              "served: kdsl's block FP8 quantizes activations")
        checks = {"type": "float", "num_bits": 8, "strategy": "group", "dynamic": True}
        for key, expected in checks.items():
            if a.get(key) != expected:
                raise _ct_refuse(name, f"input_activations.{key}", a.get(key),
                                 f"block FP8 quantizes activations as FP8 per token in groups along K "
                                 f"(expected {expected!r})")
        if not a.get("symmetric", True):
            raise _ct_refuse(name, "input_activations.symmetric", False, "FP8 activations are symmetric")
        if a.get("group_size") != block[1]:
            raise _ct_refuse(name, "input_activations.group_size", a.get("group_size"),
                             f"kdsl's activation groups match the weight block's K side ({block[1]})")
        return "float-quantized", BlockFP8(weight_block=tuple(block), act_group=block[1]), False
    if wtype != "int":
        raise _ct_refuse(name, "weights.type", wtype)
    if a is not None:
        raise _ct_refuse(name, "input_activations", a, "int8 activations (W8A8, W4A8) are not served; " + SERVED_CT)
    if bits != 4:
        raise _ct_refuse(name, "weights.num_bits", bits, "kdsl's integer kernels take 4-bit weights; " + SERVED_CT)
    if fmt not in (None, "pack-quantized"):
        raise _ct_refuse(name, "format", fmt, "int4 weights are read in format 'pack-quantized'")
    if strategy == "group":
        group_size = w.get("group_size")
        if not isinstance(group_size, int) or not is_gptq_group_size(group_size) or group_size == -1:
            raise _ct_refuse(name, "weights.group_size", group_size, "a power of two >= 16")
    elif strategy == "channel":
        group_size = -1
    else:
        raise _ct_refuse(name, "weights.strategy", strategy, "int4 weights are served with 'group' or 'channel' "
                                                             "scales")
    actorder = w.get("actorder")
    if actorder not in (None, False, "weight", "static", "group", "dynamic"):
        raise _ct_refuse(name, "weights.actorder", actorder, "known: 'group', 'weight' (and aliases)")
    g_idx = actorder in ("group", "dynamic")
    if g_idx and strategy != "group":
        raise _ct_refuse(name, "weights.actorder", actorder, "a g_idx needs group scales")
    sym = w.get("symmetric", True)
    if not isinstance(sym, bool):
        raise ValueError(f"{PREFIX}.config_groups.{name}.weights.symmetric must be true or false, got {sym!r}")
    scheme = GPTQ(bits=4, group_size=group_size, sym=sym, desc_act=g_idx, checkpoint_format="gptq_v2")
    return "pack-quantized", scheme, g_idx


def _compressed_tensors(config: dict) -> HFQuantization:
    _check_keys(config, {"quant_method", "format", "config_groups", "ignore", "quantization_status",
                         "global_compression_ratio", "version", "provider"})
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", status, "kdsl loads checkpoints saved compressed ('compressed')")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{PREFIX}.config_groups must name at least one group, got {groups!r}")
    fmt = config.get("format")
    if fmt not in (None, "float-quantized", "pack-quantized", "mixed-precision"):
        raise _refuse("format", fmt, SERVED_CT)
    read = {name: _ct_group(name, group, None if fmt == "mixed-precision" else fmt) for name, group in groups.items()}
    kinds = {(f, s) for f, s, _ in read.values()}
    if len(kinds) > 1:
        raise ValueError(f"{PREFIX}.config_groups: the groups quantize differently ({', '.join(sorted(read))}); "
                         "kdsl loads one scheme per checkpoint")
    (ct_format, scheme), = kinds
    actorder = any(g for _, _, g in read.values())
    return HFQuantization(scheme, f"compressed-tensors/{ct_format}", ignore=_ignore_list(config, "ignore"),
                          actorder=actorder)
