#!/usr/bin/env bash
# Bench an old tree and this one side by side on one GPU, interleaved old/new/new/old so drift during the
# run falls on both: `kdsl bench --op fp8_gemm gptq_gemm` (the default deepseek-v3 shapes), JSON per round.
# A tree whose bench times host time per call runs with --no-host-time: those extra few hundred calls per
# graph-timed case keep the GPU loaded between cases, which an old bench without them does not, and the
# comparison is of GPU times under the same harness.
# Usage (on the GPU machine, from the repository root, after `source shared/device/setup.sh`):
#     benchmarks/old_new_bench.sh OLD_TREE OUT_DIR [ops...]
set -uo pipefail
old="$(cd "$1" && pwd)"; out="$2"; shift 2
ops=("${@:-fp8_gemm gptq_gemm}")
site="${PYTHONPATH%%:*}"  # setup.sh puts its wheels first
bench() {  # tree tag
    (cd "$1" && export PYTHONPATH="$site:$1" && flags=() &&
     { python3 -m kdsl bench --help | grep -- --no-host-time > /dev/null && flags=(--no-host-time) || true; } &&
     python3 -m kdsl bench "${flags[@]}" --op ${ops[*]} --json "$out/$2.json") \
        > "$out/$2.log" 2>&1
    echo "$2: exit $? at $(date -u +%T)"
}
bench "$old" old_1; bench "$PWD" new_1; bench "$PWD" new_2; bench "$old" old_2
