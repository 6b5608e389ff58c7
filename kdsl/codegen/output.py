"""Write rendered files into the output folder, or compare them with it.

Writes are all-or-nothing at the folder level (nothing is touched unless every
kernel rendered) and write-if-different at the file level, so unchanged
modules keep their timestamps and Triton's cache stays warm.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

GENERATED_SUFFIXES = (".py", ".json")


@dataclass
class Difference:
    changed: list[str] = field(default_factory=list)  # differs or missing
    stale: list[str] = field(default_factory=list)  # present but no longer rendered

    @property
    def clean(self) -> bool:
        return not (self.changed or self.stale)


def _existing(out_dir: Path) -> set[str]:
    if not out_dir.is_dir():
        return set()
    return {p.name for p in out_dir.iterdir() if p.is_file() and p.suffix in GENERATED_SUFFIXES}


def compare(files: dict[str, str], out_dir: Path) -> Difference:
    diff = Difference()
    for name, text in sorted(files.items()):
        path = out_dir / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            diff.changed.append(name)
    diff.stale = sorted(_existing(out_dir) - set(files))
    return diff


def write(files: dict[str, str], out_dir: Path) -> Difference:
    """Bring out_dir in line with files; returns what changed."""
    diff = compare(files, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Modules first, the manifest last: the registry never lists a module that is not there yet.
    for name in sorted(diff.changed, key=lambda n: n.endswith(".json")):
        # Write beside, then rename: a reader never sees half a module.
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(files[name], encoding="utf-8")
        os.replace(tmp, out_dir / name)
    for name in diff.stale:
        (out_dir / name).unlink()
    return diff
