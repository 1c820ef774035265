/* cuDNN loaded with dlopen (libcudnn.so.9), one handle per (device, stream), and cuDNN's errors as dlua errors. */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <glob.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/api.h"
#include "core/error.h"
#include "cuda/cudnn_api.h"
#include "cuda/kernels.h"

/* ---- the library ------------------------------------------------------------------------------------------
   dlopen rather than linking: the binary starts on machines without cuDNN (CPU jobs) and finds the library where
   the GPU machine has it. libcudnn.so.9 is a small front that loads its sub-libraries (ops, cnn, engines) from
   its own folder. */

static dlua_cudnn_api_t api;
static int api_ok;
static char api_error[1024];
static pthread_once_t api_once = PTHREAD_ONCE_INIT;

static void *try_open(const char *path, char *why, size_t n) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h) {
    snprintf(api.path, sizeof api.path, "%s", path);
    return h;
  }
  const char *e = dlerror();
  if (!why[0] && e) snprintf(why, n, "%s", e);  // the first reason is the telling one: the plain name's
  return NULL;
}

#ifndef DLUA_CUDA_EMU
static void *try_glob(const char *pattern, char *why, size_t n) {
  glob_t g;
  void *h = NULL;
  if (glob(pattern, 0, NULL, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc && !h; i++) h = try_open(g.gl_pathv[i], why, n);
    globfree(&g);
  }
  return h;
}

/* The real libcudnn.so.9: DLUA_CUDNN_LIBRARY, the loader's path, the CUDA trees, Python's nvidia/cudnn/lib. */
static void *search(char *why, size_t n) {
  char pat[700];
  void *h = NULL;
  const char *env = getenv("DLUA_CUDNN_LIBRARY");
  if (env && *env) h = try_open(env, why, n);
  if (!h) h = try_open("libcudnn.so.9", why, n);
  const char *roots[] = {getenv("CUDNN_ROOT"), getenv("CUDA_HOME"), getenv("CUDA_PATH"), "/usr/local/cuda"};
  for (int i = 0; i < 4 && !h; i++) {
    if (!roots[i] || !*roots[i]) continue;
    snprintf(pat, sizeof pat, "%s/lib*/libcudnn.so.9", roots[i]);
    h = try_glob(pat, why, n);
  }
  const char *prefixes[] = {getenv("VIRTUAL_ENV"), getenv("CONDA_PREFIX"), getenv("HOME"), "/usr/local", "/usr"};
  for (int i = 0; i < 5 && !h; i++) {
    if (!prefixes[i] || !*prefixes[i]) continue;
    snprintf(pat, sizeof pat, "%s%s/lib/python3*/*-packages/nvidia/cudnn/lib/libcudnn.so.9", prefixes[i],
             i == 2 ? "/.local" : "");
    h = try_glob(pat, why, n);
  }
  return h;
}
#endif

static void api_load(void) {
  char why[512] = "";
#ifdef DLUA_CUDA_EMU
  /* The CUDA emulator's build loads its own cuDNN (host/cuemu/fake_cudnn.c) and never a real one. */
  const char *env = getenv("DLUA_CUDNN_LIBRARY");
  void *h = try_open(env && *env ? env : DLUA_CUEMU_CUDNN, why, sizeof why);
#else
  void *h = search(why, sizeof why);
#endif
  if (!h) {
    snprintf(api_error, sizeof api_error,
             "cannot load cuDNN (libcudnn.so.9; set LD_LIBRARY_PATH or DLUA_CUDNN_LIBRARY to the CUDA toolkit's "
             "lib64 or Python's nvidia/cudnn/lib): %s", why[0] ? why : "not found");
    return;
  }
  struct {
    void **slot;
    const char *name;
  } syms[] = {
#define DLUA_CUDNN_SYM_(f) {(void **)&api.f, #f},
      DLUA_CUDNN_FUNCS(DLUA_CUDNN_SYM_)
#undef DLUA_CUDNN_SYM_
  };
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    *syms[i].slot = dlsym(h, syms[i].name);
    if (!*syms[i].slot) {
      snprintf(api_error, sizeof api_error, "cannot load cuDNN (%s): it lacks %s", api.path, syms[i].name);
      return;
    }
  }
  *(void **)&api.cudnnGetLastErrorString = dlsym(h, "cudnnGetLastErrorString");
  api.version = api.cudnnGetVersion();
  if (api.version < 90000 || api.version >= 100000) {
    snprintf(api_error, sizeof api_error, "cannot load cuDNN (%s): version %zu.%zu.%zu, expected 9.x", api.path,
             api.version / 10000, api.version / 100 % 100, api.version % 100);
    return;
  }
  api_ok = 1;
}

const dlua_cudnn_api_t *dlua_cudnn_api(const char *op) {
  pthread_once(&api_once, api_load);
  if (!api_ok) {
    DLUA_ERR(DLUA_ERR_BACKEND, "%s: %s", op, api_error);
    return NULL;
  }
  return &api;
}

dlua_status_t dlua_cudnn_fail(const char *op, cudnnStatus_t status, const char *call, const char *context) {
  char detail[512] = "";
  if (api.cudnnGetLastErrorString) {
    api.cudnnGetLastErrorString(detail, sizeof detail);
    detail[sizeof detail - 1] = 0;
  }
  const char *name = api.cudnnGetErrorString ? api.cudnnGetErrorString(status) : "?";
  dlua_status_t code = status == CUDNN_STATUS_ALLOC_FAILED ? DLUA_ERR_OOM : DLUA_ERR_BACKEND;
  return DLUA_ERR(code, "%s: cuDNN %s in %s (%s)%s%s", op, name, call, context ? context : "", detail[0] ? ": " : "",
                  detail);
}

/* ---- handles ------------------------------------------------------------------------------------------------
   Keyed by (device, stream): dlua streams are never freed (destroy recycles them), so a key never comes to mean
   another stream. A handle keeps its stream, but is set on it again at each use, as cuDNN's docs ask of callers
   that share one. */

enum { MAX_HANDLES = 256 };
static struct {
  int device;
  void *stream;
  cudnnHandle_t h;
} handles[MAX_HANDLES];
static int nhandles;
static pthread_mutex_t handles_mu = PTHREAD_MUTEX_INITIALIZER;

dlua_status_t dlua_cudnn_handle(const char *op, int device, cudnnHandle_t *handle) {
  *handle = NULL;
  const dlua_cudnn_api_t *a = dlua_cudnn_api(op);
  if (!a) return DLUA_ERR_BACKEND;
  void *stream = dlua_cuda_raw_stream(device);
  cudnnHandle_t h = NULL;
  pthread_mutex_lock(&handles_mu);
  for (int i = 0; i < nhandles && !h; i++)
    if (handles[i].device == device && handles[i].stream == stream) h = handles[i].h;
  if (!h) {
    if (nhandles == MAX_HANDLES) {
      pthread_mutex_unlock(&handles_mu);
      return DLUA_ERR(DLUA_ERR_BACKEND, "%s: more than %d (device, stream) pairs used cuDNN", op, MAX_HANDLES);
    }
    cudnnStatus_t st = a->cudnnCreate(&h);
    if (st != CUDNN_STATUS_SUCCESS) {
      pthread_mutex_unlock(&handles_mu);
      char ctx[32];
      snprintf(ctx, sizeof ctx, "cuda:%d", device);
      return dlua_cudnn_fail(op, st, "cudnnCreate", ctx);
    }
    handles[nhandles].device = device;
    handles[nhandles].stream = stream;
    handles[nhandles].h = h;
    nhandles++;
  }
  pthread_mutex_unlock(&handles_mu);
  cudnnStatus_t st = a->cudnnSetStream(h, (cudaStream_t)stream);
  if (st != CUDNN_STATUS_SUCCESS) {
    char ctx[32];
    snprintf(ctx, sizeof ctx, "cuda:%d", device);
    return dlua_cudnn_fail(op, st, "cudnnSetStream", ctx);
  }
  *handle = h;
  return DLUA_OK;
}
