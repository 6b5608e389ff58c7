"""`python -m kdsl bench`: kdsl kernels timed against cuBLAS/torch baselines, checked against fp32.

    case     Case: one op at one problem shape (no torch)
    cases    the suite: one module per op, cases/<op>.py (its dims, setup, baselines, tune problems);
             run_case(case) -> list of Result
    shapes   presets and the JSON shape-file format -> list of Case
    timing   what the cases share: timing loops, checks, fp32 references, inputs of several ops
    moe      what the MoE ops' cases share: random layers and routings, bf16 baselines
    results  the Result data model (no torch)
    report   stdout table, JSON document (SCHEMA_VERSION), optional matplotlib plot
    cli      add_parser(subparsers) registers "bench"; run(args) -> exit code
"""
from kdsl.bench.cli import add_parser, run

__all__ = ["add_parser", "run"]
