"""`python -m kdsl COMMAND`: generate, schema, list, explain, demo, aot, bench, tune."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from kdsl.arguments import arch, int_at_least, non_negative_int

EPILOG = """\
exit status:
  0  done (a kernel fits, generated files are up to date, every result is correct)
  1  the command ran but the answer is negative: no kernel fits, generated files are stale,
     the definitions or a manifest do not load, a bench result is wrong
  2  usage error: unknown op or scheme, bad arguments, nothing to run on (no GPU, no --arch)
"""


class UsageError(Exception):
    """The user asked for something that does not exist: main prints it and exits 2."""


def _kernels(op: str | None) -> list:
    """The registry's kernels (of op only, when given); an unknown op is a UsageError listing the known ones."""
    from kdsl.registry import entries

    kernels = list(entries())
    if op is None:
        return kernels
    known = sorted({e.op for e in kernels})
    if op not in known:
        raise UsageError(f"unknown op {op!r}; known ops: {', '.join(known)}")
    return [e for e in kernels if e.op == op]


def generate_out(defs: Path, out: Path | None, check: bool = False, into_package: bool = False) -> Path:
    """The folder `generate` writes (or checks): --out if given; else the shipped kernels' folder for the shipped
    definitions (a checkout's generated/, which `make demo` and CI regenerate) and ./generated for a user's own.
    UsageError for a file, for the shipped kernels as a user's default, and for a folder inside the kdsl
    package unless into_package (a user's kernels would replace an installed wheel's)."""
    from kdsl.runtime.manifest import package_dir, shipped_definitions_dir, shipped_dir

    if out is not None:
        target = out.resolve()
    elif defs.resolve() == shipped_definitions_dir().resolve():
        target = shipped_dir().resolve()
    else:
        target = (Path.cwd() / "generated").resolve()
        if not check and target == shipped_dir().resolve():  # generate --defs mine, at the top of a checkout
            raise UsageError(f"--out defaults to ./generated for your own --defs, and {target}/ holds the kernels "
                             f"kdsl ships; name a folder for your kernels with --out DIR (or --out {target} to "
                             "replace kdsl's)")
    if target.exists() and not target.is_dir():
        raise UsageError(f"--out {out if out is not None else target}: is a file, not a folder")
    package = package_dir().resolve()
    if not check and not into_package and (target == package or package in target.parents):
        raise UsageError(f"--out {target}: is inside the kdsl package ({package}); writing there replaces the "
                         "kernels kdsl ships. Write your kernels to a folder of your own with --out DIR (then "
                         "KDSL_KERNEL_PATH=DIR), or pass --into-package to write there anyway")
    return target


def _generate(args: argparse.Namespace) -> int:
    from kdsl.codegen import OutputError, PlanError, RenderError, compare, plan_kernels, render_all, write
    from kdsl.schema import DefinitionError, DefinitionGroupError, load_definitions

    if not args.defs.is_dir():
        raise UsageError(f"--defs {args.defs}: is not a folder of kernel definitions (*.toml)")
    out = generate_out(args.defs, args.out, args.check, args.into_package)
    try:
        definitions = load_definitions(args.defs)
        kernels = plan_kernels(definitions)
        files = render_all(kernels)
    except DefinitionGroupError as error:
        for each in error.errors:
            print(f"error: {each}", file=sys.stderr)
        print(f"nothing written to {out}/", file=sys.stderr)
        return 1
    except (DefinitionError, PlanError, RenderError) as error:
        print(f"error: {error}\nnothing written to {out}/", file=sys.stderr)
        return 1
    names = ", ".join(d.path.name for d in definitions)
    modules = sum(name.endswith(".py") for name in files)
    print(f"{len(kernels)} kernels in {modules} modules from {len(definitions)} definition(s): {names}",
          file=sys.stderr)
    if args.check:
        if not out.is_dir():
            print(f"error: --out {out}: the folder does not exist, so there is nothing to check "
                  f"(`python -m kdsl generate --out {out}` writes it)", file=sys.stderr)
            return 1
        diff = compare(files, out)
        if diff.clean:
            print(f"{out}/ is up to date", file=sys.stderr)
            return 0
        for name in diff.changed:
            print(f"stale: {out / name} (differs from what the definitions render)", file=sys.stderr)
        for name in diff.stale:
            print(f"stale: {out / name} (no definition renders it)", file=sys.stderr)
        for name in diff.unowned:
            print(f"stray: {out / name} (no definition renders it and kdsl did not write it: generate leaves it, "
                  "remove it by hand)", file=sys.stderr)
        print("run `python -m kdsl generate` and commit the result", file=sys.stderr)
        return 1
    try:
        diff = write(files, out)
    except OutputError as error:
        raise UsageError(f"--out {error}; nothing written, name another folder") from None
    except OSError as error:
        raise UsageError(f"--out {out}: cannot write there ({error}); nothing written") from None
    for name in diff.changed:
        print(f"wrote {out / name}", file=sys.stderr)
    for name in diff.stale:
        print(f"removed {out / name}", file=sys.stderr)
    for name in diff.unowned:
        print(f"kept {out / name} (kdsl did not write it)", file=sys.stderr)
    unchanged = len(files) - len(diff.changed)
    print(f"{len(diff.changed)} written, {len(diff.stale)} removed, {unchanged} unchanged in {out}/", file=sys.stderr)
    _warn_unless_read(out)
    return 0


def _warn_unless_read(out: Path) -> None:
    """Tell how to use a folder of kernels that the runtime does not search."""
    from kdsl.registry import KERNEL_PATH_ENV, kernel_folders

    if any(folder.resolve() == out for _, folder in kernel_folders()):
        return
    print(f"warning: kdsl does not read kernels from {out}/; to use them, either\n"
          f"  export {KERNEL_PATH_ENV}={shlex.quote(str(out))}\n"
          f'  or call kdsl.registry.add_generated("{out}") in Python', file=sys.stderr)


def _schema(args: argparse.Namespace) -> int:
    from kdsl.schema import KernelDefinition

    print(json.dumps(KernelDefinition.model_json_schema(), indent=2))
    return 0


def _list(args: argparse.Namespace) -> int:
    kernels = _kernels(args.op)
    for entry in kernels:
        print(f"{entry.name}")
        print(f"    op {entry.op}  impl {entry.impl}  scheme {entry.scheme}  arch {entry.arch_range()}  "
              f"from {entry.origin}")
        # Its modules serve every scheme of the definition that differs only in these constexprs.
        passed = "".join(f" {name}={value}" for name, value in entry.constexprs.items())
        print(f"    modules {', '.join(m.path.name for m in entry.modules.values())}"
              + (f"  constexprs{passed}" if passed else ""))
        previous = None
        for bucket in entry.tiles:
            bound = f"M <= {bucket.m_max}" if bucket.m_max is not None else "M rest"
            if bucket.n_min is not None:
                bound += f", N >= {bucket.n_min}"
            if (bucket.m_max, bucket.n_min) == previous:
                bound = "else"  # the alternative, where the tile before refuses the call
            previous = (bucket.m_max, bucket.n_min)
            print(f"    {bound:>20}: {_tile_text(bucket.params)}")
        if entry.dequant:
            bound = f"M >= {entry.dequant['min_m']}"
            print(f"    {bound:>20}: {entry.dequant['op']} then torch.matmul (cuBLAS), where one serves (dequant_min_m)")
    print(f"{len(kernels)} kernel(s)", file=sys.stderr)
    return 0


def _tile_text(p: dict) -> str:
    """A tile's launch parameters in one line: the common geometry, then the implementation's options that are set
    (switches by name)."""
    common = ("impl", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps", "num_stages")
    extras = "".join(f" {k}" if v is True else f" {k}={v}" for k, v in p.items()
                     if k not in common and v not in (None, False))
    return (f"{p['impl']} {p['BLOCK_M']}x{p['BLOCK_N']}x{p['BLOCK_K']} warps={p['num_warps']} "
            f"stages={p['num_stages']} group_m={p['GROUP_M']} split_k={p['SPLIT_K']}{extras}")


# The MoE layers pick their tile by tokens per routed expert (kdsl.ops.moe.tokens_per_expert), which
# `explain --tokens T --experts E --topk K` works out from the routing.
MOE_LAYER_OPS = ("moe_fp8", "moe_w4a16")


def _moe_routing(args: argparse.Namespace) -> tuple[int, int, int] | None:
    """(T, E, k) from --tokens/--experts/--topk, or None when none is given; UsageError for a partial or
    conflicting set."""
    given = {"--tokens": args.tokens, "--experts": args.experts, "--topk": args.topk}
    if all(v is None for v in given.values()):
        return None
    if args.op not in MOE_LAYER_OPS:
        raise UsageError(f"--tokens, --experts and --topk describe a MoE layer's routing ({', '.join(MOE_LAYER_OPS)}), "
                         f"not {args.op}; pass --m")
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise UsageError(f"{' and '.join(missing)}: needed with {', '.join(n for n in given if n not in missing)} "
                         "(M is tokens per routed expert, from T, E and k)")
    if args.m is not None:
        raise UsageError("--m and --tokens both set M: pass one (the MoE layers' M is tokens per routed expert)")
    if args.topk > args.experts:
        raise UsageError(f"--topk {args.topk} is more than the {args.experts} experts")
    return args.tokens, args.experts, args.topk


def _moe_tiles(entry, tokens: int, experts: int, topk: int, n: int | None) -> str:
    """How a MoE layer's call at T tokens picks its tile, and which T each of the entry's tiles serves at this
    routing's E and top-k."""
    from kdsl.kernels.moe_routing import ALIGN_CHUNK, one_per_block
    from kdsl.ops.moe import most_tokens, tokens_per_expert

    assignments = tokens * topk
    m = tokens_per_expert(assignments, experts)
    steps = ("in one program" if assignments <= ALIGN_CHUNK
             else f"in three launches over chunks of {ALIGN_CHUNK} (count, scan, place)")
    sorting = ("no routing kernel: T * k * 4 <= E, so each (token, slot) is a block of its own (moe_w4a16 with "
               "act-order sorts all the same)" if one_per_block(assignments, experts)
               else f"the routing kernels sort the (token, slot) pairs by expert {steps}, each expert's run padded "
                    f"to block_m")
    lines = [f"MoE routing: T = {tokens} tokens, top-{topk} of E = {experts} experts: M = tokens per routed expert "
             f"= ceil(T * k / min(T * k, E)) = ceil({assignments} / {min(assignments, experts)}) = {m}; {sorting}",
             f"  {entry.name}'s tiles by T at E = {experts}, top-{topk}" + ("" if n is None else f", N = I = {n}")
             + ":"]
    chosen = entry.bucket_index(m, n)
    below, shown = 0, set()  # the M and T the tiles before serve; the m_max of the tiles listed
    for index, bucket in enumerate(entry.tiles):
        if not bucket.serves(bucket.m_max if bucket.m_max is not None else below + 1, n) or bucket.m_max in shown:
            continue  # a tile for other N, one a tile for more N already takes, or a run-time alternative
        shown.add(bucket.m_max)
        low = most_tokens(below, experts, topk) if below else 0
        if bucket.m_max is None:
            span, rows = f"T > {low}", f"M > {below}"
        else:
            high = most_tokens(bucket.m_max, experts, topk)
            span, rows = (f"T <= {high}" if not low else f"{low} < T <= {high}"), f"M <= {bucket.m_max}"
            below = bucket.m_max
        mark = f"   <- T = {tokens}" if index == chosen else ""
        lines.append(f"    {span:>18} ({rows:>7}): {_tile_text(bucket.params)}{mark}")
    return "\n".join(lines)


def _explain(args: argparse.Namespace) -> int:
    from kdsl.registry import NoKernelError, device_arch, explain, select
    from kdsl.runtime.manifest import ManifestError

    schemes = sorted({e.scheme for e in _kernels(args.op)})
    if args.scheme is not None and args.scheme not in schemes:
        raise UsageError(f"unknown scheme {args.scheme!r} for op {args.op}; known schemes: {', '.join(schemes)}")
    routing = _moe_routing(args)
    m = args.m
    if routing is not None:
        from kdsl.ops.moe import tokens_per_expert

        m = tokens_per_expert(routing[0] * routing[2], routing[1])
    try:
        arch_number = device_arch() if args.arch is None else args.arch
        print(explain(args.op, args.scheme, arch=arch_number, m=m, n=args.n, batch=args.batch, k=args.k))
        entry = select(args.op, args.scheme, arch=arch_number)
        if routing is not None:
            print(_moe_tiles(entry, *routing, args.n))
    except NoKernelError:
        return 1  # the trace above says why
    except ManifestError:
        raise
    except ValueError as error:  # KDSL_ARCH is set to something that is not an arch
        raise UsageError(str(error)) from None
    except RuntimeError:  # from device_arch(): no GPU
        raise UsageError("no CUDA device to select a kernel for: pass --arch sm_XX or set KDSL_ARCH") from None
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kdsl.demo import run_demo

    return run_demo()


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


class _Progress:
    """Compile progress on stderr: one bar redrawn in place on a terminal, else a line every tenth of the way
    (a CI log), and the export's own lines (kernels left out, routes, failures) as they come."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()
        self.drawn = False
        self.tenth = 0

    def line(self, text: str) -> None:
        self._clear()
        print(text, file=self.stream, flush=True)

    def tick(self, done: int, total: int) -> None:
        elapsed = time.perf_counter() - self.started
        left = f", about {_duration(elapsed / done * (total - done))} left" if done < total else ""
        status = f"compiled {done}/{total} specializations in {_duration(elapsed)}{left}"
        if self.tty:
            width = 30
            filled = width * done // total
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {status}\x1b[K")
            self.stream.flush()
            self.drawn = True
        elif done * 10 // total > self.tenth or done == total:
            self.tenth = done * 10 // total
            print(status, file=self.stream, flush=True)

    def _clear(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.drawn = False

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def _aot_needs(args: argparse.Namespace):
    """What --model or --shapes asks for (kdsl.aot.model.Needs), or None for the full export."""
    from kdsl.aot.model import ModelError, from_checkpoint, from_shapes

    try:
        if args.model is not None:
            return from_checkpoint(args.model)
        if args.shapes is not None:
            return from_shapes(args.shapes)
    except ModelError as error:
        raise UsageError(f"{'--model' if args.model is not None else '--shapes'} {error}") from None
    return None


def _aot(args: argparse.Namespace) -> int:
    from kdsl.aot import abi as abis
    from kdsl.aot.export import ExportError, export
    from kdsl.aot.model import FORWARD_OPS
    from kdsl.registry import served_schemes

    for op in args.op or ():
        if op not in abis.OPS:
            _kernels(op)  # an unknown op: UsageError listing the known ones
            raise UsageError(f"op {op!r} cannot be exported yet; exportable ops: {', '.join(abis.OPS)}")
    needs = _aot_needs(args)
    schemes, dtypes, problems = args.scheme, args.dtype, None
    if needs is None:
        ops = args.op or list(abis.OPS)
    else:
        # The model's own ops (a model's forward: load-time gptq_dequant only if --op names it), schemes and
        # dtypes, narrowed by any --op, --scheme and --dtype given.
        flag = "--model" if args.model is not None else "--shapes"
        wanted = args.op or [op for op in needs.problems if args.shapes is not None or op in FORWARD_OPS]
        ops = [op for op in wanted if op in needs.problems]
        if not ops:
            raise UsageError(f"{needs.source} runs none of --op {', '.join(args.op)}; it runs "
                             f"{', '.join(needs.problems)}")
        problems = needs.problems
        if needs.schemes is not None:
            schemes = [s for s in needs.schemes if not args.scheme or s in args.scheme]
            if not schemes:
                raise UsageError(f"{needs.source} uses scheme(s) {', '.join(needs.schemes)}, not "
                                 f"--scheme {' '.join(args.scheme)}")
        if needs.dtypes is not None and not args.dtype:
            dtypes = needs.dtypes
        for line in needs.found:
            print(line, file=sys.stderr)
        print(f"{flag}: exporting {', '.join(ops)} for {', '.join(schemes or ['every served scheme'])}, dtype(s) "
              f"{', '.join(dtypes or ['all'])}", file=sys.stderr)
    if args.scheme:
        served = set().union(*(served_schemes(op) for op in ops))
        unknown = [s for s in args.scheme if s not in served]
        if unknown:
            raise UsageError(f"scheme(s) {', '.join(unknown)} not served by {', '.join(ops)}; "
                             f"served: {', '.join(sorted(served))}")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: is a file, not a folder")
    progress = _Progress()
    try:
        result = export(args.out.resolve(), args.arch, ops, schemes, dtypes, args.generic_only, args.jobs,
                        progress=progress.line, problems=problems, tick=progress.tick)
    except ExportError as error:
        progress.close()
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # --out's folder cannot be written (the export stages beside it)
        progress.close()
        raise UsageError(f"--out {args.out}: cannot write there ({error}); nothing written") from None
    progress.close()
    seconds = time.perf_counter() - progress.started
    cubins = {spec.compiled["cubin"]: spec.compiled["size"] for spec in result.specs}
    print(f"exported {len(result.specs)} specializations of {len(result.selected)} kernel(s) to {args.out}/: "
          f"{sum(cubins.values()) / 2 ** 20:.1f} MiB of cubins in {len(cubins)} files, {_duration(seconds)}")
    print(f"build: cmake -S {args.out} -B {args.out}/build && cmake --build {args.out}/build, or make -C {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kdsl import __version__
    from kdsl.runtime.manifest import shipped_definitions_dir, shipped_dir

    parser = argparse.ArgumentParser(prog="python -m kdsl", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kdsl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="render kernel definitions (*.toml) into a folder of Triton kernels",
                              description="Validate every definition, render every kernel, and write them with "
                                          "their manifest.json into --out (all or nothing: a bad definition writes "
                                          "nothing). Only files kdsl wrote there before (listed in the folder's "
                                          "manifest, with kdsl's header) are replaced or removed. Exit 1 if a "
                                          "definition is bad, or with --check if --out is stale or missing; 2 for "
                                          "a bad --defs or --out.")
    gen.add_argument("--defs", type=Path, default=shipped_definitions_dir(),
                     help="folder of *.toml definitions (default: %(default)s)")
    gen.add_argument("--out", type=Path,
                     help=f"output folder (default: {shipped_dir()}, the kernels kdsl ships, for the shipped "
                          "definitions; ./generated for your own --defs)")
    gen.add_argument("--check", action="store_true", help="write nothing; exit 1 listing stale files if --out differs")
    gen.add_argument("--into-package", action="store_true",
                     help="allow writing inside the kdsl package (an installed wheel's shipped kernels), which "
                          "generate otherwise refuses")
    gen.set_defaults(func=_generate)

    schema = commands.add_parser("schema", help="print the JSON Schema of the definition format",
                                 description="Print the JSON Schema of a kernel_defs/*.toml file, for editors.")
    schema.set_defaults(func=_schema)

    lister = commands.add_parser("list", help="list the kernels the registry picks from",
                                 description="List the kernels the registry picks from: op, scheme, arch range, "
                                             "where each comes from (shipped, or a user folder) and its tiles per "
                                             "M bucket. Exit 2 for an unknown --op.")
    lister.add_argument("--op", help="only this op")
    lister.set_defaults(func=_list)

    why = commands.add_parser("explain", help="show how the registry picks a kernel",
                              description="Print every candidate kernel for OP and why it was chosen or refused. "
                                          "Exit 1 if no kernel fits, 2 for an unknown op or scheme.")
    why.add_argument("op", metavar="OP", help="op name, e.g. fp8_gemm")
    why.add_argument("--scheme", help="scheme name, e.g. block_fp8.e4m3.w128x128.a128.f32 (default: any)")
    why.add_argument("--arch", type=arch, help="arch such as sm_90 (default: KDSL_ARCH, else this machine's GPU)")
    why.add_argument("--m", type=non_negative_int, help="rows of the problem, to show the tile bucket")
    why.add_argument("--n", type=non_negative_int,
                     help="output columns of the problem, for definitions that tile by N too")
    why.add_argument("--k", type=int_at_least(1),
                     help="the reduced size of the problem, for tiles that refuse some K (w4a16_gemm's 16-row GEMV: "
                          "options.k_max); without it no tile is refused for its K")
    why.add_argument("--batch", type=int_at_least(1), default=1,
                     help="batches of a batched op (fp8_bmm), for tiles that serve few batches (default: 1)")
    why.add_argument("--tokens", type=int_at_least(1), metavar="T",
                     help="the MoE layers (moe_fp8, moe_w4a16): tokens of the call; with --experts and --topk sets M to "
                          "the tokens per routed expert, ceil(T * k / min(T * k, E)), and shows which T each tile "
                          "serves (--n: the intermediate size I, which the layers tile by)")
    why.add_argument("--experts", type=int_at_least(1), metavar="E", help="the MoE layers: experts per layer")
    why.add_argument("--topk", type=int_at_least(1), metavar="K", help="the MoE layers: experts per token")
    why.set_defaults(func=_explain)

    demo = commands.add_parser("demo", help="run the generated kernels on a small example",
                               description="Quantize, GEMM and check against fp32 references, on the GPU if there "
                                           "is one, else through Triton's interpreter on the CPU.")
    demo.set_defaults(func=_demo)

    aot = commands.add_parser(
        "aot", help="export kernels as cubins with a C library (launchers, dispatchers) usable without Python",
        description="Compile the kernels the registry picks for each --arch (no GPU needed) into cubins, and "
                    "write C launchers, one dispatcher per op (kdsl_<op>, the registry's choice of kernel and "
                    "tile in C), headers, CMakeLists.txt, a Makefile and aot_manifest.json into --out. Kernels "
                    "that cannot be exported are named with the reason; their cases go to an exportable one. "
                    "Exit 1 if nothing could be exported or a kernel failed to compile, 2 for an unknown op, "
                    "scheme or dtype. See docs/aot.md.")
    aot.add_argument("--arch", type=arch, action="append", required=True,
                     help="arch to compile for, e.g. sm_90 (repeat for several)")
    aot.add_argument("--op", action="append", help="only this op (repeat for several; default: every exportable op)")
    aot.add_argument("--scheme", action="append", help="only this scheme (repeat for several; default: all served)")
    aot.add_argument("--dtype", action="append", choices=("bf16", "f16", "f32"),
                     help="only this dtype where an op's dtype varies (repeat; default: all)")
    aot.add_argument("--generic-only", action="store_true",
                     help="one assumption-free specialization per tile (fast; no alignment specializations)")
    aot.add_argument("--jobs", type=int_at_least(1), help="compile processes (default: one per CPU)")
    aot.add_argument("--out", type=Path, required=True, help="output folder")
    only = aot.add_mutually_exclusive_group()
    only.add_argument("--model", type=Path, metavar="CHECKPOINT_DIR",
                      help="only what this checkpoint's quantized layers need: its scheme (config.json's "
                           "quantization_config), each layer's N x K (the *.safetensors headers; no tensor data is "
                           "read), every M bucket, its dtype")
    only.add_argument("--shapes", metavar="FILE",
                      help="only these sizes: a `kdsl bench` shape file or preset (deepseek-v3, llama); every "
                           "scheme and dtype unless --scheme / --dtype narrow them")
    aot.set_defaults(func=_aot)

    try:
        from kdsl.bench.cli import add_parser as add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(commands)
    try:
        from kdsl.tune.cli import add_parser as add_tune_parser
    except ImportError:
        pass
    else:
        add_tune_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kdsl.runtime.manifest import ManifestError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ManifestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
