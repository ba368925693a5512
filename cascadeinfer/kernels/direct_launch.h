/* What a direct launch is, shared by the C module (direct_launch.c) and the C++ hot path
 * (hot_path.cpp): a kernel's parameters packed once as the driver reads them, the byte
 * offsets where each call's addresses go, and the loop that patches them in and calls
 * cuLaunchKernelEx. Both builds inline this file where they include it
 * (cascadeinfer/kernels/direct_launch.py), so its text is part of each module's cache key.
 * Valid C and C++.
 */
#ifndef CASCADEINFER_DIRECT_LAUNCH_H
#define CASCADEINFER_DIRECT_LAUNCH_H
#include "cuda.h"
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_PARAMS 256   /* far above any kernel of ours; checked in prepare */
#define MAX_BYTES 4096   /* the driver's limit on a kernel's parameter bytes */
#define MAX_ROOTS 64

typedef CUresult (*launch_ex_t)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*error_string_t)(CUresult, const char **);
typedef CUresult (*ctx_get_current_t)(CUcontext *);

static launch_ex_t launch_ex = NULL;
static error_string_t error_string = NULL;
static ctx_get_current_t ctx_get_current = NULL;

typedef struct {
  uint16_t offset; /* byte offset of the 8-byte address in the parameter bytes */
  uint16_t root;   /* index into run's addresses */
  int64_t add;     /* byte offset from that address */
} Patch;

/* A TMA descriptor parameter (a CUtensorMap passed by value) over a root: encoded anew for
 * each launch at the root's address, with everything else as Triton's launcher encodes it
 * (checked byte for byte against Triton's encoding when prepared: direct_launch.py). */
typedef struct {
  uint16_t offset; /* byte offset of the 128-byte CUtensorMap in the parameter bytes */
  uint16_t root;
  int64_t add;
  uint32_t elem_type, rank, swizzle, fill;
  uint64_t shape[5], strides[5]; /* innermost first; strides in bytes, rank - 1 of them */
  uint32_t block[5];
} Tma;

typedef struct {
  CUfunction function;
  unsigned int grid[3];
  unsigned int block;
  unsigned int shared;
  int pdl;
  int cooperative;
  int num_params;
  uint16_t offsets[MAX_PARAMS];
  int num_patches;
  Patch *patches;
  int size;
  unsigned char *bytes; /* the parameter bytes, addresses of fixed tensors included */
  int num_tmas;
  Tma *tmas;
} Launch;

#define LAUNCH_CAPSULE "cascadeinfer.Launch"

typedef CUresult (*encode_tiled_t)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                   const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
typedef CUresult (*func_param_info_t)(CUfunction, size_t, size_t *, size_t *);
static encode_tiled_t encode_tiled = NULL;
static func_param_info_t func_param_info = NULL;
typedef CUresult (*stream_is_capturing_t)(CUstream, CUstreamCaptureStatus *);
typedef CUresult (*event_record_t)(CUevent, CUstream);
typedef CUresult (*stream_wait_event_t)(CUstream, CUevent, unsigned int);
static stream_is_capturing_t stream_is_capturing = NULL;
static event_record_t event_record = NULL;
static stream_wait_event_t stream_wait_event = NULL;

/* Encode the TMA descriptor `t` at `address` into `out` (128 bytes, 64-byte aligned), as
 * Triton 3.6's launcher does: interleave none, L2 promotion 128B, element strides 1. */
static CUresult encode_tma(const Tma *t, uint64_t address, void *out) {
  if (!encode_tiled)
    return CUDA_ERROR_NOT_SUPPORTED;
  cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  return encode_tiled((CUtensorMap *)out, (CUtensorMapDataType)t->elem_type, t->rank, (void *)(uintptr_t)address,
                      t->shape, t->strides, t->block, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                      (CUtensorMapSwizzle)t->swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                      (CUtensorMapFloatOOBfill)t->fill);
}

/* The parameter bytes of `l` for the addresses `roots` (`buf` 128-byte aligned). */
static CUresult fill(const Launch *l, const uint64_t *roots, unsigned char *buf) {
  memcpy(buf, l->bytes, (size_t)l->size);
  for (int i = 0; i < l->num_patches; i++) {
    uint64_t address = roots[l->patches[i].root] + (uint64_t)l->patches[i].add;
    memcpy(buf + l->patches[i].offset, &address, sizeof(address));
  }
  for (int i = 0; i < l->num_tmas; i++) {
    const Tma *t = &l->tmas[i];
    CUresult status = encode_tma(t, roots[t->root] + (uint64_t)t->add, buf + t->offset);
    if (status != CUDA_SUCCESS)
      return status;
  }
  return CUDA_SUCCESS;
}

static int load_driver(void) {
  if (launch_ex)
    return 0;
  void *lib = dlopen("libcuda.so.1", RTLD_LAZY);
  if (!lib) {
    PyErr_SetString(PyExc_RuntimeError, "direct launch: cannot open libcuda.so.1");
    return -1;
  }
  error_string = (error_string_t)dlsym(lib, "cuGetErrorString");
  ctx_get_current = (ctx_get_current_t)dlsym(lib, "cuCtxGetCurrent");
  stream_is_capturing = (stream_is_capturing_t)dlsym(lib, "cuStreamIsCapturing");
  encode_tiled = (encode_tiled_t)dlsym(lib, "cuTensorMapEncodeTiled");
  func_param_info = (func_param_info_t)dlsym(lib, "cuFuncGetParamInfo");
  event_record = (event_record_t)dlsym(lib, "cuEventRecord");
  stream_wait_event = (stream_wait_event_t)dlsym(lib, "cuStreamWaitEvent");
  launch_ex = (launch_ex_t)dlsym(lib, "cuLaunchKernelEx");
  if (!launch_ex) {
    PyErr_SetString(PyExc_RuntimeError, "direct launch: libcuda.so.1 has no cuLaunchKernelEx");
    return -1;
  }
  return 0;
}

/* Whether the calling thread has a current CUDA context (a thread whose first CUDA work
 * this is has none: the caller must go through Triton's launcher, which makes it current). */
static int has_context(void) {
  if (!ctx_get_current)
    return 1;
  CUcontext ctx = NULL;
  return ctx_get_current(&ctx) == CUDA_SUCCESS && ctx != NULL;
}

/* Launch `l` on `stream` with the addresses `roots`; `release_gil`: let other Python
 * threads run while the driver enqueues it. */
static CUresult launch_one(const Launch *l, const uint64_t *roots, CUstream stream, int release_gil) {
  if ((uint64_t)l->grid[0] * l->grid[1] * l->grid[2] == 0)
    return CUDA_SUCCESS;
  unsigned char buf[MAX_BYTES] __attribute__((aligned(128)));
  void *params[MAX_PARAMS];
  CUresult filled = fill(l, roots, buf);
  if (filled != CUDA_SUCCESS)
    return filled;
  for (int i = 0; i < l->num_params; i++)
    params[i] = buf + l->offsets[i];
  CUlaunchAttribute attrs[2];
  CUlaunchConfig config;
  memset(&config, 0, sizeof(config));
  config.gridDimX = l->grid[0];
  config.gridDimY = l->grid[1];
  config.gridDimZ = l->grid[2];
  config.blockDimX = l->block;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = l->shared;
  config.hStream = stream;
  config.attrs = attrs;
  if (l->pdl) {
    attrs[config.numAttrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[config.numAttrs].value.programmaticStreamSerializationAllowed = 1;
    config.numAttrs++;
  }
  if (l->cooperative) {
    attrs[config.numAttrs].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attrs[config.numAttrs].value.cooperative = 1;
    config.numAttrs++;
  }
  CUresult status;
  if (release_gil) {
    Py_BEGIN_ALLOW_THREADS;
    status = launch_ex(&config, l->function, params, NULL);
    Py_END_ALLOW_THREADS;
  } else {
    status = launch_ex(&config, l->function, params, NULL);
  }
  return status;
}

/* Raise RuntimeError for a failed driver call. */
static void launch_error(const char *call, CUresult status) {
  const char *text = "unknown error";
  if (error_string)
    error_string(status, &text);
  PyErr_Format(PyExc_RuntimeError, "direct launch: %s failed: %s", call, text);
}

#endif
