"""What to benchmark: shape presets and the JSON shape-file format, turned into a list of cases.

A shape file is a JSON object whose keys are op names; each maps to a list of entries:

    {"fp8_gemm":       [{"m": [1, 16], "n": 2112, "k": 7168}],
     "act_quant":      [{"m": 4096, "k": 7168}],
     "weight_dequant": [{"n": 7168, "k": 16384}],
     "gptq_gemm":      [{"m": [1], "k": 4096, "n": 4096}],
     "gptq_dequant":   [{"n": 14336, "k": 4096}],
     "fp8_bmm":        [{"batch": 128, "m": [1, 64], "n": 512, "k": 128}],
     "moe_fp8":        [{"experts": 256, "topk": 8, "m": [1, 4096], "hidden": 7168, "inter": 256}],
     "moe_w4a16":      [{"experts": 128, "topk": 8, "m": [1, 4096], "hidden": 2048, "inter": 768}],
     "fp8_grouped_gemm":        [{"experts": 256, "topk": 8, "m": [512], "n": 512, "k": 7168}],
     "fp8_grouped_gemm_masked": [{"experts": 256, "topk": 8, "m": [16], "n": 7168, "k": 256}]}

Entry keys per op are its case module's DIMS (kdsl/bench/cases/<op>.py); "m" (tokens) may be an integer or a
list of integers, the others are integers, multiples of what the case module's MULTIPLES says: K of 128 (the
quantization group) except for weight_dequant, whose scale grid is ceil(N/128) x ceil(K/128); GPTQ N of 8,
fp8_bmm's N of 16. The MoE ops route "m" tokens to "topk" of "experts" experts: moe_fp8 and moe_w4a16 are the layer (hidden
size, expert intermediate size, both multiples of 128), the grouped GEMMs one of its projections (N, K), their rows
those tokens' slots sorted by expert (contiguous: each group padded to 128 rows; masked: [E, m, K]).
"""
from __future__ import annotations

import json
from pathlib import Path

from kdsl.bench.case import Case
from kdsl.bench.cases import OPS, op_dims, op_multiples

__all__ = ["OPS", "Case", "ShapeFileError", "PRESETS", "preset_cases", "parse_shape_entries", "load_shape_file",
           "resolve_shapes", "select_ops"]


class ShapeFileError(ValueError):
    """A shape file or preset name that cannot be used; the message names the file and key."""


def _gemms(op: str, pairs: list[tuple[int, int]], ms: list[int]) -> list[Case]:
    return [Case(op, m=m, n=n, k=k) for n, k in pairs for m in ms]


def _deepseek_v3() -> list[Case]:
    # DeepSeek-V3 projections (N, K): fused q_a/kv_a, q_b, MoE down-like, attention out, experts.
    fp8 = _gemms("fp8_gemm", [(2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048)],
                 [1, 16, 64, 128, 512, 4096])
    act = [Case("act_quant", m=m, k=7168) for m in (4096, 16384)]
    deq = [Case("weight_dequant", n=n, k=k) for n, k in ((7168, 16384), (24576, 1536))]
    # GPTQ shapes are given as K x N (Llama-like linear layers).
    gptq = _gemms("gptq_gemm", [(n, k) for k, n in ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672))],
                  [1, 16, 64, 256])
    gptq_deq = [Case("gptq_dequant", n=n, k=k) for n, k in ((14336, 4096), (28672, 8192))]
    # MLA's absorbed per-head GEMMs (B, N, K) at 128 heads (TP = 1) and 16 (TP = 8).
    bmm = [Case("fp8_bmm", batch=b, m=m, n=n, k=k) for b, n, k in ((128, 512, 128), (128, 128, 512),
                                                                  (16, 512, 128), (16, 128, 512))
           for m in (1, 16, 64, 128, 512, 4096)]
    return fp8 + act + deq + gptq + gptq_deq + bmm + _moe(256, 8, 7168, (2048, 256)) + _qwen3_moe_w4a16()


# MoE token counts: decode (CUDA graphs) and prefill; the masked layout is a decode layout (max_m = T rows per expert).
MOE_DECODE = (1, 16, 64, 128)
MOE_PREFILL = (512, 4096)


def _moe(experts: int, topk: int, hidden: int, inters: tuple[int, ...]) -> list[Case]:
    """A MoE layer at each intermediate size (a TP slice is a smaller one): the layer, and its two grouped GEMMs,
    gate-up (N, K) = (2I, H) and down (H, I)."""
    cases = []
    for inter in inters:
        layer = dict(experts=experts, topk=topk)
        cases += [Case("moe_fp8", m=m, hidden=hidden, inter=inter, **layer) for m in MOE_DECODE + MOE_PREFILL]
        for n, k in ((2 * inter, hidden), (hidden, inter)):
            cases += [Case("fp8_grouped_gemm", m=m, n=n, k=k, **layer) for m in MOE_DECODE + MOE_PREFILL]
            cases += [Case("fp8_grouped_gemm_masked", m=m, n=n, k=k, **layer) for m in MOE_DECODE]
    return cases


def _qwen3_moe_w4a16() -> list[Case]:
    # Qwen3-30B-A3B's MoE as its GPTQ / AWQ int4 checkpoints store it (the int4 layer has no DeepSeek-V3 form).
    return [Case("moe_w4a16", m=m, experts=128, topk=8, hidden=2048, inter=768) for m in MOE_DECODE + MOE_PREFILL]


def _qwen3_moe() -> list[Case]:
    # Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, expert intermediate 768.
    return _moe(128, 8, 2048, (768,)) + _qwen3_moe_w4a16()


def _llama() -> list[Case]:
    # Llama-3-8B (hidden 4096, MLP 14336, 8 KV heads) and 70B (hidden 8192, MLP 28672) linears as
    # (N, K): fused qkv, o_proj, fused gate_up, down_proj.
    llama8b = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    llama70b = [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)]
    fp8 = _gemms("fp8_gemm", llama8b + llama70b, [1, 16, 64, 128, 512, 4096])
    act = [Case("act_quant", m=m, k=k) for m, k in ((4096, 4096), (4096, 14336), (16384, 8192))]
    norm = [Case(op, m=m, k=k)
            for op in ("rms_norm", "rms_norm_quant", "add_rms_norm") for k in (4096, 8192)
            for m in (1, 16, 64, 2048)]
    deq = [Case("weight_dequant", n=n, k=k) for n, k in ((28672, 4096), (8192, 28672))]
    gptq = _gemms("gptq_gemm", llama8b + [(10240, 8192), (57344, 8192), (8192, 28672)], [1, 16, 64, 256])
    gptq_deq = [Case("gptq_dequant", n=n, k=k) for n, k in ((28672, 4096), (8192, 28672))]
    return fp8 + act + norm + deq + gptq + gptq_deq


PRESETS = {"deepseek-v3": _deepseek_v3, "llama": _llama, "qwen3-moe": _qwen3_moe}


def preset_cases(name: str) -> list[Case]:
    return PRESETS[name]()


def _positive_int(value: object, where: str) -> int:
    # bool is an int subclass; `true` is never a dimension.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ShapeFileError(f"{where}: expected a positive integer, got {value!r}")
    return value


def _check_multiples(op: str, dims: dict[str, int | None], where: str) -> None:
    for dim, (multiple, why) in op_multiples(op).items():
        value = dims.get(dim)
        if value is not None and value % multiple:
            raise ShapeFileError(f"{where}.{dim}: {value} is not a multiple of {why}")


def parse_shape_entries(doc: object, source: str) -> list[Case]:
    """Validate a decoded shape document; `source` (the file name) prefixes every error."""
    if not isinstance(doc, dict):
        raise ShapeFileError(f"{source}: expected a JSON object keyed by op name, got {type(doc).__name__}")
    cases: list[Case] = []
    for op, entries in doc.items():
        if op not in OPS:
            raise ShapeFileError(f"{source}: unknown op {op!r} (expected one of {', '.join(OPS)})")
        if not isinstance(entries, list):
            raise ShapeFileError(f"{source}: {op}: expected a list of entries, got {type(entries).__name__}")
        for i, entry in enumerate(entries):
            where = f"{source}: {op}[{i}]"
            if not isinstance(entry, dict):
                raise ShapeFileError(f"{where}: expected an object, got {type(entry).__name__}")
            wanted = op_dims(op)
            unknown = sorted(set(entry) - set(wanted))
            if unknown:
                raise ShapeFileError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(wanted)})")
            missing = [d for d in wanted if d not in entry]
            if missing:
                raise ShapeFileError(f"{where}: missing key {missing[0]!r}")
            n = _positive_int(entry["n"], f"{where}.n") if "n" in wanted else None
            k = _positive_int(entry["k"], f"{where}.k") if "k" in wanted else None
            batch = _positive_int(entry["batch"], f"{where}.batch") if "batch" in wanted else None
            moe = {d: _positive_int(entry[d], f"{where}.{d}") for d in ("experts", "topk", "hidden", "inter")
                   if d in wanted}
            _check_multiples(op, {"n": n, "k": k, **moe}, where)
            if "topk" in moe and moe["topk"] > moe["experts"]:
                raise ShapeFileError(f"{where}.topk: {moe['topk']} is more than the {moe['experts']} experts")
            if "m" not in wanted:
                cases.append(Case(op, n=n, k=k))
                continue
            raw_m = entry["m"]
            ms = raw_m if isinstance(raw_m, list) else [raw_m]
            if not ms:
                raise ShapeFileError(f"{where}.m: empty list")
            cases += [Case(op, m=_positive_int(m, f"{where}.m"), n=n, k=k, batch=batch, **moe) for m in ms]
    return cases


def load_shape_file(path: str | Path) -> list[Case]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ShapeFileError(f"{path}: cannot read shape file ({exc.strerror or exc})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ShapeFileError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    return parse_shape_entries(doc, str(path))


def resolve_shapes(spec: str) -> list[Case]:
    """A preset name, or else the path of a shape file."""
    if spec in PRESETS:
        return preset_cases(spec)
    if not Path(spec).exists():
        raise ShapeFileError(f"{spec}: not a preset ({', '.join(PRESETS)}) and no such shape file")
    return load_shape_file(spec)


def select_ops(cases: list[Case], ops: list[str] | None) -> list[Case]:
    return cases if not ops else [c for c in cases if c.op in ops]
