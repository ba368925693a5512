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

static void free_launch(PyObject *capsule) {
  Launch *l = (Launch *)PyCapsule_GetPointer(capsule, LAUNCH_CAPSULE);
  if (l) {
    free(l->patches);
    free(l->bytes);
    free(l);
  }
}

/* prepare(function, grid_x, grid_y, grid_z, block, shared, pdl, cooperative,
 *         bytes, offsets, patches) -> capsule
 * offsets: bytes of uint16 (one per parameter); patches: list of (offset, root, add). */
static PyObject *prepare(PyObject *self, PyObject *args) {
  unsigned long long function;
  unsigned int gx, gy, gz, block, shared;
  int pdl, cooperative;
  Py_buffer bytes, offsets;
  PyObject *patches;
  if (!PyArg_ParseTuple(args, "KIIIIIppy*y*O!", &function, &gx, &gy, &gz, &block, &shared, &pdl,
                        &cooperative, &bytes, &offsets, &PyList_Type, &patches))
    return NULL;
  PyObject *result = NULL;
  Launch *l = NULL;
  Py_ssize_t num_params = offsets.len / (Py_ssize_t)sizeof(uint16_t);
  Py_ssize_t num_patches = PyList_GET_SIZE(patches);
  if (num_params > MAX_PARAMS || bytes.len > MAX_BYTES || num_patches > MAX_PARAMS) {
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
  if (!l->bytes || !l->patches) {
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
  result = PyCapsule_New(l, LAUNCH_CAPSULE, free_launch);
  if (result)
    l = NULL; /* owned by the capsule */
done:
  if (l) {
    free(l->patches);
    free(l->bytes);
    free(l);
  }
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

/* pack(capsule, roots) -> bytes: the parameter bytes a run would pass (for tests). */
static PyObject *pack(PyObject *self, PyObject *args) {
  PyObject *capsule, *roots_tuple;
  if (!PyArg_ParseTuple(args, "OO!", &capsule, &PyTuple_Type, &roots_tuple))
    return NULL;
  Launch *l = get_launch(capsule);
  uint64_t roots[MAX_ROOTS];
  if (!l || read_roots(roots_tuple, roots) < 0)
    return NULL;
  unsigned char buf[MAX_BYTES];
  fill(l, roots, buf);
  return PyBytes_FromStringAndSize((const char *)buf, l->size);
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
      launch_error("cuLaunchKernelEx", status);
      return NULL;
    }
  }
  Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"prepare", prepare, METH_VARARGS, "Store a launch's parameters and where its addresses go."},
    {"pack", pack, METH_VARARGS, "The parameter bytes a run would pass."},
    {"run", run, METH_VARARGS, "Launch prepared kernels with new addresses on a stream."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cascadeinfer_direct_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_cascadeinfer_direct_launch(void) { return PyModule_Create(&module); }
