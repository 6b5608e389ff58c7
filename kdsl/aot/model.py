"""What one model needs exported (`kdsl aot --model DIR`, `kdsl aot --shapes FILE`): the ops, schemes, sizes and
dtypes of its quantized layers, so that the export compiles their specializations instead of those of every
representative size (abi.OpAbi.problems).

A checkpoint folder is read without loading any tensor data: config.json's quantization_config gives the scheme
(kdsl.scheme_from_hf), the safetensors headers give each quantized linear's N x K and dtypes. Every tile bucket
of the chosen kernels keeps its assumption-free specialization, so a call of another size still finds a cubin.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kdsl.aot import abi as abis
from kdsl.ops import block_fp8, gptq, w4a16

# torch dtype names in config.json -> the ABI's dtype names (abi.DTYPES)
_CONFIG_DTYPES = {torch_name: name for name, (_, _, torch_name) in abis.DTYPES.items()}
_SAFETENSORS_DTYPES = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
_HEADER_LIMIT = 100 * 2 ** 20  # safetensors caps its JSON header at 100 MB


class ModelError(ValueError):
    """The checkpoint or shape file cannot say what to export; the message names the file and key."""


@dataclass
class Needs:
    """What to export for one model: per op its problems (abi.OpAbi.problems), the schemes and dtypes."""
    source: str  # "model DIR" or "shapes FILE", for messages
    problems: dict = field(default_factory=dict)  # op -> () -> tuple of problem dicts
    schemes: list | None = None  # scheme names (None: every scheme the op serves)
    dtypes: list | None = None  # ABI dtype names (None: every dtype)
    found: list = field(default_factory=list)  # lines saying what was read, printed by `kdsl aot`


def _problems(items) -> callable:
    """A problems callable over a fixed list, duplicates dropped (order kept: the export's order follows it)."""
    unique = tuple({json.dumps(p, sort_keys=True): p for p in items}.values())
    return lambda: unique


def safetensors_header(path: Path) -> dict:
    """{tensor name: (dtype, shape)} from a .safetensors file's header: its first 8 bytes give the length of a
    JSON header naming each tensor's dtype, shape and offsets; the tensor data after it is not read."""
    try:
        with path.open("rb") as file:
            prefix = file.read(8)
            if len(prefix) != 8:
                raise ModelError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > _HEADER_LIMIT:
                raise ModelError(f"{path}: not a safetensors file (header length {length} bytes)")
            raw = file.read(length)
    except OSError as error:
        raise ModelError(f"{path}: cannot read ({error.strerror or error})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelError(f"{path}: not a safetensors file (its header is not JSON: {error})") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: not a safetensors file (its header is not a JSON object)")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)):
            raise ModelError(f"{path}: tensor {name!r} has no dtype and shape in the header")
        tensors[name] = (info["dtype"], tuple(info["shape"]))
    return tensors


def _read_config(folder: Path) -> tuple[Path, dict]:
    path = folder / "config.json"
    if not folder.is_dir():
        raise ModelError(f"{folder}: not a folder (--model wants a checkpoint folder: config.json and *.safetensors)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{path}: missing (--model wants a checkpoint folder: config.json and *.safetensors)") \
            from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelError(f"{path}: unreadable ({error})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return path, config


def _quantized_linears(tensors: dict, where: dict, scheme) -> tuple[list, set]:
    """[(name, N, K)] of the quantized linears in the checkpoint's tensors, and the dtypes of their scales (int4).
    where: the file of each tensor, which errors name."""
    from kdsl.schema import BlockFP8
    from kdsl.schema.scheme import AWQ

    def at(key: str) -> str:
        return f"{where[key]}: {key}"

    linears, scale_dtypes = [], set()
    if isinstance(scheme, BlockFP8):
        block_n, block_k = scheme.weight_block
        for key, (dtype, shape) in sorted(tensors.items()):
            if not key.endswith(".weight") or dtype != "F8_E4M3":
                continue
            name = key.removesuffix(".weight")
            if len(shape) != 2:
                raise ModelError(f"{at(key)}: a float8 weight of shape {list(shape)}; expected [N, K]")
            n, k = shape
            scale = tensors.get(f"{name}.weight_scale_inv")
            if scale is None:
                raise ModelError(f"{at(key)}: float8 without {name}.weight_scale_inv (block FP8 keeps one per "
                                 f"{block_n}x{block_k} block)")
            blocks = (-(-n // block_n), -(-k // block_k))
            if scale[1] != blocks:
                raise ModelError(f"{at(name + '.weight_scale_inv')}: shape {list(scale[1])}, expected "
                                 f"{list(blocks)} for weight [{n}, {k}] in {block_n}x{block_k} blocks")
            if k % scheme.act_group:
                raise ModelError(f"{at(key)}: K = {k} is not a multiple of the activation group {scheme.act_group}")
            linears.append((name, n, k))
        return linears, scale_dtypes
    awq = isinstance(scheme, AWQ)
    pack = scheme.pack_factor
    for key, (dtype, shape) in sorted(tensors.items()):
        if not key.endswith(".qweight"):
            continue
        name = key.removesuffix(".qweight")
        if len(shape) != 2 or dtype != "I32":
            raise ModelError(f"{at(key)}: {dtype} of shape {list(shape)}; expected int32 [K / {pack}, N]"
                             + (" (AWQ: [K, N / 8])" if awq else ""))
        k, n = (shape[0], shape[1] * pack) if awq else (shape[0] * pack, shape[1])
        scales = tensors.get(f"{name}.scales")
        if scales is None:
            raise ModelError(f"{at(key)}: no {name}.scales beside it")
        if scales[0] not in ("F16", "BF16"):
            raise ModelError(f"{at(name + '.scales')}: dtype {scales[0]}, expected F16 or BF16 (the activations' "
                             "dtype)")
        scale_dtypes.add(_SAFETENSORS_DTYPES[scales[0]])
        linears.append((name, n, k))
    return linears, scale_dtypes


def from_checkpoint(folder: Path) -> Needs:
    """The ops, schemes, sizes and dtypes of a Hugging Face checkpoint folder's quantized linears."""
    from kdsl.schema import BlockFP8, scheme_from_hf

    config_path, config = _read_config(folder)
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict):
        raise ModelError(f"{config_path}: no quantization_config object (not a quantized checkpoint: kdsl serves "
                         "quant_method 'fp8' block FP8, 'gptq' and 'awq')")
    try:
        scheme = scheme_from_hf(quantization)
    except ValueError as error:
        raise ModelError(f"{config_path}: quantization_config: {error}") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder}: no *.safetensors files")
    tensors, where = {}, {}
    for path in files:
        for name, info in safetensors_header(path).items():
            tensors[name], where[name] = info, path
    linears, scale_dtypes = _quantized_linears(tensors, where, scheme)
    if not linears:
        expected = ("<name>.weight float8_e4m3fn with <name>.weight_scale_inv" if isinstance(scheme, BlockFP8)
                    else "<name>.qweight int32 with <name>.qzeros and <name>.scales")
        raise ModelError(f"{folder}: no quantized linear in the *.safetensors headers (expected {expected} for "
                         f"quantization_config.quant_method {quantization.get('quant_method')!r})")
    nks = sorted({(n, k) for _, n, k in linears})
    needs = Needs(source=f"model {folder}", schemes=list(scheme.kernel_schemes))
    needs.found.append(f"{folder}: {scheme.name}, {len(linears)} quantized linear(s), {len(nks)} N x K: "
                       + ", ".join(f"{n}x{k}" for n, k in nks))
    if isinstance(scheme, BlockFP8):
        dtype = config.get("torch_dtype", config.get("dtype"))
        needs.dtypes = [_CONFIG_DTYPES[dtype]] if dtype in _CONFIG_DTYPES else None
        needs.problems["act_quant"] = _problems(block_fp8.act_quant_problems(sorted({k for _, k in nks})))
        needs.problems["fp8_gemm"] = _problems(block_fp8.fp8_gemm_problems(nks))
        mla = [config.get(key) for key in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")]
        if all(isinstance(value, int) and value > 0 for value in mla):
            # DeepSeek's MLA with absorbed weights: per head, q_nope [.., qk_nope] times W_UK -> [.., kv_lora_rank],
            # then [.., kv_lora_rank] times W_UV -> [.., v_head]: two batched GEMMs over the heads (one GPU's).
            heads, rank, nope, v_head = mla
            needs.problems["fp8_bmm"] = _problems(block_fp8.fp8_bmm_problems((heads,), ((rank, nope), (v_head, rank))))
            needs.found.append(f"{config_path}: MLA, {heads} heads: fp8_bmm at N x K {rank}x{nope} and {v_head}x{rank}")
    else:
        needs.dtypes = sorted(scale_dtypes)
        # With and without act-order whatever the checkpoint's desc_act: the tiles that only act-order calls reach
        # (the alternatives of tiles that refuse them) would otherwise get every constexpr combination compiled,
        # more than the act-order problems add.
        needs.problems["w4a16_gemm"] = _problems(w4a16.w4a16_problems(nks))
        # Not in a model's forward (load-time dequantization): exported only when --op names it.
        needs.problems["gptq_dequant"] = _problems(gptq.gptq_dequant_problems(nks))
    return needs


# Ops a model's forward runs; the others (gptq_dequant: a load-time conversion) are exported when --op names them.
FORWARD_OPS = tuple(op for op, abi in abis.OPS.items() if abi.in_forward)


def from_shapes(spec: str) -> Needs:
    """The problems of a bench shape file or preset (kdsl.bench.shapes): its (M, N, K) per op, every scheme and
    dtype (narrow them with --scheme and --dtype). fp8_gemm's sizes also give act_quant's (M, K): a model
    quantizes its activations before each such GEMM."""
    from kdsl.bench.shapes import ShapeFileError, resolve_shapes

    try:
        cases = resolve_shapes(spec)
    except ShapeFileError as error:
        raise ModelError(str(error)) from None
    problems = {}
    needs = Needs(source=f"shapes {spec}")
    for case in cases:
        makers = [abi.bench_problems[case.op] for abi in abis.OPS.values() if case.op in abi.bench_problems]
        if not makers:
            if f"{case.op}:" not in " ".join(needs.found):
                needs.found.append(f"{case.op}: not exported yet (its OpSpec has no c_abi); left out")
            continue
        for make in makers:
            for op, items in make(case).items():
                problems.setdefault(op, []).extend(items)
    if not problems:
        raise ModelError(f"{spec}: no shapes of an exportable op ({', '.join(abis.OPS)})")
    needs.problems = {op: _problems(items) for op, items in problems.items()}
    needs.found.append(f"{spec}: " + ", ".join(f"{op} {len(needs.problems[op]())} problems" for op in needs.problems))
    return needs
