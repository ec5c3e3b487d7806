// GPTQ on the GPU: the Hessian of a layer's calibration inputs, the
// damped inverse Cholesky factor of it, and the blocked column updates.
// Package gptq (the CPU path) documents the algorithm; this file does the
// same arithmetic, with these differences in how it is computed:
//
//   - H accumulates Xᵀ·X from fp16 activations in fp32 (cuBLAS GemmEx);
//   - the factor U of H⁻¹ = UᵀU is found without forming H⁻¹: with J the
//     reversal permutation, J·H·J = L·Lᵀ (Cholesky, fp64) gives
//     H = R·Rᵀ with R = J·L·J upper triangular, so H⁻¹ = R⁻ᵀ·R⁻¹ and
//     U = R⁻¹ = J·L⁻¹·J (one triangular solve), the same unique factor the
//     CPU path gets from cholesky(inverse(H));
//   - one warp quantizes one row: its lanes hold the 128 columns of the
//     current block in registers, and each column's error reaches the
//     block's later columns through a broadcast.
#include <cusolverDn.h>
#include <math.h>
#include "common.cuh"
#include "grid.cuh"

namespace llmq {
namespace {

// cusolver returns the context's cuSOLVER handle, made on first use.
int cusolver(llmq_ctx* c, cusolverDnHandle_t* out) {
  if (!c->cusolver) {
    cusolverDnHandle_t h;
    if (cusolverDnCreate(&h) != CUSOLVER_STATUS_SUCCESS) {
      set_error(c, "cusolverDnCreate failed");
      return 1;
    }
    c->cusolver = h;
    if (cusolverDnSetStream(h, c->stream) != CUSOLVER_STATUS_SUCCESS) {
      set_error(c, "cusolverDnSetStream failed");
      return 1;
    }
  }
  *out = (cusolverDnHandle_t)c->cusolver;
  return 0;
}

__global__ void diag_kernel(const float* __restrict__ H, float* __restrict__ d, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) d[i] = H[(size_t)i * n + i];
}

// factor_input writes A = J·P·(s·Hsum)·Pᵀ·J + λI in fp64, dead inputs
// (a zero diagonal) given 1 before damping, as package gptq does.
__global__ void factor_input(const float* __restrict__ Hsum, const int32_t* __restrict__ perm, double* __restrict__ A, int n,
                             double s, double lambda) {
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (size_t)n * n) return;
  const int i = (int)(idx / n), j = (int)(idx % n);
  const int pi = perm[n - 1 - i], pj = perm[n - 1 - j];
  double v = s * (double)Hsum[(size_t)pi * n + pj];
  if (i == j) {
    if (v == 0) v = 1;
    v += lambda;
  }
  A[idx] = v;
}

__global__ void identity_kernel(double* __restrict__ B, int n) {
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (size_t)n * n) return;
  B[idx] = (idx / n == idx % n) ? 1.0 : 0.0;
}

// factor_output writes U(i,j) = Linv(n−1−i, n−1−j) (Linv column-major)
// as row-major fp32 with zeros below the diagonal, and counts values that
// are not finite.
__global__ void factor_output(const double* __restrict__ Linv, float* __restrict__ U, int n, int* bad) {
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (size_t)n * n) return;
  const int i = (int)(idx / n), j = (int)(idx % n);
  float v = 0.f;
  if (j >= i) {
    const int r = n - 1 - i, col = n - 1 - j;  // r ≥ col: the lower triangle
    const double d = Linv[(size_t)col * n + r];
    v = (float)d;
    if (!isfinite(d) || !isfinite(v)) atomicAdd(bad, 1);
  }
  U[idx] = v;
}

constexpr int kBlock = 128;  // columns per lazy-update block
constexpr int kPerLane = kBlock / 32;

// gptq_block_kernel quantizes columns [i1, i2) of rows warp-by-warp: W is
// [out][in] in Perm order (columns ≥ i1 updated by the earlier blocks),
// Hinv the upper factor [in][in]. For each column j the row's group
// parameters are fitted (fit_groups) when j starts a group, on the
// current weights of the group, or read from scale/zero [G][out] via
// group_of; then q = clamp(round(w/scale)+zero), err = (w − dq)/Hinv_jj
// goes to Err1 [out][kBlock], and the block's later columns take
// −err·Hinv[j][k]. With from_start, a group starting inside the block is
// fitted on the block's weights as they were when the block began
// (gptq.Options.GroupsFromBlockStart).
__global__ void gptq_block_kernel(const float* __restrict__ W, const float* __restrict__ Hinv, uint8_t* __restrict__ Q,
                                  float* __restrict__ scale, uint8_t* __restrict__ zero, const int32_t* __restrict__ group_of,
                                  float* __restrict__ Err1, double* __restrict__ loss, int out, int in, int i1, int i2,
                                  int group, int maxq, int sym, int fit_groups, int from_start) {
  const int lane = threadIdx.x & 31;
  const int o = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (o >= out) return;
  const float* Wrow = W + (size_t)o * in;
  float w[kPerLane], w0[kPerLane];  // the block's columns: current, and as the block began
#pragma unroll
  for (int r = 0; r < kPerLane; r++) {
    const int k = i1 + r * 32 + lane;
    w[r] = w0[r] = k < i2 ? Wrow[k] : 0.f;
  }
  double lsum = 0;
  float s = 0.f;
  int z = 0;
#pragma unroll
  for (int r = 0; r < kPerLane; r++) {
    for (int l = 0; l < 32; l++) {
      const int j = i1 + r * 32 + l;
      if (j >= i2) break;  // uniform across the warp
      const int g = group_of[j];
      if (fit_groups && j % group == 0) {
        float lo = INFINITY, hi = -INFINITY;
#pragma unroll
        for (int r2 = 0; r2 < kPerLane; r2++) {
          const int k = i1 + r2 * 32 + lane;
          if (k >= j && k < j + group && k < i2) {
            const float v = from_start && j > i1 ? w0[r2] : w[r2];
            lo = fminf(lo, v);
            hi = fmaxf(hi, v);
          }
        }
        for (int k = i2 + lane; k < j + group; k += 32) {  // a group running past the block
          const float v = Wrow[k];
          lo = fminf(lo, v);
          hi = fmaxf(hi, v);
        }
        for (int m = 16; m > 0; m >>= 1) {
          lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, m));
          hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, m));
        }
        fit(lo, hi, maxq, sym, &s, &z);
        if (lane == 0) {
          scale[(size_t)g * out + o] = s;
          zero[(size_t)g * out + o] = (uint8_t)z;
        }
      } else if (!fit_groups || j == i1) {
        s = scale[(size_t)g * out + o];
        z = zero[(size_t)g * out + o];
      }
      const float wj = __shfl_sync(0xffffffffu, w[r], l);
      const float qf = fminf(fmaxf(rintf(__fdiv_rn(wj, s)) + (float)z, 0.f), (float)maxq);
      const float diff = wj - s * (qf - (float)z);
      const float d = Hinv[(size_t)j * in + j];
      const float err = __fdiv_rn(diff, d);
      if (lane == 0) {
        Q[(size_t)o * in + j] = (uint8_t)qf;
        Err1[(size_t)o * kBlock + (j - i1)] = err;
        lsum += (double)diff * (double)diff / (2.0 * (double)d * (double)d);
      }
      const float* hrow = Hinv + (size_t)j * in;
#pragma unroll
      for (int r2 = 0; r2 < kPerLane; r2++) {
        const int k = i1 + r2 * 32 + lane;
        if (k > j && k < i2) w[r2] = __fmaf_rn(-err, hrow[k], w[r2]);
      }
    }
  }
  if (lane == 0) loss[o] += lsum;
}

}  // namespace

int hessian_add(llmq_ctx* c, const void* X, float* H, int rows, int n) {
  const float alpha = 1.f, beta = 1.f;
  // Row-major X [rows][n] is column-major Xᶜ [n][rows]; H = Xᶜ·Xᶜᵀ is
  // symmetric, so its layout does not matter.
  cublasStatus_t s = cublasGemmEx(c->cublas, CUBLAS_OP_N, CUBLAS_OP_T, n, n, rows, &alpha, X, CUDA_R_16F, n, X, CUDA_R_16F, n,
                                  &beta, H, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) {
    set_error(c, "cublasGemmEx (hessian_add) failed: status %d (rows=%d n=%d)", (int)s, rows, n);
    return 1;
  }
  return 0;
}

int hessian_diag(llmq_ctx* c, const float* H, float* d, int n) {
  diag_kernel<<<(n + 255) / 256, 256, 0, c->stream>>>(H, d, n);
  CK_LAUNCH("diag_kernel");
  return 0;
}

size_t gptq_factor_workspace_bytes(int n) { return 2 * (size_t)n * n * sizeof(double) + 64; }

int gptq_factor(llmq_ctx* c, const float* Hsum, double s, const int32_t* perm, double lambda, float* U, void* workspace,
                int n, int* ok) {
  *ok = 0;
  cusolverDnHandle_t h;
  if (cusolver(c, &h)) return 1;
  double* A = (double*)workspace;
  double* B = A + (size_t)n * n;
  int* dinfo = (int*)(B + (size_t)n * n);
  const size_t nn = (size_t)n * n;
  const unsigned blocks = (unsigned)((nn + 255) / 256);
  factor_input<<<blocks, 256, 0, c->stream>>>(Hsum, perm, A, n, s, lambda);
  CK_LAUNCH("factor_input");
  int lwork = 0;
  if (cusolverDnDpotrf_bufferSize(h, CUBLAS_FILL_MODE_LOWER, n, A, n, &lwork) != CUSOLVER_STATUS_SUCCESS) {
    set_error(c, "cusolverDnDpotrf_bufferSize failed (n=%d)", n);
    return 1;
  }
  const size_t need = (size_t)lwork * sizeof(double);
  if (need > c->solver_ws_bytes) {
    if (c->solver_ws) {
      c->live_bytes -= c->solver_ws_bytes;
      c->allocs.erase(c->solver_ws);
      CK(cudaFree(c->solver_ws));
      c->solver_ws = nullptr;
      c->solver_ws_bytes = 0;
    }
    void* p = nullptr;
    CK(cudaMalloc(&p, need));
    c->allocs[p] = need;
    c->live_bytes += need;
    if (c->live_bytes > c->peak_bytes) c->peak_bytes = c->live_bytes;
    c->solver_ws = p;
    c->solver_ws_bytes = need;
  }
  if (cusolverDnDpotrf(h, CUBLAS_FILL_MODE_LOWER, n, A, n, (double*)c->solver_ws, lwork, dinfo) != CUSOLVER_STATUS_SUCCESS) {
    set_error(c, "cusolverDnDpotrf failed (n=%d)", n);
    return 1;
  }
  int info = 0;
  CK(cudaMemcpyAsync(&info, dinfo, sizeof info, cudaMemcpyDeviceToHost, c->stream));
  CK(cudaStreamSynchronize(c->stream));
  if (info != 0) return 0;  // not positive definite: the caller damps more
  identity_kernel<<<blocks, 256, 0, c->stream>>>(B, n);
  CK_LAUNCH("identity_kernel");
  const double one = 1.0;
  if (cublasDtrsm(c->cublas, CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, CUBLAS_DIAG_NON_UNIT, n, n, &one, A, n, B, n) !=
      CUBLAS_STATUS_SUCCESS) {
    set_error(c, "cublasDtrsm failed (n=%d)", n);
    return 1;
  }
  CK(cudaMemsetAsync(dinfo, 0, sizeof(int), c->stream));
  factor_output<<<blocks, 256, 0, c->stream>>>(B, U, n, dinfo);
  CK_LAUNCH("factor_output");
  int bad = 0;
  CK(cudaMemcpyAsync(&bad, dinfo, sizeof bad, cudaMemcpyDeviceToHost, c->stream));
  CK(cudaStreamSynchronize(c->stream));
  *ok = bad == 0;
  return 0;
}

int gptq_quantize(llmq_ctx* c, float* W, const float* Hinv, uint8_t* Q, float* scale, uint8_t* zero, const int32_t* group_of,
                  float* err1, double* loss, int out, int in, int group, int bits, int sym, int fit_groups,
                  int from_start) {
  if (bits < 2 || bits > 8 || group <= 0 || in % group) {
    set_error(c, "gptq_quantize: bits %d, group %d for %d inputs", bits, group, in);
    return 1;
  }
  CK(cudaMemsetAsync(loss, 0, (size_t)out * sizeof(double), c->stream));
  const int warps = 8;
  const unsigned grid = (unsigned)((out + warps - 1) / warps);
  for (int i1 = 0; i1 < in; i1 += kBlock) {
    const int i2 = i1 + kBlock < in ? i1 + kBlock : in;
    gptq_block_kernel<<<grid, warps * 32, 0, c->stream>>>(W, Hinv, Q, scale, zero, group_of, err1, loss, out, in, i1, i2, group,
                                                         (1 << bits) - 1, sym, fit_groups,
                                                         from_start);
    CK_LAUNCH("gptq_block_kernel");
    if (i2 < in) {
      // Row-major W[:, i2:] −= Err1[out][nb]·Hinv[i1:i2, i2:] is, column-major,
      // Wᶜ[i2:, :] −= Hinvᶜ[i2:, i1:i2]·Err1ᶜ.
      const float alpha = -1.f, beta = 1.f;
      cublasStatus_t s = cublasGemmEx(c->cublas, CUBLAS_OP_N, CUBLAS_OP_N, in - i2, out, i2 - i1, &alpha, Hinv + (size_t)i1 * in + i2,
                                      CUDA_R_32F, in, err1, CUDA_R_32F, kBlock, &beta, W + i2, CUDA_R_32F, in,
                                      CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT);
      if (s != CUBLAS_STATUS_SUCCESS) {
        set_error(c, "cublasGemmEx (gptq lazy update) failed: status %d", (int)s);
        return 1;
      }
    }
  }
  return 0;
}

void destroy_cusolver(llmq_ctx* c) {
  if (c->cusolver) cusolverDnDestroy((cusolverDnHandle_t)c->cusolver);
  c->cusolver = nullptr;
}

}  // namespace llmq
