// Shared helpers of the llmq CUDA library: error reporting and the stream.
#pragma once
#include <cuda_runtime.h>
#include <stdio.h>
#include "llmq.h"

namespace llmq {
void set_error(const char* fmt, ...);
cudaStream_t stream();
}  // namespace llmq

// CK turns a failed CUDA runtime call into an error naming it.
#define CK(call)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                             \
      llmq::set_error("%s failed: %s (%s:%d)", #call, cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)

// CK_LAUNCH checks a kernel launch.
#define CK_LAUNCH(name)                                                                  \
  do {                                                                                   \
    cudaError_t e_ = cudaGetLastError();                                                 \
    if (e_ != cudaSuccess) {                                                             \
      llmq::set_error("kernel %s: %s", name, cudaGetErrorString(e_));                    \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)
