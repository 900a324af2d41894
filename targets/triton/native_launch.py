"""A lean launch path for compiled CUDA kernels: one C call that packs already-gathered argument values
and calls `cuLaunchKernelEx`.

Triton's own launcher, per call, checks that a CUDA context is current, parses every argument of a
generic signature, asks each tensor for its address through a Python method call and then asks the
driver whether that address is device memory, and releases and retakes the GIL: about 11 us on the H200's
host for a kernel of a few arguments, against 4.3 us here (`benchmarks/results/launch.md`). Here the caller passes addresses
and sizes as integers; the C side only converts them into the kernel's parameter slots. The module is
built once per machine from the source below with the C compiler (as Triton builds its own launcher),
against the CUDA header Triton ships, and opens the driver library at the first launch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any, Callable

from flashgen.env import switch
from flashgen.errors import FlashgenError
from flashgen.targets.triton.build import POINTER_ARGS, SCALAR_TYPE

log = logging.getLogger(__name__)
MAX_VALUES = 64
# kernel argument kind -> slot kind: what the binary's signature (build.ast_source) takes
KIND = {**{k: "p" for k in POINTER_ARGS}, **{k: {"i32": "i", "fp32": "f"}[t] for k, t in SCALAR_TYPE.items()}}

SOURCE = r"""
#include "cuda.h"
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_VALUES %(max_values)d

typedef CUresult (*launch_ex_t)(const CUlaunchConfig*, CUfunction, void**, void**);
typedef CUresult (*error_string_t)(CUresult, const char**);
typedef CUresult (*ctx_get_t)(CUcontext*);
typedef CUresult (*ctx_set_t)(CUcontext);
typedef CUresult (*primary_retain_t)(CUcontext*, CUdevice);

static launch_ex_t launch_ex;
static error_string_t error_string;
static ctx_get_t ctx_get;
static ctx_set_t ctx_set;
static primary_retain_t primary_retain;

/* The driver's entry points, looked up at the first launch: the module imports on machines without one. */
static int bind_driver(void) {
  if (launch_ex) return 1;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) {
    PyErr_SetString(PyExc_RuntimeError, "flashgen launch: cannot open libcuda.so.1 (is an NVIDIA driver installed?)");
    return 0;
  }
  error_string = (error_string_t)dlsym(lib, "cuGetErrorString");
  ctx_get = (ctx_get_t)dlsym(lib, "cuCtxGetCurrent");
  ctx_set = (ctx_set_t)dlsym(lib, "cuCtxSetCurrent");
  primary_retain = (primary_retain_t)dlsym(lib, "cuDevicePrimaryCtxRetain");
  launch_ex_t found = (launch_ex_t)dlsym(lib, "cuLaunchKernelEx");
  if (!found || !error_string || !ctx_get || !ctx_set || !primary_retain) {
    PyErr_SetString(PyExc_RuntimeError, "flashgen launch: libcuda.so.1 lacks cuLaunchKernelEx (driver too old)");
    return 0;
  }
  launch_ex = found;
  return 1;
}

static int check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return 1;
  const char* text = NULL;
  error_string(r, &text);
  PyErr_Format(PyExc_RuntimeError, "flashgen launch: %%s failed: %%s", what, text ? text : "unknown CUDA error");
  return 0;
}

/* A thread that has made no CUDA call yet has no current context: make the device's primary one
   current, as the CUDA runtime (and so torch) would. */
static int ensure_context(int device) {
  CUcontext ctx = NULL;
  if (!check(ctx_get(&ctx), "cuCtxGetCurrent")) return 0;
  if (ctx) return 1;
  return check(primary_retain(&ctx, (CUdevice)device), "cuDevicePrimaryCtxRetain") && check(ctx_set(ctx), "cuCtxSetCurrent");
}

/* launch(static, gx, gy, gz, stream, *values)
   static = (function, threads, shared bytes, pdl, kinds, device); kinds has one byte per value:
   'p' a 64-bit address, 'i' a 32-bit int, 'f' a 32-bit float. The two scratch addresses every Triton
   kernel takes last (global and profile scratch) are passed as null. */
static PyObject* launch(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 5 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 6) {
    PyErr_SetString(PyExc_TypeError, "launch(static, gx, gy, gz, stream, *values): static is a 6-tuple");
    return NULL;
  }
  PyObject* st = args[0];
  char* kinds;
  Py_ssize_t n;
  if (PyBytes_AsStringAndSize(PyTuple_GET_ITEM(st, 4), &kinds, &n) < 0) return NULL;
  if (n > MAX_VALUES || nargs - 5 != n) {
    PyErr_Format(PyExc_TypeError, "launch: %%zd values given, the kernel takes %%zd (at most %%d)", nargs - 5, n, MAX_VALUES);
    return NULL;
  }
  uint64_t slots[MAX_VALUES + 2];
  void* params[MAX_VALUES + 2];
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = args[5 + i];
    slots[i] = 0;
    if (kinds[i] == 'p') {
      slots[i] = PyLong_AsUnsignedLongLong(v);
    } else if (kinds[i] == 'i') {
      long long x = PyLong_AsLongLong(v);
      if (x < INT32_MIN || x > INT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "launch: value %%zd (%%lld) does not fit the kernel's 32-bit int", i, x);
        return NULL;
      }
      int32_t x32 = (int32_t)x;
      memcpy(&slots[i], &x32, sizeof x32);
    } else if (kinds[i] == 'f') {
      float f = (float)PyFloat_AsDouble(v);
      memcpy(&slots[i], &f, sizeof f);
    } else {
      PyErr_Format(PyExc_ValueError, "launch: unknown value kind '%%c'", kinds[i]);
      return NULL;
    }
    params[i] = &slots[i];
  }
  slots[n] = slots[n + 1] = 0;
  params[n] = &slots[n];
  params[n + 1] = &slots[n + 1];
  unsigned long long function = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(st, 0));
  long threads = PyLong_AsLong(PyTuple_GET_ITEM(st, 1));
  long shared = PyLong_AsLong(PyTuple_GET_ITEM(st, 2));
  long pdl = PyLong_AsLong(PyTuple_GET_ITEM(st, 3));
  long device = PyLong_AsLong(PyTuple_GET_ITEM(st, 5));
  long gx = PyLong_AsLong(args[1]), gy = PyLong_AsLong(args[2]), gz = PyLong_AsLong(args[3]);
  unsigned long long stream = PyLong_AsUnsignedLongLong(args[4]);
  if (PyErr_Occurred()) return NULL;
  if (gx <= 0 || gy <= 0 || gz <= 0) Py_RETURN_NONE;
  if (!bind_driver() || !ensure_context((int)device)) return NULL;
  CUlaunchAttribute attrs[1];
  CUlaunchConfig config;
  memset(&config, 0, sizeof config);
  config.gridDimX = (unsigned)gx;
  config.gridDimY = (unsigned)gy;
  config.gridDimZ = (unsigned)gz;
  config.blockDimX = (unsigned)threads;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = (unsigned)shared;
  config.hStream = (CUstream)stream;
  if (pdl) {
    memset(attrs, 0, sizeof attrs);
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[0].value.programmaticStreamSerializationAllowed = 1;
    config.attrs = attrs;
    config.numAttrs = 1;
  }
  if (!check(launch_ex(&config, (CUfunction)function, params, NULL), "cuLaunchKernelEx")) return NULL;
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
  {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "Launch a compiled kernel on gathered values."},
  {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "flashgen_native_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_flashgen_native_launch(void) { return PyModule_Create(&module); }
""" % {"max_values": MAX_VALUES}


@lru_cache(maxsize=1)
def module() -> ModuleType:
    """The compiled launch module (built on first use, then loaded from Triton's cache folder)."""
    from triton.backends.nvidia.driver import include_dirs
    from triton.runtime.build import compile_module_from_src

    try:
        return compile_module_from_src(SOURCE, "flashgen_native_launch", include_dirs=include_dirs)
    except Exception as e:  # a missing C compiler or Python headers: name it, the caller falls back
        raise FlashgenError(f"cannot build the native launch module: {e}") from e


@dataclass(frozen=True)
class NativeLaunch:
    """What one compiled binary's launches share: the function handle, block size, shared memory,
    programmatic dependent launch, the kinds of its values and its device; and the C launch."""
    static: tuple[int, int, int, int, bytes, int]
    launch: Callable[..., None]  # launch(static, gx, gy, gz, stream, *values)


def native_launch(compiled: Any, kinds: str, device: int) -> NativeLaunch | None:
    """The lean launch of a compiled CUDA kernel, or None where it does not apply and Triton's launcher
    stays: HIP binaries, kernels that need global or profile scratch from the launcher, clusters or
    cooperative grids, or FLASHGEN_NATIVE_LAUNCH=0."""
    md = compiled.metadata
    if (not switch("FLASHGEN_NATIVE_LAUNCH") or getattr(md, "backend_name", "cuda") != "cuda"
            or md.global_scratch_size or getattr(md, "profile_scratch_size", 0) or md.num_ctas != 1
            or getattr(md, "launch_cooperative_grid", False) or len(kinds) > MAX_VALUES):
        return None
    try:
        launch = module().launch
    except FlashgenError as e:
        log.warning("%s; launching through Triton's launcher", e)
        return None
    compiled._init_handles()
    return NativeLaunch((compiled.function, 32 * md.num_warps, md.shared, int(bool(md.launch_pdl)),
                         kinds.encode(), device), launch)
