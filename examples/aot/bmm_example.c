/* kdsl AOT example: the MLA batched block-FP8 GEMM (kdsl_fp8_bmm) from C on transposed activations, on inputs
 * written by run_bmm_example.py; writes the outputs back for it to compare with kdsl.ops.fp8_bmm.
 *
 *   bmm_example DIR [CALLS]
 *
 * DIR/bmm_cases.txt holds lines "B M N K OFFSET"; for each, DIR has a_B_M_K.bin (e4m3 [M, B, K]: tokens first, as
 * attention produces them), as_B_M_K.bin (float32 [M, B, K / 128]), b_B_N_K.bin (e4m3 [B, N, K]) and
 * bs_B_N_K.bin (float32 [B, ceil(N / 128), K / 128]); this writes c_B_M_N_K_OFFSET.out (bf16 [B, M, N], stored
 * OFFSET bytes past a 16-byte boundary: 8 makes TMA refuse it, so the portable alternative runs). The [B, M, K]
 * operand is the transposed view of a (strides K, B * K, 1): no copy. CALLS (default 200): back-to-back calls
 * timed on the host clock after the checked run.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <cuda.h>

#include "kdsl_fp8_bmm.h"

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

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static int run_case(const char *dir, long long B, long long M, long long N, long long K, long long offset,
                    int calls) {
  char name[256];
  long long groups = K / 128, n_blocks = (N + 127) / 128;
  size_t a_bytes = (size_t)(M * B * K), as_bytes = (size_t)(M * B * groups * 4);
  size_t b_bytes = (size_t)(B * N * K), bs_bytes = (size_t)(B * n_blocks * groups * 4), c_bytes = (size_t)(B * M * N * 2);
  snprintf(name, sizeof name, "a_%lld_%lld_%lld.bin", B, M, K);
  void *a = read_file(dir, name, a_bytes);
  snprintf(name, sizeof name, "as_%lld_%lld_%lld.bin", B, M, K);
  void *as = read_file(dir, name, as_bytes);
  snprintf(name, sizeof name, "b_%lld_%lld_%lld.bin", B, N, K);
  void *b = read_file(dir, name, b_bytes);
  snprintf(name, sizeof name, "bs_%lld_%lld_%lld.bin", B, N, K);
  void *bs = read_file(dir, name, bs_bytes);
  if (!a || !as || !b || !bs) return 1;

  CUdeviceptr da, das, db, dbs, dc;
  CHECK_CU(cuMemAlloc(&da, a_bytes));
  CHECK_CU(cuMemAlloc(&das, as_bytes));
  CHECK_CU(cuMemAlloc(&db, b_bytes));
  CHECK_CU(cuMemAlloc(&dbs, bs_bytes));
  CHECK_CU(cuMemAlloc(&dc, c_bytes + 16));
  CHECK_CU(cuMemcpyHtoD(da, a, a_bytes));
  CHECK_CU(cuMemcpyHtoD(das, as, as_bytes));
  CHECK_CU(cuMemcpyHtoD(db, b, b_bytes));
  CHECK_CU(cuMemcpyHtoD(dbs, bs, bs_bytes));

  CUstream stream = 0;
  CUdeviceptr c_at = dc + (CUdeviceptr)offset;
#define CALL_BMM() kdsl_fp8_bmm((const void *)da, K, B * K, (const void *)das, groups, B * groups, 1,             \
                                (const void *)db, N * K, K, (const void *)dbs, n_blocks * groups, groups, 1,    \
                                (void *)c_at, M * N, N, KDSL_BF16, B, M, N, K, stream)
  CHECK_KDSL(CALL_BMM());
  CHECK_CU(cuCtxSynchronize());
  void *c = malloc(c_bytes);
  CHECK_CU(cuMemcpyDtoH(c, c_at, c_bytes));
  char path[4096];
  snprintf(path, sizeof path, "%s/c_%lld_%lld_%lld_%lld_%lld.out", dir, B, M, N, K, offset);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(c, 1, c_bytes, f) != c_bytes) { fprintf(stderr, "cannot write %s\n", path); return 1; }
  fclose(f);

  double t0 = now_us();
  for (int i = 0; i < calls; i++) CHECK_KDSL(CALL_BMM());
  double t1 = now_us();
  CHECK_CU(cuCtxSynchronize());
  if (calls > 0)
    printf("case B=%lld M=%lld N=%lld K=%lld offset=%lld: host us/call fp8_bmm %.2f\n", B, M, N, K, offset,
           (t1 - t0) / calls);
#undef CALL_BMM
  cuMemFree(da), cuMemFree(das), cuMemFree(db), cuMemFree(dbs), cuMemFree(dc);
  free(a), free(as), free(b), free(bs), free(c);
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
  char path[4096];
  snprintf(path, sizeof path, "%s/bmm_cases.txt", argv[1]);
  FILE *cases = fopen(path, "r");
  if (!cases) { fprintf(stderr, "cannot open %s\n", path); return 1; }
  long long B, M, N, K, offset;
  int failed = 0;
  while (fscanf(cases, "%lld %lld %lld %lld %lld", &B, &M, &N, &K, &offset) == 5)
    failed |= run_case(argv[1], B, M, N, K, offset, calls);
  fclose(cases);
  cuDevicePrimaryCtxRelease(device);
  return failed;
}
