"""argparse types shared by `python -m kdsl` (kdsl.cli) and the subcommands it adds (kdsl.tune.cli)."""
from __future__ import annotations

import argparse

from kdsl.naming import KNOWN_ARCHS, format_arch, parse_arch


def int_at_least(minimum: int):
    """argparse type: an integer >= minimum, refused with a message that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = "non-negative integer" if minimum == 0 else f"integer >= {minimum}"
    return parse


non_negative_int = int_at_least(0)  # sizes


def arch(text: str) -> int:
    """argparse type for --arch: 'sm_90' -> 90; an arch kdsl does not know (a typo such as sm_999) is refused."""
    known = ", ".join(map(format_arch, KNOWN_ARCHS))
    try:
        number = parse_arch(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}; known archs: {known}") from None
    if number not in KNOWN_ARCHS:
        raise argparse.ArgumentTypeError(f"unknown arch {text!r}; known archs: {known}")
    return number
