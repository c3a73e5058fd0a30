// Does cuGraphExecUpdate accept a captured chain whose kernel nodes call other functions (other
// parameter lists, grid sizes) than the graph it was instantiated from? And what does it cost?
// Run on a GPU machine: nvcc -O2 -arch=sm_90 -o /tmp/up benches/cuda/graph_update.cu && /tmp/up
// Chains of one kernel, of three with other parameter lists, of those and memsets (kinds 4);
// each of one length (90) or of lengths 60-99 (an instance kept per length). Results in
// BENCHMARKS.md (see launch_cost.cu).
#include <cstdio>
#include <chrono>
#include <cstdlib>
#include <cuda_runtime.h>
using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }
__global__ void k1(long n, float* a, float* b) { long i = blockIdx.x * (long)blockDim.x + threadIdx.x; if (i < n) b[i] = a[i] + 1; }
__global__ void k2(long n, float* a, float* b, float* c, long m) { long i = blockIdx.x * (long)blockDim.x + threadIdx.x; if (i < n) c[i] = a[i] * b[i % m]; }
__global__ void k3(long n, float* a, const unsigned* idx, float s, int q, float* out) { long i = blockIdx.x * (long)blockDim.x + threadIdx.x; if (i < n) out[i] = a[idx[i % 7]] * s + q; }
int main() {
  float* buf; unsigned* idx; cudaMalloc(&buf, 1 << 24); cudaMalloc(&idx, 4096); cudaMemset(idx, 0, 4096); cudaMemset(buf, 0, 1 << 24);
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  srand(1);
  for (int kinds : {1, 3, 4}) for (int same_len = 1; same_len >= 0; same_len--) {
    cudaGraphExec_t execs[64] = {0};
    int ok = 0, fail = 0, fresh = 0; double tu = 0, ti = 0, tc = 0, tl = 0; const int REPS = 400;
    for (int r = 0; r < REPS; r++) {
      int n = same_len ? 90 : 60 + rand() % 40;
      auto t0 = clk::now();
      cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);
      for (int k = 0; k < n; k++) {
        int which = kinds == 1 ? 0 : rand() % kinds; int rows = 1 + rand() % 600;
        if (which == 0) k1<<<(rows + 255) / 256, 256, 0, s>>>(rows, buf, buf + 100000);
        else if (which == 1) k2<<<(rows + 255) / 256, 256, 0, s>>>(rows, buf, buf + 200000, buf + 300000, 150);
        else if (which == 2) k3<<<(rows + 255) / 256, 256, 0, s>>>(rows, buf, idx, 0.5f, 3, buf + 400000);
        else cudaMemsetAsync(buf + 500000, 0, 4 * rows, s);
      }
      cudaGraph_t g; cudaStreamEndCapture(s, &g);
      auto t1 = clk::now();
      cudaGraphExec_t& ex = execs[n % 64];
      bool updated = false;
      if (ex) {
        cudaGraphExecUpdateResultInfo info;
        cudaError_t e = cudaGraphExecUpdate(ex, g, &info);
        updated = e == cudaSuccess;
        if (!updated) { fail++; cudaGetLastError(); if (fail < 4) printf("update refused: %s, result %d\n", cudaGetErrorString(e), (int)info.result); cudaGraphExecDestroy(ex); ex = 0; }
        else ok++;
      }
      auto t2 = clk::now();
      if (!ex) { cudaGraphInstantiate(&ex, g, 0); fresh++; }
      auto t3 = clk::now();
      cudaGraphLaunch(ex, s);
      auto t4 = clk::now();
      cudaStreamSynchronize(s);
      cudaGraphDestroy(g);
      tc += us(t0, t1); tu += us(t1, t2); ti += us(t2, t3); tl += us(t3, t4);
    }
    printf("%d kinds, %s: updated %d, refused %d, instantiated %d; capture %.1f us, update %.1f us, instantiate %.1f us (per fresh %.1f), launch %.1f us per graph\n",
           kinds, same_len ? "length 90" : "lengths 60-99", ok, fail, fresh, tc / REPS, tu / REPS, ti / REPS, ti / (fresh ? fresh : 1), tl / REPS);
  }
  printf("error: %s\n", cudaGetErrorString(cudaGetLastError()));
}
