"""`python -m kdsl tune`: search tiles on the GPU, write the winners back into the definition.

    space     the candidate tiles of one M bucket, from the catalogue's knobs, validated by the schema
    target    the kernel the registry picks on this GPU and the definition variant behind it
    search    check and time candidates on a bucket's shapes (injectable timer and problems); pick the winner
    problems  GPU only: the bench's inputs and fp32 references bound to the generated kernel's launch
    write     replace one variant's tiles in the TOML text, validated, atomically
    report    the per-bucket table
    cli       add_parser(subparsers) registers "tune"; run(args) -> exit code
"""
from kdsl.tune.cli import add_parser, run

__all__ = ["add_parser", "run"]
