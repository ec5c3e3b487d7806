// How the weight kernels stream their codes from memory: the loads that
// w4a16.cu's kernels use, shared with cuda/probe/stream.cu (the program
// that measures this streaming alone), so the probe reads the way the
// kernels do.
#pragma once
#include <stdint.h>
#include <cuda_runtime.h>

// kStepBytes is a warp's 16-row step of 4-bit codes in the GPU layout
// (pack.GPUWeights): one 16-byte chunk a lane, a 16×64 tile.
constexpr int kStepBytes = 512;

// ld_stream reads 16 bytes read once: through L2, without allocating in L1.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// touch_range reads the n 16-byte words from p once, the thread's share
// of a grid-stride walk (the read-bandwidth probe: runtime.cu's
// read_probe and the stream probe's baseline), writing to out only in a
// case that never happens so the loads stay.
__device__ __forceinline__ void touch_range(const uint4* __restrict__ p, size_t n, unsigned* out) {
  uint32_t acc = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *out = acc;
}

// prefetch_l2 asks L2 for bytes (a multiple of 16) from p (16-byte
// aligned) with one bulk copy engine request; nothing comes to the SM
// (Hopper's; a no-op where there is none).
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)), "r"(bytes));
#endif
}

// Bulk copies into shared memory on mbarriers (Hopper's copy engine, used
// by the streaming probe's tma modes): a barrier counts its arrivals and
// the bytes its copies deliver (expect_tx), and a wait on its phase's
// parity returns once both are complete.
// The instructions are Hopper's (sm_90); an older architecture's build
// compiles these to a trap, and the kernels that use them are never
// launched there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define LLMQ_SM90_ASM(...) __trap()
#else
#define LLMQ_SM90_ASM(...) asm volatile(__VA_ARGS__)
#endif
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  LLMQ_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
// mbar_init_fence makes a thread's mbar_inits visible to the copy engine
// (before the barrier that shows them to the other threads).
__device__ __forceinline__ void mbar_init_fence() { LLMQ_SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  LLMQ_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  LLMQ_SM90_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// mbar_wait returns once bar's phase of this parity has completed. A wait
// past 10 s is a protocol bug (a launch takes microseconds, ms under the
// sanitizer): it traps, so the host sees an error instead of a hang.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint64_t t0 = 0;
  for (;;) {
    uint32_t done = 0;
    LLMQ_SM90_ASM(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    if (done) return;
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t0 == 0) t0 = t;
    else if (t - t0 > 10000000000ull) __trap();
  }
}
// bulk_copy copies bytes (a multiple of 16; both addresses 16-byte
// aligned) from global src to shared dst, completing on bar.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  LLMQ_SM90_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                    smem_addr(dst)),
                "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(smem_addr(bar))
                : "memory");
}

// ring_init readies a ring of S slots: slot s's `full` barrier completes
// when its producer (thread 0: one arrival with its expected bytes) and
// the bytes have arrived, its `empty` barrier when `consumers` arrivals
// (a CTA's warps) have. Every thread of the CTA calls it.
template <int S>
__device__ __forceinline__ void ring_init(uint64_t (&full)[S], uint64_t (&empty)[S], uint32_t consumers) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], consumers);
    mbar_init_fence();
  }
  __syncthreads();
}
