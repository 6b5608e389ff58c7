"""`python -m kdsl COMMAND`: generate, schema, list, explain, demo, bench, tune."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_DEFS = Path("kernel_defs")
DEFAULT_OUT = Path("generated")


def _generate(args: argparse.Namespace) -> int:
    from kdsl.codegen import PlanError, compare, plan_kernels, render_all, write
    from kdsl.schema import DefinitionError, DefinitionGroupError, load_definitions

    try:
        definitions = load_definitions(args.defs)
        kernels = plan_kernels(definitions)
        files = render_all(kernels)
    except DefinitionGroupError as error:
        for each in error.errors:
            print(f"error: {each}", file=sys.stderr)
        print(f"nothing written to {args.out}/", file=sys.stderr)
        return 1
    except (DefinitionError, PlanError) as error:
        print(f"error: {error}\nnothing written to {args.out}/", file=sys.stderr)
        return 1
    names = ", ".join(d.path.name for d in definitions)
    print(f"{len(kernels)} kernels from {len(definitions)} definition(s): {names}", file=sys.stderr)
    if args.check:
        diff = compare(files, args.out)
        if diff.clean:
            print(f"{args.out}/ is up to date", file=sys.stderr)
            return 0
        for name in diff.changed:
            print(f"stale: {args.out / name} (differs from what the definitions render)", file=sys.stderr)
        for name in diff.stale:
            print(f"stale: {args.out / name} (no definition renders it)", file=sys.stderr)
        print("run `python -m kdsl generate` and commit the result", file=sys.stderr)
        return 1
    diff = write(files, args.out)
    for name in diff.changed:
        print(f"wrote {args.out / name}", file=sys.stderr)
    for name in diff.stale:
        print(f"removed {args.out / name}", file=sys.stderr)
    unchanged = len(files) - len(diff.changed)
    print(f"{len(diff.changed)} written, {len(diff.stale)} removed, {unchanged} unchanged in {args.out}/", file=sys.stderr)
    return 0


def _schema(args: argparse.Namespace) -> int:
    from kdsl.schema import KernelDefinition

    print(json.dumps(KernelDefinition.model_json_schema(), indent=2))
    return 0


def _list(args: argparse.Namespace) -> int:
    from kdsl.runtime.manifest import ManifestError
    from kdsl.runtime.registry import entries

    try:
        kernels = [e for e in entries() if args.op is None or e.op == args.op]
    except ManifestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for entry in kernels:
        print(f"{entry.name}")
        print(f"    op {entry.op}  impl {entry.impl}  scheme {entry.scheme}  arch {entry.arch_range()}")
        for bucket in entry.tiles:
            p = bucket.params
            bound = f"M <= {bucket.m_max}" if bucket.m_max is not None else "M rest"
            if bucket.n_min is not None:
                bound += f", N >= {bucket.n_min}"
            extras = "" if p["split_fill"] is None else f" split_fill={p['split_fill']}"
            extras += "" if p["split_min_steps"] is None else f" split_min_steps={p['split_min_steps']}"
            extras += " persistent" if p["persistent"] else ""
            print(f"    {bound:>20}: {p['BLOCK_M']}x{p['BLOCK_N']}x{p['BLOCK_K']} warps={p['num_warps']} "
                  f"stages={p['num_stages']} group_m={p['GROUP_M']} split_k={p['SPLIT_K']}{extras}")
    print(f"{len(kernels)} kernel(s)", file=sys.stderr)
    return 0


def _explain(args: argparse.Namespace) -> int:
    from kdsl.runtime.manifest import ManifestError
    from kdsl.runtime.registry import explain

    try:
        print(explain(args.op, args.scheme, arch=args.arch, m=args.m, n=args.n))
    except (ManifestError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kdsl.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kdsl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="render kernel_defs/*.toml into generated/",
                              description="Validate every definition, render every kernel, and write "
                                          "generated/ (all or nothing: a bad definition writes nothing).")
    gen.add_argument("--defs", type=Path, default=DEFAULT_DEFS, help="folder of *.toml definitions (default: %(default)s)")
    gen.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    gen.add_argument("--check", action="store_true", help="write nothing; exit 1 listing stale files if --out differs")
    gen.set_defaults(func=_generate)

    schema = commands.add_parser("schema", help="print the JSON Schema of the definition format",
                                 description="Print the JSON Schema of a kernel_defs/*.toml file, for editors.")
    schema.set_defaults(func=_schema)

    lister = commands.add_parser("list", help="list the generated kernels",
                                 description="List generated kernels: op, scheme, arch range and tiles per M bucket.")
    lister.add_argument("--op", help="only this op")
    lister.set_defaults(func=_list)

    why = commands.add_parser("explain", help="show how the registry picks a kernel",
                              description="Print every candidate kernel for OP and why it was chosen or refused.")
    why.add_argument("op", metavar="OP", help="op name, e.g. fp8_gemm")
    why.add_argument("--scheme", help="scheme name, e.g. block_fp8.e4m3.w128x128.a128.f32 (default: any)")
    why.add_argument("--arch", help="arch such as sm_90 (default: KDSL_ARCH, else this machine's GPU)")
    why.add_argument("--m", type=int, help="rows of the problem, to show the tile bucket")
    why.add_argument("--n", type=int, help="output columns of the problem, for definitions that tile by N too")
    why.set_defaults(func=_explain)

    demo = commands.add_parser("demo", help="run the generated kernels on a small example",
                               description="Quantize, GEMM and check against fp32 references, on the GPU if there "
                                           "is one, else through Triton's interpreter on the CPU.")
    demo.set_defaults(func=_demo)

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
    args = build_parser().parse_args(argv)
    return args.func(args)
