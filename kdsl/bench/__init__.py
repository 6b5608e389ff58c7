"""`python -m kdsl bench`: kdsl kernels timed against cuBLAS/torch baselines, checked against fp32.

    shapes   presets and the JSON shape-file format -> list of Case
    timing   GPU only: inputs, baselines, fp32 references, do_bench timings -> list of Result
    results  the Result data model (no torch)
    report   stdout table, JSON document (SCHEMA_VERSION), optional matplotlib plot
    cli      add_parser(subparsers) registers "bench"; run(args) -> exit code
"""
from kdsl.bench.cli import add_parser, run

__all__ = ["add_parser", "run"]
