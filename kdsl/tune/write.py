"""Write tuned tiles back into a definition file's text, touching nothing else.

Only the tiles of the one `[[variants]]` block whose (op, impl, min_arch) match are replaced:
either its `[[variants.tiles]]` tables (each table's header line with its comment stays; a
tile whose values did not change keeps its text byte for byte, a changed one is written
with only its non-default fields in TILE_FIELDS order, keeping the comments of lines whose
value did not change) or its inline `tiles = [...]`. Every other byte of the file, comments
and line endings included, is left as it was; a comment line naming the tuning run goes
right above the tiles. Before anything is written the new text must load as a definition
(kdsl.schema.parse_definition) and must parse to the old document with only those tiles
changed; otherwise DefinitionError names the file and nothing is written. Writes are atomic
(a temporary file in the same folder, then os.replace) and only happen when the text changes.
"""
from __future__ import annotations

import copy
import os
import re
import stat
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kdsl.naming import parse_arch
from kdsl.schema import DefinitionError, Tile, parse_definition
from kdsl.tune.space import TILE_FIELDS, tile_key

NOTE_PREFIX = "# tiles from `python -m kdsl tune`"
_HEADER = re.compile(r"^(?P<indent>[ \t]*)(?P<open>\[\[?)[ \t]*(?P<name>[A-Za-z0-9_.-]+)[ \t]*(?P<close>\]\]?)"
                     r"(?P<rest>[ \t]*(?:#.*)?)$")
_KEY = re.compile(r"^[ \t]*(?P<key>[A-Za-z0-9_-]+)[ \t]*=")
_TILES_KEY = re.compile(r"^(?P<indent>[ \t]*)tiles[ \t]*=[ \t]*")


def note(gpu: str, date: str) -> str:
    return f"{NOTE_PREFIX} on {gpu}, {date}"


def format_value(value: object) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {format_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_.-]*", value):
        return f'"{value}"'
    raise ValueError(f"cannot write {value!r} as a tile value")


def tile_fields(tile: Tile) -> list[tuple[str, object]]:
    """The fields that differ from their defaults, in TILE_FIELDS order."""
    return [(name, getattr(tile, name)) for name in TILE_FIELDS
            if getattr(tile, name) != Tile.model_fields[name].get_default(call_default_factory=True)]


def inline_table(tile: Tile) -> str:
    return "{ " + ", ".join(f"{k} = {format_value(v)}" for k, v in tile_fields(tile)) + " }"


@dataclass(frozen=True)
class Rewrite:
    path: Path
    old_text: str
    new_text: str
    block: str  # the variant's block as it will read, for showing before writing

    @property
    def changed(self) -> bool:
        return self.new_text != self.old_text


class _Lines:
    """The text as lines with their endings, and where its table headers are."""

    def __init__(self, text: str):
        self.lines = text.splitlines(keepends=True)
        self.newline = next((line[len(line.rstrip("\r\n")):] for line in self.lines if line.endswith("\n")), "\n")
        self.headers: list[tuple[int, re.Match]] = []
        for number, line in enumerate(self.lines):
            match = _HEADER.match(line.rstrip("\r\n"))
            if match and len(match["open"]) == len(match["close"]):
                self.headers.append((number, match))

    def next_header(self, after: int, end: int) -> int:
        return next((n for n, _ in self.headers if after < n < end), end)


def _is_key_line(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _comment_of(line: str) -> str:
    """A trailing comment with the spacing before it ("  # ..."), or ""; values here hold no '#'."""
    body = line.rstrip("\r\n")
    at = body.find("#")
    if at < 0:
        return ""
    start = at
    while start > 0 and body[start - 1] in " \t":
        start -= 1
    return body[start:]


def _table_text(header: str, body: list[str], old: dict, tile: Tile, newline: str) -> list[str]:
    """A changed [[variants.tiles]] table: the header line as it was, its standalone comments,
    then the non-default fields; a line whose key keeps its value keeps its text."""
    indent = re.match(r"[ \t]*", header).group(0)
    ends = lambda line: line if line.endswith("\n") else line + newline  # noqa: E731
    out = [header] + [ends(line) for line in body if line.strip().startswith("#")]
    kept = {match["key"]: line for line in body if (match := _KEY.match(line))}
    for key, value in tile_fields(tile):
        if key in kept and old.get(key) == value and type(old.get(key)) is type(value):
            out.append(ends(kept[key]))
        else:
            out.append(f"{indent}{key} = {format_value(value)}{newline}")
    if body and not body[-1].endswith("\n"):
        out[-1] = out[-1].rstrip("\r\n")  # the file ended without a newline, and still does
    return out


def _scan_array_end(text: str, start: int) -> int:
    """Index just past the ']' closing the array that opens at text[start] == '['."""
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch == "#":
            i = text.find("\n", i)
            if i < 0:
                break
            continue
        if ch in "\"'":
            triple = text.startswith(ch * 3, i)
            close = ch * 3 if triple else ch
            i += len(close)
            while i < len(text) and not text.startswith(close, i):
                i += 2 if ch == '"' and text[i] == "\\" else 1
            i += len(close)
            continue
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError("unterminated tiles array")


def _with_note(lines: list[str], at: int, indent: str, text: str, newline: str) -> list[str]:
    """Put the note line above lines[at], replacing an earlier note right there."""
    line = f"{indent}{text}{newline}"
    if at > 0 and lines[at - 1].strip().startswith(NOTE_PREFIX):
        return lines[:at - 1] + [line] + lines[at:]
    return lines[:at] + [line] + lines[at:]


def _find_variant(data: dict, op: str, impl: str, min_arch: str) -> int:
    want = parse_arch(min_arch)
    found = [i for i, v in enumerate(data.get("variants", []))
             if v.get("op") == op and v.get("impl") == impl and _arch(v.get("min_arch")) == want]
    if len(found) != 1:
        raise ValueError(f"{len(found)} variants with op {op!r}, impl {impl!r}, min_arch {min_arch!r} (expected one)")
    return found[0]


def _arch(value: object) -> int | None:
    try:
        return parse_arch(value) if isinstance(value, str) else None
    except ValueError:
        return None


def replace_tiles(text: str, op: str, impl: str, min_arch: str, tiles: list[Tile], note_line: str) -> tuple[str, str]:
    """(new text, the variant's new block). Raises ValueError if the text cannot be rewritten."""
    data = tomllib.loads(text)
    index = _find_variant(data, op, impl, min_arch)
    old_tiles = data["variants"][index].get("tiles", [])
    if len(old_tiles) != len(tiles):
        raise ValueError(f"the variant has {len(old_tiles)} M buckets, got {len(tiles)} tiles")
    src = _Lines(text)
    lines, nl = src.lines, src.newline
    starts = [n for n, m in src.headers if m["name"] == "variants" and m["open"] == "[["]
    if len(starts) != len(data["variants"]):
        raise ValueError("variants are not all written as [[variants]] tables; cannot find the variant's text")
    start = starts[index]
    end = next((n for n, m in src.headers if n > start and not m["name"].startswith("variants.")), len(lines))
    changed = [tile_key(Tile(**old)) != tile_key(new) for old, new in zip(old_tiles, tiles)]

    tables = [n for n, m in src.headers if start < n < end and m["name"] == "variants.tiles" and m["open"] == "[["]
    if tables:
        new_lines = lines[:tables[0]]
        for j, header in enumerate(tables):
            stop = src.next_header(header, end)
            body_end = max((n + 1 for n in range(header + 1, stop) if _is_key_line(lines[n])), default=header + 1)
            if changed[j]:
                new_lines += _table_text(lines[header], lines[header + 1:body_end], old_tiles[j], tiles[j], nl)
            else:
                new_lines += lines[header:body_end]
            new_lines += lines[body_end:tables[j + 1] if j + 1 < len(tables) else len(lines)]
        if any(changed):
            indent = dict(src.headers)[tables[0]]["indent"]
            new_lines = _with_note(new_lines, tables[0], indent, note_line, nl)
    else:
        section_end = src.next_header(start, end)
        key_line = next((n for n in range(start + 1, section_end) if _TILES_KEY.match(lines[n])), None)
        if key_line is None:
            raise ValueError("the variant has no tiles to replace")
        offset = sum(len(line) for line in lines[:key_line])
        match = _TILES_KEY.match(lines[key_line])
        open_at = offset + match.end()
        if text[open_at:open_at + 1] != "[":
            raise ValueError("the variant's tiles are not an array")
        close_at = _scan_array_end(text, open_at)
        if any(changed):
            indent = match["indent"]
            if len(tiles) == 1:
                array = f"[{inline_table(tiles[0])}]"
            else:
                array = "[" + nl + "".join(f"{indent}    {inline_table(t)},{nl}" for t in tiles) + indent + "]"
            rebuilt = text[:open_at] + array + text[close_at:]
            new_lines = rebuilt.splitlines(keepends=True)
            new_lines = _with_note(new_lines, key_line, indent, note_line, nl)
        else:
            new_lines = lines
    new_text = "".join(new_lines)
    return new_text, _block(new_text, op, impl, min_arch)


def _block(text: str, op: str, impl: str, min_arch: str) -> str:
    """The variant's [[variants]] block in `text`: its header to its last key line."""
    index = _find_variant(tomllib.loads(text), op, impl, min_arch)
    src = _Lines(text)
    start = [n for n, m in src.headers if m["name"] == "variants" and m["open"] == "[["][index]
    end = next((n for n, m in src.headers if n > start and not m["name"].startswith("variants.")), len(src.lines))
    while end > start + 1 and not _is_key_line(src.lines[end - 1]):
        end -= 1  # blank lines and the comments introducing what follows
    return "".join(src.lines[start:end])


def rewrite(path: Path, op: str, impl: str, min_arch: str, tiles: list[Tile], note_line: str) -> Rewrite:
    """The file's text with the variant's tiles replaced, validated; writes nothing."""
    path = Path(path)
    try:
        old_text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DefinitionError(path, [f"cannot read: {error}"]) from None
    try:
        new_text, block = replace_tiles(old_text, op, impl, min_arch, tiles, note_line)
        _same_document_but_tiles(old_text, new_text, op, impl, min_arch, tiles)
    except (ValueError, tomllib.TOMLDecodeError) as error:
        raise DefinitionError(path, [f"cannot write tuned tiles for {op}/{impl} {min_arch}: {error}; "
                                     "nothing written"]) from None
    try:
        parse_definition(path, new_text)
    except DefinitionError as error:
        raise DefinitionError(path, [f"tuned tiles do not validate, nothing written: {p}"
                                     for p in error.problems]) from None
    return Rewrite(path, old_text, new_text, block)


def _same_document_but_tiles(old_text: str, new_text: str, op: str, impl: str, min_arch: str,
                             tiles: list[Tile]) -> None:
    """The rewritten text must parse to the old document with only that variant's tiles replaced."""
    old, new = tomllib.loads(old_text), tomllib.loads(new_text)
    index = _find_variant(old, op, impl, min_arch)
    got = new["variants"][index].get("tiles") if len(new.get("variants", [])) > index else None
    if not isinstance(got, list) or [tile_key(Tile(**t)) for t in got] != [tile_key(t) for t in tiles]:
        raise ValueError("the rewritten text does not hold the new tiles (the file's layout confused the writer)")
    old, new = copy.deepcopy(old), copy.deepcopy(new)
    del old["variants"][index]["tiles"], new["variants"][index]["tiles"]
    if old != new:
        raise ValueError("the rewritten text changes more than the variant's tiles (the file's layout confused the writer)")


def write_atomic(path: Path, text: str) -> None:
    """Replace path's content with text in one step, keeping its permission bits."""
    path = Path(path)
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_tiles(path: Path, op: str, impl: str, min_arch: str, tiles: list[Tile], note_line: str) -> Rewrite:
    """Rewrite and, if the text changes, write it; `.changed` says whether the file was written."""
    result = rewrite(path, op, impl, min_arch, tiles, note_line)
    if result.changed:
        write_atomic(result.path, result.new_text)
    return result
