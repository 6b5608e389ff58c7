"""The `kdsl bench` subcommand: argument parsing and the run loop (exit 0 ok, 1 wrong, 2 unusable)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kdsl.arguments import int_at_least
from kdsl.bench.report import build_document, command_line, format_table, matplotlib_available, plot_ratios, write_json
from kdsl.bench.results import OK, Result
from kdsl.bench.model import DECODE_M, PREFILL_M, parse_shape
from kdsl.bench.model import MODES as MODEL_MODES
from kdsl.bench.model import PRESETS as MODEL_PRESETS
from kdsl.bench.model import VARIANTS as MODEL_VARIANTS
from kdsl.bench.cases import CASES
from kdsl.bench.shapes import OPS, PRESETS, ShapeFileError, resolve_shapes, select_ops
from kdsl.bench import tp as tp_bench

def _op_lines() -> str:
    """Each op's HELP (kdsl/bench/cases/<op>.py) under its name."""
    lines = []
    for op, module in CASES.items():
        text = module.HELP.splitlines()
        if len(op) < 16:
            lines.append(f"  {op:<16}{text.pop(0)}")
        else:
            lines.append(f"  {op}")
        lines += [f"  {'':<16}{line}" for line in text]
    return "\n".join(lines)


DESCRIPTION = """\
Time kdsl's kernels against their baselines on a CUDA GPU, in one process on the same inputs,
and check every kdsl result against an fp32 reference on fresh random data.

""" + _op_lines() + """

Times are medians of triton.testing.do_bench (L2 flushed), plus do_bench_cudagraph for M <= 128
(at every M where said above). Where the calls cycle through copies of the weights, one timed
callable (and one graph) makes a call per copy, so each call reads its weights cold; times are per call.
Ratios are baseline time / kdsl time (> 1: kdsl faster). A result outside tolerance is marked
WRONG and the command exits 1.

shape presets:
  deepseek-v3  fp8_gemm (N,K) = (2112,7168) (24576,1536) (7168,16384) (4096,7168) (7168,2048)
               at M = 1 16 64 128 512 4096; act_quant [M,K] = [4096,7168] [16384,7168];
               weight_dequant (N,K) = (7168,16384) (24576,1536); gptq_gemm KxN = 4096x4096
               4096x14336 14336x4096 8192x28672 at M = 1 16 64 256; gptq_dequant (N,K) =
               (14336,4096) (28672,8192); fp8_bmm (B,N,K) = (128,512,128) (128,128,512)
               (16,512,128) (16,128,512) at M = 1 16 64 128 512 4096; MoE (E = 256, top-8,
               H = 7168, I = 2048 and the TP-8 slice I = 256): moe_fp8 and fp8_grouped_gemm (gate-up
               and down) at T = 1 16 64 128 512 4096, fp8_grouped_gemm_masked at T = 1 16 64 128;
               moe_w4a16 on Qwen3-30B-A3B's MoE (E = 128, top-8, H = 2048, I = 768) at the same T
  qwen3-moe    Qwen3-30B-A3B's MoE (E = 128, top-8, H = 2048, I = 768): the MoE ops above and moe_w4a16
  llama        Llama-3-8B and 70B linears, (N,K) = qkv (6144,4096) o (4096,4096)
               gate_up (28672,4096) down (4096,14336); qkv (10240,8192) o (8192,8192)
               gate_up (57344,8192) down (8192,28672). fp8_gemm: all eight at M = 1 16 64 128
               512 4096; gptq_gemm: 8B's four and 70B's qkv, gate_up, down at M = 1 16 64 256;
               act_quant [4096,4096] [4096,14336] [16384,8192]; weight_dequant and
               gptq_dequant (28672,4096) (8192,28672)

shape file (JSON), keyed by op; "m" may be an integer or a list, K a multiple of 128:
  {"fp8_gemm": [{"m": [1, 16], "n": 2112, "k": 7168}], "act_quant": [{"m": 4096, "k": 7168}],
   "weight_dequant": [{"n": 7168, "k": 16384}], "gptq_gemm": [{"m": [1], "k": 4096, "n": 4096}],
   "gptq_dequant": [{"n": 14336, "k": 4096}], "fp8_bmm": [{"batch": 128, "m": [1], "n": 512, "k": 128}]}

exit status: 0 all correct, 1 some result WRONG or failing, 2 cannot run (no GPU, bad arguments).
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="time kdsl kernels against cuBLAS/torch baselines on a CUDA GPU and check them",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", action="extend", nargs="+", choices=OPS, metavar="OP",
                        help=f"ops to run (default: all): {', '.join(OPS)}")
    parser.add_argument("--shapes", default="deepseek-v3", metavar="{" + ",".join(PRESETS) + "}|FILE",
                        help="a shape preset or a JSON shape file (default: deepseek-v3)")
    parser.add_argument("--json", metavar="PATH", help="write every figure, the GPU and versions to PATH")
    parser.add_argument("--no-host-time", dest="host_time", action="store_false",
                        help="skip the host time per call (timed after the GPU times of graph-timed cases, it keeps "
                             "the GPU busy for a few hundred more calls): for comparing GPU times with a run "
                             "made without it")
    parser.add_argument("--kernels", action="store_true",
                        help="also split each timed implementation's time by GPU kernel (torch.profiler over CUDA-graph "
                             "replays): the table's per-kernel section and kernels_us in --json; with --model, each "
                             "model's captured forward")
    parser.add_argument("--plot", metavar="PATH", help="draw a PNG of ratios vs baselines (needs matplotlib)")
    model = parser.add_argument_group("whole layers (--model): kdsl.bench.model")
    model.add_argument("--model", metavar="{" + ",".join(MODEL_PRESETS) + "}|FILE",
                       help="time N decoder layers with distinct weights, whole, against the fp16/bf16 model "
                            "instead of single ops (deepseek-v3-dense: MLA's decode path with its absorbed BMMs, "
                            "fp8_bmm in the fp8 model), and the same forward without its matmuls (the linears' "
                            "share); FILE: JSON {hidden, qkv, o_in, inter, layers[, mla]}")
    model.add_argument("--m", type=int, nargs="+", metavar="M", help="tokens per forward (default: decode "
                       f"{' '.join(map(str, DECODE_M))} and prefill {' '.join(map(str, PREFILL_M))})")
    model.add_argument("--modes", nargs="+", choices=MODEL_MODES, default=list(MODEL_MODES),
                       help="CUDA graph, eager, torch.compile(mode='reduce-overhead', fullgraph=True)")
    model.add_argument("--variants", nargs="+", choices=MODEL_VARIANTS, default=list(MODEL_VARIANTS),
                       help="quantized models to time beside the float one")
    model.add_argument("--layers", type=int_at_least(1), metavar="N",
                       help="decoder layers to time instead of the preset's (more layers hide torch.compile's "
                            "100-300 us of Python per call behind a longer forward, as a whole model does)")
    tp_bench.add_arguments(parser)
    parser.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"kdsl bench: error: {message}", file=sys.stderr)
    return 2


def _progress(results: list[Result]) -> str:
    parts = []
    for r in results:
        if r.status != OK or r.kdsl.eager_ms is None:
            parts.append(f"{r.impl}: {r.status}" + (f" ({r.detail})" if r.detail else ""))
            continue
        ratios = ", ".join(f"{ratio:.2f}x {name}" for name in r.baselines if (ratio := r.ratio(name)) is not None)
        parts.append(f"{r.impl}: {r.kdsl.eager_ms:.4f} ms" + (f" ({ratios})" if ratios else ""))
    return "; ".join(parts)


def _writable(path: str | None) -> bool:
    return path is None or Path(path).resolve().parent.is_dir()


def _outputs_and_gpu(args: argparse.Namespace) -> str | None:
    """Why the run cannot start (an unwritable --json/--plot, no matplotlib, no GPU), checked before any work."""
    for flag in ("json", "plot"):
        if not _writable(getattr(args, flag)):
            return f"--{flag} {getattr(args, flag)}: directory does not exist"
    if args.plot and not matplotlib_available():
        return "--plot needs matplotlib, an optional extra: pip install matplotlib"
    import torch

    if not torch.cuda.is_available():
        return ("needs a CUDA GPU, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); run it on a machine with an NVIDIA GPU")
    return None


def run(args: argparse.Namespace) -> int:
    if getattr(args, "kernels", False) and getattr(args, "tp", None) is not None:
        return _fail("--kernels: per-op and --model runs only, not with --tp")
    if getattr(args, "tp", None) is not None:
        return tp_bench.run(args)
    if args.model:
        return run_model(args)
    if args.layers is not None:
        return _fail(f"--layers {args.layers}: only with --model (the decoder layers it times)")
    # Everything that can be refused without a GPU is checked first, so a long run never
    # ends in an unwritable path or a missing optional dependency.
    try:
        cases = select_ops(resolve_shapes(args.shapes), args.op)
    except ShapeFileError as exc:
        return _fail(str(exc))
    if not cases:
        return _fail(f"--shapes {args.shapes} has no shapes for --op {' '.join(args.op or OPS)}")
    refused = _outputs_and_gpu(args)
    if refused is not None:
        return _fail(refused)

    from kdsl.bench import timing  # the GPU from here on
    from kdsl.bench.cases import run_case

    results: list[Result] = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case.op} {case.label()} ...", end="", file=sys.stderr, flush=True)
        case_results = run_case(case, host_time=args.host_time, kernels=args.kernels)
        print(" " + _progress(case_results), file=sys.stderr, flush=True)
        results += case_results

    print(format_table(results))
    if args.json:
        ops = list(dict.fromkeys(c.op for c in cases))
        write_json(build_document(results, shapes=args.shapes, ops=ops, command=command_line(),
                                  environment=timing.environment()), args.json)
        print(f"kdsl bench: wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot_ratios(results, args.plot)
        print(f"kdsl bench: wrote {args.plot}", file=sys.stderr)

    failed = [r for r in results if r.failed]
    if failed:
        print(f"kdsl bench: {len(failed)} of {len(results)} results WRONG or failing: "
              + "; ".join(f"{r.case.op} {r.case.label()} {r.impl}: {r.status}" for r in failed), file=sys.stderr)
        return 1
    unavailable = sum(r.status != OK for r in results)
    print(f"kdsl bench: all {len(results) - unavailable} results correct"
          + (f" ({unavailable} not available)" if unavailable else ""), file=sys.stderr)
    return 0


def run_model(args: argparse.Namespace) -> int:
    """kdsl bench --model: whole layers (kdsl.bench.model); refusals first, as for the op bench."""
    try:
        parse_shape(args.model)
    except ValueError as exc:
        return _fail(str(exc))
    if args.m and any(m < 1 for m in args.m):
        return _fail(f"--m {' '.join(map(str, args.m))}: token counts must be positive")
    refused = _outputs_and_gpu(args)
    if refused is not None:
        return _fail(refused)
    from kdsl.bench.model import run_model_bench

    return run_model_bench(args.model, args.m or [*DECODE_M, *PREFILL_M], args.modes, args.variants, args.json,
                           args.plot, layers=args.layers, kernels=args.kernels)
