// The transformer's non-GEMM kernels for the GPU backend (package cuda's
// Model): embedding gather, RMSNorm fused with the residual add, rotary
// embeddings, the key/value cache, attention, SwiGLU, and the negative
// log-likelihood that perplexity needs, so logits never leave the GPU.
//
// The residual stream x is fp32; everything a GEMM reads or writes is
// fp16, with fp32 arithmetic inside every kernel.
//
// Rows of a forward pass can belong to different sequences (a batch of
// requests, some in prefill, some decoding). Each row t carries its
// sequence row_seq[t] and position row_pos[t] in device memory, so a
// captured CUDA graph replays a decode step for new positions after a copy
// of these arrays. Sequence s's cache is one fp16 buffer at kv_base[s]
// holding [2][layers][kv_cap[s]][kv_dim]: keys, then values.
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <math.h>
#include "common.cuh"

namespace llmq {
int cublas(cublasHandle_t* h);
}

namespace {

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// block_sum / block_max reduce over a block of up to 1024 threads; red is
// 32 floats of shared memory. Every thread gets the result.
__device__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[w] = v;
  __syncthreads();
  v = lane < nw ? red[lane] : 0.f;
  return warp_sum(v);
}
__device__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[w] = v;
  __syncthreads();
  v = lane < nw ? red[lane] : -INFINITY;
  return warp_max(v);
}

__global__ void embed_kernel(const int32_t* __restrict__ ids, const half* __restrict__ E, float* __restrict__ x, int H) {
  const half* e = E + (size_t)ids[blockIdx.x] * H;
  float* o = x + (size_t)blockIdx.x * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = __half2float(e[i]);
}

// rmsnorm_kernel: one block per output row. Without rows: x += delta (if
// any), out = RMSNorm(x)·w. With rows: out row i = RMSNorm(x[rows[i]])·w.
__global__ void rmsnorm_kernel(float* __restrict__ x, const half* __restrict__ delta, const int32_t* __restrict__ rows,
                               const float* __restrict__ w, half* __restrict__ out, int H, float eps) {
  __shared__ float red[32];
  const int r = rows ? rows[blockIdx.x] : blockIdx.x;
  float* xr = x + (size_t)r * H;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float v = xr[i];
    if (delta) {
      v += __half2float(delta[(size_t)r * H + i]);
      xr[i] = v;
    }
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, red) / H + eps);
  half* o = out + (size_t)blockIdx.x * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = __float2half(xr[i] * inv * w[i]);
}

// add_kernel: x += delta over n values (the last block's residual).
__global__ void add_kernel(float* __restrict__ x, const half* __restrict__ delta, size_t n) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += __half2float(delta[i]);
}

__global__ void bias_kernel(half* __restrict__ y, const half* __restrict__ b, int N, size_t n) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2half(__half2float(y[i]) + __half2float(b[i % N]));
}

// rope_kernel rotates the two halves of every head of row blockIdx.x by
// the angles pos·inv_freq (computed as float32 products, then cos/sin in
// double, as the CPU backend does).
__global__ void rope_kernel(half* __restrict__ x, const int32_t* __restrict__ pos, const float* __restrict__ inv_freq,
                            int heads, int hd) {
  const int half_d = hd / 2;
  const float p = (float)pos[blockIdx.x];
  half* row = x + (size_t)blockIdx.x * heads * hd;
  for (int i = threadIdx.x; i < heads * half_d; i += blockDim.x) {
    const int h = i / half_d, j = i % half_d;
    double s, c;
    sincos((double)(p * inv_freq[j]), &s, &c);
    half* v = row + h * hd;
    const float a = __half2float(v[j]), b = __half2float(v[j + half_d]);
    v[j] = __float2half(a * (float)c - b * (float)s);
    v[j + half_d] = __float2half(b * (float)c + a * (float)s);
  }
}

__device__ __forceinline__ half* cache_row(const uint64_t* kv_base, const int32_t* kv_cap, int s, int kind, int layer,
                                           int layers, int pos, int kv_dim) {
  const size_t cap = kv_cap[s];
  return (half*)kv_base[s] + (((size_t)kind * layers + layer) * cap + pos) * kv_dim;
}

__global__ void kv_store_kernel(const half* __restrict__ k, const half* __restrict__ v, const int32_t* __restrict__ row_seq,
                                const int32_t* __restrict__ row_pos, const uint64_t* __restrict__ kv_base,
                                const int32_t* __restrict__ kv_cap, int layer, int layers, int kv_dim) {
  const int t = blockIdx.x, s = row_seq[t], p = row_pos[t];
  half* kc = cache_row(kv_base, kv_cap, s, 0, layer, layers, p, kv_dim);
  half* vc = cache_row(kv_base, kv_cap, s, 1, layer, layers, p, kv_dim);
  for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
    kc[i] = k[(size_t)t * kv_dim + i];
    vc[i] = v[(size_t)t * kv_dim + i];
  }
}

// attention_kernel: one block of 128 threads per (row, head). The row's
// query attends to keys 0..row_pos (causal) of its sequence's cache:
// scores in shared memory (one warp per key, lanes over the head
// dimension), softmax, then each thread accumulates output dimensions.
__global__ void attention_kernel(const half* __restrict__ q, half* __restrict__ out, const int32_t* __restrict__ row_seq,
                                 const int32_t* __restrict__ row_pos, const uint64_t* __restrict__ kv_base,
                                 const int32_t* __restrict__ kv_cap, int layer, int layers, int heads, int kv_heads,
                                 int hd, float scale) {
  extern __shared__ float smem[];  // [hd] query, then [n] scores
  __shared__ float red[32];
  const int t = blockIdx.x, h = blockIdx.y, s = row_seq[t], n = row_pos[t] + 1;
  const int kvh = h / (heads / kv_heads), kv_dim = kv_heads * hd;
  float* qs = smem;
  float* sc = smem + hd;
  const half* qr = q + ((size_t)t * heads + h) * hd;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = __half2float(qr[i]) * scale;
  __syncthreads();
  const half* K = cache_row(kv_base, kv_cap, s, 0, layer, layers, 0, kv_dim) + kvh * hd;
  const half* V = cache_row(kv_base, kv_cap, s, 1, layer, layers, 0, kv_dim) + kvh * hd;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float mx = -INFINITY;
  for (int j = warp; j < n; j += nwarps) {
    const half2* kr = (const half2*)(K + (size_t)j * kv_dim);
    float d = 0.f;
    for (int i = lane; i < hd / 2; i += 32) {
      const float2 kv = __half22float2(kr[i]);
      d += qs[2 * i] * kv.x + qs[2 * i + 1] * kv.y;
    }
    d = warp_sum(d);
    if (lane == 0) sc[j] = d;
    mx = fmaxf(mx, d);
  }
  mx = block_max(mx, red);  // lanes hold their warp's max; the block's is the max of those
  float sum = 0.f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float e = __expf(sc[j] - mx);
    sc[j] = e;
    sum += e;
  }
  sum = block_sum(sum, red);  // ends with a barrier after sc is written
  const float inv = 1.f / sum;
  half* o = out + ((size_t)t * heads + h) * hd;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < n; j++) acc += sc[j] * __half2float(V[(size_t)j * kv_dim + i]);
    o[i] = __float2half(acc * inv);
  }
}

__global__ void silu_mul_kernel(half* __restrict__ g, const half* __restrict__ u, size_t n) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float a = __half2float(g[i]);
  g[i] = __float2half(a / (1.f + __expf(-a)) * __half2float(u[i]));
}

// nll_kernel: one block per row: −log softmax(logits)[target].
__global__ void nll_kernel(const float* __restrict__ logits, const int32_t* __restrict__ targets, float* __restrict__ nll,
                           int V) {
  __shared__ float red[32];
  const float* l = logits + (size_t)blockIdx.x * V;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, l[i]);
  mx = block_max(mx, red);
  float s = 0.f;
  for (int i = threadIdx.x; i < V; i += blockDim.x) s += expf(l[i] - mx);
  s = block_sum(s, red);
  if (threadIdx.x == 0) nll[blockIdx.x] = logf(s) + mx - l[targets[blockIdx.x]];
}

inline unsigned blocks(size_t n, int per) { return (unsigned)((n + per - 1) / per); }

}  // namespace

extern "C" {

int llmq_embed(const int32_t* ids, const void* E, float* x, int T, int H) {
  embed_kernel<<<T, 256, 0, llmq::stream()>>>(ids, (const half*)E, x, H);
  CK_LAUNCH("embed_kernel");
  return 0;
}

int llmq_rmsnorm(float* x, const void* delta, const int32_t* rows, const float* w, void* out, int n, int H, float eps) {
  rmsnorm_kernel<<<n, 256, 0, llmq::stream()>>>(x, (const half*)delta, rows, w, (half*)out, H, eps);
  CK_LAUNCH("rmsnorm_kernel");
  return 0;
}

int llmq_add(float* x, const void* delta, size_t n) {
  add_kernel<<<blocks(n, 256), 256, 0, llmq::stream()>>>(x, (const half*)delta, n);
  CK_LAUNCH("add_kernel");
  return 0;
}

int llmq_add_bias(void* y, const void* b, int T, int N) {
  const size_t n = (size_t)T * N;
  bias_kernel<<<blocks(n, 256), 256, 0, llmq::stream()>>>((half*)y, (const half*)b, N, n);
  CK_LAUNCH("bias_kernel");
  return 0;
}

int llmq_rope(void* x, const int32_t* pos, const float* inv_freq, int T, int heads, int hd) {
  rope_kernel<<<T, 128, 0, llmq::stream()>>>((half*)x, pos, inv_freq, heads, hd);
  CK_LAUNCH("rope_kernel");
  return 0;
}

int llmq_kv_store(const void* k, const void* v, const int32_t* row_seq, const int32_t* row_pos, const uint64_t* kv_base,
                  const int32_t* kv_cap, int layer, int layers, int T, int kv_dim) {
  kv_store_kernel<<<T, 128, 0, llmq::stream()>>>((const half*)k, (const half*)v, row_seq, row_pos, kv_base, kv_cap, layer,
                                                 layers, kv_dim);
  CK_LAUNCH("kv_store_kernel");
  return 0;
}

int llmq_attention(const void* q, void* out, const int32_t* row_seq, const int32_t* row_pos, const uint64_t* kv_base,
                   const int32_t* kv_cap, int layer, int layers, int T, int heads, int kv_heads, int hd, int max_keys) {
  if (heads % kv_heads || hd % 2 || hd > 1024) {
    llmq::set_error("attention: heads %d must be a multiple of kv_heads %d and head_dim %d even and ≤ 1024", heads, kv_heads, hd);
    return 1;
  }
  const size_t smem = (size_t)(hd + max_keys) * sizeof(float);
  static size_t raised = 48 << 10;
  if (smem > raised) {
    CK(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    raised = smem;
  }
  attention_kernel<<<dim3(T, heads), 128, smem, llmq::stream()>>>((const half*)q, (half*)out, row_seq, row_pos, kv_base,
                                                                    kv_cap, layer, layers, heads, kv_heads, hd,
                                                                    1.f / sqrtf((float)hd));
  CK_LAUNCH("attention_kernel");
  return 0;
}

int llmq_silu_mul(void* g, const void* u, size_t n) {
  silu_mul_kernel<<<blocks(n, 256), 256, 0, llmq::stream()>>>((half*)g, (const half*)u, n);
  CK_LAUNCH("silu_mul_kernel");
  return 0;
}

int llmq_nll(const float* logits, const int32_t* targets, float* nll, int T, int V) {
  nll_kernel<<<T, 1024, 0, llmq::stream()>>>(logits, targets, nll, V);
  CK_LAUNCH("nll_kernel");
  return 0;
}

// C[M,N] = A[M,K]·W[N,K]ᵀ with W in PyTorch's [out][in] layout, fp32
// accumulation; C is fp16, or fp32 when c_fp32 (logits).
int llmq_gemm_nt(const void* A, const void* W, void* C, int M, int N, int K, int c_fp32) {
  cublasHandle_t h;
  if (llmq::cublas(&h)) return 1;
  const float alpha = 1.f, beta = 0.f;
  // Row-major C = A·Wᵀ is column-major Cᵀ = W·Aᵀ, W being column-major [K][N]ᵀ.
  cublasStatus_t s = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, W, CUDA_R_16F, K, A, CUDA_R_16F, K, &beta,
                                  C, c_fp32 ? CUDA_R_32F : CUDA_R_16F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) {
    llmq::set_error("cublasGemmEx (gemm_nt) failed: status %d (M=%d N=%d K=%d)", (int)s, M, N, K);
    return 1;
  }
  return 0;
}

}  // extern "C"
