"""The table `kdsl tune` prints per bucket: current tile, winner, runners-up, speed-up, dropped."""
from __future__ import annotations

from kdsl.tune.search import BucketResult, Outcome, compact

RUNNERS_UP = 2


def _ms_values(shapes) -> str:
    ms = sorted({s.m for s in shapes})
    pairs = len({(s.n, s.k) for s in shapes})
    return f"M = {', '.join(map(str, ms))} x {pairs} (N, K)"


def _row(role: str, outcome: Outcome, current: Outcome) -> list[str]:
    if not outcome.ok:
        return [role, compact(outcome.tile), "-", "-", "dropped"]
    vs = "-" if not current.ok else f"{current.score / outcome.score:.3f}x"
    return [role, compact(outcome.tile), f"{outcome.score:.3f}", vs, ""]


def _render(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def format_bucket(result: BucketResult) -> str:
    b, cur, win = result.bucket, result.current, result.winner
    title = (f"-- bucket {b.label()}: {len(result.outcomes)} candidates on {len(result.shapes)} shapes "
             f"({_ms_values(result.shapes)}), {len(result.dropped)} dropped")
    header = ["", "tile", "score", "speed-up", ""]
    rows = [header, _row("current", cur, cur)]
    if win is not None and win is not cur:
        rows.append(_row("winner", win, cur))
    ranked = sorted((o for o in result.outcomes if o.ok and o is not win and o is not cur), key=lambda o: o.score)
    rows += [_row("next", o, cur) for o in ranked[:RUNNERS_UP]]
    lines = [title, *_render(rows)]
    if win is None:
        lines.append("  no candidate ran correctly: the bucket keeps its tile")
    elif win is cur:
        lines.append("  the current tile is the fastest: unchanged")
    elif result.speedup is not None:
        lines.append(f"  winner is {result.speedup:.3f}x the current tile's speed (geometric mean over shapes)")
    else:
        lines.append(f"  the current tile failed ({cur.dropped}); the winner replaces it")
    lines += [f"  dropped {compact(o.tile)}: {o.dropped}" for o in result.dropped]
    return "\n".join(lines)


def format_results(title: str, results: list[BucketResult]) -> str:
    note = "score = geometric mean over shapes of (time / current tile's time); lower is faster"
    return "\n\n".join([f"== {title} ==\n{note}", *(format_bucket(r) for r in results)])
