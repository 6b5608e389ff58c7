#!/usr/bin/env bash
# The AOT checks of the TMA kernels on a GPU machine, in one go (from the repository root, after
# shared/device/setup.sh): export act_quant + fp8_gemm + fp8_bmm for sm_90 (bf16), build the library with
# -Werror and examples/aot/{aot,bmm}_example.c, run run_example.py (kdsl_fp8_gemm: tma_persistent's wgmma tiles
# for M <= 128, the portable fallback above; C against the same kernel from Python, bit for bit) and
# run_bmm_example.py (kdsl_fp8_bmm on transposed MLA activations against kdsl.ops.fp8_bmm, bit for bit), host
# time per call from C and from kdsl.ops, compute-sanitizer memcheck on both examples' small cases.
# Logs go to $OUT (default /tmp/aot_out): aot_tma_{device,export,build,example,bmm_example,sanitizer}.txt.
set -u
OUT=${OUT:-/tmp/aot_out}
mkdir -p "$OUT"
EXPORT=/tmp/kdsl_aot_tma_sm90
CALLS=${CALLS:-200}
nvidia-smi -L > "$OUT/aot_tma_device.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$OUT/aot_tma_device.txt" 2>&1
INC=""
for d in /usr/local/cuda/include "$(python3 -c 'import os, triton; print(os.path.dirname(triton.__file__))')/backends/nvidia/include"; do
  if [ -f "$d/cuda.h" ]; then INC=$d; break; fi
done
LIBDIRS="-L/usr/local/cuda/lib64/stubs -L/usr/lib/x86_64-linux-gnu"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)

start=$(date +%s)
python3 -m kdsl aot --arch sm_90 --op act_quant --op fp8_gemm --op fp8_bmm --dtype bf16 --out "$EXPORT" \
  > "$OUT/aot_tma_export.txt" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s" >> "$OUT/aot_tma_export.txt"
grep -v '^\[' "$OUT/aot_tma_export.txt" | tail -8

{
  echo "cuda.h from $INC; cc: $(cc --version | head -1)"
  make -C "$EXPORT" CUDA_INCLUDE="$INC" CFLAGS="-O2 -Wall -Wextra -Werror" && echo "make: ok"
  for example in aot_example bmm_example; do
    cc -std=gnu11 -O2 -Wall -Wextra -Werror examples/aot/$example.c -I"$EXPORT/include" -I"$INC" \
       -L"$EXPORT" -lkdsl_aot -Wl,-rpath,"$EXPORT" $LIBDIRS -lcuda -o /tmp/$example && echo "$example: ok"
  done
} > "$OUT/aot_tma_build.txt" 2>&1
tail -3 "$OUT/aot_tma_build.txt"

timeout 150 python3 examples/aot/run_example.py --exe /tmp/aot_example --export "$EXPORT" --work /tmp/aot_data \
  --calls "$CALLS" > "$OUT/aot_tma_example.txt" 2>&1
echo "exit $?" >> "$OUT/aot_tma_example.txt"
cat "$OUT/aot_tma_example.txt"

timeout 150 python3 examples/aot/run_bmm_example.py --exe /tmp/bmm_example --work /tmp/aot_bmm_data \
  --calls "$CALLS" > "$OUT/aot_tma_bmm_example.txt" 2>&1
echo "exit $?" >> "$OUT/aot_tma_bmm_example.txt"
cat "$OUT/aot_tma_bmm_example.txt"

{
  if [ -n "$SAN" ]; then
    timeout 60 python3 examples/aot/run_example.py --exe /tmp/aot_example --export "$EXPORT" --work /tmp/aot_quick \
      --quick --calls 1 | tail -1
    timeout 90 "$SAN" --tool memcheck --error-exitcode 9 /tmp/aot_example /tmp/aot_quick 1
    echo "compute-sanitizer aot_example exit $?"
    timeout 60 python3 examples/aot/run_bmm_example.py --exe /tmp/bmm_example --work /tmp/aot_bmm_quick --quick \
      --calls 1 | tail -1
    timeout 90 "$SAN" --tool memcheck --error-exitcode 9 /tmp/bmm_example /tmp/aot_bmm_quick 1
    echo "compute-sanitizer bmm_example exit $?"
  else
    echo "compute-sanitizer: not found"
  fi
} > "$OUT/aot_tma_sanitizer.txt" 2>&1
tail -6 "$OUT/aot_tma_sanitizer.txt"
python3 - "$EXPORT/aot_manifest.json" > "$OUT/aot_tma_manifest.txt" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
print("triton", m["triton"], "archs", m["archs"])
for o in m["ops"]:
    print("op", o["op"], o["function"], o["arch"], o["entry"], o["specializations"], "fallback:", o.get("fallback"))
for r in m["routes"]:
    print(r)
for s in m["specializations"]:
    tma = "; ".join(f"{d['param']} box {d['box']} swizzle {d['swizzle']} type {d['host_type']}" for d in s.get("tma", []))
    print(s["name"], s["impl"], "bucket", s["bucket"], s["sha256"][:16], s["specialization"], tma)
PY
