// AWQ's searches on the GPU (package awq documents the algorithm; the
// quantize driver runs them through cuda.Calibrator):
//
//   - awq_quant writes a candidate's weights Q(W·diag(s))·diag(s)⁻¹ in
//     fp16, with the grid arithmetic of pack.Grid (AWQ's MinMax variant
//     and the GPTQ-style one) done in the same float32 operations, so a
//     candidate's codes are the CPU's;
//   - col_abs_sum and sq_diff_sum are the reductions the scale search
//     reads (x̄ = mean |x| per channel; Σ (y − y₀)²), written as per-slice
//     partial sums in fp64 that the caller adds in a fixed order, so the
//     result does not depend on scheduling;
//   - awq_clip is the clip search. For one group g of one output row o,
//     the reference scores a shrink by Σ_t (x_t·(q − w))² over the sampled
//     rows x_t; with G = Σ_t x_t·x_tᵀ (the Gram matrix of the group's
//     inputs, a diagonal block of their Hessian) that is (q − w)ᵀ G (q − w),
//     so each candidate costs one batched GEMM over the groups, D·G, and a
//     row-wise dot product, instead of a GEMM over the sampled rows.
#include <math.h>
#include <algorithm>
#include <cuda_fp16.h>
#include "common.cuh"
#include "grid.cuh"

namespace llmq {
namespace {

constexpr int kColSplits = LLMQ_COL_SPLITS;
constexpr int kSqParts = LLMQ_SQ_PARTS;

__global__ void f32_to_f16_kernel(const float* __restrict__ src, __half* __restrict__ dst, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dst[i] = __float2half_rn(src[i]);
}

// Grid parameters, as pack.Grid.ParamsRange computes them in float32.
struct GridParams {
  float scale;
  float zero;
};

__device__ GridParams grid_params(float xmin, float xmax, int maxq, int sym, int minmax) {
  const float fq = (float)maxq;
  GridParams p;
  if (minmax && !sym) {  // AWQ's own grid: the group's range, the scale not rounded
    p.scale = __fmul_rn(fmaxf(__fsub_rn(xmax, xmin), 1e-5f), __fdiv_rn(1.f, fq));
    float z = -rintf(__fdiv_rn(xmin, p.scale));
    p.zero = fminf(fmaxf(z, 0.f), fq);
    return p;
  }
  int z;
  fit(xmin, xmax, maxq, sym, &p.scale, &z);
  p.zero = (float)z;
  return p;
}

// fake_quant is Dequantize(Quantize(x)) on the grid p.
__device__ __forceinline__ float fake_quant(float x, GridParams p, int maxq) {
  float q = rintf(__fdiv_rn(x, p.scale)) + p.zero;
  q = fminf(fmaxf(q, 0.f), (float)maxq);
  return __fmul_rn(p.scale, q - p.zero);
}

__device__ __forceinline__ float warp_min(float v) {
  for (int o = 16; o; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// WarpTask is the (row o, group g) of W [out][in] a warp takes in the
// kernels that run one warp per group: G groups a row, the group's first
// element at base.
struct WarpTask {
  int G, o, g, lane;
  size_t base;
};

__device__ __forceinline__ bool warp_task(int out, int in, int group, WarpTask* t) {
  t->G = in / group;
  const long long task = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (task >= (long long)out * t->G) return false;
  t->lane = threadIdx.x & 31;
  t->o = (int)(task / t->G);
  t->g = (int)(task % t->G);
  t->base = (size_t)t->o * in + (size_t)t->g * group;
  return true;
}

// One warp per (row o, group g): Wq = Q(W·s)/s over the group.
__global__ void awq_quant_kernel(const float* __restrict__ W, const float* __restrict__ s, __half* __restrict__ Wq, int out,
                                 int in, int group, int maxq, int sym, int minmax) {
  WarpTask wt;
  if (!warp_task(out, in, group, &wt)) return;
  const int lane = wt.lane, g = wt.g;
  const size_t base = wt.base;
  float lo = INFINITY, hi = -INFINITY;
  for (int i = lane; i < group; i += 32) {
    const int col = g * group + i;
    const float v = s ? __fmul_rn(W[base + i], s[col]) : W[base + i];
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  const GridParams p = grid_params(warp_min(lo), warp_max(hi), maxq, sym, minmax);
  for (int i = lane; i < group; i += 32) {
    const int col = g * group + i;
    float v = s ? __fmul_rn(W[base + i], s[col]) : W[base + i];
    v = fake_quant(v, p, maxq);
    if (s) v = __fdiv_rn(v, s[col]);
    Wq[base + i] = __float2half_rn(v);
  }
}

// part[y][c] += Σ |X[r][c]| over the rows r of slice y.
__global__ void col_abs_sum_kernel(const __half* __restrict__ X, double* __restrict__ part, int rows, int d) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= d) return;
  const int y = blockIdx.y;
  const int per = (rows + kColSplits - 1) / kColSplits;
  const int r0 = y * per, r1 = min(rows, r0 + per);
  double acc = 0;
  for (int r = r0; r < r1; r++) acc += fabs((double)__half2float(X[(size_t)r * d + c]));
  part[(size_t)y * d + c] += acc;
}

// part[b] += Σ (a − b)² over block b's elements (a fixed stride pattern).
__global__ void sq_diff_sum_kernel(const __half* __restrict__ a, const __half* __restrict__ b, double* __restrict__ part,
                                   size_t n) {
  double acc = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const double d = (double)__half2float(a[i]) - (double)__half2float(b[i]);
    acc += d * d;
  }
  __shared__ double red[32];
  acc = warp_sum(acc);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0;
    acc = warp_sum(acc);
    if (threadIdx.x == 0) part[blockIdx.x] += acc;
  }
}

// shrink is the clip search's k-th factor, as package awq computes it.
__device__ __forceinline__ float shrink(int k, int n_shrink) {
  return __fsub_rn(1.f, __fdiv_rn((float)k, (float)(2 * n_shrink)));
}

// group_absmax is max |w| over the warp's group.
__device__ __forceinline__ float group_absmax(const float* __restrict__ w, int group, int lane) {
  float m = 0;
  for (int i = lane; i < group; i += 32) m = fmaxf(m, fabsf(w[i]));
  return warp_max(m);
}

// One warp per (o, g): D = (Q(clip(w, ±max|w|·f)) − w)/s for candidate k.
__global__ void clip_candidate_kernel(const float* __restrict__ W, const float* __restrict__ s, float* __restrict__ D, int out,
                                      int in, int group, int maxq, int sym, int minmax, int k, int n_shrink) {
  WarpTask wt;
  if (!warp_task(out, in, group, &wt)) return;
  const int lane = wt.lane, g = wt.g;
  const size_t base = wt.base;
  const float m = __fmul_rn(group_absmax(W + base, group, lane), shrink(k, n_shrink));
  float lo = INFINITY, hi = -INFINITY;
  for (int i = lane; i < group; i += 32) {
    const float v = fminf(fmaxf(W[base + i], -m), m);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  const GridParams p = grid_params(warp_min(lo), warp_max(hi), maxq, sym, minmax);
  for (int i = lane; i < group; i += 32) {
    const float w = W[base + i];
    float d = __fsub_rn(fake_quant(fminf(fmaxf(w, -m), m), p, maxq), w);
    if (s) d = __fdiv_rn(d, s[g * group + i]);
    D[base + i] = d;
  }
}

// One warp per (o, g): e = Σ P·D over the group (P = D·G); keep the best
// shrink (the first of equals, as the CPU search).
__global__ void clip_score_kernel(const float* __restrict__ D, const float* __restrict__ P, double* __restrict__ best_err,
                                  float* __restrict__ best_max, int out, int in, int group, int k) {
  WarpTask wt;
  if (!warp_task(out, in, group, &wt)) return;
  const int G = wt.G, lane = wt.lane, o = wt.o, g = wt.g;
  const size_t base = wt.base;
  double e = 0;
  for (int i = lane; i < group; i += 32) e += (double)P[base + i] * (double)D[base + i];
  e = warp_sum(e);
  if (lane) return;
  const size_t t = (size_t)o * G + g;
  if (k == 0) {  // nothing chosen yet: a group whose every score is NaN keeps max|w|
    best_err[t] = INFINITY;
    best_max[t] = -1.f;
  }
  if (e < best_err[t]) {
    best_err[t] = e;
    best_max[t] = (float)k;  // the shrink index; turned into a threshold after the last candidate
  }
}

// Turns each group's chosen shrink index into its threshold max|w|·f.
__global__ void clip_threshold_kernel(const float* __restrict__ W, float* __restrict__ best_max, int out, int in, int group,
                                      int n_shrink) {
  WarpTask wt;
  if (!warp_task(out, in, group, &wt)) return;
  const int G = wt.G, lane = wt.lane, o = wt.o, g = wt.g;
  const float mx = group_absmax(W + (size_t)o * in + (size_t)g * group, group, lane);
  if (lane) return;
  const size_t t = (size_t)o * G + g;
  const float k = best_max[t];
  best_max[t] = k < 0 ? mx : __fmul_rn(mx, shrink((int)k, n_shrink));
}

unsigned warp_blocks(long long tasks) { return (unsigned)((tasks + 7) / 8); }

int check_grid(llmq_ctx* c, const char* who, int out, int in, int group, int bits) {
  if (bits < 2 || bits > 8 || group <= 0 || in % group || out <= 0) {
    set_error(c, "%s: bits %d, group %d for a %d×%d layer", who, bits, group, out, in);
    return 1;
  }
  return 0;
}

}  // namespace

int f32_to_f16(llmq_ctx* c, const float* src, void* dst, size_t n) {
  if (!n) return 0;
  const unsigned blocks = (unsigned)std::min<size_t>((n + 255) / 256, 65535);
  f32_to_f16_kernel<<<blocks, 256, 0, c->stream>>>(src, (__half*)dst, n);
  CK_LAUNCH("f32_to_f16_kernel");
  return 0;
}

int memcpy_2d(llmq_ctx* c, void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) {
  if (!height) return 0;
  CK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice, c->stream));
  return 0;
}

int col_abs_sum(llmq_ctx* c, const void* X, double* part, int rows, int d) {
  if (rows <= 0) return 0;
  dim3 grid((d + 255) / 256, kColSplits);
  col_abs_sum_kernel<<<grid, 256, 0, c->stream>>>((const __half*)X, part, rows, d);
  CK_LAUNCH("col_abs_sum_kernel");
  return 0;
}

int sq_diff_sum(llmq_ctx* c, const void* a, const void* b, double* part, size_t n) {
  if (!n) return 0;
  sq_diff_sum_kernel<<<kSqParts, 256, 0, c->stream>>>((const __half*)a, (const __half*)b, part, n);
  CK_LAUNCH("sq_diff_sum_kernel");
  return 0;
}

int awq_quant(llmq_ctx* c, const float* W, const float* s, void* Wq, int out, int in, int group, int bits, int sym, int minmax) {
  if (check_grid(c, "awq_quant", out, in, group, bits)) return 1;
  awq_quant_kernel<<<warp_blocks((long long)out * (in / group)), 256, 0, c->stream>>>(W, s, (__half*)Wq, out, in, group,
                                                                                     (1 << bits) - 1, sym, minmax);
  CK_LAUNCH("awq_quant_kernel");
  return 0;
}

int awq_clip(llmq_ctx* c, const float* W, const float* s, const float* H, float* D, float* P, double* best_err, float* best_max,
             int out, int in, int group, int bits, int sym, int minmax, int n_shrink) {
  if (check_grid(c, "awq_clip", out, in, group, bits)) return 1;
  if (n_shrink <= 0) {
    set_error(c, "awq_clip: %d shrink candidates", n_shrink);
    return 1;
  }
  const int G = in / group;
  const unsigned blocks = warp_blocks((long long)out * G);
  for (int k = 0; k < n_shrink; k++) {
    clip_candidate_kernel<<<blocks, 256, 0, c->stream>>>(W, s, D, out, in, group, (1 << bits) - 1, sym, minmax, k, n_shrink);
    CK_LAUNCH("clip_candidate_kernel");
    // Row-major D, P [out][in] are column-major Dᶜ, Pᶜ [in][out]; group
    // g's block is Pᶜ_g [group][out] = G_g·Dᶜ_g with G_g the g-th diagonal
    // block of H (symmetric, leading dimension in). TF32 tensor cores:
    // their 2⁻¹¹ input rounding is that of the fp16 activations G is made
    // of, and fp32 FMA (the first version) took most of a block's time on
    // an 8B model.
    const float one = 1.f, zero = 0.f;
    cublasStatus_t st = cublasGemmStridedBatchedEx(
        c->cublas, CUBLAS_OP_N, CUBLAS_OP_N, group, out, group, &one, H, CUDA_R_32F, in, (long long)group * in + group, D,
        CUDA_R_32F, in, group, &zero, P, CUDA_R_32F, in, group, G, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
      set_error(c, "cublasGemmStridedBatchedEx (awq_clip) failed: status %d (out=%d in=%d group=%d)", (int)st, out, in, group);
      return 1;
    }
    clip_score_kernel<<<blocks, 256, 0, c->stream>>>(D, P, best_err, best_max, out, in, group, k);
    CK_LAUNCH("clip_score_kernel");
  }
  clip_threshold_kernel<<<blocks, 256, 0, c->stream>>>(W, best_max, out, in, group, n_shrink);
  CK_LAUNCH("clip_threshold_kernel");
  return 0;
}

}  // namespace llmq
