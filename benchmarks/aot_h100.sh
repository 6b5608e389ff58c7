#!/usr/bin/env bash
# The AOT checks on a GPU machine, in one go (from the repository root, after shared/device/setup.sh):
#   export act_quant + fp8_gemm for sm_90, build the library (Makefile, and CMake if present) and the example,
#   run the example against kdsl.ops, compute-sanitizer on the example, the first-call benchmark.
#   Then kdsl_gptq_gemm: export w4a16_gemm (g128, f16) for sm_90, build it and examples/aot/gptq_example.c,
#   run run_gptq_example.py (C against kdsl.ops, bit for bit where the same kernel ran), compute-sanitizer.
# Logs go to $OUT (default /tmp/aot_out): aot_h100_{export,build,example,sanitizer,first_call}.txt and
# aot_h100_gptq_{export,build,example,sanitizer}.txt. ONLY=gptq runs the kdsl_gptq_gemm part alone.
set -u
OUT=${OUT:-/tmp/aot_out}
mkdir -p "$OUT"
EXPORT=/tmp/kdsl_aot_sm90
REPEAT=${REPEAT:-2}
nvidia-smi -L > "$OUT/aot_h100_device.txt" 2>&1
INC=""
for d in /usr/local/cuda/include "$(python3 -c 'import os, triton; print(os.path.dirname(triton.__file__))')/backends/nvidia/include"; do
  if [ -f "$d/cuda.h" ]; then INC=$d; break; fi
done
LIBDIRS="-L/usr/local/cuda/lib64/stubs -L/usr/lib/x86_64-linux-gnu"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)

if [ "${ONLY:-all}" != gptq ]; then

start=$(date +%s)
python3 -m kdsl aot --arch sm_90 --op act_quant --op fp8_gemm --out "$EXPORT" > "$OUT/aot_h100_export.txt" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s" >> "$OUT/aot_h100_export.txt"
tail -3 "$OUT/aot_h100_export.txt"

{
  echo "cuda.h from $INC; cc: $(cc --version | head -1); nvcc: $(command -v nvcc && nvcc --version | tail -1)"
  make -C "$EXPORT" CUDA_INCLUDE="$INC" CFLAGS="-O2 -Wall -Wextra -Werror" && echo "make: ok"
  if command -v cmake > /dev/null; then
    cmake -S "$EXPORT" -B "$EXPORT/build" -DKDSL_CUDA_INCLUDE="$INC" > /dev/null && cmake --build "$EXPORT/build" && echo "cmake: ok"
  else
    echo "cmake: not installed here"
  fi
  cc -std=gnu11 -O2 -Wall -Wextra -Werror examples/aot/aot_example.c -I"$EXPORT/include" -I"$INC" \
     -L"$EXPORT" -lkdsl_aot -Wl,-rpath,"$EXPORT" $LIBDIRS -lcuda -o /tmp/aot_example && echo "example: ok"
  ls -la "$EXPORT/libkdsl_aot.so" /tmp/aot_example
} > "$OUT/aot_h100_build.txt" 2>&1
tail -2 "$OUT/aot_h100_build.txt"

timeout 120 python3 examples/aot/run_example.py --exe /tmp/aot_example --export "$EXPORT" --work /tmp/aot_data > "$OUT/aot_h100_example.txt" 2>&1
echo "exit $?" >> "$OUT/aot_h100_example.txt"
tail -4 "$OUT/aot_h100_example.txt"

{
  if [ -n "$SAN" ]; then
    timeout 60 python3 examples/aot/run_example.py --exe /tmp/aot_example --export "$EXPORT" --work /tmp/aot_quick --quick --calls 1 | tail -1
    timeout 90 "$SAN" --tool memcheck --error-exitcode 9 /tmp/aot_example /tmp/aot_quick 1
    echo "compute-sanitizer exit $?"
  else
    echo "compute-sanitizer: not found"
  fi
} > "$OUT/aot_h100_sanitizer.txt" 2>&1
tail -2 "$OUT/aot_h100_sanitizer.txt"

timeout 150 python3 benchmarks/aot_first_call.py --export "$EXPORT" --repeat "$REPEAT" > "$OUT/aot_h100_first_call.txt" 2>&1
echo "exit $?" >> "$OUT/aot_h100_first_call.txt"
cat "$OUT/aot_h100_first_call.txt"
cp "$EXPORT/aot_manifest.json" "$OUT/aot_h100_manifest.json"  # summarized into results/aot_h100_manifest.txt
fi

# ---- kdsl_gptq_gemm (w4a16_gemm on prepared weights) ----
GEXPORT=/tmp/kdsl_aot_gptq_sm90
start=$(date +%s)
python3 -m kdsl aot --arch sm_90 --op w4a16_gemm --scheme w4a16.int4.g128 --dtype f16 --out "$GEXPORT" \
  > "$OUT/aot_h100_gptq_export.txt" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s" >> "$OUT/aot_h100_gptq_export.txt"
grep -v '^\[' "$OUT/aot_h100_gptq_export.txt" | tail -5
{
  make -C "$GEXPORT" CUDA_INCLUDE="$INC" CFLAGS="-O2 -Wall -Wextra -Werror" && echo "make: ok"
  cc -std=gnu11 -O2 -Wall -Wextra -Werror examples/aot/gptq_example.c -I"$GEXPORT/include" -I"$INC" \
     -L"$GEXPORT" -lkdsl_aot -Wl,-rpath,"$GEXPORT" $LIBDIRS -lcuda -o /tmp/gptq_example && echo "gptq example: ok"
} > "$OUT/aot_h100_gptq_build.txt" 2>&1
tail -2 "$OUT/aot_h100_gptq_build.txt"
timeout 150 python3 examples/aot/run_gptq_example.py --exe /tmp/gptq_example --work /tmp/aot_gptq_data \
  --calls "${CALLS:-200}" > "$OUT/aot_h100_gptq_example.txt" 2>&1
echo "exit $?" >> "$OUT/aot_h100_gptq_example.txt"
cat "$OUT/aot_h100_gptq_example.txt"
{
  if [ -n "$SAN" ]; then
    timeout 180 "$SAN" --tool memcheck --error-exitcode 9 /tmp/gptq_example /tmp/aot_gptq_data 1
    echo "compute-sanitizer exit $?"
  else
    echo "compute-sanitizer: not found"
  fi
} > "$OUT/aot_h100_gptq_sanitizer.txt" 2>&1
tail -3 "$OUT/aot_h100_gptq_sanitizer.txt"
cp "$GEXPORT/aot_manifest.json" "$OUT/aot_h100_gptq_manifest.json"
