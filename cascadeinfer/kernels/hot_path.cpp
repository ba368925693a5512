/* A replayed launcher call in one C++ call (cascadeinfer/kernels/hot_path.py).
 *
 * A launcher called with `validate=False` and a signature it replayed before asks its
 * cache's `call(tensors, options)` first. Each entry of the cache is one replayed
 * signature: the options tuple, and per tensor its dispatch keys, dtype, device,
 * requires_grad, sizes and strides (a page list's length excepted). On a match every
 * address must be 16-byte aligned (Triton specialised the kernels on it); then the call
 * allocates the outputs the caller left out, patches the roots' addresses into the
 * recording's packed launches and enqueues them (for a cascade's run, on its two streams
 * with the events between them), and returns the call's outputs. The Python path does
 * the same through a dozen calls into C (torch's tensor guards, `empty_like`, the stream
 * and scratch lookups, the C launcher): about twice the CPU time (benchmarks/NOTES.md,
 * "Host cost" v10).
 *
 * Whatever this path cannot do exactly as the Python path would, it declines (returns
 * None) and the Python path runs: a recording in progress (its launches must go through
 * the Python launchers, which keep them), a profiler's launch hooks set, a stream other than the
 * one an entry's scratch or counters are bound to, that stream's scratch block checked
 * out or replaced, a stream being captured where scratch or counters are needed, a thread
 * with no current CUDA context. The GIL is held from the lookup to the last launch, so no
 * other Python thread enqueues work between two kernels of one call.
 */
#include "direct_launch.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/python_variable.h>

#include <vector>

namespace {

constexpr int kMaxEntries = 4;
constexpr int kAllocate = -1;
constexpr int kFixed = -2;
constexpr const char *kCacheCapsule = "cascadeinfer.HotCache";

// Set once by configure(): the dict of streams' scratch blocks
// (cascadeinfer.kernels.launch._STREAM_SCRATCH), the current-stream query, Triton's
// runtime knobs (launch hooks) and the context variable of the recording in progress
// (cascadeinfer.kernels.launch._RECORDING).
PyObject *g_scratch_blocks = nullptr;
PyObject *g_current_stream = nullptr;
PyObject *g_runtime_knobs = nullptr;
PyObject *g_recording = nullptr;
PyObject *g_enter_hook_name = nullptr;
PyObject *g_exit_hook_name = nullptr;
PyObject *g_calls_name = nullptr;

struct Spec {
  c10::DispatchKeySet keys;
  at::ScalarType dtype;
  c10::Device device{c10::kCPU};
  bool requires_grad = false;
  bool lengthless = false;  // a 1-D page list: any length
  std::vector<int64_t> sizes, strides;
};

// One step of a replay: launches on a stream, or an event recorded on a stream, or a
// stream made to wait for an event. `current`: on the caller's current stream.
enum StepKind { kLaunch = 0, kRecord = 1, kWait = 2 };

struct Step {
  StepKind kind = kLaunch;
  bool current = true;
  uint64_t stream = 0;
  uint64_t event = 0;
  std::vector<const Launch *> launches;
};

struct Entry {
  PyObject *options = nullptr;  // owned
  PyObject *steps_obj = nullptr;  // owned: the steps as given (their Launch capsules)
  PyObject *keep = nullptr;  // owned: the recording (its fixed tensors) and blocks it uses
  PyObject *scratch_key = nullptr;  // owned or null: (device, stream) in g_scratch_blocks
  PyObject *scratch_block = nullptr;  // owned or null: the block that key must hold
  PyObject *device_arg = nullptr;  // owned: the device index, as the stream query takes it
  std::vector<Spec> specs;
  std::vector<Step> steps;
  // per root: the tensor it is, or kAllocate (like templates[root]), or kFixed (always
  // the address in fixed[root]: a buffer the owner keeps)
  std::vector<int> sources;
  std::vector<at::Tensor> templates;  // per root (undefined where not allocated)
  std::vector<uint64_t> fixed;  // per root
  std::vector<int> returned;  // roots returned, in order
  bool single = false;  // return the one returned root itself, not a tuple
  bool bound = false;  // scratch or counters: only on `stream`, never while captured
  uint64_t stream = 0, base = 0, counts = 0;

  ~Entry() {
    Py_XDECREF(options);
    Py_XDECREF(steps_obj);
    Py_XDECREF(keep);
    Py_XDECREF(scratch_key);
    Py_XDECREF(scratch_block);
    Py_XDECREF(device_arg);
  }
};

struct Cache {
  std::vector<Entry *> entries;  // most recently added first
  ~Cache() {
    for (Entry *e : entries) delete e;
  }
};

Cache *get_cache(PyObject *capsule) {
  return static_cast<Cache *>(PyCapsule_GetPointer(capsule, kCacheCapsule));
}

void free_cache(PyObject *capsule) {
  delete get_cache(capsule);
}

bool spec_of(PyObject *obj, bool lengthless, Spec &spec) {
  if (!THPVariable_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "hot path: expected tensors");
    return false;
  }
  const at::Tensor &t = THPVariable_Unpack(obj);
  spec.keys = t.unsafeGetTensorImpl()->key_set();
  spec.dtype = t.scalar_type();
  spec.device = t.device();
  spec.requires_grad = t.requires_grad();
  spec.lengthless = lengthless;
  spec.sizes = t.sizes().vec();
  spec.strides = t.strides().vec();
  return true;
}

// Whether `obj` is a tensor of `spec`'s signature; its address in `ptr`.
bool matches(PyObject *obj, const Spec &spec, uint64_t &ptr) {
  if (!THPVariable_Check(obj)) return false;
  const at::Tensor &t = THPVariable_Unpack(obj);
  c10::TensorImpl *impl = t.unsafeGetTensorImpl();
  // The dispatch keys first: a fake or functional tensor (torch.compile tracing) differs
  // here and is never asked for sizes or an address.
  if (impl->key_set() != spec.keys || t.scalar_type() != spec.dtype || t.device() != spec.device ||
      t.requires_grad() != spec.requires_grad || impl->dim() != static_cast<int64_t>(spec.sizes.size()))
    return false;
  auto sizes = impl->sizes();
  auto strides = impl->strides();
  for (size_t d = 0; d < spec.sizes.size(); d++) {
    if (strides[d] != spec.strides[d] || (!spec.lengthless && sizes[d] != spec.sizes[d])) return false;
  }
  ptr = reinterpret_cast<uint64_t>(t.data_ptr());
  return true;
}

// The entry whose signature `tensors` and `options` have, or null; their addresses in `ptrs`.
Entry *find(const Cache *cache, PyObject *tensors, PyObject *options, uint64_t *ptrs) {
  Py_ssize_t n = PyTuple_GET_SIZE(tensors);
  if (n > MAX_ROOTS) return nullptr;
  for (Entry *e : cache->entries) {
    if (static_cast<Py_ssize_t>(e->specs.size()) != n) continue;
    if (e->options != options) {
      int same = PyObject_RichCompareBool(e->options, options, Py_EQ);
      if (same < 0) PyErr_Clear();
      if (same != 1) continue;
    }
    uint64_t bits = 0;
    Py_ssize_t i = 0;
    for (; i < n && matches(PyTuple_GET_ITEM(tensors, i), e->specs[static_cast<size_t>(i)], ptrs[i]); i++)
      bits |= ptrs[i];
    if (i == n && !(bits & 15)) return e;
  }
  return nullptr;
}

bool hooked() {
  for (PyObject *name : {g_enter_hook_name, g_exit_hook_name}) {
    PyObject *hook = PyObject_GetAttr(g_runtime_knobs, name);
    if (!hook) {
      PyErr_Clear();
      return true;
    }
    PyObject *calls = PyObject_GetAttr(hook, g_calls_name);
    Py_DECREF(hook);
    if (!calls) {
      PyErr_Clear();
      return true;
    }
    int on = PyObject_IsTrue(calls);
    Py_DECREF(calls);
    if (on != 0) {
      PyErr_Clear();
      return true;
    }
  }
  return false;
}

// Whether a recording is in progress in the caller's context: 1, 0, or -1 with an error set.
int recording() {
  PyObject *rec = nullptr;
  if (PyContextVar_Get(g_recording, nullptr, &rec) < 0) return -1;
  int active = rec != nullptr && rec != Py_None;
  Py_XDECREF(rec);
  return active;
}

// call(tensors, options) -> outputs tuple, or None where the Python path must run.
// Bound to its cache's capsule (`self`) by caller().
PyObject *call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "hot path: call(tensors: tuple, options)");
    return nullptr;
  }
  Cache *cache = get_cache(self);
  if (!cache) return nullptr;
  PyObject *tensors = args[0], *options = args[1];
  uint64_t roots[MAX_ROOTS];
  uint64_t ptrs[MAX_ROOTS];
  Entry *hit = find(cache, tensors, options, ptrs);
  if (!hit || hooked()) Py_RETURN_NONE;
  // A launcher called inside a recording (the cascade's levels and merge while it records
  // them) must launch through its Python path, or the recording misses its kernels.
  int in_recording = recording();
  if (in_recording < 0) return nullptr;
  if (in_recording) Py_RETURN_NONE;
  PyObject *stream_obj = PyObject_CallOneArg(g_current_stream, hit->device_arg);
  if (!stream_obj) return nullptr;
  uint64_t stream = PyLong_AsUnsignedLongLong(stream_obj);
  Py_DECREF(stream_obj);
  if (PyErr_Occurred()) return nullptr;
  if (load_driver() < 0) return nullptr;
  if (hit->bound) {
    if (stream != hit->stream) Py_RETURN_NONE;
    if (hit->scratch_key) {  // the stream's block, not checked out by a replay in progress
      PyObject *block = PyDict_GetItemWithError(g_scratch_blocks, hit->scratch_key);
      if (!block && PyErr_Occurred()) return nullptr;
      if (block != hit->scratch_block) Py_RETURN_NONE;
    }
    CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
    if (!stream_is_capturing ||
        stream_is_capturing(reinterpret_cast<CUstream>(stream), &capture) != CUDA_SUCCESS ||
        capture != CU_STREAM_CAPTURE_STATUS_NONE)
      Py_RETURN_NONE;
  }
  if (!has_context() || ((!event_record || !stream_wait_event) && hit->steps.size() > 1)) Py_RETURN_NONE;
  size_t num_roots = hit->sources.size();
  std::vector<at::Tensor> fresh(num_roots);
  try {
    for (size_t r = 0; r < num_roots; r++) {
      int source = hit->sources[r];
      if (source >= 0) {
        roots[r] = ptrs[source];
      } else if (source == kFixed) {
        roots[r] = hit->fixed[r];
      } else {
        const at::Tensor &like = hit->templates[r];
        fresh[r] = at::empty(like.sizes(), like.options());
        roots[r] = reinterpret_cast<uint64_t>(fresh[r].data_ptr());
      }
    }
  } catch (const std::exception &exc) {
    PyErr_Format(PyExc_RuntimeError, "hot path: allocating an output failed: %s", exc.what());
    return nullptr;
  }
  roots[num_roots] = hit->base;
  roots[num_roots + 1] = hit->counts;
  for (const Step &step : hit->steps) {
    CUstream on = reinterpret_cast<CUstream>(step.current ? stream : step.stream);
    CUresult status = CUDA_SUCCESS;
    const char *what = "a launch (cuTensorMapEncodeTiled, cuLaunchKernelEx)";
    if (step.kind == kLaunch) {
      for (const Launch *l : step.launches) {
        status = launch_one(l, roots, on, 0);
        if (status != CUDA_SUCCESS) break;
      }
    } else if (step.kind == kRecord) {
      what = "cuEventRecord";
      status = event_record(reinterpret_cast<CUevent>(step.event), on);
    } else {
      what = "cuStreamWaitEvent";
      status = stream_wait_event(on, reinterpret_cast<CUevent>(step.event), 0);
    }
    if (status != CUDA_SUCCESS) {
      launch_error(what, status);
      return nullptr;
    }
  }
  auto item_of = [&](int r) -> PyObject * {
    if (hit->sources[r] >= 0) {
      PyObject *given = PyTuple_GET_ITEM(tensors, hit->sources[r]);
      Py_INCREF(given);
      return given;
    }
    return THPVariable_Wrap(std::move(fresh[r]));
  };
  if (hit->single) return item_of(hit->returned[0]);
  PyObject *out = PyTuple_New(static_cast<Py_ssize_t>(hit->returned.size()));
  if (!out) return nullptr;
  for (size_t k = 0; k < hit->returned.size(); k++) {
    PyObject *item = item_of(hit->returned[k]);
    if (!item) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(k), item);
  }
  return out;
}

PyMethodDef call_def = {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call)),
                        METH_FASTCALL, "Replay a known signature's launches; its outputs, or None."};

// configure(scratch_blocks, current_stream, runtime_knobs, recording_var)
PyObject *configure(PyObject *, PyObject *args) {
  PyObject *blocks, *stream, *knobs, *recording_var;
  if (!PyArg_ParseTuple(args, "O!OOO!", &PyDict_Type, &blocks, &stream, &knobs, &PyContextVar_Type, &recording_var))
    return nullptr;
  Py_INCREF(blocks);
  Py_INCREF(stream);
  Py_INCREF(knobs);
  Py_INCREF(recording_var);
  Py_XSETREF(g_scratch_blocks, blocks);
  Py_XSETREF(g_current_stream, stream);
  Py_XSETREF(g_runtime_knobs, knobs);
  Py_XSETREF(g_recording, recording_var);
  if (!g_enter_hook_name) {
    g_enter_hook_name = PyUnicode_InternFromString("launch_enter_hook");
    g_exit_hook_name = PyUnicode_InternFromString("launch_exit_hook");
    g_calls_name = PyUnicode_InternFromString("calls");
  }
  Py_RETURN_NONE;
}

// new_cache() -> capsule
PyObject *new_cache(PyObject *, PyObject *) {
  Cache *cache = new Cache();
  PyObject *capsule = PyCapsule_New(cache, kCacheCapsule, free_cache);
  if (!capsule) delete cache;
  return capsule;
}

// caller(cache) -> the cache's call(tensors, options)
PyObject *caller(PyObject *, PyObject *capsule) {
  if (!get_cache(capsule)) return nullptr;
  return PyCFunction_New(&call_def, capsule);
}

// Parse one step: (kind, stream or None, launches tuple or event handle).
bool step_of(PyObject *obj, Step &step) {
  int kind;
  PyObject *stream, *payload;
  if (!PyArg_ParseTuple(obj, "iOO", &kind, &stream, &payload)) return false;
  if (kind < kLaunch || kind > kWait) {
    PyErr_SetString(PyExc_ValueError, "hot path: a step's kind is 0 (launch), 1 (record) or 2 (wait)");
    return false;
  }
  step.kind = static_cast<StepKind>(kind);
  step.current = stream == Py_None;
  if (!step.current) {
    step.stream = PyLong_AsUnsignedLongLong(stream);
    if (PyErr_Occurred()) return false;
  }
  if (step.kind != kLaunch) {
    step.event = PyLong_AsUnsignedLongLong(payload);
    return !PyErr_Occurred();
  }
  if (!PyTuple_Check(payload)) {
    PyErr_SetString(PyExc_TypeError, "hot path: a launch step's launches are a tuple");
    return false;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(payload); k++) {
    auto *l = static_cast<const Launch *>(PyCapsule_GetPointer(PyTuple_GET_ITEM(payload, k), LAUNCH_CAPSULE));
    if (!l) return false;
    step.launches.push_back(l);
  }
  return true;
}

// add(cache, options, tensors, lengthless, sources, templates, returned, single, steps,
//     device, bound, stream, base, counts, scratch_key, scratch_block, keep)
// sources: per root, a tensor's index, -1 (allocated like templates[root]) or -2 (the
// fixed buffer templates[root]); steps: see step_of.
PyObject *add(PyObject *, PyObject *args) {
  PyObject *capsule, *options, *tensors, *lengthless, *sources, *templates, *returned, *steps, *device;
  PyObject *scratch_key, *scratch_block, *keep;
  int single, bound;
  unsigned long long stream, base, counts;
  if (!PyArg_ParseTuple(args, "OOO!O!O!O!O!pO!OpKKKOOO", &capsule, &options, &PyTuple_Type, &tensors,
                        &PyTuple_Type, &lengthless, &PyTuple_Type, &sources, &PyTuple_Type, &templates,
                        &PyTuple_Type, &returned, &single, &PyTuple_Type, &steps, &device, &bound, &stream, &base,
                        &counts, &scratch_key, &scratch_block, &keep))
    return nullptr;
  Cache *cache = get_cache(capsule);
  if (!cache) return nullptr;
  Py_ssize_t n = PyTuple_GET_SIZE(tensors), num_roots = PyTuple_GET_SIZE(sources);
  if (n > MAX_ROOTS || num_roots + 2 > MAX_ROOTS || PyTuple_GET_SIZE(templates) != num_roots) {
    PyErr_SetString(PyExc_ValueError, "hot path: too many tensors, or templates unlike sources");
    return nullptr;
  }
  if (single && PyTuple_GET_SIZE(returned) != 1) {
    PyErr_SetString(PyExc_ValueError, "hot path: a single return needs exactly one returned root");
    return nullptr;
  }
  auto *e = new Entry();
  std::vector<bool> free_length(static_cast<size_t>(n), false);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(lengthless); i++) {
    long index = PyLong_AsLong(PyTuple_GET_ITEM(lengthless, i));
    if (index >= 0 && index < n) free_length[static_cast<size_t>(index)] = true;
  }
  e->specs.resize(static_cast<size_t>(n));
  uint64_t bits = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *t = PyTuple_GET_ITEM(tensors, i);
    if (!spec_of(t, free_length[static_cast<size_t>(i)], e->specs[static_cast<size_t>(i)])) {
      delete e;
      return nullptr;
    }
    bits |= reinterpret_cast<uint64_t>(THPVariable_Unpack(t).data_ptr());
  }
  if (bits & 15) {  // never matched (the kernels were specialised on aligned addresses): no entry
    delete e;
    Py_RETURN_NONE;
  }
  e->templates.resize(static_cast<size_t>(num_roots));
  e->fixed.assign(static_cast<size_t>(num_roots), 0);
  for (Py_ssize_t r = 0; r < num_roots; r++) {
    long source = PyLong_AsLong(PyTuple_GET_ITEM(sources, r));
    PyObject *like = PyTuple_GET_ITEM(templates, r);
    if (source >= n || source < kFixed || (source < 0 && !THPVariable_Check(like))) {
      PyErr_SetString(PyExc_ValueError, "hot path: a root is neither a given tensor nor a template or buffer");
      delete e;
      return nullptr;
    }
    e->sources.push_back(static_cast<int>(source));
    if (source == kAllocate) e->templates[static_cast<size_t>(r)] = THPVariable_Unpack(like);
    if (source == kFixed) e->fixed[static_cast<size_t>(r)] = reinterpret_cast<uint64_t>(THPVariable_Unpack(like).data_ptr());
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(returned); k++) {
    long r = PyLong_AsLong(PyTuple_GET_ITEM(returned, k));
    if (r < 0 || r >= num_roots || e->sources[static_cast<size_t>(r)] == kFixed) {
      PyErr_SetString(PyExc_ValueError, "hot path: a returned root is out of range or a fixed buffer");
      delete e;
      return nullptr;
    }
    e->returned.push_back(static_cast<int>(r));
  }
  e->steps.resize(static_cast<size_t>(PyTuple_GET_SIZE(steps)));
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(steps); k++) {
    if (!step_of(PyTuple_GET_ITEM(steps, k), e->steps[static_cast<size_t>(k)])) {
      delete e;
      return nullptr;
    }
  }
  if (PyErr_Occurred()) {
    delete e;
    return nullptr;
  }
  Py_INCREF(options);
  Py_INCREF(steps);
  Py_INCREF(keep);
  Py_INCREF(device);
  e->options = options;
  e->steps_obj = steps;
  e->single = single != 0;
  e->keep = keep;
  e->device_arg = device;
  e->bound = bound != 0;
  e->stream = stream;
  e->base = base;
  e->counts = counts;
  if (scratch_key != Py_None) {
    Py_INCREF(scratch_key);
    Py_INCREF(scratch_block);
    e->scratch_key = scratch_key;
    e->scratch_block = scratch_block;
  }
  // One entry per options and signature: a newer one replaces it (its stream or blocks moved).
  for (auto it = cache->entries.begin(); it != cache->entries.end(); ++it) {
    Entry *old = *it;
    bool same = old->specs.size() == e->specs.size() && PyObject_RichCompareBool(old->options, options, Py_EQ) == 1;
    PyErr_Clear();
    for (size_t i = 0; same && i < e->specs.size(); i++) {
      const Spec &a = old->specs[i], &b = e->specs[i];
      same = a.keys == b.keys && a.dtype == b.dtype && a.device == b.device && a.requires_grad == b.requires_grad &&
             a.strides == b.strides && (a.lengthless || a.sizes == b.sizes);
    }
    if (same) {
      delete old;
      cache->entries.erase(it);
      break;
    }
  }
  cache->entries.insert(cache->entries.begin(), e);
  while (cache->entries.size() > static_cast<size_t>(kMaxEntries)) {
    delete cache->entries.back();
    cache->entries.pop_back();
  }
  Py_RETURN_NONE;
}

// clear(cache): drop every entry.
PyObject *clear(PyObject *, PyObject *capsule) {
  Cache *cache = get_cache(capsule);
  if (!cache) return nullptr;
  for (Entry *e : cache->entries) delete e;
  cache->entries.clear();
  Py_RETURN_NONE;
}

// size(cache) -> number of entries
PyObject *size(PyObject *, PyObject *capsule) {
  Cache *cache = get_cache(capsule);
  if (!cache) return nullptr;
  return PyLong_FromSize_t(cache->entries.size());
}

// match(cache, tensors, options) -> the index of the entry a call would take, or -1
// (the lookup alone, launching nothing: tests run it without a GPU).
PyObject *match(PyObject *, PyObject *args) {
  PyObject *capsule, *tensors, *options;
  if (!PyArg_ParseTuple(args, "OO!O", &capsule, &PyTuple_Type, &tensors, &options)) return nullptr;
  Cache *cache = get_cache(capsule);
  if (!cache) return nullptr;
  uint64_t ptrs[MAX_ROOTS];
  Entry *hit = find(cache, tensors, options, ptrs);
  for (size_t k = 0; k < cache->entries.size(); k++)
    if (cache->entries[k] == hit) return PyLong_FromSize_t(k);
  return PyLong_FromLong(-1);
}

PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Set the scratch blocks, stream query and Triton knobs."},
    {"new_cache", new_cache, METH_NOARGS, "A new, empty cache of replayed signatures."},
    {"caller", caller, METH_O, "The cache's call(tensors, options)."},
    {"add", add, METH_VARARGS, "Add a replayed signature to a cache."},
    {"clear", clear, METH_O, "Drop a cache's entries."},
    {"size", size, METH_O, "The number of a cache's entries."},
    {"match", match, METH_VARARGS, "The entry a call would take, or -1."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "cascadeinfer_hot_path", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_cascadeinfer_hot_path(void) { return PyModule_Create(&module_def); }
