// How the weight kernels stream their codes from memory: the loads that
// w4a16.cu's kernels use, shared with cuda/probe/stream.cu (the program
// that measures this streaming alone), so the probe reads the way the
// kernels do.
#pragma once
#include <stdint.h>
#include <cuda_runtime.h>

// ld_stream reads 16 bytes read once: through L2, without allocating in L1.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// prefetch_l2 asks L2 for bytes (a multiple of 16) from p (16-byte
// aligned) with one bulk copy engine request; nothing comes to the SM
// (Hopper's; a no-op where there is none).
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)), "r"(bytes));
#endif
}
