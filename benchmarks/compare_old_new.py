"""Old/new ratio per cell from benchmarks/old_new_bench.sh's JSON rounds (old_*.json, new_*.json in one folder).

Each cell's time is its CUDA-graph median where the bench took one, else eager; per tree the best round
counts (the fewest microseconds: noise on a shared host only adds time). old/new >= 1: the new tree is as fast.
Usage: python benchmarks/compare_old_new.py RESULTS_DIR [--bar 0.97]
"""
import argparse
import json
from pathlib import Path


def cells(path: Path) -> dict:
    found = {}
    for result in json.loads(path.read_text())["results"]:
        if result["status"] != "ok":
            continue
        timing = "graph" if result["kdsl"].get("graph_ms") else "eager"
        shape = result["shape"]
        key = (result["impl"], shape.get("m"), shape.get("n"), shape.get("k"), timing)
        found[key] = result["kdsl"][f"{timing}_ms"] * 1000
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--bar", type=float, default=0.97)
    args = parser.parse_args()
    rounds = {tree: [cells(p) for p in sorted(args.folder.glob(f"{tree}_*.json"))] for tree in ("old", "new")}
    if not rounds["old"] or not rounds["new"]:
        parser.error(f"{args.folder}: needs old_*.json and new_*.json")
    keys = [k for k in rounds["old"][0] if all(k in r for r in rounds["old"] + rounds["new"])]
    print("| op | M | N | K | timing | old us (rounds) | new us (rounds) | old/new (best) |")
    print("|---|---|---|---|---|---|---|---|")
    below = 0
    for key in keys:
        old = [r[key] for r in rounds["old"]]
        new = [r[key] for r in rounds["new"]]
        ratio = min(old) / min(new)
        below += ratio < args.bar
        mark = " **below**" if ratio < args.bar else ""
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | {' / '.join(f'{t:.1f}' for t in old)} | "
              f"{' / '.join(f'{t:.1f}' for t in new)} | {ratio:.3f}{mark} |")
    print(f"\n{len(keys)} cells, {below} below {args.bar}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
