// The CUDA emulator's own checks (host/cuemu): that it runs kernels as CUDA would, and that it catches the
// mistakes it is there to catch: a missing __syncthreads, a stream that reads another's output without an
// event, a host that reads a result before waiting, an access outside an allocation, a barrier some threads
// never reach. Built through the same rewrite as the backend's .cu files; exit status 1 on any failure.
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

static int failures = 0, checks = 0;
#define CHECK(cond, ...)                    \
  do {                                      \
    checks++;                               \
    if (!(cond)) {                          \
      failures++;                           \
      printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      printf(__VA_ARGS__);                  \
      printf("\n");                         \
    }                                       \
  } while (0)

// Reverses each block's 256 values through shared memory, with or without the barrier between the
// writes and the reads.
template <bool SYNC> __global__ void reverse_block(const int *in, int *out) {
  __shared__ int sh[256];
  const int i = blockIdx.x * 256 + threadIdx.x;
  sh[threadIdx.x] = in[i];
  if (SYNC) __syncthreads();
  out[i] = sh[255 - threadIdx.x];
}

// A block sum by warp shuffles, then one partial per warp through shared memory.
__global__ void block_sum(const float *in, float *out, int n) {
  __shared__ float part[32];
  float v = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) v += in[i];
  for (int d = 16; d > 0; d /= 2) v += __shfl_down_sync(0xffffffffu, v, d);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0;
    for (unsigned w = 0; w < blockDim.x / 32; w++) s += part[w];
    *out = s;
  }
}

__global__ void fill(int *p, int n, int v) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v;
}

__global__ void copy_k(const int *a, int *b, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) b[i] = a[i];
}

__global__ void write_past(int *p, int n) { p[n] = 1; }  // n ints end at the guard page

// Half the warp waits at __syncthreads, the other half at a shuffle that needs the first half: stuck for good.
__global__ void half_barrier(int *p) {
  int v = (int)threadIdx.x;
  if (threadIdx.x < 16) __syncthreads();
  else v = __shfl_down_sync(0xffffffffu, v, 1);
  p[threadIdx.x] = v;
}

int main() {
  setenv("CUEMU_DEVICES", "2", 0);  // two devices, for check 8 (read at the first CUDA call)
  const int B = 4, N = B * 256;
  int *din, *dout;
  CHECK(cudaMalloc((void **)&din, N * sizeof(int)) == cudaSuccess, "cudaMalloc");
  CHECK(cudaMalloc((void **)&dout, N * sizeof(int)) == cudaSuccess, "cudaMalloc");
  std::vector<int> h(N), r(N);
  for (int i = 0; i < N; i++) h[i] = i * 7 + 1;
  cudaMemcpy(din, h.data(), N * sizeof(int), cudaMemcpyHostToDevice);

  // 1. With the barrier: right in every thread order. Without: wrong in at least one of the orders the
  //    emulator rotates through (forward, reverse, shuffled), as it would be on a GPU.
  bool all_ok = true, any_wrong = false;
  for (int round = 0; round < 3; round++) {
    reverse_block<true><<<B, 256>>>(din, dout);
    cudaMemcpy(r.data(), dout, N * sizeof(int), cudaMemcpyDeviceToHost);
    for (int i = 0; i < N; i++) all_ok &= r[i] == h[(i / 256) * 256 + 255 - i % 256];
    reverse_block<false><<<B, 256>>>(din, dout);
    cudaMemcpy(r.data(), dout, N * sizeof(int), cudaMemcpyDeviceToHost);
    for (int i = 0; i < N; i++) any_wrong |= r[i] != h[(i / 256) * 256 + 255 - i % 256];
  }
  CHECK(all_ok, "reverse with __syncthreads gave a wrong value");
  CHECK(any_wrong, "reverse without __syncthreads was right in every thread order: the race went unseen");

  // 2. Warp shuffles and a barrier: the exact sum of small integers.
  float *df, *ds, s = 0;
  std::vector<float> hf(1000);
  for (int i = 0; i < 1000; i++) hf[i] = (float)(i % 13);
  cudaMalloc((void **)&df, 1000 * sizeof(float));
  cudaMalloc((void **)&ds, sizeof(float));
  cudaMemcpy(df, hf.data(), 1000 * sizeof(float), cudaMemcpyHostToDevice);
  block_sum<<<1, 256>>>(df, ds, 1000);
  cudaMemcpy(&s, ds, sizeof(float), cudaMemcpyDeviceToHost);
  float want = 0;
  for (float v : hf) want += v;
  CHECK(s == want, "block_sum %g, expected %g", s, want);

  // 3. Streams: b copies what a filled. Without an event the copy runs before the fill (stale), with one after.
  cudaStream_t a, b;
  cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
  cudaMemset(dout, 0, N * sizeof(int));
  fill<<<2, 128, 0, a>>>(din, N, 5);
  copy_k<<<2, 128, 0, b>>>(din, dout, N);
  cudaStreamSynchronize(b);
  cudaMemcpy(r.data(), dout, N * sizeof(int), cudaMemcpyDeviceToHost);
  CHECK(r[0] != 5, "stream b saw stream a's fill without an event");
  cudaEvent_t e;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  fill<<<2, 128, 0, a>>>(din, N, 9);
  cudaEventRecord(e, a);
  cudaStreamWaitEvent(b, e, 0);
  copy_k<<<2, 128, 0, b>>>(din, dout, N);
  cudaStreamSynchronize(b);
  cudaMemcpy(r.data(), dout, N * sizeof(int), cudaMemcpyDeviceToHost);
  CHECK(r[0] == 9 && r[N - 1] == 9, "stream b did not see the fill it waited for (%d)", r[0]);

  // 4. A copy into pinned memory is there only after the host waits.
  int *pin;
  cudaHostAlloc((void **)&pin, N * sizeof(int), 0);
  memset(pin, 0, N * sizeof(int));
  cudaMemcpyAsync(pin, dout, N * sizeof(int), cudaMemcpyDeviceToHost, a);
  CHECK(pin[0] == 0, "an asynchronous copy into pinned memory landed before the host waited");
  CHECK(cudaStreamQuery(a) == cudaErrorNotReady, "a stream with queued work answered ready");
  cudaStreamSynchronize(a);
  CHECK(pin[0] == 9, "the copy had not landed after cudaStreamSynchronize (%d)", pin[0]);

  // 5. Copies outside an allocation are refused.
  CHECK(cudaMemcpy(r.data(), dout, (N + 1) * sizeof(int), cudaMemcpyDeviceToHost) == cudaErrorInvalidValue,
        "a copy past the end of an allocation was accepted");
  cudaGetLastError();

  // 6. The host reading device memory dies at that read, with a message naming the allocation (a child does it).
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    volatile int x = dout[3];  // device memory, read on the host: the bug the emulator exists to catch
    (void)x;
    _exit(0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV, "the host read device memory and was not stopped (status %d)", st);

  // 7. Faults in device code, each in a child: a write past the end of an allocation, and a barrier that half
  //    the threads never reach. Both are reported and stick, as on a GPU.
  for (int k = 0; k < 2; k++) {
    fflush(stdout);
    pid = fork();
    if (pid == 0) {
      if (k == 0) write_past<<<1, 1>>>(dout, N);
      else half_barrier<<<1, 32>>>(dout);
      cudaError_t err = cudaDeviceSynchronize();
      cudaError_t want = k == 0 ? cudaErrorIllegalAddress : cudaErrorLaunchFailure;
      int sticks = cudaMalloc((void **)&din, 16) != cudaSuccess;
      _exit(err == want && sticks ? 0 : 1);
    }
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s was not reported as a sticky %s (status %d)",
          k == 0 ? "a write past an allocation" : "a barrier half the block never reaches",
          k == 0 ? "cudaErrorIllegalAddress" : "cudaErrorLaunchFailure", st);
  }
  // 8. A kernel on cuda:0 writing memory of cuda:1 (no peer access) faults too.
  fflush(stdout);
  pid = fork();
  if (pid == 0) {
    int *other = NULL;
    cudaSetDevice(1);
    cudaMalloc((void **)&other, N * sizeof(int));
    cudaSetDevice(0);
    fill<<<1, 32>>>(other, N, 1);
    _exit(cudaDeviceSynchronize() == cudaErrorIllegalAddress ? 0 : 1);
  }
  waitpid(pid, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "a kernel on cuda:0 wrote cuda:1's memory unnoticed (status %d)", st);
  printf("(the messages above were expected)\n");
  printf("cuemu selftest: %d checks, %d failures\n", checks, failures);
  return failures ? 1 : 0;
}
