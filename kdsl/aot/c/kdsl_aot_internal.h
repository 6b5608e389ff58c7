/* Internal to the kdsl AOT library: the spec table, the driver table and the launch helper. */
#ifndef KDSL_AOT_INTERNAL_H
#define KDSL_AOT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include "kdsl_aot.h"

#if defined(__GNUC__)
#define KDSL_INTERNAL __attribute__((visibility("hidden")))
#else
#define KDSL_INTERNAL
#endif

typedef struct kdsl__loaded {
  CUcontext context;
  CUmodule module;
  CUfunction function;
  struct kdsl__loaded *next;
} kdsl__loaded;

/* A host TMA descriptor parameter of a compiled kernel, as its metadata (Triton's tensordesc_meta) and PTX say. */
typedef struct kdsl__tma_meta {
  unsigned host_type;              /* CUtensorMapDataType */
  unsigned elem_size;              /* bytes */
  unsigned swizzle;                /* CUtensorMapSwizzle */
  unsigned rank;
  unsigned box[5];                 /* outermost dimension first, as Triton's block_size */
  int shape_params, stride_params; /* int32 / int64 kernel parameters after the CUtensorMap */
} kdsl__tma_meta;

/* A descriptor as the dispatcher computes it for one call: what Python's launch gives TensorDescriptor. */
#define KDSL__TMA_MAX_RANK 5
typedef struct kdsl__tma_call {
  int64_t base;
  int rank;
  int64_t shape[KDSL__TMA_MAX_RANK];    /* elements, outermost first */
  int64_t strides[KDSL__TMA_MAX_RANK];  /* elements, outermost first, the last 1 */
} kdsl__tma_call;

/* One compiled specialization of one kernel. */
typedef struct kdsl__spec {
  const char *name;
  const char *entry;               /* the kernel's symbol in the cubin */
  const unsigned char *cubin;
  const unsigned char *cubin_end;
  unsigned shared;                 /* bytes of dynamic shared memory */
  unsigned threads;                /* num_warps * 32 */
  int arch;                        /* exported for sm_<arch> */
  int bucket;                      /* tile bucket of the kernel's definition */
  int dtype;                       /* the op's varying dtype (kdsl_dtype), -1 if none */
  int nparams;                     /* kernel parameters the dispatcher computes, in signature order */
  const char *types;               /* per parameter: 'p' pointer, 'i' int32, 'l' int64, 'T' TMA descriptor */
  const char *claims;              /* per parameter: '1' equal to 1 (compiled in, not passed), 'D' divisible by 16, '-' */
  int hidden;                      /* trailing parameters Triton adds (global/profile scratch), passed as NULL */
  int nvariant;                    /* constexprs the launch computes from the arguments (act-order, ...) */
  const int64_t *variant;          /* their values for this spec, compared with the call's */
  const kdsl__tma_meta *tma;       /* per 'T' parameter, in order (NULL if none) */
  kdsl__loaded *loaded;            /* per CUDA context; guarded by the runtime's lock */
} kdsl__spec;

typedef struct kdsl__driver {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuCtxGetCurrent)(CUcontext *);
  CUresult (*cuCtxGetDevice)(CUdevice *);
  CUresult (*cuDeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
  CUresult (*cuModuleLoadData)(CUmodule *, const void *);
  CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
  CUresult (*cuFuncSetAttribute)(CUfunction, CUfunction_attribute, int);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                             unsigned int, unsigned int, CUstream, void **, void **);
  CUresult (*cuGetErrorString)(CUresult, const char **);
  /* Split-K scratch (cuMemAlloc and cuMemsetD32Async; named apart from cuda.h's _v2 macros). */
  CUresult (*mem_alloc)(CUdeviceptr *, size_t);
  CUresult (*memset_d32_async)(CUdeviceptr, unsigned int, size_t, CUstream);
  /* TMA descriptors (CUDA 12.0+). */
  CUresult (*cuTensorMapEncodeTiled)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                     const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                     CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
} kdsl__driver;

/* What the last launch on this thread was given (read by the tests; the cost is a few stores). */
#define KDSL__RECORDED_VALUES 64
typedef struct kdsl__launch_record {
  const kdsl__spec *spec;
  unsigned grid[3];
  int nvalues;
  int64_t values[KDSL__RECORDED_VALUES];
} kdsl__launch_record;

KDSL_INTERNAL kdsl_status kdsl__fail(kdsl_status status, const char *format, ...);
KDSL_INTERNAL void kdsl__clear_error(void);
/* The arch (major * 10 + minor) of the current context's device, loading the driver on first use. */
KDSL_INTERNAL kdsl_status kdsl__current_arch(const char *op, int *arch);
/* The SM count of the current context's device (for the K split a launch takes). */
KDSL_INTERNAL kdsl_status kdsl__current_sms(const char *op, int *sms);
/* Split-K scratch of the current context: at least `workspace_bytes` of fp32 workspace and `counters` int32
 * counters, all zero. Kept per context and grown on demand (the counters zeroed on `stream` when new); every
 * split launch leaves its counters at zero again, so launches on one stream (or ordered between streams) may
 * share it, while concurrent launches on different streams of one context must not (as on the Python side).
 * A grown buffer's predecessor is not freed (a launch in flight may still use it). */
KDSL_INTERNAL kdsl_status kdsl__splitk_scratch(const char *op, int64_t workspace_bytes, int64_t counters,
                                               CUstream stream, int64_t *workspace, int64_t *counter_words);
/* The most specific spec whose assumptions the values meet (bucket and dtype equal), or NULL. */
KDSL_INTERNAL const kdsl__spec *kdsl__pick(kdsl__spec *const *specs, int count, int bucket, int dtype,
                                          const int64_t *variant, int nvariant, const int64_t *values, int nvalues);
/* values: one per spec parameter; a 'T' parameter's value indexes `descriptors`, which are encoded into
 * CUtensorMaps here (with the box, swizzle and type the spec's kernel was compiled for). */
KDSL_INTERNAL kdsl_status kdsl__launch(const char *op, kdsl__spec *spec, CUstream stream, int64_t gx, int64_t gy,
                                       int64_t gz, const int64_t *values, const kdsl__tma_call *descriptors);

/* Tests: replace the driver (NULL: back to dlopen), and read this thread's last launch. */
void kdsl_aot_test_set_driver(const kdsl__driver *driver);
const kdsl__launch_record *kdsl_aot_test_last_launch(void);

static inline int64_t kdsl__cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t kdsl__div(int64_t a, int64_t b) { return a / b; }
/* kdsl/kernels/host.py's split_for (SPLIT_FILL 2, PROGRAM_COST_STEPS 6), as kdsl.aot.abi.split_for. */
static inline int64_t kdsl__split_cap(int64_t k_steps, int64_t split_k, int64_t min_steps) {
  int64_t cap = k_steps / (min_steps > 0 ? min_steps : 1);
  if (cap > split_k) cap = split_k;
  return cap < 1 ? 1 : cap;
}
static inline int64_t kdsl__split_for(int64_t k_steps, int64_t tiles, int64_t split_k, int64_t min_steps,
                                      int64_t fill, int64_t sms) {
  int64_t cap = kdsl__split_cap(k_steps, split_k, min_steps);
  int64_t slots = (fill > 0 ? fill : 2) * sms;
  if (tiles >= slots) return 1;
  int64_t best = 1, best_finish = -1;
  for (int64_t split = 1; split <= cap; split++) {
    int64_t finish = kdsl__cdiv(tiles * split, slots) * (kdsl__cdiv(k_steps, split) + 6);
    if (best_finish < 0 || finish < best_finish) best = split, best_finish = finish;
  }
  return best;
}
static inline int64_t kdsl__least(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t kdsl__dtype_size(int64_t dtype) { return dtype == KDSL_F32 ? 4 : 2; }
static inline int64_t kdsl__programs(int64_t work, int64_t persistent, int64_t per_sm, int64_t sms) {
  return persistent && work > per_sm * sms ? per_sm * sms : work;
}
/* fp8_bmm_tma_sm90.py.j2's _tma_strides: a dimension of size 1 is never stepped; TMA gets the padded row. */
static inline int64_t kdsl__tma_stride(int64_t size, int64_t stride, int64_t cols, int64_t esize) {
  return size > 1 ? stride : (cols * esize + 15) / 16 * 16 / esize;
}
static inline int64_t kdsl__bad_tma_stride(int64_t size, int64_t stride, int64_t esize) {
  return size > 1 && (stride == 0 || stride * esize % 16 != 0);
}
#define kdsl__addr(p) ((int64_t)(uintptr_t)(p))
#define kdsl__nonzero(p) ((p) != 0)
#define kdsl__either(p, q) ((p) ? (p) : (q))

#endif
