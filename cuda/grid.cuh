// The grid arithmetic of pack.Grid on the device, shared by GPTQ's column
// updates (quant.cu) and AWQ's candidates (awq.cu): the same float32
// operations as the Go code, so that codes agree bit for bit.
#pragma once
#include <cuda_fp16.h>
#include <math.h>

namespace llmq {

// round_f16 is pack.RoundF16.
__device__ __forceinline__ float round_f16(float x) { return __half2float(__float2half_rn(x)); }

// fit is pack.Grid.ParamsRange for GPTQ's grids (min-max over the group,
// stretched to hold 0; symmetric or not; scale rounded to fp16).
__device__ __forceinline__ void fit(float xmin, float xmax, int maxq, bool sym, float* scale, int* zero) {
  xmin = fminf(xmin, 0.f);
  xmax = fmaxf(xmax, 0.f);
  if (sym) {
    xmax = fmaxf(-xmin, xmax);
    if (xmin < 0) xmin = -xmax;
  }
  if (xmin == 0 && xmax == 0) {
    xmin = -1;
    xmax = 1;
  }
  float s = round_f16(__fdiv_rn(xmax - xmin, (float)maxq));
  if (s == 0) s = round_f16(6e-8f);
  *scale = s;
  if (sym) {
    *zero = (maxq + 1) / 2;
  } else {
    const float z = rintf(__fdiv_rn(-xmin, s));
    *zero = (int)fminf(fmaxf(z, 0.f), (float)maxq);
  }
}

}  // namespace llmq
