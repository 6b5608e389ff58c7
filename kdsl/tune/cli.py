"""The `kdsl tune` subcommand: argument parsing and the run (exit 0 ok, 1 a bucket failed, 2 unusable)."""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from kdsl.bench.shapes import PRESETS, ShapeFileError, resolve_shapes
from kdsl.arguments import int_at_least
from kdsl.kernels import find_impl
from kdsl.tune import search
from kdsl.tune.space import DEFAULT_MAX_CANDIDATES, Bucket, buckets, candidates

DEFAULT_DEFS = Path("kernel_defs")

DESCRIPTION = """\
Search a tiling space on this CUDA GPU for the kernel the registry picks for --op, and write
the winning tile of each M bucket back into its definition (kernel_defs/*.toml), to be
reviewed like code and then rendered with `python -m kdsl generate`.

For each M bucket of the variant (or those named by --bucket), and inside one tiled by N
(n_min) for each of its tiles:
  candidates  the bucket's current tile first, then tiles that vary only the knobs the
              implementation honours, validated like the definition itself (knobs, MMA rows,
              block sizes, shared memory on every arch of the variant's range), nearest the
              current tile first, at most --max-candidates in all; block_m = 1 GEMV candidates
              only in an m_max = 1 bucket of w4a16_gemm
  shapes      every (N, K) of the --shapes preset for the op in the tile's N range, at the
              preset's M values that fall in the bucket (or at the bucket's m_max if none does);
              the MoE layers (moe_fp8, moe_w4a16), whose M is tokens per routed expert: every
              layer (E, top-k, H, I) of the preset at its token counts T that fall in the bucket
              (or at the most T that give the bucket's m_max tokens per expert)
  timing      the implementation's launch with each candidate tile; median of
              triton.testing.do_bench_cudagraph for M <= 128 (fp8_bmm: every M, as its bench
              times it), do_bench otherwise. Each candidate
              is checked once per shape against the fp32 reference (the bench's tolerance);
              wrong or failing tiles (out of resources, compile errors) are dropped, with why
  winner      lowest geometric mean over shapes of (time / current tile's time); ties keep
              the current tile, so the winner is never slower on these shapes

Without --write it prints the TOML the definition would get; with --write it replaces only
that variant's tiles in the file (a comment names the GPU and date; every other line stays).

exit status: 0 done, 1 a bucket had no tile that ran correctly or its current tile failed,
2 cannot run (no GPU, bad arguments, no matching definition).
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune", help="search tiles on a CUDA GPU and write the winners into the definition",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", required=True, choices=search.TUNABLE_OPS, metavar="OP",
                        help=f"the op whose kernel to tune: {', '.join(search.TUNABLE_OPS)}")
    parser.add_argument("--defs", type=Path, default=DEFAULT_DEFS, metavar="DIR",
                        help="folder of *.toml definitions to read and write (default: %(default)s)")
    parser.add_argument("--shapes", default="deepseek-v3", metavar="{" + ",".join(PRESETS) + "}|FILE",
                        help="a bench shape preset or JSON shape file, as for `kdsl bench` (default: deepseek-v3)")
    parser.add_argument("--bucket", action="extend", nargs="+", metavar="M_MAX",
                        help="tune only these buckets, named by their m_max ('rest' for the last one), every "
                             "tile of each; default: every bucket")
    parser.add_argument("--max-candidates", type=int_at_least(1), default=DEFAULT_MAX_CANDIDATES, metavar="N",
                        help="at most N tiles per bucket, the current one included (default: %(default)s)")
    parser.add_argument("--write", action="store_true",
                        help="write the winners into the definition file (default: only print the TOML)")
    parser.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"kdsl tune: error: {message}", file=sys.stderr)
    return 2


def pick_buckets(all_buckets: list[Bucket], names: list[str] | None) -> list[Bucket]:
    """The buckets --bucket names (by m_max, or 'rest'), in the variant's order; ValueError for unknown names."""
    if not names:
        return all_buckets
    known = {b.name(): b for b in all_buckets}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--bucket {' '.join(unknown)}: the variant's buckets are {', '.join(known)}")
    wanted = set(names)
    return [b for b in all_buckets if b.name() in wanted]


def winners(all_buckets: list[Bucket], results: list[search.BucketResult]) -> list:
    """The variant's tiles with each tuned bucket's winner in place of its current tile."""
    won = {r.bucket.index: r.winner.tile for r in results if r.winner is not None}
    return [won.get(b.index, b.tile) for b in all_buckets]


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from kdsl.schema import DefinitionError, DefinitionGroupError, load_definitions

    # Everything that can be refused without a GPU is checked first.
    try:
        cases = resolve_shapes(args.shapes)
    except ShapeFileError as exc:
        return _fail(str(exc))
    if not any(c.op == search.SHAPE_OPS[args.op] for c in cases):
        return _fail(f"--shapes {args.shapes} has no {search.SHAPE_OPS[args.op]} shapes to tune {args.op} on")
    if not args.defs.is_dir():  # the default, kernel_defs, is relative: outside a checkout it is not there
        return _fail(f"--defs {args.defs}: is not a folder of kernel definitions (*.toml); run in a checkout of kdsl "
                     "or pass --defs DIR, the definitions to tune and rewrite")
    try:
        definitions = load_definitions(args.defs)
    except DefinitionGroupError as exc:
        return _fail("the definitions do not load:\n" + "\n".join(str(e) for e in exc.errors))
    except DefinitionError as exc:
        return _fail(str(exc))
    import torch

    if not torch.cuda.is_available():
        return _fail("needs a CUDA GPU, but torch.cuda.is_available() is False "
                     f"(torch {torch.__version__}); run it on a machine with an NVIDIA GPU")

    from kdsl.runtime.manifest import ManifestError
    from kdsl.runtime.registry import NoKernelError
    from kdsl.tune import problems, target, write  # GPU from here on

    try:
        chosen = target.select_target(args.op, definitions)
    except (ManifestError, NoKernelError, target.TargetError) as exc:
        return _fail(str(exc))
    variant = chosen.variant
    all_buckets = buckets(variant)
    try:
        tuned = pick_buckets(all_buckets, args.bucket)
    except ValueError as exc:
        return _fail(str(exc))
    gpu = torch.cuda.get_device_name()
    print(f"kdsl tune: {chosen.describe()} on {gpu}", file=sys.stderr)
    if target.stale_tiles(chosen):
        print(f"kdsl tune: warning: generated/ holds other tiles than {chosen.loaded.path} for this variant; "
              "`python -m kdsl generate` brings it up to date", file=sys.stderr)

    make_problem = problems.problem_factory(args.op, chosen.entry)
    results = []
    for bucket in tuned:
        tiles = candidates(variant, bucket, chosen.loaded.definition.schemes, args.max_candidates)
        shapes = search.shapes_for_bucket(args.op, cases, bucket)
        print(f"kdsl tune: bucket {bucket.label()}: {len(tiles)} candidates on {len(shapes)} shapes", file=sys.stderr)
        results.append(search.search_bucket(bucket, tiles, shapes, make_problem, search.timer_for(args.op),
                                            _progress, impl=find_impl(variant.op, variant.impl_of(bucket.tile))))

    from kdsl.tune.report import format_results

    print(format_results(f"{chosen.describe()} on {gpu}", results))
    status = 0
    for r in results:
        if r.winner is None or not r.current.ok:
            status = 1
    path = chosen.loaded.path
    note = write.note(gpu, datetime.date.today().isoformat())
    v = variant
    try:
        if args.write:
            rewritten = write.write_tiles(path, v.op, v.impl, v.min_arch, winners(all_buckets, results), note)
        else:
            rewritten = write.rewrite(path, v.op, v.impl, v.min_arch, winners(all_buckets, results), note)
    except DefinitionError as exc:
        print(f"kdsl tune: error: {exc}", file=sys.stderr)
        return 1
    print()
    if not rewritten.changed:
        print(f"{path} already holds these tiles; nothing to write")
    elif args.write:
        print(f"wrote {path}; run `python -m kdsl generate` and review the diff")
    else:
        print(f"# {path} would read (run again with --write to write it):\n")
        print(rewritten.block, end="")
    return status
