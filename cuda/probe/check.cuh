// CHECK, the probes' one way to stop on a CUDA error: the failed call, its
// error and where it was made (the probe's file and line), then exit 1,
// which device-model.sh reports as the probe's failure.
#pragma once
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                                                    \
  do {                                                                                                 \
    cudaError_t e_ = (call);                                                                           \
    if (e_ != cudaSuccess) {                                                                           \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));          \
      exit(1);                                                                                         \
    }                                                                                                  \
  } while (0)
