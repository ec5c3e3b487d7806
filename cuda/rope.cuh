// Where a decode step's q, k and v go before attention, shared by
// model.cu (qk_rope_store_kernel, the attention kernels' cache reads) and
// w4a16.cu (the GEMV kernels' q/k/v epilogue, w4a16_gemm_rope): the key
// and value cache's two layouts, and the per-head preparation — Qwen3's
// q/k RMSNorm, RoPE, the cache store — as one piece of code, so that the
// joined launch and the kernel of its own write the same bits.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>
#include "common.cuh"
#include "llmq.h"

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
static __device__ __forceinline__ void cache_span(const uint64_t* kv_base, const int32_t* kv_cap, int s, int layer,
                                                  int layers, int p0, int kv_dim, half*& k, half*& v) {
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
static __device__ __forceinline__ void cache_kv(const uint64_t* kv_base, const int32_t* kv_cap, int s, int layer,
                                                int layers, int pos, int kv_dim, half*& k, half*& v) {
  const int r = pos % kPageTokens;
  cache_span(kv_base, kv_cap, s, layer, layers, pos - r, kv_dim, k, v);
  k += (size_t)r * kv_dim, v += (size_t)r * kv_dim;
}

// The preparation of one (row t, head y) by one warp: y < heads is q's
// head y, otherwise k's head y − heads (and the same head of v). It runs
// in two halves so that qk_rope_store_kernel can read the first before it
// waits on the kernel ahead (its `early`): rope_begin reads what no kernel
// of the step writes — the row's position, the k head's cache slots, the
// lane's first cos and sin values — and rope_end does the rest.
constexpr int kRopePre = 4;  // a lane's first rotation pairs (head dims up to 256) have their cos and sin here
struct RopeLane {
  int pos;
  half *kc, *vc;  // a k head's slots in its sequence's cache (nullptr: a q head, or no cache)
  float c[kRopePre], s[kRopePre];
};

static __device__ __forceinline__ void rope_begin(const llmq_rope& a, int t, int y, int lane, RopeLane& p) {
  const bool is_q = y < a.heads;
  const int h = is_q ? y : y - a.heads, half_d = a.hd / 2;
  p.pos = a.row_pos[t];
  p.kc = p.vc = nullptr;
  if (!is_q && a.kv_base) {
    cache_kv(a.kv_base, a.kv_cap, a.row_seq[t], a.layer, a.layers, p.pos, a.kv_heads * a.hd, p.kc, p.vc);
    p.kc += h * a.hd, p.vc += h * a.hd;
  }
  const float* ct = a.cos_t + (size_t)p.pos * half_d;
  const float* st = a.sin_t + (size_t)p.pos * half_d;
#pragma unroll
  for (int i = 0; i < kRopePre; i++) {
    const int j = lane + 32 * i;
    p.c[i] = j < half_d ? ct[j] : 0.f, p.s[i] = j < half_d ? st[j] : 0.f;
  }
}

// rope_end: with SUMS, the head's fp32 sums (a k head's: the same head of
// v too) in sums [T][(heads + 2·kv_heads)·hd] (q's columns, then k's,
// then v's; read from L2, where other CTAs' atomics left them) become fp16
// q, k and v, each rounded once as finish_splits rounds (so, on the GEMV
// kernels, bit for bit what the GEMM would have written), and are zeroed
// (the workspace is kept zeroed between GEMMs). Then the head's RMSNorm
// when its weights are given (the sum of squares in lane-strided order,
// the result rounded to fp16 as a stored tensor would be), RoPE on the
// head's two halves by the row's position (the tables made once on the
// host: float32 angle products, cos/sin in double, as the CPU backend
// computes them), and a k head's rotated values and v's into the cache.
template <bool SUMS>
__device__ __forceinline__ void rope_end(const llmq_rope& a, float* sums, int t, int y, int lane, const RopeLane& p) {
  const bool is_q = y < a.heads;
  const int h = is_q ? y : y - a.heads, hd = a.hd, half_d = hd / 2, kv_dim = a.kv_heads * hd;
  half* r = is_q ? (half*)a.q + ((size_t)t * a.heads + h) * hd : (half*)a.k + ((size_t)t * a.kv_heads + h) * hd;
  if constexpr (SUMS) {
    float* row = sums + (size_t)t * (a.heads + 2 * a.kv_heads) * hd;
    float* src = row + (is_q ? h : a.heads + h) * hd;
    float* vsrc = row + (a.heads + a.kv_heads + h) * hd;
    half* vdst = (half*)a.v + (size_t)t * kv_dim + h * hd;
    for (int i = lane; i < hd; i += 32) {
      r[i] = __float2half_rn(__ldcg(src + i));
      src[i] = 0.f;
      if (!is_q) {
        vdst[i] = __float2half_rn(__ldcg(vsrc + i));
        vsrc[i] = 0.f;
      }
    }
    __syncwarp();  // the lanes below read what other lanes of the warp wrote
  }
  const float* w = is_q ? a.q_norm : a.k_norm;
  float inv = 1.f;
  if (w) {
    float ss = 0.f;
    for (int i = lane; i < hd; i += 32) {
      const float x = __half2float(r[i]);
      ss += x * x;
    }
    inv = rsqrtf(warp_sum(ss) / hd + a.eps);
  }
  half *kc = p.kc, *vc = p.vc;
  const half* vr = kc ? (const half*)a.v + (size_t)t * kv_dim + h * hd : nullptr;
  // rotate turns pair (j, j + hd/2) by the position's angle (its cos c and sin s).
  auto rotate = [&](int j, float c, float s) {
    float x0 = __half2float(r[j]), x1 = __half2float(r[j + half_d]);
    if (w) {
      x0 = __half2float(__float2half(x0 * inv * w[j]));
      x1 = __half2float(__float2half(x1 * inv * w[j + half_d]));
    }
    const half r0 = __float2half(x0 * c - x1 * s), r1 = __float2half(x1 * c + x0 * s);
    r[j] = r0;
    r[j + half_d] = r1;
    if (kc) {
      kc[j] = r0;
      kc[j + half_d] = r1;
      vc[j] = vr[j];
      vc[j + half_d] = vr[j + half_d];
    }
  };
#pragma unroll
  for (int i = 0; i < kRopePre; i++)
    if (lane + 32 * i < half_d) rotate(lane + 32 * i, p.c[i], p.s[i]);
  const float* ct = a.cos_t + (size_t)p.pos * half_d;
  const float* st = a.sin_t + (size_t)p.pos * half_d;
  for (int j = lane + 32 * kRopePre; j < half_d; j += 32) rotate(j, ct[j], st[j]);
}
