/* kdsl AOT example: the MoE grouped block-FP8 GEMMs (kdsl_fp8_grouped_gemm, kdsl_fp8_grouped_gemm_masked) from C,
 * on inputs written by run_moe_example.py; writes the outputs back for it to compare with kdsl.ops.
 *
 *   moe_example DIR [CALLS]
 *
 * DIR/moe_cases.txt holds one line per case: "LAYOUT E M N K EXPECTED_M" with LAYOUT c (contiguous: a [M, K], one
 * expert id per row, -1 for padding) or m (masked: a [E, M, K], M = max_m, a row count per expert on the device,
 * EXPECTED_M the tile hint, 0 for max_m). Case i reads DIR/case<i>_a.bin (e4m3), case<i>_as.bin (float32 scales,
 * one per 128 of K), case<i>_ids.bin (int32: group_ids [M] or masked_m [E]) and the weights b_E_N_K.bin (e4m3
 * [E, N, K]) and bs_E_N_K.bin (float32 [E, ceil(N / 128), K / 128]); it writes case<i>_c.out (bf16 [M, N] or
 * [E, M, N]). Masked cases also run from a CUDA graph: the call is captured once, replayed, then DIR/case<i>_ids2.bin
 * (another routing) is copied into masked_m and the same graph replayed, written to case<i>_c2.out: one graph
 * serves any routing. CALLS (default 200): back-to-back calls timed on the host clock after the checked run.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda.h>

#include "kdsl_fp8_grouped_gemm.h"
#include "kdsl_fp8_grouped_gemm_masked.h"

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

/* A file copied to a new device allocation; 1 (said on stderr) where it cannot be read. */
static int upload(const char *dir, const char *name, size_t bytes, CUdeviceptr *device) {
  void *host = read_file(dir, name, bytes);
  if (!host) return 1;
  CHECK_CU(cuMemAlloc(device, bytes ? bytes : 1));
  CHECK_CU(cuMemcpyHtoD(*device, host, bytes));
  free(host);
  return 0;
}

static int download(const char *dir, const char *name, CUdeviceptr device, size_t bytes) {
  char path[4096];
  void *host = malloc(bytes ? bytes : 1);
  CHECK_CU(cuMemcpyDtoH(host, device, bytes));
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  int failed = !f || fwrite(host, 1, bytes, f) != bytes;
  if (f) fclose(f);
  free(host);
  if (failed) fprintf(stderr, "cannot write %s\n", path);
  return failed;
}

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static int run_case(const char *dir, int index, char layout, long long E, long long M, long long N, long long K,
                    long long expected_m, int calls) {
  char name[256];
  int masked = layout == 'm';
  long long groups = K / 128, n_blocks = (N + 127) / 128, rows = masked ? E * M : M;
  size_t c_bytes = (size_t)(rows * N * 2);
  CUdeviceptr a, as, ids, b, bs, c;
  snprintf(name, sizeof name, "case%d_a.bin", index);
  if (upload(dir, name, (size_t)(rows * K), &a)) return 1;
  snprintf(name, sizeof name, "case%d_as.bin", index);
  if (upload(dir, name, (size_t)(rows * groups * 4), &as)) return 1;
  snprintf(name, sizeof name, "case%d_ids.bin", index);
  if (upload(dir, name, (size_t)((masked ? E : M) * 4), &ids)) return 1;
  snprintf(name, sizeof name, "b_%lld_%lld_%lld.bin", E, N, K);
  if (upload(dir, name, (size_t)(E * N * K), &b)) return 1;
  snprintf(name, sizeof name, "bs_%lld_%lld_%lld.bin", E, N, K);
  if (upload(dir, name, (size_t)(E * n_blocks * groups * 4), &bs)) return 1;
  CHECK_CU(cuMemAlloc(&c, c_bytes ? c_bytes : 1));
  CHECK_CU(cuMemsetD8(c, 0, c_bytes));  /* rows the kernels leave unwritten (padding, past masked_m) read as 0 */

  CUstream stream = 0;
#define CALL_GROUPED(on) (masked                                                                                      \
    ? kdsl_fp8_grouped_gemm_masked((const void *)a, M * K, K, (const void *)as, M * groups, groups,                  \
                                   (const void *)b, N * K, K, (const void *)bs, n_blocks * groups, groups,           \
                                   (const void *)ids, (void *)c, M * N, N, KDSL_BF16, E, M, N, K, expected_m, on)    \
    : kdsl_fp8_grouped_gemm((const void *)a, K, (const void *)as, groups, (const void *)b, N * K, K,                  \
                            (const void *)bs, n_blocks * groups, groups, (const void *)ids, (void *)c, N, KDSL_BF16, \
                            M, N, K, E, on))
  CHECK_KDSL(CALL_GROUPED(stream));
  CHECK_CU(cuCtxSynchronize());
  snprintf(name, sizeof name, "case%d_c.out", index);
  if (download(dir, name, c, c_bytes)) return 1;

  if (masked) {
    /* Captured once (the cubin is loaded by the call above), replayed for two routings. */
    CUstream capture;
    CUgraph graph;
    CUgraphExec exec;
    CHECK_CU(cuStreamCreate(&capture, CU_STREAM_NON_BLOCKING));
    CHECK_CU(cuStreamBeginCapture(capture, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    kdsl_status captured = CALL_GROUPED(capture);
    CHECK_CU(cuStreamEndCapture(capture, &graph));
    CHECK_KDSL(captured);
    CHECK_CU(cuGraphInstantiate(&exec, graph, 0));
    CHECK_CU(cuMemsetD8(c, 0, c_bytes));
    CHECK_CU(cuGraphLaunch(exec, capture));
    CHECK_CU(cuStreamSynchronize(capture));
    void *eager = read_file(dir, name, c_bytes);
    void *replayed = malloc(c_bytes ? c_bytes : 1);
    if (!eager) return 1;
    CHECK_CU(cuMemcpyDtoH(replayed, c, c_bytes));
    if (memcmp(eager, replayed, c_bytes) != 0) {
      fprintf(stderr, "case %d: the graph replay differs from the eager call\n", index);
      return 1;
    }
    free(eager), free(replayed);
    void *routing = NULL;
    snprintf(name, sizeof name, "case%d_ids2.bin", index);
    if (!(routing = read_file(dir, name, (size_t)(E * 4)))) return 1;
    CHECK_CU(cuMemcpyHtoD(ids, routing, (size_t)(E * 4)));
    free(routing);
    CHECK_CU(cuMemsetD8(c, 0, c_bytes));
    CHECK_CU(cuGraphLaunch(exec, capture));
    CHECK_CU(cuStreamSynchronize(capture));
    snprintf(name, sizeof name, "case%d_c2.out", index);
    if (download(dir, name, c, c_bytes)) return 1;
    cuGraphExecDestroy(exec), cuGraphDestroy(graph), cuStreamDestroy(capture);
  }

  double t0 = now_us();
  for (int i = 0; i < calls; i++) CHECK_KDSL(CALL_GROUPED(stream));
  double t1 = now_us();
  CHECK_CU(cuCtxSynchronize());
  if (calls > 0)
    printf("case %d %s E=%lld M=%lld N=%lld K=%lld: host us/call %.2f\n", index, masked ? "masked" : "contiguous",
           E, M, N, K, (t1 - t0) / calls);
#undef CALL_GROUPED
  cuMemFree(a), cuMemFree(as), cuMemFree(ids), cuMemFree(b), cuMemFree(bs), cuMemFree(c);
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
  snprintf(path, sizeof path, "%s/moe_cases.txt", argv[1]);
  FILE *cases = fopen(path, "r");
  if (!cases) { fprintf(stderr, "cannot open %s\n", path); return 1; }
  char layout;
  long long E, M, N, K, expected_m;
  int failed = 0, index = 0;
  while (fscanf(cases, " %c %lld %lld %lld %lld %lld", &layout, &E, &M, &N, &K, &expected_m) == 6)
    failed |= run_case(argv[1], index++, layout, E, M, N, K, expected_m, calls);
  fclose(cases);
  cuDevicePrimaryCtxRelease(device);
  return failed;
}
