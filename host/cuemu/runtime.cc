/* The CUDA emulator's runtime: the subset of the CUDA runtime API that dlua's backend calls, on the CPU.

   - Devices: CUEMU_DEVICES of them (default 1), each with CUEMU_MEMORY bytes (default 8 GiB) and CUEMU_SMS
     multiprocessors (default 4, so grid-stride loops go round several times).
   - Device memory is host memory mapped PROT_NONE except while device work runs: a host read or write of it is
     caught (SIGSEGV, reported with the allocation and aborted), as is a kernel's access outside every mapping
     (reported as cudaErrorIllegalAddress naming the kernel, sticky as on a GPU). Each allocation ends at a guard
     page.
   - Streams are queues. Work runs only when the host waits for it (synchronize, a blocking copy, a query that
     then answers "not ready" once), in stream order, with events and cudaStreamWaitEvent ordering streams. A
     host that reads a result without waiting, or a stream that uses another's output without an event, gets
     stale data here. Copies from pageable memory are staged at the call; pinned memory is read when the copy
     runs, as on a GPU.
   - A block's threads run as fibers, one at a time, each until it finishes or waits at __syncthreads or a warp
     operation; the order rotates between launches (forward, reverse, shuffled), so a missing barrier shows up
     as a wrong result. Blocks run one after another in the same order. */
/* One file, over 900 lines: the emulated devices' memory protection, streams, events and launches share one
   allocation table and one lock (mu), which the fault handler guarding device memory reads too. */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <signal.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>
#include "cuemu.h"
#include "kernel.h"

namespace cuemu {
namespace {

const int kMaxDevices = 8;
std::recursive_mutex mu;

struct Config {
  int devices = 1, sms = 4;
  size_t memory = (size_t)8 << 30;
  int order = -1;  // -1: rotate; 0 forward, 1 reverse, 2 shuffled
  Config() {
    if (const char *v = getenv("CUEMU_DEVICES")) devices = std::max(0, std::min(kMaxDevices, atoi(v)));
    // as the driver: CUDA_VISIBLE_DEVICES lists the devices shown (empty: none), up to the first invalid entry
    if (const char *v = getenv("CUDA_VISIBLE_DEVICES")) {
      int shown = 0;
      for (const char *p = v; *p;) {
        char *end;
        long d = strtol(p, &end, 10);
        if (end == p || d < 0 || d >= devices) break;
        shown++;
        p = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') break;
      }
      devices = shown;
    }
    if (const char *v = getenv("CUEMU_SMS")) sms = std::max(1, atoi(v));
    if (const char *v = getenv("CUEMU_MEMORY")) memory = (size_t)strtoull(v, NULL, 0);
    if (const char *v = getenv("CUEMU_ORDER")) {
      order = !strcmp(v, "forward") ? 0 : !strcmp(v, "reverse") ? 1 : !strcmp(v, "shuffle") ? 2 : -1;
    }
  }
};
Config &cfg() {
  static Config c;
  return c;
}

/* ---- errors ------------------------------------------------------------------------------------------ */

thread_local cudaError_t last_error = cudaSuccess;
cudaError_t sticky = cudaSuccess;  // a fault in device work: every later call fails, as on a GPU

cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

/* What a call that waited for device work answers: the sticky error, if that work faulted. */
cudaError_t after_wait() { return ret(sticky); }

/* ---- device memory ------------------------------------------------------------------------------------ */

struct Alloc {
  char *map;       // the mapping: [map, map + maplen), its last page a guard
  size_t maplen;
  char *p;         // what cudaMalloc returned
  size_t n;
  int device;
};
std::map<uintptr_t, Alloc> allocs;     // by p
std::map<uintptr_t, size_t> pinned;    // cudaHostAlloc: p -> bytes
size_t used[kMaxDevices];
int open_depth = 0;
const size_t kPage = 4096;

/* Sets the protection of every allocation (but their guard pages), except those of device `except`. */
void protect(int prot, int except = -1) {
  for (auto &kv : allocs)
    if (kv.second.device != except) mprotect(kv.second.map, kv.second.maplen - kPage, prot);
}
struct DeviceOpen {  // device memory readable and writable while device work runs
  DeviceOpen() {
    if (open_depth++ == 0) protect(PROT_READ | PROT_WRITE);
  }
  ~DeviceOpen() {
    if (--open_depth == 0) protect(PROT_NONE);
  }
};

const Alloc *find_alloc(const void *ptr) {
  uintptr_t a = (uintptr_t)ptr;
  auto it = allocs.upper_bound(a);
  if (it == allocs.begin()) return nullptr;
  --it;
  const Alloc &al = it->second;
  return a >= (uintptr_t)al.map && a < (uintptr_t)al.map + al.maplen ? &al : nullptr;
}

/* ---- streams and events ------------------------------------------------------------------------------- */

struct Stream {
  int device;
  bool legacy;       // the device's stream 0
  bool nonblocking;
  std::deque<std::function<void()>> q;
  uint64_t submitted = 0, completed = 0;
};
struct Event {
  Stream *s = nullptr;
  uint64_t pos = 0;
  bool timing = true;
  std::shared_ptr<double> stamp;  // when the record ran (ms)
};
Stream legacy_streams[kMaxDevices];
std::vector<Stream *> all_streams;
thread_local int cur_device = 0;

double now_ms() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

Stream *stream_of(cudaStream_t s) {
  if (s == 0 || s == cudaStreamLegacy || s == cudaStreamPerThread) {
    Stream *l = &legacy_streams[cur_device];
    l->device = cur_device;
    l->legacy = true;
    return l;
  }
  return (Stream *)s;
}

void run_one(Stream *s) {
  std::function<void()> f = std::move(s->q.front());
  s->q.pop_front();
  if (sticky == cudaSuccess) f();
  s->completed++;
}

/* Device memory is opened once for the whole run (mprotect of every allocation), not per operation. */
void run_until(Stream *s, uint64_t pos) {
  if (s->completed >= pos) return;
  DeviceOpen open;
  while (s->completed < pos) run_one(s);
}

void drain(Stream *s) { run_until(s, s->submitted); }

void drain_device(int device) {
  bool again = true;
  while (again) {
    again = false;
    for (Stream *s : all_streams)
      if (s->device == device && s->completed < s->submitted) drain(s), again = true;
    Stream *l = &legacy_streams[device];
    if (l->completed < l->submitted) drain(l), again = true;
  }
}

/* Queues f on s. The legacy stream waits for the device's blocking streams and they wait for it: the work
   already queued there runs first. */
void submit(Stream *s, std::function<void()> f) {
  if (s->legacy) {
    for (Stream *o : all_streams)
      if (o->device == s->device && !o->nonblocking) drain(o);
  } else if (!s->nonblocking) {
    drain(&legacy_streams[s->device]);
  }
  s->q.push_back(std::move(f));
  s->submitted++;
}

/* ---- kernels: fibers ---------------------------------------------------------------------------------- */

inline uint3 u3(unsigned x, unsigned y, unsigned z) {
  uint3 v;
  v.x = x;
  v.y = y;
  v.z = z;
  return v;
}

enum State { RUNNABLE, WAIT_BAR, WAIT_WARP, DONE };
struct Fiber {
  void *sp = nullptr;
  char *stack = nullptr;
  uint3 tid;
  int state = DONE;
  int wop = 0, warg = 0, wwidth = 32;
  uint64_t wval = 0, wres = 0;
};
const size_t kStack = 256 * 1024;
std::vector<Fiber> fibers;
Fiber *current = nullptr;
void *sched_sp = nullptr;
const std::function<void()> *body = nullptr;
sigjmp_buf *fault_jmp = nullptr;
volatile uintptr_t fault_addr = 0;

extern "C" void cuemu_switch(void **save, void *to);
#if defined(__x86_64__)
__asm__(
    ".text\n.globl cuemu_switch\n.type cuemu_switch,@function\ncuemu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size cuemu_switch,.-cuemu_switch\n");
#elif defined(__aarch64__)
__asm__(
    ".text\n.globl cuemu_switch\n.type cuemu_switch,%function\ncuemu_switch:\n"
    "  sub sp, sp, #176\n"
    "  stp x19, x20, [sp, #0]\n  stp x21, x22, [sp, #16]\n  stp x23, x24, [sp, #32]\n  stp x25, x26, [sp, #48]\n"
    "  stp x27, x28, [sp, #64]\n  stp x29, x30, [sp, #80]\n  stp d8, d9, [sp, #96]\n  stp d10, d11, [sp, #112]\n"
    "  stp d12, d13, [sp, #128]\n  stp d14, d15, [sp, #144]\n"
    "  mov x9, sp\n  str x9, [x0]\n  mov sp, x1\n"
    "  ldp x19, x20, [sp, #0]\n  ldp x21, x22, [sp, #16]\n  ldp x23, x24, [sp, #32]\n  ldp x25, x26, [sp, #48]\n"
    "  ldp x27, x28, [sp, #64]\n  ldp x29, x30, [sp, #80]\n  ldp d8, d9, [sp, #96]\n  ldp d10, d11, [sp, #112]\n"
    "  ldp d12, d13, [sp, #128]\n  ldp d14, d15, [sp, #144]\n"
    "  add sp, sp, #176\n  ret\n"
    ".size cuemu_switch,.-cuemu_switch\n");
#else
#error "the CUDA emulator's fibers need x86-64 or aarch64"
#endif

void yield_to_scheduler() { cuemu_switch(&current->sp, sched_sp); }

extern "C" void cuemu_fiber_entry() {
  (*body)();
  current->state = DONE;
  yield_to_scheduler();
  abort();  // never resumed
}

/* A fresh stack whose first switch enters cuemu_fiber_entry. */
void *fresh_sp(Fiber &f) {
  uintptr_t top = ((uintptr_t)f.stack + kStack) & ~(uintptr_t)15;
  uint64_t *sp = (uint64_t *)top;
#if defined(__x86_64__)
  *--sp = 0;                              // the entry's return address: it never returns
  *--sp = (uint64_t)&cuemu_fiber_entry;   // ret target
  for (int i = 0; i < 6; i++) *--sp = 0;  // rbp rbx r12-r15
  uint32_t mxcsr;
  uint16_t x87cw;
  __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
  __asm__ volatile("fnstcw %0" : "=m"(x87cw));
  *--sp = (uint64_t)mxcsr | ((uint64_t)x87cw << 32);
#else
  sp -= 22;  // 176 bytes
  memset(sp, 0, 176);
  sp[11] = (uint64_t)&cuemu_fiber_entry;  // x30
#endif
  return sp;
}

void ensure_fibers(size_t n) {
  while (fibers.size() < n) {
    Fiber f;
    void *m = mmap(nullptr, kStack + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      fprintf(stderr, "cuemu: cannot map a fiber stack: %s\n", strerror(errno));
      abort();
    }
    mprotect(m, kPage, PROT_NONE);  // a guard below the stack
    f.stack = (char *)m + kPage;
    fibers.push_back(f);
  }
}

/* Releases one warp whose live lanes all wait at a warp operation; false when none can be released. */
bool release_warp(size_t nthreads, std::string *why) {
  for (size_t w0 = 0; w0 < nthreads; w0 += 32) {
    size_t w1 = std::min(nthreads, w0 + 32);
    bool any = false, all = true;
    for (size_t i = w0; i < w1; i++) {
      if (fibers[i].state == DONE) continue;
      if (fibers[i].state == WAIT_WARP) any = true;
      else all = false;
    }
    if (!any || !all) continue;
    int op = -1;
    for (size_t i = w0; i < w1; i++) {
      Fiber &f = fibers[i];
      if (f.state != WAIT_WARP) continue;
      if (op >= 0 && f.wop != op) {
        *why = "lanes of one warp wait at different warp operations";
        return false;
      }
      op = f.wop;
    }
    uint64_t red = 0;
    bool first = true;
    for (size_t i = w0; i < w1; i++) {
      Fiber &f = fibers[i];
      if (f.state != WAIT_WARP) continue;
      uint64_t v = f.wval;
      switch (op) {
        case W_BALLOT: red |= v ? (uint64_t)1 << (i - w0) : 0; break;
        case W_ANY: red |= v; break;
        case W_ALL: red = first ? v : (red & v); break;
        case W_RMAX_U: red = first ? (uint32_t)v : std::max<uint64_t>(red, (uint32_t)v); break;
        case W_RMIN_U: red = first ? (uint32_t)v : std::min<uint64_t>(red, (uint32_t)v); break;
        case W_RADD_U: red = (uint32_t)(red + v); break;
        case W_RMAX_I: red = first ? v : (uint64_t)std::max<int64_t>((int64_t)red, (int64_t)v); break;
        case W_RMIN_I: red = first ? v : (uint64_t)std::min<int64_t>((int64_t)red, (int64_t)v); break;
        default: break;
      }
      first = false;
    }
    for (size_t i = w0; i < w1; i++) {
      Fiber &f = fibers[i];
      if (f.state != WAIT_WARP) continue;
      const int lane = (int)(i - w0), w = f.wwidth > 0 && f.wwidth <= 32 ? f.wwidth : 32;
      const int seg = lane - lane % w;
      int src = lane;
      switch (op) {
        case W_SHFL: src = seg + ((f.warg % w) + w) % w; break;
        case W_SHFL_DOWN: src = lane % w + f.warg < w ? lane + f.warg : lane; break;
        case W_SHFL_UP: src = lane % w - f.warg >= 0 ? lane - f.warg : lane; break;
        case W_SHFL_XOR: src = (lane ^ f.warg) - seg < w && (lane ^ f.warg) >= seg ? lane ^ f.warg : lane; break;
        default: break;
      }
      if (op == W_SHFL || op == W_SHFL_DOWN || op == W_SHFL_UP || op == W_SHFL_XOR) {
        size_t si = w0 + src;
        if (si >= w1 || fibers[si].state != WAIT_WARP) {
          *why = "a shuffle reads a lane that has exited or does not exist";
          return false;
        }
        f.wres = fibers[si].wval;
      } else {
        f.wres = red;
      }
    }
    for (size_t i = w0; i < w1; i++)
      if (fibers[i].state == WAIT_WARP) fibers[i].state = RUNNABLE;
    return true;
  }
  return false;
}

unsigned launch_counter = 0;

extern "C" char __start_cuemu_shared[] __attribute__((weak));
extern "C" char __stop_cuemu_shared[] __attribute__((weak));

/* Runs one block; false (and a message) on a deadlock. */
bool run_block(const dim3 &bd, const std::vector<size_t> &order, std::string *why) {
  const size_t n = (size_t)bd.x * bd.y * bd.z;
  if (__start_cuemu_shared && (uintptr_t)__stop_cuemu_shared > (uintptr_t)__start_cuemu_shared)
    memset(__start_cuemu_shared, 0xff, (size_t)(__stop_cuemu_shared - __start_cuemu_shared));
  for (size_t i = 0; i < n; i++) {
    Fiber &f = fibers[i];
    f.tid = u3((unsigned)(i % bd.x), (unsigned)(i / bd.x % bd.y), (unsigned)(i / ((size_t)bd.x * bd.y)));
    f.state = RUNNABLE;
    f.sp = fresh_sp(f);
  }
  for (;;) {
    for (size_t k = 0; k < n; k++) {
      Fiber &f = fibers[order[k]];
      if (f.state != RUNNABLE) continue;
      current = &f;
      cuemu_threadIdx = f.tid;
      cuemu_switch(&sched_sp, f.sp);
    }
    size_t done = 0, at_bar = 0;
    for (size_t i = 0; i < n; i++) {
      done += fibers[i].state == DONE;
      at_bar += fibers[i].state == WAIT_BAR;
    }
    if (done == n) return true;
    std::string wwhy;
    if (release_warp(n, &wwhy)) continue;
    if (at_bar + done == n) {
      for (size_t i = 0; i < n; i++)
        if (fibers[i].state == WAIT_BAR) fibers[i].state = RUNNABLE;
      continue;
    }
    *why = wwhy.empty() ? "some threads wait at __syncthreads while others of the block wait at a warp operation"
                        : wwhy;
    return false;
  }
}

std::vector<size_t> make_order(size_t n, int kind, unsigned seed) {
  std::vector<size_t> o(n);
  for (size_t i = 0; i < n; i++) o[i] = kind == 1 ? n - 1 - i : i;
  if (kind == 2) std::shuffle(o.begin(), o.end(), std::mt19937(seed));
  return o;
}

void fault_handler(int sig, siginfo_t *si, void *ctx);

void install_handler() {
  static bool done = false;
  if (done) return;
  done = true;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = fault_handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
}

void alt_stack() {
  thread_local bool set = false;
  if (set) return;
  set = true;
  stack_t ss;
  ss.ss_size = 64 * 1024;
  ss.ss_sp = malloc(ss.ss_size);
  ss.ss_flags = 0;
  sigaltstack(&ss, nullptr);
}

void fault_handler(int sig, siginfo_t *si, void *) {
  uintptr_t a = (uintptr_t)si->si_addr;
  if (fault_jmp) {
    fault_addr = a;
    siglongjmp(*fault_jmp, 1);
  }
  const Alloc *al = find_alloc((void *)a);
  if (al) {
    char msg[256];
    int len = snprintf(msg, sizeof msg,
                       "cuemu: the host touched device memory at %p (offset %td of a %zu-byte allocation on cuda:%d) "
                       "outside device work\n",
                       (void *)a, (ptrdiff_t)(a - (uintptr_t)al->p), al->n, al->device);
    if (write(2, msg, (size_t)len) < 0) {
    }
  }
  signal(sig, SIG_DFL);  // the access faults again and ends the process as it would have
}

/* Another device's memory is out of a kernel's reach (no peer access here): closed while it runs. */
struct OtherDevicesClosed {
  int device;
  explicit OtherDevicesClosed(int d) : device(d) {
    if (cfg().devices > 1) protect(PROT_NONE, device);
  }
  ~OtherDevicesClosed() {
    if (cfg().devices > 1) protect(PROT_READ | PROT_WRITE, device);
  }
};

void run_kernel(const Cfg &c, int device, const char *name, const std::function<void()> &fn) {
  OtherDevicesClosed closed(device);
  const size_t nt = (size_t)c.block.x * c.block.y * c.block.z;
  ensure_fibers(nt);
  install_handler();
  alt_stack();
  const unsigned k = launch_counter++;
  const int kind = cfg().order >= 0 ? cfg().order : (int)(k % 3);
  std::vector<size_t> torder = make_order(nt, kind, k);
  const size_t nb = (size_t)c.grid.x * c.grid.y * c.grid.z;
  std::vector<size_t> border = make_order(nb, kind, k * 7919u + 1);
  cuemu_blockDim = c.block;
  cuemu_gridDim = c.grid;
  body = &fn;
  sigjmp_buf jb;
  if (sigsetjmp(jb, 1)) {
    fault_jmp = nullptr;
    char msg[512];
    const Alloc *al = find_alloc((void *)fault_addr);
    char where[96] = "";
    if (al && al->device != device)
      snprintf(where, sizeof where, ", in memory of cuda:%d (the kernel runs on cuda:%d)", al->device, device);
    else if (al && fault_addr >= (uintptr_t)al->p + al->n)
      snprintf(where, sizeof where, ", past the end of an allocation");
    snprintf(msg, sizeof msg, "kernel %s: illegal memory access at %p (block %u,%u,%u thread %u,%u,%u)%s", name,
             (void *)fault_addr, cuemu_blockIdx.x, cuemu_blockIdx.y, cuemu_blockIdx.z, current ? current->tid.x : 0,
             current ? current->tid.y : 0, current ? current->tid.z : 0, where);
    cuemu_fail("%s", msg);
    sticky = cudaErrorIllegalAddress;
    return;
  }
  fault_jmp = &jb;
  for (size_t bi = 0; bi < nb; bi++) {
    size_t b = border[bi];
    cuemu_blockIdx = u3((unsigned)(b % c.grid.x), (unsigned)(b / c.grid.x % c.grid.y),
                                (unsigned)(b / ((size_t)c.grid.x * c.grid.y)));
    std::string why;
    if (!run_block(c.block, torder, &why)) {
      fault_jmp = nullptr;
      cuemu_fail("kernel %s: block %u,%u,%u cannot go on: %s", name, cuemu_blockIdx.x, cuemu_blockIdx.y,
                 cuemu_blockIdx.z, why.c_str());
      sticky = cudaErrorLaunchFailure;
      return;
    }
  }
  fault_jmp = nullptr;
}

bool device_ok(int d) { return d >= 0 && d < cfg().devices; }

}  // namespace

/* ---- the kernel side ---------------------------------------------------------------------------------- */

uint64_t warp_op(int op, unsigned mask, uint64_t value, int arg, int width) {
  Fiber *f = current;
  f->wop = op;
  (void)mask;  // every live lane of the warp takes part, whatever the mask says
  f->wval = value;
  f->warg = arg;
  f->wwidth = width;
  f->state = WAIT_WARP;
  yield_to_scheduler();
  cuemu_threadIdx = f->tid;
  return f->wres;
}

void launch_raw(const Cfg &c, const char *name, std::function<void()> fn) {
  std::lock_guard<std::recursive_mutex> g(mu);
  if (sticky != cudaSuccess) {
    last_error = sticky;
    return;
  }
  const size_t nt = (size_t)c.block.x * c.block.y * c.block.z;
  if (nt == 0 || nt > 1024 || c.block.z > 64 || c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0 ||
      c.grid.y > 65535 || c.grid.z > 65535 || c.grid.x > 0x7fffffffu) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (c.shmem > 48 * 1024) {
    last_error = cudaErrorInvalidValue;
    return;
  }
  Stream *s = stream_of(c.stream);
  if (s->device != cur_device) {
    last_error = cudaErrorInvalidResourceHandle;  // a stream of another device
    return;
  }
  Cfg cc = c;
  std::string nm = name;
  const int dev = s->device;
  submit(s, [cc, dev, nm, fn]() { run_kernel(cc, dev, nm.c_str(), fn); });
}

}  // namespace cuemu

using namespace cuemu;

extern "C" {

uint3 cuemu_threadIdx, cuemu_blockIdx;
dim3 cuemu_blockDim, cuemu_gridDim;

void cuemu_syncthreads(void) {
  Fiber *f = current;
  f->state = WAIT_BAR;
  yield_to_scheduler();
  cuemu_threadIdx = f->tid;
}

void cuemu_enqueue(cudaStream_t s, void (*fn)(void *), const void *arg, size_t size) {
  std::lock_guard<std::recursive_mutex> g(mu);
  std::shared_ptr<std::vector<char>> a = std::make_shared<std::vector<char>>((const char *)arg, (const char *)arg + size);
  submit(stream_of(s), [fn, a]() { fn(a->data()); });
}

int cuemu_memory_kind(const void *p, size_t n) {
  std::lock_guard<std::recursive_mutex> g(mu);
  const Alloc *al = find_alloc(p);
  if (al) return (const char *)p >= al->p && (const char *)p + n <= al->p + al->n ? 1 : 0;
  auto it = pinned.upper_bound((uintptr_t)p);
  if (it != pinned.begin()) {
    --it;
    if ((uintptr_t)p + n <= it->first + it->second) return 2;
  }
  return 0;
}

void cuemu_fail(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::lock_guard<std::recursive_mutex> g(mu);
  if (sticky == cudaSuccess) {
    sticky = cudaErrorLaunchFailure;
      fprintf(stderr, "cuemu: %s\n", buf);
  }
}

/* ---- the runtime API ---------------------------------------------------------------------------------- */

#define LOCK std::lock_guard<std::recursive_mutex> lock_(mu)
#define STICKY                                     \
  do {                                             \
    if (sticky != cudaSuccess) return ret(sticky); \
  } while (0)

cudaError_t cudaGetLastError(void) {
  LOCK;
  cudaError_t e = last_error;
  last_error = sticky;
  return e;
}
cudaError_t cudaPeekAtLastError(void) {
  LOCK;
  return last_error;
}

/* The errors this runtime gives: name and text, as the real runtime's. */
static const struct {
  cudaError_t e;
  const char *name, *text;
} errors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
};

const char *cudaGetErrorName(cudaError_t e) {
  for (const auto &x : errors)
    if (x.e == e) return x.name;
  return "cudaErrorUnknown";
}
const char *cudaGetErrorString(cudaError_t e) {
  for (const auto &x : errors)
    if (x.e == e) return x.text;
  return "unknown error";
}

cudaError_t cudaRuntimeGetVersion(int *v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int *v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int *n) {
  *n = cfg().devices;
  return cfg().devices ? cudaSuccess : ret(cudaErrorNoDevice);
}
cudaError_t cudaSetDevice(int d) {
  if (!device_ok(d)) return ret(cfg().devices ? cudaErrorInvalidDevice : cudaErrorNoDevice);
  cur_device = d;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d) {
  if (!cfg().devices) return ret(cudaErrorNoDevice);
  *d = cur_device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d) {
  if (!device_ok(d)) return ret(cudaErrorInvalidDevice);
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "dlua CUDA emulator (CPU)");
  p->totalGlobalMem = cfg().memory;
  p->sharedMemPerBlock = 48 * 1024;
  p->regsPerBlock = 65536;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 0x7fffffff;
  p->maxGridSize[1] = p->maxGridSize[2] = 65535;
  p->major = 9;
  p->minor = 0;
  p->multiProcessorCount = cfg().sms;
  p->maxThreadsPerMultiProcessor = 2048;
  p->pciBusID = d;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int d) {
  if (!device_ok(d)) return ret(cudaErrorInvalidDevice);
  switch (a) {
    case cudaDevAttrMultiProcessorCount: *v = cfg().sms; break;
    case cudaDevAttrMaxThreadsPerBlock: *v = 1024; break;
    case cudaDevAttrWarpSize: *v = 32; break;
    case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *v = 0; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = 48 * 1024; break;
    default: return ret(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total) {
  LOCK;
  *total = cfg().memory;
  *free_b = cfg().memory - used[cur_device];
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t n) {
  LOCK;
  STICKY;
  *p = nullptr;
  if (!device_ok(cur_device)) return ret(cudaErrorNoDevice);
  if (n == 0) return cudaSuccess;
  if (n > cfg().memory - used[cur_device]) return ret(cudaErrorMemoryAllocation);
  const size_t body_len = (n + 255) & ~(size_t)255;
  const size_t pages = (body_len + kPage - 1) / kPage * kPage;
  const size_t maplen = pages + kPage;
  char *m = (char *)mmap(nullptr, maplen, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return ret(cudaErrorMemoryAllocation);
  Alloc a;
  a.map = m;
  a.maplen = maplen;
  a.p = m + pages - body_len;  // 256-byte aligned, ending (rounded to 256) at the guard page
  a.n = n;
  a.device = cur_device;
  if (open_depth > 0) mprotect(m, pages, PROT_READ | PROT_WRITE);
  allocs[(uintptr_t)a.p] = a;
  used[cur_device] += n;
  *p = a.p;
  return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
  LOCK;
  if (!p) return cudaSuccess;
  auto it = allocs.find((uintptr_t)p);
  if (it == allocs.end()) return ret(cudaErrorInvalidDevicePointer);
  drain_device(it->second.device);  // cudaFree waits for the device
  it = allocs.find((uintptr_t)p);
  used[it->second.device] -= it->second.n;
  munmap(it->second.map, it->second.maplen);
  allocs.erase(it);
  return after_wait();
}

cudaError_t cudaHostAlloc(void **p, size_t n, unsigned int) {
  LOCK;
  *p = nullptr;
  void *m = mmap(nullptr, n ? n : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return ret(cudaErrorMemoryAllocation);
  pinned[(uintptr_t)m] = n ? n : 1;
  *p = m;
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaHostAlloc(p, n, 0); }

cudaError_t cudaFreeHost(void *p) {
  LOCK;
  if (!p) return cudaSuccess;
  auto it = pinned.find((uintptr_t)p);
  if (it == pinned.end()) return ret(cudaErrorInvalidValue);
  for (int d = 0; d < cfg().devices; d++) drain_device(d);  // as cudaFreeHost waits for the work using it
  munmap(p, it->second);
  pinned.erase(it);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *out, unsigned int flags) {
  LOCK;
  STICKY;
  Stream *s = new Stream();
  s->device = cur_device;
  s->legacy = false;
  s->nonblocking = (flags & cudaStreamNonBlocking) != 0;
  all_streams.push_back(s);
  *out = (cudaStream_t)s;
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t *out) { return cudaStreamCreateWithFlags(out, 0); }

cudaError_t cudaStreamDestroy(cudaStream_t h) {
  LOCK;
  Stream *s = stream_of(h);
  if (s->legacy) return ret(cudaErrorInvalidResourceHandle);
  drain(s);
  all_streams.erase(std::remove(all_streams.begin(), all_streams.end(), s), all_streams.end());
  delete s;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t h) {
  LOCK;
  drain(stream_of(h));
  return after_wait();
}

cudaError_t cudaStreamQuery(cudaStream_t h) {
  LOCK;
  Stream *s = stream_of(h);
  if (s->completed < s->submitted) {
    drain(s);  // not ready now; ready when asked again
    return cudaErrorNotReady;
  }
  return after_wait();
}

cudaError_t cudaDeviceSynchronize(void) {
  LOCK;
  drain_device(cur_device);
  return after_wait();
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *out, unsigned int flags) {
  LOCK;
  Event *e = new Event();
  e->timing = !(flags & cudaEventDisableTiming);
  *out = (cudaEvent_t)e;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *out) { return cudaEventCreateWithFlags(out, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t h) {
  LOCK;
  delete (Event *)h;  // pending stamps hold no pointer to it
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t h, cudaStream_t st) {
  LOCK;
  STICKY;
  Event *e = (Event *)h;
  Stream *s = stream_of(st);
  std::shared_ptr<double> stamp = std::make_shared<double>(0);
  submit(s, [stamp]() { *stamp = now_ms(); });
  e->s = s;
  e->pos = s->submitted;
  e->stamp = stamp;
  return cudaSuccess;
}

static bool event_done(Event *e) { return !e->s || e->s->completed >= e->pos; }

cudaError_t cudaEventQuery(cudaEvent_t h) {
  LOCK;
  Event *e = (Event *)h;
  if (!event_done(e)) {
    run_until(e->s, e->pos);  // not ready now; ready when asked again
    return cudaErrorNotReady;
  }
  return after_wait();
}

cudaError_t cudaEventSynchronize(cudaEvent_t h) {
  LOCK;
  Event *e = (Event *)h;
  if (!event_done(e)) run_until(e->s, e->pos);
  return after_wait();
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
  LOCK;
  Event *ea = (Event *)a, *eb = (Event *)b;
  if (!ea->s || !eb->s || !ea->timing || !eb->timing) return ret(cudaErrorInvalidResourceHandle);
  if (!event_done(ea) || !event_done(eb)) return ret(cudaErrorNotReady);
  *ms = (float)(*eb->stamp - *ea->stamp);
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t h, unsigned int) {
  LOCK;
  STICKY;
  Event *e = (Event *)h;
  if (!e->s) return cudaSuccess;  // never recorded: nothing to wait for
  Stream *src = e->s;
  const uint64_t pos = e->pos;
  submit(stream_of(st), [src, pos]() { run_until(src, pos); });
  return cudaSuccess;
}

/* ---- copies and fills ----------------------------------------------------------------------------------- */

/* Checks one side of a copy: device memory must lie inside one allocation; host memory must not be device memory.
   Sets *pin for pinned host memory. */
static cudaError_t side(const void *p, size_t n, bool device, bool *pin) {
  if (device) return cuemu_memory_kind(p, n) == 1 ? cudaSuccess : cudaErrorInvalidValue;
  if (find_alloc(p)) return cudaErrorInvalidValue;
  *pin = cuemu_memory_kind(p, n) == 2;
  return cudaSuccess;
}

static cudaError_t copy(void *dst, const void *src, size_t n, cudaMemcpyKind kind, Stream *s, bool sync) {
  if (n == 0) return cudaSuccess;
  if (kind == cudaMemcpyDefault) {
    const bool dd = find_alloc(dst) != nullptr, sd = find_alloc(src) != nullptr;
    kind = dd ? (sd ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
              : (sd ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  }
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind != cudaMemcpyHostToHost && !dst_dev && !src_dev) return ret(cudaErrorInvalidMemcpyDirection);
  bool dpin = false, spin = false;
  if (side(dst, n, dst_dev, &dpin) != cudaSuccess || side(src, n, src_dev, &spin) != cudaSuccess)
    return ret(cudaErrorInvalidValue);
  if (!src_dev && !spin) {  // pageable source: staged now, the caller may reuse it at once
    std::shared_ptr<std::vector<char>> staged = std::make_shared<std::vector<char>>((const char *)src, (const char *)src + n);
    submit(s, [dst, staged]() { memcpy(dst, staged->data(), staged->size()); });
  } else {
    submit(s, [dst, src, n]() { memcpy(dst, src, n); });
  }
  if (sync || (!dst_dev && !dpin)) drain(s);  // a pageable destination is written before the call returns
  return after_wait();
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t st) {
  LOCK;
  STICKY;
  return copy(dst, src, n, kind, stream_of(st), false);
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
  LOCK;
  STICKY;
  drain_device(cur_device);
  return copy(dst, src, n, kind, stream_of(0), true);
}

cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t st) {
  LOCK;
  STICKY;
  if (n == 0) return cudaSuccess;
  bool pin = false;
  if (side(p, n, true, &pin) != cudaSuccess) return ret(cudaErrorInvalidValue);
  submit(stream_of(st), [p, v, n]() { memset(p, v, n); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void *p, int v, size_t n) {
  LOCK;
  cudaError_t e = cudaMemsetAsync(p, v, n, 0);
  if (e == cudaSuccess) drain_device(cur_device);
  return e != cudaSuccess ? e : after_wait();
}

}  // extern "C"
