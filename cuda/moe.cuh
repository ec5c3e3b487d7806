// A mixture of experts' routing, shared by model.cu (moe_route_kernel,
// moe_route_plan_kernel) and w4a16.cu (the routed expert GEMV of a decode
// step, which routes in every CTA): one piece of code, so that both route
// alike bit for bit (llm.RouteLogits' experts, its weights to fp32
// rounding).
#pragma once
#include <math.h>
#include <stdint.h>
#include "common.cuh"
#include "llmq.h"

constexpr int kMaxTopK = 16;  // a mixture's experts a row (rmsnorm_kernel, route_row)
constexpr int kMaxExpertsPerLane = 8;  // E ≤ 256
constexpr int kMaxExperts = 32 * kMaxExpertsPerLane;
// A routed expert GEMV (moe_gemv_routed) routes up to this many rows (a
// warp each) of at most 32 slots in every CTA: a decode step's.
constexpr int kMaxRoutedRows = LLMQ_MOE_ROUTED_ROWS, kMaxRoutedSlots = LLMQ_MOE_ROUTED_SLOTS;

// route_row is a warp's routing of one row of router logits l [E] (fp32),
// as llm.RouteLogits does it on the CPU: p = softmax(l) over every
// expert, the k largest p in turn (ties to the lower expert: each lane
// keeps its best with a strict >, the warp prefers the lower expert among
// equals), their p as weights, divided by their sum when norm is set,
// into ids and weights [k], most probable first. A row whose p are NaN
// (an overflow upstream) gets, as on the CPU, the lowest experts not yet
// taken, with NaN weights: every id stays a valid expert.
static __device__ void route_row(const float* __restrict__ l, int32_t* __restrict__ ids, float* __restrict__ weights, int E,
                                 int k, int norm, int lane) {
  float p[kMaxExpertsPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; i++) {
    const int e = lane + 32 * i;
    p[i] = e < E ? l[e] : -INFINITY;
    mx = fmaxf(mx, p[i]);
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; i++)
    if (lane + 32 * i < E) sum += p[i] = expf(p[i] - mx);
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; i++) p[i] = lane + 32 * i < E ? p[i] / sum : -1.f;  // −1: not an expert
  float chosen = 0.f, w[kMaxTopK];
  int be = E;
  for (int j = 0; j < k; j++) {
    float bv = -1.f;
    be = E;
#pragma unroll
    for (int i = 0; i < kMaxExpertsPerLane; i++)
      if (p[i] > bv) bv = p[i], be = lane + 32 * i;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe;
    }
    if (be == E) {  // no p above −1: NaNs; the lowest expert not taken (p ≠ −1)
#pragma unroll
      for (int i = kMaxExpertsPerLane - 1; i >= 0; i--)
        if (lane + 32 * i < E && p[i] != -1.f) be = lane + 32 * i;
      for (int o = 16; o > 0; o >>= 1) be = min(be, __shfl_xor_sync(0xffffffffu, be, o));
      bv = __int_as_float(0x7fc00000);  // NaN, the CPU's weight there
    }
    if (lane == 0) ids[j] = be;
    if (j < kMaxTopK) w[j] = bv;
    chosen += bv;
#pragma unroll
    for (int i = 0; i < kMaxExpertsPerLane; i++)
      if (lane + 32 * i == be) p[i] = -1.f;  // taken
  }
  if (lane == 0)
    for (int j = 0; j < k; j++) weights[j] = norm ? w[j] / chosen : w[j];
}

// The router's logits: kRouterWarps experts a CTA, one a warp
// (moe_router_kernel; rmsnorm_router, whose CTAs of fewer warps take
// router_warps()).
constexpr int kRouterWarps = 4;
static __device__ __forceinline__ int router_warps() { return min(kRouterWarps, (int)(blockDim.x >> 5)); }

// router_dot is a warp's router logit: the row x (H fp16 values, 4 a
// word) · expert row w (H fp32, 4 a float4), lane-strided, each lane's
// loads unrolled so the warp has the row in flight at once; the warp's
// sum, in every lane. SHARED: x is in shared memory (rmsnorm_router), else
// global (moe_router_kernel). H % 4 == 0.
template <bool SHARED>
static __device__ __forceinline__ float router_dot(const uint2* __restrict__ x, const float4* __restrict__ w, int H,
                                                   int lane) {
  float acc = 0.f;
#pragma unroll 8
  for (int i = lane; i < H / 4; i += 32) {
    const float4 wv = __ldg(w + i);
    const uint2 xv = SHARED ? x[i] : __ldg(x + i);
    const float2 a = __half22float2(*reinterpret_cast<const half2*>(&xv.x));
    const float2 b = __half22float2(*reinterpret_cast<const half2*>(&xv.y));
    acc += a.x * wv.x + a.y * wv.y + b.x * wv.z + b.y * wv.w;
  }
  return warp_sum(acc);
}
