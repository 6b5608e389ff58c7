/* kdsl AOT example: the W4A16 GEMM on prepared GPTQ weights (kdsl_gptq_gemm) from C, on inputs written by
 * run_gptq_example.py; writes the outputs back for it to compare with kdsl.ops.
 *
 *   gptq_example DIR [CALLS]
 *
 * DIR/cases.txt holds lines "M N K W": W names a prepared weight set, described by DIR/wW.txt, one line
 *   K N layout_planes contiguous_groups has_perm qweight_bytes zs_bytes zeros_offset scales_offset ldz lds ldqw
 * with its tensors in wW_qweight.bin, wW_zs.bin (zeros and scales in one buffer: the prepared tensors are
 * views of it at those byte offsets, as the "paired" layout has them), wW_groups.bin and wW_perm.bin
 * (int32 [K], if has_perm). x_M_K.bin is fp16 [M, K]; this writes y_M_N_K_W.out (fp16 [M, N]).
 * CALLS (default 200): back-to-back calls timed on the host clock after the checked run.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <cuda.h>

#include "kdsl_w4a16_gemm.h"

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

/* One prepared weight set on the device. */
typedef struct weights {
  long long K, N, planes, contiguous, has_perm, qweight_bytes, zs_bytes, zeros_offset, scales_offset, ldz, lds, ldqw;
  CUdeviceptr qweight, zs, groups, perm;
} weights;

static int upload(const char *dir, const char *name, size_t bytes, CUdeviceptr *out) {
  void *host = read_file(dir, name, bytes);
  if (!host) return 1;
  CHECK_CU(cuMemAlloc(out, bytes));
  CHECK_CU(cuMemcpyHtoD(*out, host, bytes));
  free(host);
  return 0;
}

static int load_weights(const char *dir, int index, weights *w) {
  char name[256];
  snprintf(name, sizeof name, "%s/w%d.txt", dir, index);
  FILE *f = fopen(name, "r");
  if (!f || fscanf(f, "%lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld", &w->K, &w->N, &w->planes,
                   &w->contiguous, &w->has_perm, &w->qweight_bytes, &w->zs_bytes, &w->zeros_offset,
                   &w->scales_offset, &w->ldz, &w->lds, &w->ldqw) != 12) {
    fprintf(stderr, "cannot read %s\n", name);
    return 1;
  }
  fclose(f);
  snprintf(name, sizeof name, "w%d_qweight.bin", index);
  if (upload(dir, name, (size_t)w->qweight_bytes, &w->qweight)) return 1;
  snprintf(name, sizeof name, "w%d_zs.bin", index);
  if (upload(dir, name, (size_t)w->zs_bytes, &w->zs)) return 1;
  snprintf(name, sizeof name, "w%d_groups.bin", index);
  if (upload(dir, name, (size_t)w->K * 4, &w->groups)) return 1;
  w->perm = 0;
  snprintf(name, sizeof name, "w%d_perm.bin", index);
  if (w->has_perm && upload(dir, name, (size_t)w->K * 4, &w->perm)) return 1;
  return 0;
}

static int run_case(const char *dir, long long M, long long N, long long K, int index, const weights *w, int calls) {
  char name[256];
  size_t x_bytes = (size_t)(M * K * 2), y_bytes = (size_t)(M * N * 2);
  if (w->K != K || w->N != N) { fprintf(stderr, "case %lld %lld %lld: weights w%d are %lld x %lld\n", M, N, K, index, w->K, w->N); return 1; }
  CUdeviceptr dx, dy;
  snprintf(name, sizeof name, "x_%lld_%lld.bin", M, K);
  if (upload(dir, name, x_bytes, &dx)) return 1;
  CHECK_CU(cuMemAlloc(&dy, y_bytes));
  CUstream stream = 0;
#define CALL kdsl_gptq_gemm((const void *)dx, K, (const void *)w->perm, (const void *)w->qweight, w->ldqw, \
                            (const void *)(w->zs + w->zeros_offset), w->ldz, (const void *)(w->zs + w->scales_offset), \
                            w->lds, (const void *)w->groups, w->contiguous, (void *)dy, N, KDSL_F16, M, N, K, stream)
  CHECK_KDSL(CALL);
  CHECK_CU(cuCtxSynchronize());
  void *y = malloc(y_bytes);
  CHECK_CU(cuMemcpyDtoH(y, dy, y_bytes));
  snprintf(name, sizeof name, "%s/y_%lld_%lld_%lld_%d.out", dir, M, N, K, index);
  FILE *f = fopen(name, "wb");
  if (!f || fwrite(y, 1, y_bytes, f) != y_bytes) { fprintf(stderr, "cannot write %s\n", name); return 1; }
  fclose(f);
  double t0 = now_us();
  for (int i = 0; i < calls; i++) CHECK_KDSL(CALL);
  double t1 = now_us();
  CHECK_CU(cuCtxSynchronize());
  if (calls > 0) printf("case M=%lld N=%lld K=%lld w%d: host us/call kdsl_gptq_gemm %.2f\n", M, N, K, index, (t1 - t0) / calls);
#undef CALL
  cuMemFree(dx), cuMemFree(dy);
  free(y);
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
  weights sets[8];
  int loaded[8] = {0};
  long long M, N, K;
  int index, failed = 0;
  while (fscanf(cases, "%lld %lld %lld %d", &M, &N, &K, &index) == 4) {
    if (index < 0 || index >= 8) { fprintf(stderr, "weight set %d: 0..7 only\n", index); return 1; }
    if (!loaded[index]) {
      if (load_weights(argv[1], index, &sets[index])) return 1;
      loaded[index] = 1;
    }
    failed |= run_case(argv[1], M, N, K, index, &sets[index], calls);
  }
  fclose(cases);
  cuDevicePrimaryCtxRelease(device);
  return failed;
}
