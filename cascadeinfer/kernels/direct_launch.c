/* Direct kernel launches for recorded calls (cascadeinfer/kernels/direct_launch.py).
 *
 * A recorded launch knows everything about its kernel parameters except the addresses of
 * the caller's tensors. `prepare` stores the parameters packed once, as the driver reads
 * them, with the byte offsets where each new address goes; `run` copies that template,
 * writes the addresses of this call's tensors and calls cuLaunchKernelEx, for every
 * launch of a recording in one call from Python. Triton's generated launcher instead
 * parses every parameter from a Python tuple on every launch.
 *
 * libcuda is opened on the first run, so the module builds and imports on a machine
 * without a GPU (where `pack` lets tests check the parameter bytes).
 */
#include "direct_launch.h"

static void free_launch_struct(Launch *l) {
  if (l) {
    free(l->patches);
    free(l->tmas);
    free(l->bytes);
    free(l);
  }
}

static void free_launch(PyObject *capsule) {
  free_launch_struct((Launch *)PyCapsule_GetPointer(capsule, LAUNCH_CAPSULE));
}

/* Read up to 5 unsigned ints of `seq` into `out` (n of them). */
static int read_dims(PyObject *seq, unsigned int n, uint64_t *out) {
  if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) != (Py_ssize_t)n || n > 5) {
    PyErr_SetString(PyExc_ValueError, "prepare: a TMA descriptor's dimensions do not match its rank");
    return -1;
  }
  for (unsigned int d = 0; d < n; d++) {
    out[d] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(seq, d));
    if (PyErr_Occurred())
      return -1;
  }
  return 0;
}

/* A TMA descriptor from (offset, root, add, elem_type, rank, shape, strides, block,
 * swizzle, fill): shape and block `rank` ints, strides `rank - 1` (bytes), innermost first. */
static int read_tma(PyObject *item, Tma *t) {
  unsigned int offset, root, elem_type, rank, swizzle, fill_mode;
  long long add;
  PyObject *shape, *strides, *block;
  if (!PyArg_ParseTuple(item, "IILIIOOOII", &offset, &root, &add, &elem_type, &rank, &shape, &strides, &block,
                        &swizzle, &fill_mode))
    return -1;
  if (rank < 1 || rank > 5) {
    PyErr_SetString(PyExc_ValueError, "prepare: a TMA descriptor's rank must be 1..5");
    return -1;
  }
  uint64_t block64[5] = {0};
  if (read_dims(shape, rank, t->shape) < 0 || read_dims(strides, rank - 1, t->strides) < 0 ||
      read_dims(block, rank, block64) < 0)
    return -1;
  for (unsigned int d = 0; d < rank; d++)
    t->block[d] = (uint32_t)block64[d];
  t->offset = (uint16_t)offset;
  t->root = (uint16_t)root;
  t->add = add;
  t->elem_type = elem_type;
  t->rank = rank;
  t->swizzle = swizzle;
  t->fill = fill_mode;
  return 0;
}

/* prepare(function, grid_x, grid_y, grid_z, block, shared, pdl, cooperative,
 *         bytes, offsets, patches, tmas) -> capsule
 * offsets: bytes of uint16 (one per parameter); patches: list of (offset, root, add);
 * tmas: list of TMA descriptors (read_tma), encoded at each launch. */
static PyObject *prepare(PyObject *self, PyObject *args) {
  unsigned long long function;
  unsigned int gx, gy, gz, block, shared;
  int pdl, cooperative;
  Py_buffer bytes, offsets;
  PyObject *patches, *tmas;
  if (!PyArg_ParseTuple(args, "KIIIIIppy*y*O!O!", &function, &gx, &gy, &gz, &block, &shared, &pdl,
                        &cooperative, &bytes, &offsets, &PyList_Type, &patches, &PyList_Type, &tmas))
    return NULL;
  PyObject *result = NULL;
  Launch *l = NULL;
  Py_ssize_t num_params = offsets.len / (Py_ssize_t)sizeof(uint16_t);
  Py_ssize_t num_patches = PyList_GET_SIZE(patches);
  Py_ssize_t num_tmas = PyList_GET_SIZE(tmas);
  if (num_params > MAX_PARAMS || bytes.len > MAX_BYTES || num_patches > MAX_PARAMS || num_tmas > MAX_PARAMS) {
    PyErr_SetString(PyExc_ValueError, "prepare: too many kernel parameters");
    goto done;
  }
  l = (Launch *)calloc(1, sizeof(Launch));
  if (!l) {
    PyErr_NoMemory();
    goto done;
  }
  l->function = (CUfunction)(uintptr_t)function;
  l->grid[0] = gx;
  l->grid[1] = gy;
  l->grid[2] = gz;
  l->block = block;
  l->shared = shared;
  l->pdl = pdl;
  l->cooperative = cooperative;
  l->num_params = (int)num_params;
  memcpy(l->offsets, offsets.buf, (size_t)offsets.len);
  l->size = (int)bytes.len;
  l->bytes = (unsigned char *)malloc((size_t)bytes.len + 1);
  l->patches = (Patch *)calloc((size_t)num_patches + 1, sizeof(Patch));
  l->tmas = (Tma *)calloc((size_t)num_tmas + 1, sizeof(Tma));
  if (!l->bytes || !l->patches || !l->tmas) {
    PyErr_NoMemory();
    goto done;
  }
  memcpy(l->bytes, bytes.buf, (size_t)bytes.len);
  for (Py_ssize_t i = 0; i < num_params; i++) {
    if (l->offsets[i] >= l->size) {
      PyErr_SetString(PyExc_ValueError, "prepare: a parameter offset lies outside the parameter bytes");
      goto done;
    }
  }
  for (Py_ssize_t i = 0; i < num_patches; i++) {
    unsigned int offset, root;
    long long add;
    if (!PyArg_ParseTuple(PyList_GET_ITEM(patches, i), "IIL", &offset, &root, &add))
      goto done;
    if (offset + 8 > (unsigned int)l->size || root >= MAX_ROOTS) {
      PyErr_SetString(PyExc_ValueError, "prepare: a patch lies outside the parameter bytes or roots");
      goto done;
    }
    l->patches[i].offset = (uint16_t)offset;
    l->patches[i].root = (uint16_t)root;
    l->patches[i].add = add;
  }
  l->num_patches = (int)num_patches;
  for (Py_ssize_t i = 0; i < num_tmas; i++) {
    if (read_tma(PyList_GET_ITEM(tmas, i), &l->tmas[i]) < 0)
      goto done;
    if (l->tmas[i].offset % 64 || l->tmas[i].offset + 128 > (unsigned int)l->size || l->tmas[i].root >= MAX_ROOTS) {
      PyErr_SetString(PyExc_ValueError, "prepare: a TMA descriptor lies outside the parameter bytes or roots, "
                                        "or off its 64-byte alignment");
      goto done;
    }
  }
  l->num_tmas = (int)num_tmas;
  result = PyCapsule_New(l, LAUNCH_CAPSULE, free_launch);
  if (result)
    l = NULL; /* owned by the capsule */
done:
  free_launch_struct(l);
  PyBuffer_Release(&bytes);
  PyBuffer_Release(&offsets);
  return result;
}

static int read_roots(PyObject *tuple, uint64_t *roots) {
  Py_ssize_t n = PyTuple_GET_SIZE(tuple);
  if (n > MAX_ROOTS) {
    PyErr_SetString(PyExc_ValueError, "too many roots");
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    roots[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(tuple, i));
    if (roots[i] == (uint64_t)-1 && PyErr_Occurred())
      return -1;
  }
  for (Py_ssize_t i = n; i < MAX_ROOTS; i++)
    roots[i] = 0;
  return 0;
}

static Launch *get_launch(PyObject *capsule) {
  return (Launch *)PyCapsule_GetPointer(capsule, LAUNCH_CAPSULE);
}

/* pack(capsule, roots) -> bytes: the parameter bytes a run would pass (for tests; a
 * launch with TMA descriptors needs the driver, which encodes them). */
static PyObject *pack(PyObject *self, PyObject *args) {
  PyObject *capsule, *roots_tuple;
  if (!PyArg_ParseTuple(args, "OO!", &capsule, &PyTuple_Type, &roots_tuple))
    return NULL;
  Launch *l = get_launch(capsule);
  uint64_t roots[MAX_ROOTS];
  if (!l || read_roots(roots_tuple, roots) < 0 || (l->num_tmas && load_driver() < 0))
    return NULL;
  unsigned char buf[MAX_BYTES] __attribute__((aligned(128)));
  CUresult status = fill(l, roots, buf);
  if (status != CUDA_SUCCESS) {
    launch_error("cuTensorMapEncodeTiled", status);
    return NULL;
  }
  return PyBytes_FromStringAndSize((const char *)buf, l->size);
}

/* encode(tma, address) -> bytes: the 128-byte CUtensorMap a launch would pass for the TMA
 * descriptor `tma` (as in prepare, offset and root ignored) at `address`. */
static PyObject *encode(PyObject *self, PyObject *args) {
  PyObject *item;
  unsigned long long address;
  if (!PyArg_ParseTuple(args, "O!K", &PyTuple_Type, &item, &address))
    return NULL;
  Tma t;
  memset(&t, 0, sizeof(t));
  if (read_tma(item, &t) < 0 || load_driver() < 0)
    return NULL;
  CUtensorMap map;
  CUresult status = encode_tma(&t, address, &map);
  if (status != CUDA_SUCCESS) {
    launch_error("cuTensorMapEncodeTiled", status);
    return NULL;
  }
  return PyBytes_FromStringAndSize((const char *)&map, sizeof(map));
}

/* param_sizes(function) -> tuple of each kernel parameter's size in bytes, as the driver
 * reads them (cuFuncGetParamInfo), or None where the driver cannot tell. */
static PyObject *param_sizes(PyObject *self, PyObject *args) {
  unsigned long long function;
  if (!PyArg_ParseTuple(args, "K", &function) || load_driver() < 0)
    return NULL;
  if (!func_param_info)
    Py_RETURN_NONE;
  PyObject *sizes = PyList_New(0);
  if (!sizes)
    return NULL;
  for (size_t i = 0; i < MAX_PARAMS; i++) {
    size_t offset = 0, size = 0;
    if (func_param_info((CUfunction)(uintptr_t)function, i, &offset, &size) != CUDA_SUCCESS)
      break; /* past the last parameter */
    PyObject *one = PyLong_FromSize_t(size);
    if (!one || PyList_Append(sizes, one) < 0) {
      Py_XDECREF(one);
      Py_DECREF(sizes);
      return NULL;
    }
    Py_DECREF(one);
  }
  PyObject *result = PyList_AsTuple(sizes);
  Py_DECREF(sizes);
  return result;
}

/* run(capsules, roots, stream) -> bool: launch each recorded kernel, in order, on
 * `stream`. False, launching nothing, when the calling thread has no current CUDA
 * context (a thread whose first CUDA work this is): the caller then launches through
 * Triton's launcher, which makes the device's context current. */
static PyObject *run(PyObject *self, PyObject *args) {
  PyObject *launches, *roots_tuple;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "O!O!K", &PyTuple_Type, &launches, &PyTuple_Type, &roots_tuple, &stream))
    return NULL;
  if (load_driver() < 0)
    return NULL;
  uint64_t roots[MAX_ROOTS];
  if (read_roots(roots_tuple, roots) < 0)
    return NULL;
  if (!has_context())
    Py_RETURN_FALSE;
  Py_ssize_t n = PyTuple_GET_SIZE(launches);
  for (Py_ssize_t k = 0; k < n; k++) {
    Launch *l = get_launch(PyTuple_GET_ITEM(launches, k));
    if (!l)
      return NULL;
    CUresult status = launch_one(l, roots, (CUstream)(uintptr_t)stream, 1);
    if (status != CUDA_SUCCESS) {
      launch_error("a launch (cuTensorMapEncodeTiled, cuLaunchKernelEx)", status);
      return NULL;
    }
  }
  Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"prepare", prepare, METH_VARARGS, "Store a launch's parameters and where its addresses go."},
    {"pack", pack, METH_VARARGS, "The parameter bytes a run would pass."},
    {"encode", encode, METH_VARARGS, "The CUtensorMap a launch would pass for a TMA descriptor at an address."},
    {"param_sizes", param_sizes, METH_VARARGS, "Each kernel parameter's size, as the driver reads them."},
    {"run", run, METH_VARARGS, "Launch prepared kernels with new addresses on a stream."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cascadeinfer_direct_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_cascadeinfer_direct_launch(void) { return PyModule_Create(&module); }
