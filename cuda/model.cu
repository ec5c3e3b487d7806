// The transformer's non-GEMM kernels for the GPU backend (package cuda's
// Model): embedding gather, RMSNorm fused with the residual add, rotary
// embeddings, the key/value cache, attention (split over chunks of keys), SwiGLU, and the negative
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
// holding [2][layers][kv_cap[s]][kv_dim] (keys, then values), or, when
// kv_cap[s] < 0, blocks of 16 positions through a block table (cache_row).
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <algorithm>
#include <limits.h>
#include <math.h>
#include "common.cuh"
#include "moe.cuh"
#include "stream.cuh"

namespace {

constexpr int kMaxNormHidden = 16384;  // rmsnorm_kernel's widest row (llmq.h)

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

__global__ void embed_kernel(const int32_t* __restrict__ ids, const half* __restrict__ E, float* __restrict__ x, int H,
                             float scale) {
  pdl_gate();  // before any global access: see common.cuh
  const half* e = E + (size_t)ids[blockIdx.x] * H;
  float* o = x + (size_t)blockIdx.x * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = __half2float(e[i]) * scale;
}

// rmsnorm_kernel: one block per output row. Without rows: x += delta (if
// any; Gemma 3's sandwich norms: x += RMSNorm(delta)·dw when dw is given),
// out = RMSNorm(x)·w. With rows: out row i = RMSNorm(x[rows[i]])·w.
//
// With y, the delta is a mixture's output: row t's Σ_j weight[t][j] ·
// y[t·k + j] over its k experts (y fp32 [T·k][H], ids and weights [T][k])
// added in ascending expert order, the CPU's order of additions, in fp32;
// the kernel zeroes the rows of y it read (the expert GEMVs accumulate into
// them). This is the mixture's combine, joined to the norm that follows it.
//
// A row is held in registers, V chunks of 4 values a thread (float4 of x
// and w, 4 halves of delta or a float4 of sums), so every load of the row is issued before the
// first reduction and x is read once: at batch 1 the kernel is one block,
// and a strided scalar loop paid a dependent round trip per 256 values
// (6.7 µs for 4096 of them, decode-ops-h200.txt). H is a multiple of 4, at
// most 16384 (V ≤ 4: at 1024 threads a thread has 64 registers). MAXT:
// the most threads the launch may have (launch_bounds); 512 for a
// mixture's combine on rows of at most 2,048 values, whose registers then
// hold eight experts' rows in flight at once.
//
// With both delta and y, x + delta comes first, then the experts' sum: the
// delta a ROUTER norm left pending (below) before the mixture that
// followed it, the CPU's order of additions.
//
// SUMS: the delta comes as sums (fp32 rows, not delta's fp16), what a
// GEMM with no outputs left in the workspace (w4a16_gemm's n_outs 0),
// added as the fp16 delta would be; each thread zeroes the values it read,
// unless ROUTER (whose CTAs share the row; the next norm zeroes them).
//
// early (a mixture's combine, under LLMQ_COMBINE_EARLY, on by default):
// the row's slots are ordered — its ids and weights read — before
// pdl_gate(). The routing wrote them a launch before the one just before
// this kernel (the expert down GEMV), and under PDL this kernel starts
// only once that launch has passed its own gate, so every kernel before
// it has finished (common.cuh): the ids are final, and only y, which the
// down GEMV is still writing, waits for the gate. One dependent round
// trip fewer after the gate. Not with LLMQ_MOE_FUSED_DOWN=1, where the
// down may run inside the routing launch itself (then the ids are final
// only at the gate): rmsnorm turns it off whenever the switch is set,
// fused or not.
//
// ROUTER (rmsnorm_router, a mixture's norm): x + delta is normed but not
// written back (the next norm adds the same delta, still in its buffer),
// so that the row's gridDim.y CTAs can each norm it from the same x;
// CTA y = 0 writes out, and every CTA keeps the normed row in shared
// memory (dynamic, H halves) for its router_warps() experts' logits, one
// a warp (router_dot, moe_router_kernel's arithmetic), their rows of W
// asked of L2 before the kernel waits on the one before (E = 0: the norm
// alone, one CTA). No y, rows or dw.
template <int V, bool ROUTER = false, int MAXT = 1024, bool SUMS = false>
__global__ void __launch_bounds__(MAXT) rmsnorm_kernel(float* __restrict__ x, const half* __restrict__ delta, const float* __restrict__ dw,
                               float* y, const int32_t* __restrict__ ids, const float* __restrict__ ew, int k,
                               const int32_t* __restrict__ rows, const float* __restrict__ w, half* __restrict__ out,
                               int H, float eps, const float* __restrict__ W, float* __restrict__ logits, int E,
                               float* __restrict__ sums, int early) {
  __shared__ int slot[kMaxTopK];
  __shared__ float wt[kMaxTopK];
  // order_slots puts row r's k slots in ascending expert order (slot,
  // wt): lane e of warp 0 reads slot e's expert and counts the slots that
  // go before it (a lower expert, or the same one at a lower slot) — its
  // place, at once for all k instead of one dependent read after another.
  auto order_slots = [&](int r) {
    if (threadIdx.x < 32) {
      const int e = threadIdx.x;
      const int id = e < k ? ids[r * k + e] : INT_MAX;
      int place = 0;
      for (int j = 0; j < k; j++) {
        const int other = __shfl_sync(0xffffffffu, id, j);
        place += other < id || (other == id && j < e);
      }
      if (e < k) slot[place] = r * k + e, wt[place] = ew[r * k + e];
    }
  };
  if constexpr (ROUTER) {  // this CTA's experts' rows of W on their way to L2 while the kernel before ends (weights: common.cuh)
    const int e = blockIdx.y * router_warps() + (threadIdx.x >> 5);
    if ((threadIdx.x & 31) == 0 && (threadIdx.x >> 5) < router_warps() && e < E) prefetch_l2(W + (size_t)e * H, H * 4);
  }
  if (early) order_slots(blockIdx.x);  // (no rows then)
  pdl_gate();  // before any global access but the router's weights and the early slots: see common.cuh
  __shared__ float red[32];
  extern __shared__ uint2 norm_h[];  // ROUTER: the normed row, 4 halves a word
  const int r = rows ? rows[blockIdx.x] : blockIdx.x;
  const int H4 = H >> 2;
  float4* xr = reinterpret_cast<float4*>(x + (size_t)r * H);
  const uint2* dr = delta && !SUMS ? reinterpret_cast<const uint2*>(delta + (size_t)r * H) : nullptr;
  float4* sr = SUMS ? reinterpret_cast<float4*>(sums) + (size_t)r * H4 : nullptr;
  float4 v[V], d[V];
#pragma unroll
  for (int j = 0; j < V; j++) {
    const int i = threadIdx.x + j * blockDim.x;
    v[j] = i < H4 ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    d[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (SUMS) {
      if (i < H4) {
        d[j] = sr[i];
        if constexpr (!ROUTER) sr[i] = make_float4(0.f, 0.f, 0.f, 0.f);  // this thread's own values: read, then zeroed
      }
    } else if (dr && i < H4) {
      const uint2 u = dr[i];
      const float2 a = __half22float2(*reinterpret_cast<const half2*>(&u.x));
      const float2 b = __half22float2(*reinterpret_cast<const half2*>(&u.y));
      d[j] = make_float4(a.x, a.y, b.x, b.y);
    }
  }
  if (y && (dr || SUMS)) {  // a pending delta (ROUTER) before the experts
#pragma unroll
    for (int j = 0; j < V; j++) {
      v[j] = make_float4(v[j].x + d[j].x, v[j].y + d[j].y, v[j].z + d[j].z, v[j].w + d[j].w);
      d[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  if (y) {
    if (!early) order_slots(r);
    __syncthreads();
    if constexpr (MAXT <= 512 && V == 1) {
      // kSlots slots' rows asked for at once, then added in order: the
      // rows were just written (the expert GEMVs' atomics, in L2), and at
      // 1,024 threads' 64 registers ptxas issues them about two at a time,
      // a round trip each (qwen3-30b-a3b's eight). At most 512 threads
      // (hidden ≤ 2,048) leave the registers for eight.
      constexpr int kSlots = 8;
      for (int e0 = 0; e0 < k; e0 += kSlots) {
        float4 u[kSlots];
        const int i = threadIdx.x;
#pragma unroll
        for (int s = 0; s < kSlots; s++) {
          const float4* ye = reinterpret_cast<const float4*>(y + (size_t)slot[min(e0 + s, k - 1)] * H);
          u[s] = e0 + s < k && i < H4 ? ye[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int s = 0; s < kSlots; s++)
          if (e0 + s < k)
            d[0] = make_float4(d[0].x + wt[e0 + s] * u[s].x, d[0].y + wt[e0 + s] * u[s].y,
                               d[0].z + wt[e0 + s] * u[s].z, d[0].w + wt[e0 + s] * u[s].w);
      }
    } else {
      for (int e = 0; e < k; e++) {
        const float4* ye = reinterpret_cast<const float4*>(y + (size_t)slot[e] * H);
#pragma unroll
        for (int j = 0; j < V; j++) {
          const int i = threadIdx.x + j * blockDim.x;
          if (i < H4) {
            const float4 u = ye[i];
            d[j] = make_float4(d[j].x + wt[e] * u.x, d[j].y + wt[e] * u.y, d[j].z + wt[e] * u.z, d[j].w + wt[e] * u.w);
          }
        }
      }
    }
    for (int e = 0; e < k; e++) {
      float4* ye = reinterpret_cast<float4*>(y + (size_t)slot[e] * H);
#pragma unroll
      for (int j = 0; j < V; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < H4) ye[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
  if (dr || y || SUMS) {
    if (dw) {  // the delta's own norm first: x += RMSNorm(delta)·dw
      float ds = 0.f;
#pragma unroll
      for (int j = 0; j < V; j++) ds += d[j].x * d[j].x + d[j].y * d[j].y + d[j].z * d[j].z + d[j].w * d[j].w;
      const float dinv = rsqrtf(block_sum(ds, red) / H + eps);
      const float4* dw4 = reinterpret_cast<const float4*>(dw);
#pragma unroll
      for (int j = 0; j < V; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < H4) {
          const float4 g = dw4[i];
          d[j] = make_float4(d[j].x * dinv * g.x, d[j].y * dinv * g.y, d[j].z * dinv * g.z, d[j].w * dinv * g.w);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < V; j++) {
      const int i = threadIdx.x + j * blockDim.x;
      v[j] = make_float4(v[j].x + d[j].x, v[j].y + d[j].y, v[j].z + d[j].z, v[j].w + d[j].w);
      if (!ROUTER && i < H4) xr[i] = v[j];
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < V; j++) ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
  const float inv = rsqrtf(block_sum(ss, red) / H + eps);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  uint2* o = reinterpret_cast<uint2*>(out + (size_t)blockIdx.x * H);
#pragma unroll
  for (int j = 0; j < V; j++) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < H4) {
      const float4 g = w4[i];
      const half2 a = __floats2half2_rn(v[j].x * inv * g.x, v[j].y * inv * g.y);
      const half2 b = __floats2half2_rn(v[j].z * inv * g.z, v[j].w * inv * g.w);
      uint2 u;
      u.x = *reinterpret_cast<const uint32_t*>(&a);
      u.y = *reinterpret_cast<const uint32_t*>(&b);
      if (!ROUTER || blockIdx.y == 0) o[i] = u;
      if constexpr (ROUTER) norm_h[i] = u;
    }
  }
  if constexpr (ROUTER) {
    if (E == 0) return;  // the norm alone (LLMQ_MOE_NORM_ROUTER=0: moe_router follows)
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, e = blockIdx.y * router_warps() + warp;
    if (warp < router_warps() && e < E) {
      const float acc = router_dot<true>(norm_h, reinterpret_cast<const float4*>(W + (size_t)e * H), H, lane);
      if (lane == 0) logits[(size_t)r * E + e] = acc;
    }
  }
}

// add_kernel: x += delta over n values (the last block's residual).
__global__ void add_kernel(float* __restrict__ x, const half* __restrict__ delta, size_t n) {
  pdl_gate();  // before any global access: see common.cuh
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += __half2float(delta[i]);
}

__global__ void bias_kernel(half* __restrict__ y, const half* __restrict__ b, int N, size_t n) {
  pdl_gate();  // before any global access: see common.cuh
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2half(__half2float(y[i]) + __half2float(b[i % N]));
}

// A sequence's key/value cache, in either layout:
// - contiguous (kv_cap[s] > 0, the capacity): one buffer at kv_base[s],
//   [2][layers][cap][kv_dim];
// - paged (kv_cap[s] < 0): kv_base[s] is the sequence's block table,
//   [pos / kPageTokens][layers] device addresses of blocks (llm.BlockTable),
//   each block [2][kPageTokens][kv_dim]: keys, then values.
constexpr int kPageTokens = 16;  // llm.DefaultBlockTokens

// cache_span is where the keys and values of positions p0 … p0+15 lie
// (p0 a multiple of kPageTokens): in either layout they are 16 rows of
// kv_dim one after another, keys from k, values from v, and a paged cache
// finds them with one read of its block table.
__device__ __forceinline__ void cache_span(const uint64_t* kv_base, const int32_t* kv_cap, int s, int layer, int layers,
                                           int p0, int kv_dim, half*& k, half*& v) {
  const int cap = kv_cap[s];
  if (cap < 0) {
    k = (half*)reinterpret_cast<const uint64_t*>(kv_base[s])[(size_t)(p0 / kPageTokens) * layers + layer];
    v = k + (size_t)kPageTokens * kv_dim;
  } else {
    k = (half*)kv_base[s] + ((size_t)layer * cap + p0) * kv_dim;
    v = k + (size_t)layers * cap * kv_dim;
  }
}

// cache_kv is the key and value rows of one position.
__device__ __forceinline__ void cache_kv(const uint64_t* kv_base, const int32_t* kv_cap, int s, int layer, int layers,
                                         int pos, int kv_dim, half*& k, half*& v) {
  const int r = pos % kPageTokens;
  cache_span(kv_base, kv_cap, s, layer, layers, pos - r, kv_dim, k, v);
  k += (size_t)r * kv_dim, v += (size_t)r * kv_dim;
}

// cache_row is the address of position pos's keys (kind 0) or values (1).
__device__ __forceinline__ half* cache_row(const uint64_t* kv_base, const int32_t* kv_cap, int s, int kind, int layer,
                                           int layers, int pos, int kv_dim) {
  half *k, *v;
  cache_kv(kv_base, kv_cap, s, layer, layers, pos, kv_dim, k, v);
  return kind ? v : k;
}

// qk_rope_store_kernel prepares q and k for attention, one warp per
// (row, head) of q (heads) and then k (kv_heads), in place: Qwen3's
// per-head RMSNorm when its weights are given (the sum of squares in
// lane-strided order, the result rounded to fp16 as a stored tensor
// would be), then RoPE on the head's two halves by the row's position,
// from tables cos/sin [positions][hd/2] made once on the host (float32
// angle products, cos/sin in double, as the CPU backend computes them).
// With kv_base, a k head's rotated values and the same head of v also
// go into the row's slot of its sequence's cache. One kernel for what
// were five launches a layer (two norms, two rotations, the store).
//
// SUMS: the joined q/k/v GEMM left its fp32 sums in sums [T][(heads +
// 2·kv_heads)·hd] (w4a16_gemm with no outputs: no K split's last CTA
// finished them), q's columns, then k's, then v's. Each warp first turns
// its head's sums (a k head's: the same head of v too) into fp16 q, k
// and v, rounding each sum once as finish_splits does (so, on the GEMV
// kernels, bit for bit what the GEMM would have written), and zeroes them (the workspace is kept
// zeroed between GEMMs); the rest runs on those values as without.
template <bool SUMS>
__global__ void qk_rope_store_kernel(half* __restrict__ q, half* __restrict__ k, half* __restrict__ v,
                                     float* __restrict__ sums, const float* __restrict__ qw,
                                     const float* __restrict__ kw, float eps, const int32_t* __restrict__ row_seq,
                                     const int32_t* __restrict__ row_pos, const uint64_t* __restrict__ kv_base,
                                     const int32_t* __restrict__ kv_cap, const float* __restrict__ cos_t,
                                     const float* __restrict__ sin_t, int layer, int layers, int heads, int kv_heads,
                                     int hd, int early) {
  // early (LLMQ_ATTN_EARLY, as attention_decode_kernel's): the row's
  // position and cache slot, and the lane's first cos and sin values, are
  // read before pdl_gate() — the kernel before this one (the q/k/v GEMM)
  // writes none of them, and every kernel before that has finished when
  // this one starts (attention_decode_kernel says why) — so only the
  // GEMM's outputs wait for the gate.
  if (!early) pdl_gate();  // otherwise before any global access: see common.cuh
  const int t = blockIdx.x, y = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (y >= heads + kv_heads) return;  // whole warps leave together: the shuffles below see all 32 lanes
  const bool is_q = y < heads;
  const int h = is_q ? y : y - heads;
  const int half_d = hd / 2, pos = row_pos[t], kv_dim = kv_heads * hd;
  const float* ct = cos_t + (size_t)pos * half_d;
  const float* st = sin_t + (size_t)pos * half_d;
  half *kc = nullptr, *vc = nullptr;
  if (!is_q && kv_base) {
    cache_kv(kv_base, kv_cap, row_seq[t], layer, layers, pos, kv_dim, kc, vc);
    kc += h * hd, vc += h * hd;
  }
  constexpr int kPre = 4;  // a lane's first rotation pairs (head dims up to 256) have their cos and sin here
  float cpre[kPre], spre[kPre];
#pragma unroll
  for (int i = 0; i < kPre; i++) {
    const int j = lane + 32 * i;
    cpre[i] = j < half_d ? ct[j] : 0.f, spre[i] = j < half_d ? st[j] : 0.f;
  }
  if (early) pdl_gate();
  half* r = is_q ? q + ((size_t)t * heads + h) * hd : k + ((size_t)t * kv_heads + h) * hd;
  if constexpr (SUMS) {
    float* row = sums + (size_t)t * (heads + 2 * kv_heads) * hd;
    float* src = row + (is_q ? h : heads + h) * hd;
    float* vsrc = row + (heads + kv_heads + h) * hd;
    half* vdst = v + ((size_t)t * kv_heads + h) * hd;
    for (int i = lane; i < hd; i += 32) {
      r[i] = __float2half_rn(src[i]);
      src[i] = 0.f;
      if (!is_q) {
        vdst[i] = __float2half_rn(vsrc[i]);
        vsrc[i] = 0.f;
      }
    }
    __syncwarp();  // the lanes below read what other lanes of the warp wrote
  }
  const float* w = is_q ? qw : kw;
  float inv = 1.f;
  if (w) {
    float ss = 0.f;
    for (int i = lane; i < hd; i += 32) {
      const float x = __half2float(r[i]);
      ss += x * x;
    }
    inv = rsqrtf(warp_sum(ss) / hd + eps);
  }
  const half* vr = kc ? v + (size_t)t * kv_dim + h * hd : nullptr;
  // rotate turns pair (j, j + hd/2) by the position's angle (its cos c and sin s).
  auto rotate = [&](int j, float c, float s) {
    float a = __half2float(r[j]), b = __half2float(r[j + half_d]);
    if (w) {
      a = __half2float(__float2half(a * inv * w[j]));
      b = __half2float(__float2half(b * inv * w[j + half_d]));
    }
    const half ra = __float2half(a * c - b * s), rb = __float2half(b * c + a * s);
    r[j] = ra;
    r[j + half_d] = rb;
    if (kc) {
      kc[j] = ra;
      kc[j + half_d] = rb;
      vc[j] = vr[j];
      vc[j + half_d] = vr[j + half_d];
    }
  };
#pragma unroll
  for (int i = 0; i < kPre; i++)
    if (lane + 32 * i < half_d) rotate(lane + 32 * i, cpre[i], spre[i]);
  for (int j = lane + 32 * kPre; j < half_d; j += 32) rotate(j, ct[j], st[j]);
}

// Attention runs in two kernels, as flash-decoding does (Dao et al. 2023):
// attention_kernel splits each (row, head)'s keys 0..row_pos into chunks
// of `chunk` keys (64 when decoding), one block of 128 threads per
// (row, head, chunk), and writes the chunk's running max m, sum
// l = Σ exp(s − m) and unnormalised output Σ exp(s − m)·v;
// attention_combine merges the chunks. Decoding (few rows, long contexts)
// gets many blocks per head this way; prefill uses one chunk per row.
// With a sliding window W (Mistral's, Gemma's sliding layers) a row sees
// only its last W keys. Decoding usually runs attention_decode_kernel
// below instead, which reads each key row once for a GQA group; this
// kernel decodes the head dims that one does not take.
//
// In a block, each warp scores keys (lanes over the head dimension, the
// query in shared memory), then each warp accumulates the output of its
// share of the keys with lane l owning dimensions l, l + 32, …, so a value
// row is read in coalesced loads for any even head_dim (Qwen3's test
// checkpoint has 48); the four warps' sums meet in shared memory. part
// holds, per (row, head, chunk), hd outputs then m and l.
constexpr int kMaxDimsPerLane = 8;  // head_dim ≤ 256
constexpr int kUnroll = 4;          // keys a warp loads at once
constexpr int kDecodeChunk = 64;    // keys per block when decoding

__global__ void attention_kernel(const half* __restrict__ q, float* __restrict__ part, const int32_t* __restrict__ row_seq,
                                 const int32_t* __restrict__ row_pos, const uint64_t* __restrict__ kv_base,
                                 const int32_t* __restrict__ kv_cap, int layer, int layers, int heads, int kv_heads,
                                 int hd, float scale, int chunk, int window) {
  pdl_gate();  // before any global access: see common.cuh
  extern __shared__ float smem[];  // [hd] query, [chunk] scores, [4][hd] warp outputs
  __shared__ float red[32];
  const int t = blockIdx.x, h = blockIdx.y, c = blockIdx.z, s = row_seq[t], n = row_pos[t] + 1;
  // A sliding window W sees keys n−W … n−1; chunks before it are empty.
  const int j0 = max(c * chunk, window > 0 ? n - window : 0), j1 = min(n, c * chunk + chunk);
  float* out = part + (((size_t)t * heads + h) * gridDim.z + c) * (hd + 2);
  if (j0 >= j1) {  // beyond this row's keys, or before its window: an empty chunk
    if (threadIdx.x == 0) out[hd] = -INFINITY, out[hd + 1] = 0.f;
    return;
  }
  const int kvh = h / (heads / kv_heads), kv_dim = kv_heads * hd;
  float* qs = smem;
  float* sc = smem + hd;
  float* wo = sc + chunk;
  const half* qr = q + ((size_t)t * heads + h) * hd;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = __half2float(qr[i]) * scale;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  // Scores, kUnroll keys per warp at a time so that their loads are in
  // flight together (a decode step is latency-bound, not bandwidth-bound).
  float mx = -INFINITY;
  for (int j = j0 + warp; j < j1; j += kUnroll * nwarps) {
    float d[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
      const int jj = j + u * nwarps;
      d[u] = 0.f;
      if (jj < j1) {
        const half2* kr = (const half2*)(cache_row(kv_base, kv_cap, s, 0, layer, layers, jj, kv_dim) + kvh * hd);
#pragma unroll
        for (int r = 0; r < kMaxDimsPerLane / 2; r++) {
          const int i = lane + 32 * r;
          if (i < hd / 2) {
            const float2 kv = __half22float2(kr[i]);
            d[u] += qs[2 * i] * kv.x + qs[2 * i + 1] * kv.y;
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
      const int jj = j + u * nwarps;
      const float v = warp_sum(d[u]);
      if (jj < j1) {
        if (lane == 0) sc[jj - j0] = v;
        mx = fmaxf(mx, v);
      }
    }
  }
  mx = block_max(mx, red);
  float sum = 0.f;
  for (int j = threadIdx.x; j < j1 - j0; j += blockDim.x) {
    const float e = __expf(sc[j] - mx);
    sc[j] = e;
    sum += e;
  }
  sum = block_sum(sum, red);  // its barriers publish sc
  // Lane l accumulates dimensions l, l + 32, …: loads of a warp stay
  // contiguous, and any head_dim up to 32·kMaxDimsPerLane works.
  float acc[kMaxDimsPerLane];
#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; i++) acc[i] = 0.f;
  for (int j = j0 + warp; j < j1; j += kUnroll * nwarps) {
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
      const int jj = j + u * nwarps;
      if (jj < j1) {
        const half* vr = cache_row(kv_base, kv_cap, s, 1, layer, layers, jj, kv_dim) + kvh * hd;
        const float p = sc[jj - j0];
#pragma unroll
        for (int i = 0; i < kMaxDimsPerLane; i++)
          if (lane + 32 * i < hd) acc[i] += p * __half2float(vr[lane + 32 * i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; i++)
    if (lane + 32 * i < hd) wo[warp * hd + lane + 32 * i] = acc[i];
  __syncthreads();
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    float o = 0.f;
    for (int w = 0; w < nwarps; w++) o += wo[w * hd + i];
    out[i] = o;
  }
  if (threadIdx.x == 0) out[hd] = mx, out[hd + 1] = sum;
}

// attention_decode_kernel is attention_kernel's decoding case built for
// memory-level parallelism: a decode step's attention reads the whole
// cache once and does little arithmetic on it, so its time is the latency
// of its loads unless many are in flight. A block takes `spans`
// sub-chunks of kDecodeChunk (64) keys in turn — its chunk, whose record
// attention_combine merges, is 64·spans keys — and a warp 16 keys of each
// (one page of a paged cache). Each half-warp owns one key at a time, a
// lane one or two 16-byte slices (VPL) of its keys' and values' rows,
// which it copies into shared memory with cp.async, all of a sub-chunk's
// at once: the keys in one group, the values in a second. The scores are
// computed while the values are still on the way, and the next
// sub-chunk's keys (values) are on the way while this one's values are
// used (the next scores computed): the memory sees a block's loads back
// to back, and the block's fixed costs — its row, query and page lookups,
// its record — are paid once for `spans` sub-chunks, which the block
// sizes from its row's length so that the work is about one wave (the
// grid itself is fixed by the launch's key bound, as a CUDA graph
// captures it). No register holds a load in
// flight, so more blocks fit on an SM; a lane reads back only its own
// copies, so the waits need no barrier. The GB query heads of a GQA
// group that share the key head stay in registers, scores are summed
// over the 16 lanes of a key (4 shuffles), each warp keeps its own
// online softmax state (max m, sum l, output, rescaled when m grows), and
// the warps meet once, in shared memory, to write the same (row, head,
// chunk) records as attention_kernel. head_dim a multiple of 8, at most
// 16·8·VPL.
constexpr int kDecodeWarps = 4;
constexpr int kSlots = kDecodeChunk / kDecodeWarps / 2;  // keys a lane loads a sub-chunk: 8
constexpr int kMaxSpans = 32;                            // sub-chunks a block (a lane looks up one's page)
static_assert(kMaxSpans <= 32, "lane j of a warp looks up sub-chunk j's page");
constexpr int kDecodeWaveBlocks = 4;                     // blocks an SM that attention() sizes the grid for

// spans_for is the sub-chunks a decode block takes: enough that `work`
// sub-chunks spread over about `wave` blocks, at least `floor`, at most
// kMaxSpans. The kernel sizes each row with it; attention() sizes the
// grid with it for rows of half the key bound.
__host__ __device__ __forceinline__ int spans_for(long work, int wave, int floor) {
  const long want = (work + wave - 1) / wave;
  return want >= kMaxSpans ? kMaxSpans : want > floor ? (int)want : floor;
}

// row_spans is the sub-chunks each block of a row takes, the row's keys
// lo … n − 1 spread over a grid of `rows` (row, head group)s: the decode
// kernel's chunk is kDecodeChunk of them, and attention_combine bounds
// the row's records with the same count.
__device__ __forceinline__ int row_spans(int n, int lo, long rows, int wave, int min_spans) {
  return spans_for(rows * ((n - lo + kDecodeChunk - 1) / kDecodeChunk), wave, min_spans);
}

__device__ __forceinline__ void unpack8(uint4 u, float* f) {
  const half2* h = reinterpret_cast<const half2*>(&u);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const float2 v = __half22float2(h[k]);
    f[2 * k] = v.x, f[2 * k + 1] = v.y;
  }
}

// fold_chunks folds chunk records c0, c0 + step, … < chunks of one
// head (p: its first record, hd + 2 floats each: outputs, m, l) into
// warp w's online softmax state — its max m, its sum l and its outputs
// (lane's dimensions lane + 32·i), rescaled when m grows — and leaves it
// in shared memory for meet_warps: wm[w], wl[w], wo[w·hd …]. A record's
// m, l and outputs are loaded together (through L2: they were written by
// other blocks), four records' at a time.
__device__ __forceinline__ void fold_chunks(const float* p, int c0, int step, int chunks, int hd, float* wm, float* wl,
                                            float* wo) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  float m = -INFINITY, l = 0.f, acc[kMaxDimsPerLane];
#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; i++) acc[i] = 0.f;
#pragma unroll 4
  for (int c = c0; c < chunks; c += step) {
    const float* pc = p + (size_t)c * (hd + 2);
    const float mc = __ldcg(pc + hd), lc = __ldcg(pc + hd + 1);
    float v[kMaxDimsPerLane];
#pragma unroll
    for (int i = 0; i < kMaxDimsPerLane; i++) v[i] = lane + 32 * i < hd ? __ldcg(pc + lane + 32 * i) : 0.f;
    if (lc > 0.f) {  // l = 0: an empty chunk (the same for the whole warp)
      const float mn = fmaxf(m, mc), r = __expf(m - mn), e = __expf(mc - mn);  // r = 0 for the warp's first
      l = l * r + e * lc;
#pragma unroll
      for (int i = 0; i < kMaxDimsPerLane; i++) acc[i] = acc[i] * r + e * v[i];
      m = mn;
    }
  }
  if (lane == 0) wm[w] = m, wl[w] = l;
#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; i++)
    if (lane + 32 * i < hd) wo[w * hd + lane + 32 * i] = acc[i];
}

// meet_warps is dimension i of a head's output from the states of its n
// warps in shared memory (wm, wl: a float each; wo: hd floats each):
// Σ_w e^{m_w − M}·o_w / Σ_w e^{m_w − M}·l_w, M = max_w m_w.
__device__ __forceinline__ float meet_warps(const float* wm, const float* wl, const float* wo, int n, int hd, int i) {
  float M = -INFINITY;
  for (int w = 0; w < n; w++) M = fmaxf(M, wm[w]);
  float L = 0.f, o = 0.f;
  for (int w = 0; w < n; w++)
    if (wl[w] > 0.f) {  // a warp without keys: m = −inf, l = 0
      const float e = __expf(wm[w] - M);
      L += e * wl[w], o += e * wo[w * hd + i];
    }
  return o / L;
}

template <int GB, int VPL>
__global__ void __launch_bounds__(32 * kDecodeWarps)
    attention_decode_kernel(const half* __restrict__ q, float* __restrict__ part, const int32_t* __restrict__ row_seq,
                            const int32_t* __restrict__ row_pos, const uint64_t* __restrict__ kv_base,
                            const int32_t* __restrict__ kv_cap, int layer, int layers, int heads, int kv_heads, int hd,
                            float scale, int window, int wave, int min_spans, int early) {
  // early (LLMQ_ATTN_EARLY, on by default): what the step fixed before
  // the kernel that runs just before this one (RoPE and the cache store)
  // — the rows' sequences and positions, the caches' block tables — is
  // read, and the first sub-chunk's key and value rows asked of L2,
  // before pdl_gate(); see the prefetch below. Otherwise the gate first,
  // as every kernel (common.cuh).
  if (!early) pdl_gate();
  // kSlots·VPL·2 uint4s a thread (its keys' and values' slices), then
  // [warps][GB] m, [warps][GB] l, [warps][GB][hd] outputs in the same bytes
  extern __shared__ uint4 decode_smem[];
  float* smem = reinterpret_cast<float*>(decode_smem);
  const int t = blockIdx.x, h0 = blockIdx.y * GB, c = blockIdx.z, s = row_seq[t], n = row_pos[t] + 1;
  // The row's sub-chunks a block: as many as would bring a grid of rows
  // like this one to about `wave` blocks, and at least min_spans, for
  // which the grid was sized (attention(): the launch's key bound, a CUDA
  // graph's, is up to twice the rows' lengths); the blocks past the row's
  // chunks only write empty records.
  const int lo = window > 0 ? max(0, n - window) : 0;
  const int spans = row_spans(n, lo, (long)gridDim.x * gridDim.y, wave, min_spans);
  const int chunk = kDecodeChunk * spans;
  const int j0 = max(c * chunk, lo), j1 = min(n, c * chunk + chunk);
  float* out = part + (((size_t)t * heads + h0) * gridDim.z + c) * (hd + 2);
  const size_t head_stride = (size_t)gridDim.z * (hd + 2);
  if (j0 >= j1) {  // beyond this row's keys, or before its window: an empty chunk
    if (early) pdl_gate();  // (no write before the gate)
    if (threadIdx.x < GB) out[threadIdx.x * head_stride + hd] = -INFINITY, out[threadIdx.x * head_stride + hd + 1] = 0.f;
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kg = lane >> 4, tl = lane & 15;  // the half-warp (key) and the lane in it
  const int kvh = h0 / (heads / kv_heads), kv_dim = kv_heads * hd;
  // The lane's slices of a row: 8 dimensions from 8·(tl + 16·i).
  bool on[VPL];
#pragma unroll
  for (int i = 0; i < VPL; i++) on[i] = 8 * (tl + 16 * i) < hd;
  const half* qr = q + ((size_t)t * heads + h0) * hd;  // the GB heads are consecutive
  // The warp's keys of sub-chunk j are pw + 64·j … +15, one cache span
  // (cache_span): lane j looks up sub-chunk j's, once, before any copy.
  static_assert(2 * kSlots == kPageTokens && kDecodeChunk % kPageTokens == 0, "a warp's keys are one cache span");
  const int pw = c * chunk + warp * 2 * kSlots;
  unsigned long long kj = 0, vj = 0;
  if (lane < spans) {
    const int p0 = pw + lane * kDecodeChunk;
    if (p0 < j1 && p0 + 2 * kSlots > j0) {
      half *K, *V;
      cache_span(kv_base, kv_cap, s, layer, layers, p0, kv_dim, K, V);
      kj = (unsigned long long)K, vj = (unsigned long long)V;  // the span's first row: lane-independent
    }
  }
  if (early) {
    // Under PDL this kernel starts once the one before it (RoPE and the
    // cache store) has passed its own gate, so every kernel before that
    // has finished: the rows, positions and block tables read above are
    // final. The store is still writing this step's key and value rows,
    // so sub-chunk 0's rows are only asked of L2 here (a hint: L2 is where
    // all SMs' reads and writes meet, so a row the store writes after the
    // prefetch is read new by the copies after the gate, never stale),
    // and the copies themselves wait for the gate.
    // A lane takes one row of the warp's 16 positions (lanes 0–15 the
    // keys, 16–31 the values): its head's hd values, one bulk request.
    const unsigned long long k0 = __shfl_sync(0xffffffffu, kj, 0), v0 = __shfl_sync(0xffffffffu, vj, 0);
    const int r = lane & 15, jj = pw + r;
    if (k0 != 0 && jj >= j0 && jj < j1)
      prefetch_l2(reinterpret_cast<const half*>(lane < 16 ? k0 : v0) + (size_t)r * kv_dim + kvh * hd, hd * 2);
    pdl_gate();
  }
  // issue copies sub-chunk j's keys (kv 0) or values (1) into the lane's
  // slots — slot k, slice i at stage[((k·VPL + i)·2 + kv)·T]: a warp's
  // lanes touch consecutive 16 bytes — as one cp.async group (empty past
  // the last sub-chunk); absent keys and slices are zero-filled. The whole
  // warp calls it (a shuffle hands out the page).
  constexpr int T = 32 * kDecodeWarps;
  uint4* stage = decode_smem + threadIdx.x;
  auto issue = [&](int kv, int j) {
    const unsigned long long base = __shfl_sync(0xffffffffu, kv ? vj : kj, j & 31);
    if (j < spans) {
      const half* B = reinterpret_cast<const half*>(base) + (size_t)kg * kv_dim + kvh * hd;  // this lane's key row
      const int p0 = pw + j * kDecodeChunk;
#pragma unroll
      for (int k = 0; k < kSlots; k++) {
        const int jj = p0 + 2 * k + kg;
#pragma unroll
        for (int i = 0; i < VPL; i++) {
          const bool ok = base != 0 && jj >= j0 && jj < j1 && on[i];
          cp_async16_zfill(stage + ((k * VPL + i) * 2 + kv) * T, ok ? B + (size_t)2 * k * kv_dim + 8 * (tl + 16 * i) : qr,
                           ok);
        }
      }
    }
    cp_async_commit();
  };
  issue(0, 0);
  issue(1, 0);
  float qf[GB][VPL][8];
#pragma unroll
  for (int g = 0; g < GB; g++)
#pragma unroll
    for (int i = 0; i < VPL; i++) {
      uint4 u = make_uint4(0, 0, 0, 0);
      if (on[i]) u = *reinterpret_cast<const uint4*>(qr + g * hd + 8 * (tl + 16 * i));
      unpack8(u, qf[g][i]);
#pragma unroll
      for (int e = 0; e < 8; e++) qf[g][i][e] *= scale;
    }
  // The warp's online softmax state over its keys (both half-warps share
  // m; l and the output are the lane's until the end).
  float m[GB], l[GB], acc[GB][VPL][8];
#pragma unroll
  for (int g = 0; g < GB; g++) {
    m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < VPL; i++)
#pragma unroll
      for (int e = 0; e < 8; e++) acc[g][i][e] = 0.f;
  }
  for (int j = 0; j < spans; j++) {
    bool act[kSlots];
#pragma unroll
    for (int k = 0; k < kSlots; k++) {
      const int jj = pw + j * kDecodeChunk + 2 * k + kg;
      act[k] = jj >= j0 && jj < j1;
    }
    cp_async_wait<1>();  // sub-chunk j's keys
    // Scores: each lane's partial dot product, summed over the half-warp.
    float sc[kSlots][GB];
#pragma unroll
    for (int k = 0; k < kSlots; k++) {
      float kf[VPL][8];
#pragma unroll
      for (int i = 0; i < VPL; i++) unpack8(stage[((k * VPL + i) * 2) * T], kf[i]);
#pragma unroll
      for (int g = 0; g < GB; g++) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < VPL; i++)
#pragma unroll
          for (int e = 0; e < 8; e++) d += qf[g][i][e] * kf[i][e];
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        sc[k][g] = d;
      }
    }
    asm volatile("" ::: "memory");  // the keys are read before their slots are refilled
    issue(0, j + 1);
    // The new max; what was summed so far is rescaled to it.
#pragma unroll
    for (int g = 0; g < GB; g++) {
      float mj = -INFINITY;
#pragma unroll
      for (int k = 0; k < kSlots; k++)
        if (act[k]) mj = fmaxf(mj, sc[k][g]);
      mj = fmaxf(m[g], fmaxf(mj, __shfl_xor_sync(0xffffffffu, mj, 16)));
      if (mj != -INFINITY) {  // the warp has seen a key
        const float r = __expf(m[g] - mj);  // 0 for the first
        l[g] *= r;
#pragma unroll
        for (int i = 0; i < VPL; i++)
#pragma unroll
          for (int e = 0; e < 8; e++) acc[g][i][e] *= r;
        m[g] = mj;
      }
    }
    cp_async_wait<1>();  // sub-chunk j's values
#pragma unroll
    for (int k = 0; k < kSlots; k++) {
      if (!act[k]) continue;
      float vf[VPL][8];
#pragma unroll
      for (int i = 0; i < VPL; i++) unpack8(stage[((k * VPL + i) * 2 + 1) * T], vf[i]);
#pragma unroll
      for (int g = 0; g < GB; g++) {
        const float p = __expf(sc[k][g] - m[g]);
        l[g] += p;
#pragma unroll
        for (int i = 0; i < VPL; i++)
#pragma unroll
          for (int e = 0; e < 8; e++) acc[g][i][e] += p * vf[i][e];
      }
    }
    asm volatile("" ::: "memory");  // the values are read before their slots are refilled
    issue(1, j + 1);
  }
  cp_async_wait<0>();
#pragma unroll
  for (int g = 0; g < GB; g++) {
    l[g] += __shfl_xor_sync(0xffffffffu, l[g], 16);
#pragma unroll
    for (int i = 0; i < VPL; i++)
#pragma unroll
      for (int e = 0; e < 8; e++) acc[g][i][e] += __shfl_xor_sync(0xffffffffu, acc[g][i][e], 16);
  }
  // The warps meet: M = max_w m_w, o = Σ_w e^{m_w − M}·o_w, L likewise,
  // in the shared memory that held the block's keys and values once every
  // lane is done with its copies.
  __syncthreads();
  float* wm = smem;
  float* wl = wm + kDecodeWarps * GB;
  float* wo = wl + kDecodeWarps * GB;
  if (lane == 0)
#pragma unroll
    for (int g = 0; g < GB; g++) wm[warp * GB + g] = m[g], wl[warp * GB + g] = l[g];
  if (kg == 0)
#pragma unroll
    for (int g = 0; g < GB; g++)
#pragma unroll
      for (int i = 0; i < VPL; i++)
        if (on[i])
#pragma unroll
          for (int e = 0; e < 8; e++) wo[(warp * GB + g) * hd + 8 * (tl + 16 * i) + e] = acc[g][i][e];
  __syncthreads();
  for (int k = threadIdx.x; k < GB * (hd + 2); k += blockDim.x) {
    const int g = k / (hd + 2), i = k % (hd + 2);
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; w++) M = fmaxf(M, wm[w * GB + g]);
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; w++) {
      const float l_w = wl[w * GB + g];  // 0: a warp without keys in the chunk
      if (l_w > 0.f) o += __expf(wm[w * GB + g] - M) * (i < hd ? wo[(w * GB + g) * hd + i] : l_w);
    }
    out[g * head_stride + i] = i == hd ? M : o;  // i = hd + 1: L
  }
}

// attention_combine: one block per (row, head) merges the chunks,
// O = Σ_c e^{m_c − M}·o_c / Σ_c e^{m_c − M}·l_c with M = max_c m_c, in one
// pass over them: each warp takes every kCombineWarps-th chunk and keeps
// its own online softmax state as the decode kernel's warps do — its max
// m, its sum l and its output, rescaled when m grows — so a chunk's m, l
// and outputs are loaded together (fold_chunks), with no block-wide max
// to wait for first; the warps then meet once in shared memory
// (meet_warps). After the decode kernel (row_pos set), only the row's own
// records are read: a CUDA graph's key bound is up to twice the row's
// keys, and the records past them (or before a sliding window) are
// empty. The row's chunk is the decode kernel's (row_spans, from the same
// grid sizes: rows, wave, min_spans); its position, fixed before the
// RoPE kernel ahead of the attention, is read before the gate when early
// (the decode kernel's argument). (It replaced three passes — a
// block-wide max, the sums, then the outputs — which loaded the records
// three times: 0.3–1.5% slower decodes on an H100, cuda/NOTES.md, "The
// twenty-eighth session".)
constexpr int kCombineWarps = 4;

__global__ void __launch_bounds__(32 * kCombineWarps)
    attention_combine(const float* __restrict__ part, half* __restrict__ out, int heads, int hd, int chunks,
                       const int32_t* __restrict__ row_pos, int rows, int wave, int min_spans, int window, int early) {
  const int t = blockIdx.x, h = blockIdx.y;
  int c0 = 0, c1 = chunks;
  auto bound = [&]() {
    if (!row_pos) return;
    const int n = row_pos[t] + 1, lo = window > 0 ? max(0, n - window) : 0;
    const int chunk = kDecodeChunk * row_spans(n, lo, rows, wave, min_spans);
    c0 = lo / chunk, c1 = min(chunks, (n + chunk - 1) / chunk);
  };
  if (early) bound();
  pdl_gate();  // before any other global access: see common.cuh
  if (!early) bound();
  __shared__ float wm[kCombineWarps], wl[kCombineWarps];
  __shared__ float wo[kCombineWarps * 32 * kMaxDimsPerLane];
  fold_chunks(part + ((size_t)t * heads + h) * chunks * (hd + 2), c0 + (threadIdx.x >> 5), kCombineWarps, c1, hd, wm, wl,
              wo);
  __syncthreads();
  half* o = out + ((size_t)t * heads + h) * hd;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) o[i] = __float2half(meet_warps(wm, wl, wo, kCombineWarps, hd, i));
}

// gated_act_kernel: g = act(g)·u.
__global__ void gated_act_kernel(half* __restrict__ g, const half* __restrict__ u, size_t n, int act) {
  pdl_gate();  // before any global access: see common.cuh
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  g[i] = gated_pair(__half2float(g[i]), __half2float(u[i]), act);
}

// fake_quant_kernel: one block per row of cols fp16 values, quantized and
// dequantized as package actquant does on the CPU (a linear layer's input
// in a W8A8-style simulation): the scale is t/maxq with t the row's max
// |x| (per token) or the layer's calibrated threshold, x/scale is clamped
// to ±maxq and rounded to an integer (ties to even) or to the E4M3 grid
// (the hardware conversion: ties to even, saturating), then multiplied
// back. A zero threshold (or a zero row, or a row with a NaN per token)
// leaves the row as it is; a NaN stays NaN. in and out may be the same.
__global__ void fake_quant_kernel(const half* in, half* out, int cols, float maxq, int fp8, int per_token,
                                  float threshold) {
  pdl_gate();  // before any global access: see common.cuh
  __shared__ float red[32];
  const half* x = in + (size_t)blockIdx.x * cols;
  half* y = out + (size_t)blockIdx.x * cols;
  float t = threshold;
  if (per_token) {
    float m = 0.f;
    int bad = 0;  // a NaN: the CPU's max is NaN then, and it skips the row
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
      const float v = __half2float(x[i]);
      bad |= !(v == v);
      m = fmaxf(m, fabsf(v));
    }
    t = block_max(m, red);
    if (__syncthreads_or(bad)) t = 0.f;
  }
  if (!(t > 0.f)) {
    for (int i = threadIdx.x; i < cols; i += blockDim.x) y[i] = x[i];
    return;
  }
  const float scale = t / maxq;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) {
    float q = __half2float(x[i]) / scale;
    if (q == q) q = fminf(fmaxf(q, -maxq), maxq);  // NaN passes through, as on the CPU
    q = fp8 ? float(__nv_fp8_e4m3(q)) : rintf(q);
    y[i] = __float2half(q * scale);
  }
}

// Mixtures of experts (llm.MoE) on the device, in the order a layer runs
// them: moe_router_kernel (the router's logits), moe_route_plan_kernel
// (each row's top k, then the rows' T·k slots grouped by expert), the
// grouped expert GEMVs (w4a16.cu's w4a16_gemv_grouped for 4-bit experts,
// moe_gemv_f16_kernel here for fp16 ones) adding into fp32 outputs,
// moe_act_kernel between gate/up and down, and the weighted sum of each
// row's experts in the rmsnorm_kernel that follows the layer. The fp32
// outputs start zeroed and the kernel that reads one zeroes it again, so
// split-K partial sums can be added with atomics and nothing is left for
// the next layer to clear.
__global__ void moe_route_kernel(const float* __restrict__ logits, int32_t* __restrict__ ids,
                                 float* __restrict__ weights, int T, int E, int k, int norm) {
  const int lane = threadIdx.x & 31, row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= T) return;  // the whole warp
  route_row(logits + (size_t)row * E, ids + (size_t)row * k, weights + (size_t)row * k, E, k, norm, lane);
}

// PlanShared is plan_slots' shared memory: each expert's slot count, its
// first index into order and first chunk, and the slots placed so far.
struct PlanShared {
  int count[kMaxExperts], first[kMaxExperts], chunk0[kMaxExperts], fill[kMaxExperts];
  int n_chunks;
};

// plan_slots (one block) groups a pass's S slots (row t's j-th expert is
// slot t·k + j, ids [S]) by expert for the expert GEMVs: order [S] lists
// the slots expert by expert (ascending experts; within one, in no fixed
// order: each slot's output is its own row, so the order changes no
// value), and chunks [max_chunks][3] = (expert, first index into order,
// slots) cut each expert's list into pieces of at most mt; the chunks past
// the last have 0 slots. Warp 0 computes the offsets with a shuffle scan.
// ids outside [0, E) are left out (route_row writes none; a bad one must
// not write out of bounds). ids is not __restrict__: moe_route_plan_kernel
// writes it in the same launch, and a read-only (.nc) load of it would not
// be ordered after those writes.
__device__ void plan_slots(const int32_t* ids, int S, int E, int mt, int32_t* __restrict__ order,
                           int32_t* __restrict__ chunks, int max_chunks, PlanShared& sh) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) sh.count[e] = sh.fill[e] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < S; s += blockDim.x)
    if ((unsigned)ids[s] < (unsigned)E) atomicAdd(&sh.count[ids[s]], 1);
  __syncthreads();
  if (threadIdx.x < 32) {  // lane l scans experts 8l … 8l+7, then the lanes' totals
    const int lane = threadIdx.x;
    int slots = 0, pieces = 0;
    for (int e = lane * kMaxExpertsPerLane; e < min(E, (lane + 1) * kMaxExpertsPerLane); e++)
      slots += sh.count[e], pieces += (sh.count[e] + mt - 1) / mt;
    int s_in = slots, p_in = pieces;  // inclusive scans over the lanes
    for (int o = 1; o < 32; o <<= 1) {
      const int so = __shfl_up_sync(0xffffffffu, s_in, o), po = __shfl_up_sync(0xffffffffu, p_in, o);
      if (lane >= o) s_in += so, p_in += po;
    }
    int at = s_in - slots, ch = p_in - pieces;
    for (int e = lane * kMaxExpertsPerLane; e < min(E, (lane + 1) * kMaxExpertsPerLane); e++) {
      sh.first[e] = at, sh.chunk0[e] = ch;
      at += sh.count[e], ch += (sh.count[e] + mt - 1) / mt;
    }
    if (lane == 31) sh.n_chunks = p_in;
  }
  __syncthreads();
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    const int e = ids[s];
    if ((unsigned)e < (unsigned)E) order[sh.first[e] + atomicAdd(&sh.fill[e], 1)] = s;
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    for (int j = 0; j * mt < sh.count[e]; j++) {
      int32_t* c = chunks + 3 * (sh.chunk0[e] + j);
      c[0] = e, c[1] = sh.first[e] + j * mt, c[2] = min(mt, sh.count[e] - j * mt);
    }
  for (int c = sh.n_chunks + threadIdx.x; c < max_chunks; c += blockDim.x)
    chunks[3 * c] = chunks[3 * c + 1] = chunks[3 * c + 2] = 0;
}

__global__ void __launch_bounds__(1024) moe_plan_kernel(const int32_t* ids, int S, int E, int mt, int32_t* __restrict__ order,
                                int32_t* __restrict__ chunks, int max_chunks) {
  __shared__ PlanShared sh;
  plan_slots(ids, S, E, mt, order, chunks, max_chunks, sh);
}

// moe_route_plan_kernel: route_row for every row (warp w takes rows w,
// w + 32, …), then plan_slots, in one block: a layer's routing in one
// launch.
__global__ void __launch_bounds__(1024) moe_route_plan_kernel(const float* __restrict__ logits, int32_t* ids,
                                                              float* __restrict__ weights, int T, int E, int k, int norm,
                                                              int mt, int32_t* __restrict__ order,
                                                              int32_t* __restrict__ chunks, int max_chunks) {
  pdl_gate();  // before any global access: see common.cuh
  __shared__ PlanShared sh;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int row = threadIdx.x >> 5; row < T; row += warps)
    route_row(logits + (size_t)row * E, ids + (size_t)row * k, weights + (size_t)row * k, E, k, norm, lane);
  __syncthreads();  // the ids, written to global memory, are the block's to read now
  plan_slots(ids, T * k, E, mt, order, chunks, max_chunks, sh);
}

// moe_router_kernel: router logits [T][E] (fp32) = h [T][H] (fp16) · Wᵀ,
// W [E][H] fp32 (the router stays in full precision, as on the CPU); one
// warp an expert, kRouterWarps a block, blockIdx.y the row; a warp's row
// of W is asked of L2 before the kernel waits on the one before, then
// read with a lane's loads unrolled. H % 4 == 0.
__global__ void moe_router_kernel(const half* __restrict__ h, const float* __restrict__ W, float* __restrict__ logits,
                                  int E, int H) {
  const int lane = threadIdx.x & 31, e = blockIdx.x * kRouterWarps + (threadIdx.x >> 5), t = blockIdx.y;
  if (lane == 0 && e < E) prefetch_l2(W + (size_t)e * H, H * 4);
  pdl_gate();  // before any global access but the weights: see common.cuh
  if (e >= E) return;  // the whole warp
  const float acc = router_dot<false>(reinterpret_cast<const uint2*>(h + (size_t)t * H),
                                      reinterpret_cast<const float4*>(W + (size_t)e * H), H, lane);
  if (lane == 0) logits[(size_t)t * E + e] = acc;
}

// moe_gemv_f16_kernel: the grouped expert GEMV for fp16 experts W [E][N][K]
// (PyTorch's [out][in] layout): out (slot s, n) += A row s / a_div ·
// W[e][n] (out fp32 [S][N]), for the slots of each plan chunk, MT at
// most; one warp a column, 8 a block (blockIdx.x), blockIdx.y the chunk.
// K % 8 == 0.
template <int MT>
__global__ void moe_gemv_f16_kernel(const half* __restrict__ A, int a_div, const int32_t* __restrict__ order,
                                    const int32_t* __restrict__ chunks, const half* __restrict__ W,
                                    float* __restrict__ out, int N, int K) {
  pdl_gate();  // before any global access: see common.cuh
  const int* ch = chunks + 3 * blockIdx.y;
  const int e = ch[0], start = ch[1], n = ch[2];
  const int lane = threadIdx.x & 31, col = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (n == 0 || col >= N) return;
  const uint4* w = reinterpret_cast<const uint4*>(W + ((size_t)e * N + col) * K);
  const uint4* a[MT];
#pragma unroll
  for (int m = 0; m < MT; m++) a[m] = reinterpret_cast<const uint4*>(A + (size_t)(order[start + min(m, n - 1)] / a_div) * K);
  float acc[MT] = {};
  for (int i = lane; i < K / 8; i += 32) {
    const uint4 wv = __ldg(w + i);
    const half2* wh = reinterpret_cast<const half2*>(&wv);
#pragma unroll
    for (int m = 0; m < MT; m++) {
      const uint4 av = __ldg(a[m] + i);
      const half2* ah = reinterpret_cast<const half2*>(&av);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float2 x = __half22float2(ah[j]), y = __half22float2(wh[j]);
        acc[m] += x.x * y.x + x.y * y.y;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; m++) {
    const float v = warp_sum(acc[m]);
    if (lane == 0 && m < n) atomicAdd(&out[(size_t)order[start + m] * N + col], v);
  }
}

// moe_act_kernel: g [S][I] fp16 = act(gate) · up (gated_pair, as the
// dense layers' gated_act) from a joined gate/up output gu [S][2I] (fp32),
// which it zeroes: gate gu[:, :I] and up gu[:, I:], or, interleaved
// (pack.InterleaveGPU), output column j's gate at 64·(j / 32) + j % 32
// and its up 32 columns on.
__global__ void moe_act_kernel(float* __restrict__ gu, half* __restrict__ g, int I, size_t n, int act, int interleaved) {
  pdl_gate();  // before any global access: see common.cuh
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const size_t s = i / I, j = i % I;
  float* r = gu + s * 2 * I;
  const size_t gj = interleaved ? 64 * (j / 32) + j % 32 : j, uj = interleaved ? gj + 32 : I + j;
  g[i] = gated_pair(r[gj], r[uj], act);
  r[gj] = r[uj] = 0.f;
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

// widen_kernel: dst fp32 = src fp16, n values, a pair a thread (n
// even): the logits of a packed LM head, which the W4A16 kernels write
// in fp16 (f16_to_f32).
__global__ void widen_kernel(const half2* __restrict__ src, float2* __restrict__ dst, size_t pairs) {
  pdl_gate();  // before any global access: see common.cuh
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += (size_t)gridDim.x * blockDim.x)
    dst[i] = __half22float2(src[i]);
}

// argmax_kernel: one block a row of logits; out[row] = llm.Argmax of the
// row: the first index of the largest value, NaNs skipped, 0 when the
// first value is NaN or nothing exceeds it. VEC reads four floats a load
// (V % 4 == 0). Each thread keeps its best (value, index) (argmax_merge,
// common.cuh), so any order of merging gives the first.

template <bool VEC>
__global__ void argmax_kernel(const float* __restrict__ logits, int32_t* __restrict__ out, int V) {
  pdl_gate();  // before any global access: see common.cuh
  __shared__ float rv[32];
  __shared__ int ri[32];
  const float* l = logits + (size_t)blockIdx.x * V;
  float bv = -INFINITY;
  int bi = INT_MAX;
  if (VEC) {
    const float4* l4 = reinterpret_cast<const float4*>(l);
#pragma unroll 4
    for (int i = threadIdx.x; i < V / 4; i += blockDim.x) {
      const float4 u = l4[i];
      argmax_merge(bv, bi, u.x, 4 * i);
      argmax_merge(bv, bi, u.y, 4 * i + 1);
      argmax_merge(bv, bi, u.z, 4 * i + 2);
      argmax_merge(bv, bi, u.w, 4 * i + 3);
    }
  } else {
    for (int i = threadIdx.x; i < V; i += blockDim.x) argmax_merge(bv, bi, l[i], i);
  }
  warp_argmax(bv, bi);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (lane == 0) rv[w] = bv, ri[w] = bi;
  __syncthreads();
  if (w == 0) {
    bv = lane < (int)(blockDim.x >> 5) ? rv[lane] : -INFINITY;
    bi = lane < (int)(blockDim.x >> 5) ? ri[lane] : INT_MAX;
    warp_argmax(bv, bi);
    // llm.Argmax starts from index 0 and moves only on a strictly larger
    // value: a NaN first value (or only NaNs) leaves 0.
    if (lane == 0) out[blockIdx.x] = (l[0] != l[0] || bi == INT_MAX) ? 0 : bi;
  }
}

inline unsigned blocks(size_t n, int per) { return (unsigned)((n + per - 1) / per); }

}  // namespace

namespace llmq {

int embed(llmq_ctx* c, const int32_t* ids, const void* E, float* x, int T, int H, float scale) {
  CK(launch(c, (embed_kernel), T, 256, 0, ids, (const half*)E, x, H, scale > 0 ? scale : 1.f));
  return 0;
}

// norm_chunks and norm_threads are rmsnorm_kernel's V and block for rows
// of H values: up to 1024 threads, each with V chunks of 4 values (V 1, 2
// or 4).
static int norm_chunks(int H) { return H / 4 <= 1024 ? 1 : H / 4 <= 2048 ? 2 : 4; }
static int norm_threads(int H) { return ((H / 4 + norm_chunks(H) - 1) / norm_chunks(H) + 31) / 32 * 32; }

// launch_norm launches rmsnorm_kernel<V, ROUTER, MAXT, SUMS> over grid
// for rows of H values (rmsnorm, rmsnorm_router), with the kernel's
// arguments (sums: SUMS's fp32 delta).
template <bool ROUTER, bool SUMS>
static int launch_norm(llmq_ctx* c, dim3 grid, size_t smem, float* x, const half* d, const float* dw, float* y,
                       const int32_t* ids, const float* ew, int k, const int32_t* rows, const float* w, half* out, int H,
                       float eps, const float* W, float* logits, int E, float* sums, int early) {
  const int threads = norm_threads(H);
  if (!ROUTER && y && threads <= 512) {  // a mixture's combine on a hidden size ≤ 2,048 (rmsnorm_kernel's MAXT)
    CK(launch(c, (rmsnorm_kernel<1, false, 512, SUMS>), grid, threads, smem, x, d, dw, y, ids, ew, k, rows, w, out, H, eps, W,
              logits, E, sums, early));
    return 0;
  }
  switch (norm_chunks(H)) {
    case 1: CK(launch(c, (rmsnorm_kernel<1, ROUTER, 1024, SUMS>), grid, threads, smem, x, d, dw, y, ids, ew, k, rows, w, out, H, eps, W, logits, E, sums, early)); break;
    case 2: CK(launch(c, (rmsnorm_kernel<2, ROUTER, 1024, SUMS>), grid, threads, smem, x, d, dw, y, ids, ew, k, rows, w, out, H, eps, W, logits, E, sums, early)); break;
    default: CK(launch(c, (rmsnorm_kernel<4, ROUTER, 1024, SUMS>), grid, threads, smem, x, d, dw, y, ids, ew, k, rows, w, out, H, eps, W, logits, E, sums, early)); break;
  }
  return 0;
}

int rmsnorm(llmq_ctx* c, float* x, const void* delta, float* sums, const float* delta_norm, float* y, const int32_t* ids,
            const float* weights, int k, const int32_t* rows, const float* w, void* out, int n, int H, float eps) {
  if (H <= 0 || H % 4 != 0 || H > kMaxNormHidden) {
    set_error(c, "rmsnorm: hidden size %d (want a multiple of 4, at most %d)", H, kMaxNormHidden);
    return 1;
  }
  if (delta && sums) {
    set_error(c, "rmsnorm: a delta and sums (want at most one)");
    return 1;
  }
  if (sums && rows) {
    set_error(c, "rmsnorm: sums with rows (sums are added and zeroed row by row: want no rows)");
    return 1;
  }
  const bool pending = delta || sums;
  if (y && (k <= 0 || k > kMaxTopK || (pending && delta_norm))) {
    set_error(c, "rmsnorm: the experts' sum of %d a row (want 1 to %d%s)", k, kMaxTopK,
              pending && delta_norm ? ", and no delta_norm with a delta before it" : "");
    return 1;
  }
  const auto norm = sums ? launch_norm<false, true> : launch_norm<false, false>;  // (delta is null with sums)
  // (the slots ordered before the gate: rmsnorm_kernel; not where a fused
  // down may have run just before, in the launch that routed: its ids are
  // final only at the gate)
  const int early = y && !rows && c->combine_early && !c->moe_fused_down;
  return norm(c, n, 0, x, (const half*)delta, delta_norm, y, ids, weights, k, rows, w, (half*)out, H, eps, nullptr, nullptr,
              0, sums, early);
}

int add(llmq_ctx* c, float* x, const void* delta, size_t n) {
  CK(launch(c, (add_kernel), blocks(n, 256), 256, 0, x, (const half*)delta, n));
  return 0;
}

int add_bias(llmq_ctx* c, void* y, const void* b, int T, int N) {
  const size_t n = (size_t)T * N;
  CK(launch(c, (bias_kernel), blocks(n, 256), 256, 0, (half*)y, (const half*)b, N, n));
  return 0;
}

int qk_rope_store(llmq_ctx* c, void* q, void* k, void* v, float* sums, const float* q_norm, const float* k_norm,
                  float eps, const int32_t* row_seq, const int32_t* row_pos, const uint64_t* kv_base,
                  const int32_t* kv_cap, const float* cos_t, const float* sin_t, int layer, int layers, int T, int heads,
                  int kv_heads, int hd) {
  if (T <= 0 || heads <= 0 || kv_heads <= 0 || hd <= 0 || hd % 2) {
    set_error(c, "qk_rope_store: %d rows of %d q and %d k heads of dimension %d (want positive counts, an even dimension)",
              T, heads, kv_heads, hd);
    return 1;
  }
  constexpr int kHeadsPerBlock = 4;
  const dim3 grid(T, (heads + kv_heads + kHeadsPerBlock - 1) / kHeadsPerBlock);
  const auto kernel = sums ? qk_rope_store_kernel<true> : qk_rope_store_kernel<false>;
  CK(launch(c, kernel, grid, 32 * kHeadsPerBlock, 0, (half*)q, (half*)k, (half*)v, sums, q_norm, k_norm, eps, row_seq,
            row_pos, kv_base, kv_cap, cos_t, sin_t, layer, layers, heads, kv_heads, hd, c->attn_early ? 1 : 0));
  return 0;
}

size_t attention_workspace_bytes(int T, int heads, int hd, int max_keys) {
  const int chunk = T <= 64 ? kDecodeChunk : max_keys;
  return (size_t)T * heads * ((max_keys + chunk - 1) / chunk) * (hd + 2) * sizeof(float);
}

int attention(llmq_ctx* c, const void* q, void* out, void* workspace, const int32_t* row_seq, const int32_t* row_pos,
                   const uint64_t* kv_base, const int32_t* kv_cap, int layer, int layers, int T, int heads, int kv_heads,
                   int hd, int max_keys, int window, float scale) {
  if (heads % kv_heads || hd % 2 || hd > 32 * kMaxDimsPerLane || window < 0) {
    set_error(c, "attention: heads %d must be a multiple of kv_heads %d, head_dim %d even and at most %d, window %d ≥ 0",
              heads, kv_heads, hd, 32 * kMaxDimsPerLane, window);
    return 1;
  }
  // Few rows (decoding): chunks of 64 keys spread a head over many
  // blocks. Many rows (prefill): one chunk per row is parallel enough
  // (the scores of a whole row must fit in shared memory).
  const bool decode = T <= 64;
  // The decode kernel's grid sizes, which attention_combine bounds each
  // row's records with (rows 0: the decode kernel did not run).
  int rows = 0, wave = 0, min_spans = 0;
  const int chunk = decode ? kDecodeChunk : max_keys;
  int chunks = (max_keys + chunk - 1) / chunk;
  const float qscale = scale > 0 ? scale : 1.f / sqrtf((float)hd);
  if (decode && hd % 8 == 0 && hd <= 256 && ((uintptr_t)q & 15) == 0) {
    // attention_decode_kernel: up to 4 query heads of a GQA group a block
    // (2 for head_dim > 128), their q slices and scores in registers.
    const int group = heads / kv_heads, vpl = hd <= 128 ? 1 : 2;
    const int gb = group % 4 == 0 && vpl == 1 ? 4 : group % 2 == 0 ? 2 : 1;
    // The grid the kernel sizes each row's chunks for: one wave of
    // kDecodeWaveBlocks blocks an SM. Every row takes at least the
    // sub-chunks that rows of half the key bound would (min_spans), so
    // the grid needs only chunks / min_spans blocks a head group.
    wave = c->decode_wave > 0 ? c->decode_wave : c->sms * kDecodeWaveBlocks;
    // (A sliding window bounds a row's keys below the key bound.)
    const int span_chunks = window > 0 ? std::min(chunks, (window + kDecodeChunk - 1) / kDecodeChunk + 1) : chunks;
    rows = T * (heads / gb);
    min_spans = spans_for((long)rows * ((span_chunks + 1) / 2), wave, 1);
    chunks = (chunks + min_spans - 1) / min_spans;
    // Shared memory: the block's keys and values in flight, then the
    // warps' meeting in the same bytes (whichever is larger).
    const size_t meet = (size_t)kDecodeWarps * gb * (hd + 2) * sizeof(float),
                 kv = (size_t)kSlots * vpl * 2 * 32 * kDecodeWarps * sizeof(uint4), smem = meet > kv ? meet : kv;
    const dim3 grid(T, heads / gb, chunks);
#define LLMQ_DECODE(GB, VPL)                                                                                          \
  if (allow_smem(c, attention_decode_kernel<GB, VPL>, smem)) return 1;                                                 \
  CK(launch(c, (attention_decode_kernel<GB, VPL>), grid, 32 * kDecodeWarps, smem,                                      \
      (const half*)q, (float*)workspace, row_seq, row_pos, kv_base, kv_cap, layer, layers, heads, kv_heads, hd, qscale, \
      window, wave, min_spans, c->attn_early ? 1 : 0))
    switch (vpl * 10 + gb) {
      case 14: LLMQ_DECODE(4, 1); break;
      case 12: LLMQ_DECODE(2, 1); break;
      case 11: LLMQ_DECODE(1, 1); break;
      case 22: LLMQ_DECODE(2, 2); break;
      default: LLMQ_DECODE(1, 2);
    }
#undef LLMQ_DECODE
    CK_LAUNCH("attention_decode_kernel");
  } else {
    const size_t smem = (size_t)(hd + chunk + 4 * hd) * sizeof(float);
    if (allow_smem(c, attention_kernel, smem)) return 1;
    CK(launch(c, (attention_kernel), dim3(T, heads, chunks), 128, smem, (const half*)q, (float*)workspace, row_seq, row_pos,
                                                                       kv_base, kv_cap, layer, layers, heads, kv_heads, hd,
                                                                       qscale, chunk, window));
  }
  CK(launch(c, attention_combine, dim3(T, heads), 32 * kCombineWarps, 0, (const float*)workspace, (half*)out, heads, hd,
            chunks, rows ? row_pos : nullptr, rows, wave, min_spans, window, c->attn_early ? 1 : 0));
  return 0;
}

int gated_act(llmq_ctx* c, void* g, const void* u, size_t n, int act) {
  if (act < 0 || act > 1) {
    set_error(c, "gated_act: activation %d (0 SiLU, 1 GELU-tanh)", act);
    return 1;
  }
  CK(launch(c, (gated_act_kernel), blocks(n, 256), 256, 0, (half*)g, (const half*)u, n, act));
  return 0;
}

int rmsnorm_router(llmq_ctx* c, const float* x, const void* delta, const float* sums, const float* w, void* out,
                   const float* W, float* logits, int n, int H, int E, float eps) {
  if (H <= 0 || H % 4 != 0 || H > kMaxNormHidden || E <= 0 || E > kMaxExperts || n <= 0 || n > 65535 || !delta == !sums ||
      !W || !logits) {
    set_error(c, "rmsnorm_router: %d rows (at most 65535), hidden size %d (want a multiple of 4, at most %d), %d experts "
                 "(at most %d)%s%s%s", n, H, kMaxNormHidden, E, kMaxExperts,
              delta && sums ? ", a delta and sums (want one of the two)" : !delta && !sums ? ", no delta or sums (want one)" : "",
              W ? "" : ", no router weights", logits ? "" : ", no logits");
    return 1;
  }
  // router_warps() experts a CTA, as moe_router's grid, so that as many SMs
  // read W (or one CTA of no experts, the norm alone, when
  // LLMQ_MOE_NORM_ROUTER=0 and moe_router follows). x is read, never
  // written, and sums are left for the next rmsnorm to add and zero.
  const int per = std::min(kRouterWarps, norm_threads(H) / 32);
  const int R = c->moe_norm_router ? (E + per - 1) / per : 1, Ek = c->moe_norm_router ? E : 0;
  const auto norm = sums ? launch_norm<true, true> : launch_norm<true, false>;  // (delta is null with sums)
  if (norm(c, dim3(n, R), (size_t)H * sizeof(half), const_cast<float*>(x), (const half*)delta, nullptr, nullptr, nullptr,
           nullptr, 0, nullptr, w, (half*)out, H, eps, W, logits, Ek, const_cast<float*>(sums), 0))
    return 1;
  if (!c->moe_norm_router) return moe_router(c, out, W, logits, n, E, H);
  return 0;
}

int moe_route(llmq_ctx* c, const float* logits, int32_t* ids, float* weights, int T, int E, int k, int norm) {
  if (T <= 0 || E <= 0 || E > kMaxExperts || k <= 0 || k > E || k > kMaxTopK) {
    set_error(c, "moe_route: %d rows of %d experts, top %d (want 1 ≤ top ≤ experts ≤ %d, top ≤ %d)", T, E, k,
              kMaxExperts, kMaxTopK);
    return 1;
  }
  constexpr int kRowsPerBlock = 4;
  moe_route_kernel<<<(T + kRowsPerBlock - 1) / kRowsPerBlock, 32 * kRowsPerBlock, 0, c->stream>>>(logits, ids, weights, T,
                                                                                                  E, k, norm);
  CK_LAUNCH("moe_route_kernel");
  return 0;
}

int moe_router(llmq_ctx* c, const void* h, const float* W, float* logits, int T, int E, int H) {
  if (T <= 0 || T > 65535 || E <= 0 || E > kMaxExperts || H <= 0 || H % 4) {
    set_error(c, "moe_router: %d rows, %d experts, hidden %d (want rows ≤ 65535, experts ≤ %d, hidden a multiple of 4)",
              T, E, H, kMaxExperts);
    return 1;
  }
  CK(launch(c, (moe_router_kernel), dim3((E + kRouterWarps - 1) / kRouterWarps, T), 32 * kRouterWarps, 0, 
      (const half*)h, W, logits, E, H));
  return 0;
}

// check_plan checks a plan's sizes (moe_plan, moe_route_plan).
int check_plan(llmq_ctx* c, const char* fn, int S, int E, int mt, int max_chunks) {
  // Chunks of one slot are exactly the slots; longer ones may leave each
  // expert's last chunk partial.
  const int need = mt == 1 ? S : (S + mt - 1) / mt + min(E, S);
  if (S <= 0 || E <= 0 || E > kMaxExperts || mt <= 0 || max_chunks < need) {
    set_error(c, "%s: %d slots, %d experts, %d a chunk, room for %d chunks (want experts ≤ %d and room for "
                 "⌈slots/mt⌉ + min(experts, slots), or slots when mt is 1)",
              fn, S, E, mt, max_chunks, kMaxExperts);
    return 1;
  }
  return 0;
}

int moe_plan(llmq_ctx* c, const int32_t* ids, int S, int E, int mt, int32_t* order, int32_t* chunks, int max_chunks) {
  if (check_plan(c, "moe_plan", S, E, mt, max_chunks)) return 1;
  moe_plan_kernel<<<1, 1024, 0, c->stream>>>(ids, S, E, mt, order, chunks, max_chunks);
  CK_LAUNCH("moe_plan_kernel");
  return 0;
}

int moe_route_plan(llmq_ctx* c, const float* logits, int32_t* ids, float* weights, int T, int E, int k, int norm, int mt,
                   int32_t* order, int32_t* chunks, int max_chunks) {
  if (k <= 0 || k > E || k > kMaxTopK) {
    set_error(c, "moe_route_plan: top %d of %d experts (want 1 ≤ top ≤ experts, top ≤ %d)", k, E, kMaxTopK);
    return 1;
  }
  if (check_plan(c, "moe_route_plan", T * k, E, mt, max_chunks)) return 1;
  CK(launch(c, (moe_route_plan_kernel), 1, 1024, 0, logits, ids, weights, T, E, k, norm, mt, order, chunks, max_chunks));
  return 0;
}

int moe_gemv(llmq_ctx* c, const void* A, int a_div, const int32_t* order, const int32_t* chunks, int max_chunks, int mt,
             int slots, const void* B, const void* scales, const void* zeros, const void* W16, float* out, int N, int K,
             int group, void* g, int act) {
  if (max_chunks <= 0 || max_chunks > 65535 || a_div <= 0 || slots <= 0 || N <= 0 || K <= 0 || (mt != 1 && mt != 4)) {
    set_error(c, "moe_gemv: %d chunks (want 1–65535), a_div %d, %d slots, %d a chunk (1 or 4), N=%d, K=%d", max_chunks,
              a_div, slots, mt, N, K);
    return 1;
  }
  if (check_gated(c, "moe_gemv", g, act)) return 1;
  if (!W16) return moe_gemv_w4(c, A, a_div, order, chunks, max_chunks, mt, slots, B, scales, zeros, out, N, K, group, g, act);
  if (K % 8 || act >= 0) {
    set_error(c, "moe_gemv: fp16 experts need K %% 8 == 0 (K=%d) and no gated output (act %d)", K, act);
    return 1;
  }
  const dim3 grid((N + 7) / 8, max_chunks);
  if (mt == 1)
    CK(launch(c, (moe_gemv_f16_kernel<1>), grid, 256, 0, (const half*)A, a_div, order, chunks, (const half*)W16, out, N, K));
  else if (mt == 4)
    CK(launch(c, (moe_gemv_f16_kernel<4>), grid, 256, 0, (const half*)A, a_div, order, chunks, (const half*)W16, out, N, K));
  else {
    set_error(c, "moe_gemv: %d slots a chunk (the kernels run 1 or 4)", mt);
    return 1;
  }
  CK_LAUNCH("moe_gemv_f16_kernel");
  return 0;
}

int moe_act(llmq_ctx* c, float* gu, void* g, int S, int I, int act, int interleaved) {
  if (S <= 0 || I <= 0 || act < 0 || act > 1 || (interleaved && I % 32)) {
    set_error(c, "moe_act: %d slots of %d, activation %d (0 SiLU, 1 GELU-tanh)%s", S, I, act,
              interleaved && I % 32 ? ", interleaved in halves of 32 columns" : "");
    return 1;
  }
  const size_t n = (size_t)S * I;
  CK(launch(c, (moe_act_kernel), blocks(n, 256), 256, 0, gu, (half*)g, I, n, act, interleaved));
  return 0;
}

int fake_quant(llmq_ctx* c, const void* in, void* out, int rows, int cols, int bits, int fp8, int per_token,
               float threshold) {
  if (rows <= 0 || cols <= 0 || bits < 2 || bits > 8 || (fp8 && bits != 8) || (!per_token && !(threshold >= 0.f))) {
    set_error(c, "fake_quant: %d rows of %d, %d bits%s, %s, threshold %g", rows, cols, bits, fp8 ? " (fp8)" : "",
              per_token ? "per token" : "per tensor", threshold);
    return 1;
  }
  const float maxq = fp8 ? 448.f : (float)((1 << (bits - 1)) - 1);
  CK(launch(c, (fake_quant_kernel), rows, 256, 0, (const half*)in, (half*)out, cols, maxq, fp8, per_token, threshold));
  return 0;
}

int nll(llmq_ctx* c, const float* logits, const int32_t* targets, float* nll, int T, int V) {
  nll_kernel<<<T, 1024, 0, c->stream>>>(logits, targets, nll, V);
  CK_LAUNCH("nll_kernel");
  return 0;
}

int argmax_rows(llmq_ctx* c, const float* logits, int32_t* out, int T, int V) {
  if (T <= 0 || V <= 0) {
    set_error(c, "argmax_rows: %d rows of %d logits (want positive counts)", T, V);
    return 1;
  }
  if (V % 4 == 0)
    CK(launch(c, (argmax_kernel<true>), T, 1024, 0, logits, out, V));
  else
    CK(launch(c, (argmax_kernel<false>), T, 1024, 0, logits, out, V));
  return 0;
}

int f16_to_f32(llmq_ctx* c, const void* src, float* dst, size_t n) {
  if (n % 2 || ((uintptr_t)src & 3) || ((uintptr_t)dst & 7)) {
    set_error(c, "f16_to_f32: %zu values (want an even count) at %p and %p (want 4- and 8-byte alignment)", n, src, (void*)dst);
    return 1;
  }
  if (!n) return 0;
  const unsigned blocks = (unsigned)std::min<size_t>((n / 2 + 255) / 256, (size_t)c->sms * 8);
  CK(launch(c, (widen_kernel), blocks, 256, 0, (const half2*)src, (float2*)dst, n / 2));
  return 0;
}

// C[M,N] = A[M,K]·W[N,K]ᵀ with W in PyTorch's [out][in] layout, fp32
// accumulation; C is fp16, or fp32 when c_fp32 (logits).
int gemm_nt(llmq_ctx* c, const void* A, const void* W, void* C, int M, int N, int K, int c_fp32) {
  const float alpha = 1.f, beta = 0.f;
  // Row-major C = A·Wᵀ is column-major Cᵀ = W·Aᵀ, W being column-major [K][N]ᵀ.
  cublasStatus_t s = cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, W, CUDA_R_16F, K, A, CUDA_R_16F, K, &beta,
                                  C, c_fp32 ? CUDA_R_32F : CUDA_R_16F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) {
    set_error(c, "cublasGemmEx (gemm_nt) failed: status %d (M=%d N=%d K=%d)", (int)s, M, N, K);
    return 1;
  }
  return 0;
}

}  // namespace llmq
