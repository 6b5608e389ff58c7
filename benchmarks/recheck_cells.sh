#!/usr/bin/env bash
# Re-time a few cells of an old tree and this one, interleaved ROUNDS times (old, new, new, old, ...), from a
# kdsl bench shape file. Usage (GPU machine, repository root, after `source shared/device/setup.sh`):
#     benchmarks/recheck_cells.sh OLD_TREE SHAPES.json OUT_DIR ROUNDS OP...
set -uo pipefail
old="$(cd "$1" && pwd)"; shapes="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; out="$3"; rounds="$4"; shift 4
site="${PYTHONPATH%%:*}"
bench() {  # tree tag (--no-host-time where the tree's bench has it: see old_new_bench.sh)
    (cd "$1" && export PYTHONPATH="$site:$1" && flags=() &&
     { python3 -m kdsl bench --help | grep -- --no-host-time > /dev/null && flags=(--no-host-time) || true; } &&
     python3 -m kdsl bench "${flags[@]}" --op "${@:3}" --shapes "$shapes" --json "$out/$2.json") \
        >> "$out/recheck.log" 2>&1
}
for r in $(seq 1 "$rounds"); do
    if (( r % 2 )); then bench "$old" "old_$r" "$@"; bench "$PWD" "new_$r" "$@"
    else bench "$PWD" "new_$r" "$@"; bench "$old" "old_$r" "$@"; fi
done
