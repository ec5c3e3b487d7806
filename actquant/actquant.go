// Package actquant quantizes the activations that enter linear layers, the
// other half of W8A8-style inference (Xiao et al. 2023, "SmoothQuant";
// Micikevicius et al. 2022, "FP8 Formats for Deep Learning"), simulated:
// each input is quantized and dequantized before the float product, which
// gives the accuracy of a real INT8/FP8 GEMM without one.
//
// A Scheme chooses the number format and the granularity of the scale:
//
//	INT8, per token (dynamic):   s_t = max_j |x_tj| / 127,  x̂ = s_t·clamp(round(x/s_t), −127, 127)
//	INT8, per tensor (static):   s = T / 127 for a threshold T calibrated offline
//	FP8 E4M3:                    the same with 448 (E4M3's largest value) for 127,
//	                             and rounding to the E4M3 grid instead of the integers
//
// Static thresholds come from calibration (Observer, Threshold): the largest
// |x| seen (min-max), a percentile of |x|, or the threshold whose clipped
// and quantized histogram is closest to the original in KL divergence
// (TensorRT's entropy calibration, Migacz 2017).
package actquant

import (
	"fmt"
	"math"
)

// Scheme is how a linear layer's input is quantized.
type Scheme struct {
	Bits     int  // 8 (INT8); 4 also runs (W4A4 experiments)
	FP8      bool // E4M3 instead of integers (Bits is then 8)
	PerToken bool // a scale per row (dynamic); else one static scale per layer input
}

// String names the scheme as the command line does.
func (s Scheme) String() string {
	f := fmt.Sprintf("int%d", s.Bits)
	if s.FP8 {
		f = "fp8-e4m3"
	}
	if s.PerToken {
		return f + " per-token"
	}
	return f + " per-tensor"
}

// Validate checks the scheme.
func (s Scheme) Validate() error {
	if s.FP8 && s.Bits != 8 {
		return fmt.Errorf("FP8 activations have 8 bits, not %d", s.Bits)
	}
	if s.Bits < 2 || s.Bits > 8 {
		return fmt.Errorf("activation bits %d: want 2 to 8", s.Bits)
	}
	return nil
}

// MaxQ is the largest quantized magnitude: 2^(bits−1) − 1 (symmetric
// integers), or 448 for E4M3.
func (s Scheme) MaxQ() float32 {
	if s.FP8 {
		return E4M3Max
	}
	return float32(int(1)<<(s.Bits-1) - 1)
}

// FakeQuant quantizes and dequantizes x [rows][cols] in place: per row
// with its own max |x| (PerToken), or with the static threshold (values
// beyond it saturate). A zero threshold or row leaves zeros.
func (s Scheme) FakeQuant(x []float32, rows, cols int, threshold float32) {
	maxq := s.MaxQ()
	for r := 0; r < rows; r++ {
		row := x[r*cols : (r+1)*cols]
		t := threshold
		if s.PerToken {
			t = 0
			for _, v := range row {
				t = max(t, float32(math.Abs(float64(v))))
			}
		}
		if t == 0 || t != t {
			continue
		}
		scale := t / maxq
		for i, v := range row {
			q := min(max(v/scale, -maxq), maxq)
			if s.FP8 {
				q = RoundE4M3(q)
			} else {
				q = float32(math.RoundToEven(float64(q)))
			}
			row[i] = q * scale
		}
	}
}
