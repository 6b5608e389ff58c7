/* kdsl AOT runtime: the CUDA driver through dlopen, errors per thread, cubins loaded once per context. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kdsl_aot_internal.h"

static __thread char last_error[1024];
static __thread kdsl__launch_record last_launch;

const char *kdsl_last_error(void) { return last_error; }

kdsl_status kdsl__fail(kdsl_status status, const char *format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(last_error, sizeof last_error, format, args);
  va_end(args);
  return status;
}

void kdsl__clear_error(void) { last_error[0] = '\0'; }

const kdsl__launch_record *kdsl_aot_test_last_launch(void) { return &last_launch; }

/* ---- the driver ---------------------------------------------------------------------------------- */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;  /* guards everything below */
static kdsl__driver driver;
static int driver_state;  /* 0 not tried, 1 loaded, -1 failed (the message kept in driver_problem) */
static char driver_problem[512];

void kdsl_aot_test_set_driver(const kdsl__driver *replacement) {
  pthread_mutex_lock(&lock);
  if (replacement) {
    driver = *replacement;
    driver_state = 1;
  } else {
    memset(&driver, 0, sizeof driver);
    driver_state = 0;
  }
  pthread_mutex_unlock(&lock);
}

typedef CUresult (*get_proc_v2_t)(const char *, void **, int, cuuint64_t, void *);
typedef CUresult (*get_proc_v1_t)(const char *, void **, int, cuuint64_t);

static void *driver_symbol(void *library, get_proc_v2_t v2, get_proc_v1_t v1, const char *name) {
  void *pointer = NULL;
  /* 12000: the entry points' CUDA 12.0 ABI, the prototypes in kdsl__driver. */
  if (v2 && v2(name, &pointer, 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL) == CUDA_SUCCESS && pointer) return pointer;
  if (v1 && v1(name, &pointer, 12000, CU_GET_PROC_ADDRESS_DEFAULT) == CUDA_SUCCESS && pointer) return pointer;
  return dlsym(library, name);
}

static int load_driver_locked(void) {
  if (driver_state) return driver_state;
  const char *path = getenv("KDSL_AOT_LIBCUDA");
  void *library = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!library && !(path && *path)) library = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
  if (!library) {
    snprintf(driver_problem, sizeof driver_problem, "cannot open the CUDA driver (%s): %s",
             path && *path ? path : "libcuda.so.1", dlerror());
    return driver_state = -1;
  }
  get_proc_v2_t v2 = (get_proc_v2_t)dlsym(library, "cuGetProcAddress_v2");
  get_proc_v1_t v1 = v2 ? NULL : (get_proc_v1_t)dlsym(library, "cuGetProcAddress");
  struct { const char *name; void **slot; int optional; } wanted[] = {
    {"cuInit", (void **)&driver.cuInit, 0},
    {"cuCtxGetCurrent", (void **)&driver.cuCtxGetCurrent, 0},
    {"cuCtxGetDevice", (void **)&driver.cuCtxGetDevice, 0},
    {"cuDeviceGetAttribute", (void **)&driver.cuDeviceGetAttribute, 0},
    {"cuModuleLoadData", (void **)&driver.cuModuleLoadData, 0},
    {"cuModuleGetFunction", (void **)&driver.cuModuleGetFunction, 0},
    {"cuFuncSetAttribute", (void **)&driver.cuFuncSetAttribute, 0},
    {"cuLaunchKernel", (void **)&driver.cuLaunchKernel, 0},
    {"cuGetErrorString", (void **)&driver.cuGetErrorString, 0},
    {"cuMemAlloc", (void **)&driver.mem_alloc, 0},
    {"cuMemsetD32Async", (void **)&driver.memset_d32_async, 0},
    {"cuTensorMapEncodeTiled", (void **)&driver.cuTensorMapEncodeTiled, 1},  /* checked where a TMA kernel runs */
  };
  for (size_t i = 0; i < sizeof wanted / sizeof wanted[0]; i++) {
    *wanted[i].slot = driver_symbol(library, v2, v1, wanted[i].name);
    if (!*wanted[i].slot && !wanted[i].optional) {
      snprintf(driver_problem, sizeof driver_problem, "the CUDA driver has no entry point %s", wanted[i].name);
      return driver_state = -1;
    }
  }
  CUresult status = driver.cuInit(0);
  if (status != CUDA_SUCCESS) {
    snprintf(driver_problem, sizeof driver_problem, "cuInit failed with CUDA error %d", (int)status);
    return driver_state = -1;
  }
  return driver_state = 1;
}

static kdsl_status cuda_failed(const char *op, const char *call, CUresult status) {
  const char *text = NULL;
  if (driver.cuGetErrorString) driver.cuGetErrorString(status, &text);
  return kdsl__fail(KDSL_ERR_CUDA, "%s: %s failed: CUDA error %d (%s)", op, call, (int)status, text ? text : "?");
}

/* ---- contexts ---------------------------------------------------------------------------------------- */

typedef struct context_info {
  CUcontext context;
  int arch;
  int shared_optin;
  int sms;
  CUdeviceptr workspace, counters;  /* split-K scratch (kdsl__splitk_scratch) */
  int64_t workspace_bytes, counter_count;
  struct context_info *next;
} context_info;

static context_info *contexts;

static kdsl_status context_locked(const char *op, CUcontext *context, context_info **info) {
  if (load_driver_locked() < 0)
    return kdsl__fail(KDSL_ERR_CUDA_UNAVAILABLE, "%s: %s", op, driver_problem);
  CUresult status = driver.cuCtxGetCurrent(context);
  if (status != CUDA_SUCCESS) return cuda_failed(op, "cuCtxGetCurrent", status);
  if (!*context)
    return kdsl__fail(KDSL_ERR_NO_CONTEXT, "%s: no CUDA context is current on this thread "
                      "(cuCtxSetCurrent, or cudaSetDevice and a runtime call, first)", op);
  for (context_info *each = contexts; each; each = each->next)
    if (each->context == *context) {
      *info = each;
      return KDSL_OK;
    }
  CUdevice device;
  int major = 0, minor = 0, optin = 0, sms = 0;
  if ((status = driver.cuCtxGetDevice(&device)) != CUDA_SUCCESS) return cuda_failed(op, "cuCtxGetDevice", status);
  if ((status = driver.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)) ||
      (status = driver.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)) ||
      (status = driver.cuDeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device)) ||
      (status = driver.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)))
    return cuda_failed(op, "cuDeviceGetAttribute", status);
  context_info *added = calloc(1, sizeof *added);
  if (!added) return kdsl__fail(KDSL_ERR_CUDA, "%s: out of host memory", op);
  added->context = *context;
  added->arch = major * 10 + minor;
  added->shared_optin = optin;
  added->sms = sms;
  added->next = contexts;
  contexts = added;
  *info = added;
  return KDSL_OK;
}

kdsl_status kdsl__current_arch(const char *op, int *arch) {
  CUcontext context;
  context_info *info = NULL;
  pthread_mutex_lock(&lock);
  kdsl_status status = context_locked(op, &context, &info);
  if (status == KDSL_OK) *arch = info->arch;
  pthread_mutex_unlock(&lock);
  return status;
}

kdsl_status kdsl__current_sms(const char *op, int *sms) {
  CUcontext context;
  context_info *info = NULL;
  pthread_mutex_lock(&lock);
  kdsl_status status = context_locked(op, &context, &info);
  if (status == KDSL_OK) *sms = info->sms;
  pthread_mutex_unlock(&lock);
  return status;
}

kdsl_status kdsl__splitk_scratch(const char *op, int64_t workspace_bytes, int64_t counters, CUstream stream,
                                 int64_t *workspace, int64_t *counter_words) {
  CUcontext context;
  context_info *info = NULL;
  pthread_mutex_lock(&lock);
  kdsl_status status = context_locked(op, &context, &info);
  CUresult result = CUDA_SUCCESS;
  const char *call = NULL;
  if (status == KDSL_OK && workspace_bytes > info->workspace_bytes) {
    /* Grown geometrically, so a run of growing shapes allocates a few times, not per call. */
    int64_t bytes = workspace_bytes > 2 * info->workspace_bytes ? workspace_bytes : 2 * info->workspace_bytes;
    CUdeviceptr grown = 0;
    if ((result = driver.mem_alloc(&grown, (size_t)bytes)) != CUDA_SUCCESS) call = "cuMemAlloc";
    else info->workspace = grown, info->workspace_bytes = bytes;
  }
  if (status == KDSL_OK && !call && counters > info->counter_count) {
    int64_t count = counters > 2 * info->counter_count ? counters : 2 * info->counter_count;
    CUdeviceptr grown = 0;
    /* Zeroed on the launch's stream, so the launch after it sees zeros whatever stream it is. */
    if ((result = driver.mem_alloc(&grown, (size_t)count * 4)) != CUDA_SUCCESS) call = "cuMemAlloc";
    else if ((result = driver.memset_d32_async(grown, 0, (size_t)count, stream)) != CUDA_SUCCESS)
      call = "cuMemsetD32Async";
    else info->counters = grown, info->counter_count = count;
  }
  if (status == KDSL_OK && call) status = cuda_failed(op, call, result);
  if (status == KDSL_OK) *workspace = (int64_t)info->workspace, *counter_words = (int64_t)info->counters;
  pthread_mutex_unlock(&lock);
  return status;
}

/* ---- choosing and launching -------------------------------------------------------------------------- */

static int meets(const kdsl__spec *spec, const int64_t *values) {
  for (int i = 0; i < spec->nparams; i++) {
    int64_t v = values[i];
    char type = spec->types[i], claim = spec->claims[i];
    if (type == 'i' && (v < INT32_MIN || v > INT32_MAX)) return -1;
    if (claim == '1' && v != 1) return -1;
    if (claim == 'D' && v % 16 != 0) return -1;
  }
  int assumed = 0;
  for (int i = 0; i < spec->nparams; i++) assumed += spec->claims[i] != '-';
  return assumed;
}

const kdsl__spec *kdsl__pick(kdsl__spec *const *specs, int count, int bucket, int dtype, const int64_t *variant,
                             int nvariant, const int64_t *values, int nvalues) {
  const kdsl__spec *best = NULL;
  int best_assumed = -1;
  for (int i = 0; i < count; i++) {
    const kdsl__spec *spec = specs[i];
    if (spec->bucket != bucket || spec->dtype != dtype || spec->nparams != nvalues || spec->nvariant != nvariant)
      continue;
    int same = 1;
    for (int v = 0; v < nvariant; v++) same &= spec->variant[v] == variant[v];
    if (!same) continue;
    int assumed = meets(spec, values);
    if (assumed > best_assumed) {  /* the first of the most specific: the table lists exact ones first */
      best = spec;
      best_assumed = assumed;
    }
  }
  return best;
}

static kdsl_status function_locked(const char *op, kdsl__spec *spec, CUcontext context, const context_info *info,
                                   CUfunction *function) {
  for (kdsl__loaded *each = spec->loaded; each; each = each->next)
    if (each->context == context) {
      *function = each->function;
      return KDSL_OK;
    }
  if (spec->shared > (unsigned)info->shared_optin)
    return kdsl__fail(KDSL_ERR_NO_KERNEL, "%s: %s needs %u bytes of shared memory, the device allows %d", op,
                      spec->name, spec->shared, info->shared_optin);
  CUmodule module;
  CUresult status = driver.cuModuleLoadData(&module, spec->cubin);
  if (status != CUDA_SUCCESS) return cuda_failed(op, "cuModuleLoadData", status);
  if ((status = driver.cuModuleGetFunction(function, module, spec->entry)) != CUDA_SUCCESS)
    return cuda_failed(op, "cuModuleGetFunction", status);
  if (spec->shared > 49152 &&
      (status = driver.cuFuncSetAttribute(*function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                          (int)spec->shared)) != CUDA_SUCCESS)
    return cuda_failed(op, "cuFuncSetAttribute", status);
  kdsl__loaded *added = calloc(1, sizeof *added);
  if (!added) return kdsl__fail(KDSL_ERR_CUDA, "%s: out of host memory", op);
  added->context = context;
  added->module = module;
  added->function = *function;
  added->next = spec->loaded;
  spec->loaded = added;
  return KDSL_OK;
}

/* A descriptor's CUtensorMap as Triton's launcher builds it (fill_tma_descriptor_tiled in its driver.c): sizes
 * innermost first, strides in bytes of every dimension but the innermost, element strides 1, no interleave, the
 * kernel's swizzle and box, L2 promotion 128B, out-of-bounds elements read as zeros. */
static kdsl_status encode_tma(const char *op, const kdsl__spec *spec, const kdsl__tma_meta *meta,
                              const kdsl__tma_call *call, CUtensorMap *map) {
  unsigned rank = meta->rank;
  if (!driver.cuTensorMapEncodeTiled)
    return kdsl__fail(KDSL_ERR_CUDA_UNAVAILABLE, "%s: %s needs TMA descriptors and the CUDA driver has no "
                      "cuTensorMapEncodeTiled (CUDA 12.0 or newer)", op, spec->name);
  if (rank < 1 || rank > KDSL__TMA_MAX_RANK || (int)rank != call->rank)
    return kdsl__fail(KDSL_ERR_INVALID_ARGUMENT, "%s: %s: a descriptor of rank %d for a kernel compiled for rank %u",
                      op, spec->name, call->rank, rank);
  cuuint64_t dims[KDSL__TMA_MAX_RANK], strides[KDSL__TMA_MAX_RANK];
  cuuint32_t box[KDSL__TMA_MAX_RANK], element_strides[KDSL__TMA_MAX_RANK];
  for (unsigned i = 0; i < rank; i++) {
    dims[rank - 1 - i] = (cuuint64_t)call->shape[i];
    box[rank - 1 - i] = meta->box[i];
    element_strides[i] = 1;
  }
  for (unsigned i = 0; i + 1 < rank; i++) strides[rank - 2 - i] = (cuuint64_t)call->strides[i] * meta->elem_size;
  CUresult result = driver.cuTensorMapEncodeTiled(
      map, (CUtensorMapDataType)meta->host_type, rank, (void *)(uintptr_t)call->base, dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, (CUtensorMapSwizzle)meta->swizzle,
      CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    const char *text = NULL;
    if (driver.cuGetErrorString) driver.cuGetErrorString(result, &text);
    return kdsl__fail(KDSL_ERR_CUDA, "%s: cuTensorMapEncodeTiled failed for %s (base 0x%llx, rank %u): CUDA error %d "
                      "(%s)", op, spec->name, (unsigned long long)call->base, rank, (int)result, text ? text : "?");
  }
  return KDSL_OK;
}

kdsl_status kdsl__launch(const char *op, kdsl__spec *spec, CUstream stream, int64_t gx, int64_t gy, int64_t gz,
                         const int64_t *values, const kdsl__tma_call *descriptors) {
  if (gx <= 0 || gy <= 0 || gz <= 0) return KDSL_OK;
  if (gx > 2147483647 || gy > 65535 || gz > 65535)
    return kdsl__fail(KDSL_ERR_INVALID_ARGUMENT, "%s: the problem needs a grid of %lld x %lld x %lld programs, "
                      "more than CUDA launches", op, (long long)gx, (long long)gy, (long long)gz);
  last_launch.spec = spec;
  last_launch.grid[0] = (unsigned)gx, last_launch.grid[1] = (unsigned)gy, last_launch.grid[2] = (unsigned)gz;
  last_launch.nvalues = spec->nparams < KDSL__RECORDED_VALUES ? spec->nparams : KDSL__RECORDED_VALUES;
  memcpy(last_launch.values, values, sizeof(int64_t) * (size_t)last_launch.nvalues);

  CUcontext context;
  context_info *info = NULL;
  CUfunction function = NULL;
  pthread_mutex_lock(&lock);
  kdsl_status status = context_locked(op, &context, &info);
  if (status == KDSL_OK) status = function_locked(op, spec, context, info, &function);
  pthread_mutex_unlock(&lock);
  if (status != KDSL_OK) return status;

  /* Arguments as the kernel's parameter list has them: parameters compiled in ('1') are not passed; a TMA
   * descriptor is its CUtensorMap (by value) followed by its shape (int32) and strides (int64), as many of each
   * as the export read from the kernel's PTX; Triton's hidden scratch pointers come last, NULL (exported
   * kernels need no scratch). */
  int total = spec->hidden, maps = 0;
  for (int i = 0; i < spec->nparams; i++) {
    if (spec->claims[i] == '1') continue;
    if (spec->types[i] == 'T') {
      const kdsl__tma_meta *meta = &spec->tma[maps++];
      total += 1 + meta->shape_params + meta->stride_params;
    } else {
      total++;
    }
  }
  union { CUdeviceptr pointer; int32_t i32; int64_t i64; } storage[total > 0 ? total : 1];
  CUtensorMap map_storage[maps > 0 ? maps : 1];
  void *arguments[total > 0 ? total : 1];
  int passed = 0;
  maps = 0;
  for (int i = 0; i < spec->nparams; i++) {
    if (spec->claims[i] == '1') continue;
    switch (spec->types[i]) {
      case 'T': {
        const kdsl__tma_meta *meta = &spec->tma[maps];
        const kdsl__tma_call *call = &descriptors[values[i]];
        if ((status = encode_tma(op, spec, meta, call, &map_storage[maps])) != KDSL_OK) return status;
        arguments[passed++] = &map_storage[maps++];
        for (int d = 0; d < meta->shape_params; d++) {
          storage[passed].i32 = (int32_t)call->shape[d];
          arguments[passed] = &storage[passed];
          passed++;
        }
        for (int d = 0; d < meta->stride_params; d++) {
          storage[passed].i64 = call->strides[d];
          arguments[passed] = &storage[passed];
          passed++;
        }
        continue;
      }
      case 'p': storage[passed].pointer = (CUdeviceptr)(uint64_t)values[i]; break;
      case 'i': storage[passed].i32 = (int32_t)values[i]; break;
      default: storage[passed].i64 = values[i]; break;
    }
    arguments[passed] = &storage[passed];
    passed++;
  }
  for (int i = 0; i < spec->hidden; i++) {
    storage[passed].pointer = 0;
    arguments[passed] = &storage[passed];
    passed++;
  }
  CUresult result = driver.cuLaunchKernel(function, (unsigned)gx, (unsigned)gy, (unsigned)gz, spec->threads, 1, 1,
                                          spec->shared, stream, arguments, NULL);
  if (result != CUDA_SUCCESS) return cuda_failed(op, "cuLaunchKernel", result);
  return KDSL_OK;
}
