// Host cost of kernel launches, stream capture and graph replay for a chain of small kernels.
// Run on a GPU machine (no Rust needed): nvcc -O2 -arch=sm_90 -o /tmp/lc benches/cuda/launch_cost.cu && /tmp/lc
// Results (an H200, 2026-11-28) in BENCHMARKS.md, "Current comparison (GPU)", and in
// benches/results/gpu-h200-2026-11-28-launches.txt.
#include <cstdio>
#include <chrono>
#include <vector>
#include <cuda_runtime.h>
using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }

__global__ void small(long n, float* a, float* b, float* c, float* d, float* e, float* f, const unsigned* idx, long rows) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) { float x = a[i] * b[i % 150] + c[i]; d[i] = tanhf(x); e[i] = x * 0.5f; if (idx) f[i] = (float)idx[i % rows]; }
}

int main() {
  const int N = 100, REPS = 300;
  float *buf; unsigned *idx;
  cudaMalloc(&buf, 64 << 20); cudaMalloc(&idx, 1 << 20); cudaMemset(buf, 0, 64 << 20); cudaMemset(idx, 0, 1 << 20);
  float *a = buf, *b = buf + 100000, *c = buf + 200000, *d = buf + 300000, *e = buf + 400000, *f = buf + 500000;
  for (int w = 0; w < 2; w++) {
    for (cudaStream_t s : {(cudaStream_t)0}) {
      double issue = 0, total = 0;
      for (int r = 0; r < REPS; r++) {
        auto t0 = clk::now();
        for (int k = 0; k < N; k++) small<<<2, 256, 0, s>>>(450, a, b, c, d, e, f, idx, 10);
        auto t1 = clk::now();
        cudaStreamSynchronize(s);
        auto t2 = clk::now();
        issue += us(t0, t1); total += us(t0, t2);
      }
      if (w) printf("direct legacy stream: issue %.2f us/launch, chain of %d done in %.1f us (%.2f us/kernel)\n", issue / REPS / N, N, total / REPS, total / REPS / N);
    }
  }
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  {
    double issue = 0, total = 0;
    for (int r = 0; r < REPS; r++) {
      auto t0 = clk::now();
      for (int k = 0; k < N; k++) small<<<2, 256, 0, s>>>(450, a, b, c, d, e, f, idx, 10);
      auto t1 = clk::now(); cudaStreamSynchronize(s); auto t2 = clk::now();
      issue += us(t0, t1); total += us(t0, t2);
    }
    printf("direct own stream: issue %.2f us/launch, chain done in %.1f us\n", issue / REPS / N, total / REPS);
  }
  // capture + instantiate + launch each time (a new schedule every step)
  cudaGraphExec_t prev = nullptr;
  double cap = 0, inst = 0, upd = 0, lau = 0, tot = 0; int updated = 0;
  for (int r = 0; r < REPS; r++) {
    auto t0 = clk::now();
    cudaGraph_t g;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    for (int k = 0; k < N; k++) small<<<2, 256, 0, s>>>(450 + (r % 3), a + r % 7, b, c, d, e, f, idx, 10);
    cudaStreamEndCapture(s, &g);
    auto t1 = clk::now();
    cudaGraphExec_t ex = nullptr;
    bool ok = false;
    if (prev) {
      cudaGraphExecUpdateResultInfo info;
      ok = cudaGraphExecUpdate(prev, g, &info) == cudaSuccess;
      if (ok) { ex = prev; updated++; }
    }
    auto t2 = clk::now();
    if (!ok) { if (prev) cudaGraphExecDestroy(prev); cudaGraphInstantiate(&ex, g, 0); }
    auto t3 = clk::now();
    cudaGraphLaunch(ex, s);
    auto t4 = clk::now();
    cudaStreamSynchronize(s);
    auto t5 = clk::now();
    cudaGraphDestroy(g);
    prev = ex;
    cap += us(t0, t1); upd += us(t1, t2); inst += us(t2, t3); lau += us(t3, t4); tot += us(t0, t5);
  }
  printf("capture %.1f us, exec update %.1f us (%d of %d updated), instantiate %.1f us, graph launch %.1f us, whole %.1f us per chain of %d\n",
         cap / REPS, upd / REPS, updated, REPS, inst / REPS, lau / REPS, tot / REPS, N);
  // replay of one instantiated graph
  {
    cudaGraph_t g; cudaGraphExec_t ex;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    for (int k = 0; k < N; k++) small<<<2, 256, 0, s>>>(450, a, b, c, d, e, f, idx, 10);
    cudaStreamEndCapture(s, &g);
    cudaGraphInstantiate(&ex, g, 0);
    double l = 0, t = 0;
    for (int r = 0; r < REPS; r++) {
      auto t0 = clk::now(); cudaGraphLaunch(ex, s); auto t1 = clk::now(); cudaStreamSynchronize(s); auto t2 = clk::now();
      l += us(t0, t1); t += us(t0, t2);
    }
    printf("replay: launch %.1f us, chain done in %.1f us (%.2f us/kernel)\n", l / REPS, t / REPS, t / REPS / N);
    // the same graph launched on the legacy stream
    double t2s = 0;
    for (int r = 0; r < REPS; r++) { auto t0 = clk::now(); cudaGraphLaunch(ex, 0); cudaStreamSynchronize(0); t2s += us(t0, clk::now()); }
    printf("replay on the legacy stream: %.1f us\n", t2s / REPS);
  }
  // small async copy cost (pageable and pinned)
  {
    std::vector<unsigned> host(512); unsigned* pinned; cudaMallocHost(&pinned, 4096);
    double pg = 0, pn = 0, rd = 0;
    for (int r = 0; r < REPS; r++) {
      auto t0 = clk::now(); cudaMemcpyAsync(idx, host.data(), 2048, cudaMemcpyHostToDevice, 0); auto t1 = clk::now();
      cudaMemcpyAsync(idx, pinned, 2048, cudaMemcpyHostToDevice, 0); auto t2 = clk::now();
      float out[8]; cudaMemcpy(out, buf, 32, cudaMemcpyDeviceToHost); auto t3 = clk::now();
      pg += us(t0, t1); pn += us(t1, t2); rd += us(t2, t3);
    }
    printf("2 KB upload: pageable %.1f us, pinned %.1f us; 32 B read after it %.1f us\n", pg / REPS, pn / REPS, rd / REPS);
  }
  printf("error: %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
