/* kdsl AOT example: quantize activations (kdsl_act_quant) and multiply by a block-FP8 weight (kdsl_fp8_gemm)
 * from C, on inputs written by run_example.py; writes the outputs back for it to compare with kdsl.ops.
 *
 *   aot_example DIR [CALLS]
 *
 * DIR/cases.txt holds lines "M N K"; for each, DIR has x_M_K.bin (bf16 [M, K]), w_N_K.bin (e4m3 [N, K]) and
 * ws_N_K.bin (float32 [ceil(N / 128), K / 128]); this writes q_M_K.out, s_M_K.out and c_M_N_K.out (bf16).
 * CALLS (default 200): back-to-back calls per op, timed on the host clock, after the checked run.
 * Uses the CUDA driver API for memory; the kdsl library itself needs only the header at build time.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <cuda.h>

#include "kdsl_act_quant.h"
#include "kdsl_fp8_gemm.h"

#define CHECK_CU(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) { \
  const char *s_ = NULL; cuGetErrorString(r_, &s_); fprintf(stderr, "%s failed: %s\n", #call, s_ ? s_ : "?"); return 1; } } while (0)
#define CHECK_KDSL(call) do { kdsl_status s_ = (call); if (s_ != KDSL_OK) { \
  fprintf(stderr, "%s failed (%d): %s\n", #call, (int)s_, kdsl_last_error()); return 1; } } while (0)

static void *read_file(const char *dir, const char *name, size_t bytes) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "rb");
  if (!f) { fprintf(stderr, "cannot open %s\n", path); return NULL; }
  void *data = malloc(bytes ? bytes : 1);
  size_t got = fread(data, 1, bytes, f);
  fclose(f);
  if (got != bytes) { fprintf(stderr, "%s: expected %zu bytes, read %zu\n", path, bytes, got); free(data); return NULL; }
  return data;
}

static int write_file(const char *dir, const char *name, const void *data, size_t bytes) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(data, 1, bytes, f) != bytes) { fprintf(stderr, "cannot write %s\n", path); return 1; }
  fclose(f);
  return 0;
}

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static int run_case(const char *dir, long long M, long long N, long long K, int calls) {
  char name[256];
  long long groups = K / 128, n_blocks = (N + 127) / 128;
  size_t x_bytes = (size_t)(M * K * 2), q_bytes = (size_t)(M * K), s_bytes = (size_t)(M * groups * 4);
  size_t w_bytes = (size_t)(N * K), ws_bytes = (size_t)(n_blocks * groups * 4), c_bytes = (size_t)(M * N * 2);
  snprintf(name, sizeof name, "x_%lld_%lld.bin", M, K);
  void *x = read_file(dir, name, x_bytes);
  snprintf(name, sizeof name, "w_%lld_%lld.bin", N, K);
  void *w = read_file(dir, name, w_bytes);
  snprintf(name, sizeof name, "ws_%lld_%lld.bin", N, K);
  void *ws = read_file(dir, name, ws_bytes);
  if (!x || !w || !ws) return 1;

  CUdeviceptr dx, dq, ds, dw, dws, dc;
  CHECK_CU(cuMemAlloc(&dx, x_bytes));
  CHECK_CU(cuMemAlloc(&dq, q_bytes));
  CHECK_CU(cuMemAlloc(&ds, s_bytes));
  CHECK_CU(cuMemAlloc(&dw, w_bytes));
  CHECK_CU(cuMemAlloc(&dws, ws_bytes));
  CHECK_CU(cuMemAlloc(&dc, c_bytes));
  CHECK_CU(cuMemcpyHtoD(dx, x, x_bytes));
  CHECK_CU(cuMemcpyHtoD(dw, w, w_bytes));
  CHECK_CU(cuMemcpyHtoD(dws, ws, ws_bytes));

  CUstream stream = 0;
  CHECK_KDSL(kdsl_act_quant((const void *)dx, KDSL_BF16, K, (void *)dq, (void *)ds, M, K, stream));
  CHECK_KDSL(kdsl_fp8_gemm((const void *)dq, K, (const void *)ds, groups, (const void *)dw, K, (const void *)dws,
                           groups, (void *)dc, N, KDSL_BF16, M, N, K, stream));
  CHECK_CU(cuCtxSynchronize());

  void *q = malloc(q_bytes), *s = malloc(s_bytes), *c = malloc(c_bytes);
  CHECK_CU(cuMemcpyDtoH(q, dq, q_bytes));
  CHECK_CU(cuMemcpyDtoH(s, ds, s_bytes));
  CHECK_CU(cuMemcpyDtoH(c, dc, c_bytes));
  snprintf(name, sizeof name, "q_%lld_%lld.out", M, K);
  if (write_file(dir, name, q, q_bytes)) return 1;
  snprintf(name, sizeof name, "s_%lld_%lld.out", M, K);
  if (write_file(dir, name, s, s_bytes)) return 1;
  snprintf(name, sizeof name, "c_%lld_%lld_%lld.out", M, N, K);
  if (write_file(dir, name, c, c_bytes)) return 1;

  /* Host time per call: back-to-back calls on the host clock, the GPU synchronized after. */
  double t0 = now_us();
  for (int i = 0; i < calls; i++)
    CHECK_KDSL(kdsl_act_quant((const void *)dx, KDSL_BF16, K, (void *)dq, (void *)ds, M, K, stream));
  double t1 = now_us();
  CHECK_CU(cuCtxSynchronize());
  double t2 = now_us();
  for (int i = 0; i < calls; i++)
    CHECK_KDSL(kdsl_fp8_gemm((const void *)dq, K, (const void *)ds, groups, (const void *)dw, K, (const void *)dws,
                             groups, (void *)dc, N, KDSL_BF16, M, N, K, stream));
  double t3 = now_us();
  CHECK_CU(cuCtxSynchronize());
  if (calls > 0)
    printf("case M=%lld N=%lld K=%lld: host us/call act_quant %.2f fp8_gemm %.2f\n", M, N, K,
           (t1 - t0) / calls, (t3 - t2) / calls);

  cuMemFree(dx), cuMemFree(dq), cuMemFree(ds), cuMemFree(dw), cuMemFree(dws), cuMemFree(dc);
  free(x), free(w), free(ws), free(q), free(s), free(c);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s DIR [CALLS]\n", argv[0]);
    return 2;
  }
  int calls = argc > 2 ? atoi(argv[2]) : 200;
  CUdevice device;
  CUcontext context;
  CHECK_CU(cuInit(0));
  CHECK_CU(cuDeviceGet(&device, 0));
  CHECK_CU(cuDevicePrimaryCtxRetain(&context, device));
  CHECK_CU(cuCtxSetCurrent(context));
  printf("kdsl AOT library for %s (Triton %s)\n", kdsl_aot_archs(), kdsl_aot_triton_version());

  char path[4096];
  snprintf(path, sizeof path, "%s/cases.txt", argv[1]);
  FILE *cases = fopen(path, "r");
  if (!cases) { fprintf(stderr, "cannot open %s\n", path); return 1; }
  long long M, N, K;
  int failed = 0;
  while (fscanf(cases, "%lld %lld %lld", &M, &N, &K) == 3)
    failed |= run_case(argv[1], M, N, K, calls);
  fclose(cases);
  cuDevicePrimaryCtxRelease(device);
  return failed;
}
