//go:build cgo

package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/x448/float16"
)

// TestAttentionCausalMatchesReference runs the flash kernel on random
// queries, keys and values and compares with causal softmax attention in
// float64: window lengths below, at and across the 64-row tile (1, 64,
// 200), grouped-query heads, every head dimension it takes, sliding
// windows shorter and longer than a tile (whole tiles skipped, partial
// ones masked) and a score scale other than head_dim^-½. The output is
// fp16, so the error allowed is fp16's.
func TestAttentionCausalMatchesReference(t *testing.T) {
	x := openContext(t)
	r := rand.New(rand.NewPCG(7, 8))
	for _, tc := range []struct {
		windows, T, heads, kvHeads, hd, window int
		scale                                  float32
	}{
		{2, 200, 4, 2, 64, 0, 0}, {1, 64, 2, 2, 128, 0, 0}, {3, 1, 4, 1, 32, 0, 0}, {2, 130, 8, 2, 128, 0, 0}, {1, 96, 2, 1, 32, 0, 0},
		{2, 200, 4, 2, 64, 50, 0}, {1, 300, 2, 1, 128, 100, 0}, {1, 130, 2, 2, 32, 64, 0.0625},
	} {
		rows, qd, kvd := tc.windows*tc.T, tc.heads*tc.hd, tc.kvHeads*tc.hd
		gen := func(n int, sd float64) []float32 {
			v := make([]float32, n)
			for i := range v {
				v[i] = float32(r.NormFloat64() * sd)
			}
			return fromF16(toF16(v)) // the values the GPU sees
		}
		q, k, v := gen(rows*qd, 1), gen(rows*kvd, 1), gen(rows*kvd, 1)
		bufs := make([]Buf, 4)
		var err error
		for i, src := range [][]float32{q, k, v} {
			if bufs[i], err = AllocFrom(x, toF16(src)); err != nil {
				t.Fatal(err)
			}
		}
		if bufs[3], err = x.Alloc(rows * qd * 2); err != nil {
			t.Fatal(err)
		}
		if err := x.AttentionCausal(bufs[0], bufs[1], bufs[2], bufs[3], tc.windows, tc.T, tc.heads, tc.kvHeads, tc.hd, AttnOptions{Window: tc.window, Scale: tc.scale}); err != nil {
			t.Fatal(err)
		}
		got16 := make([]uint16, rows*qd)
		if err := Download(x, got16, bufs[3]); err != nil {
			t.Fatal(err)
		}
		got := fromF16(got16)
		var worst float64
		for w := 0; w < tc.windows; w++ {
			for p := 0; p < tc.T; p++ {
				row := w*tc.T + p
				lo := 0 // keys before a sliding window are not seen
				if tc.window > 0 {
					lo = max(0, p-tc.window+1)
				}
				for h := 0; h < tc.heads; h++ {
					kh := h / (tc.heads / tc.kvHeads)
					of := func(m []float32) func(j, i int) float64 {
						return func(j, i int) float64 { return float64(m[(w*tc.T+j)*kvd+kh*tc.hd+i]) }
					}
					want := refAttention(q[row*qd+h*tc.hd:][:tc.hd], of(k), of(v), lo, p, tc.scale)
					for i, o := range want {
						worst = math.Max(worst, math.Abs(float64(got[row*qd+h*tc.hd+i])-o))
					}
				}
			}
		}
		t.Logf("%+v: max |error| %.2e", tc, worst)
		if worst > 4e-3 || math.IsNaN(worst) {
			t.Errorf("%+v: output differs from the reference by %.2e", tc, worst)
		}
		for _, b := range bufs {
			x.Free(b)
		}
	}
}

func fromF16(h []uint16) []float32 {
	f := make([]float32, len(h))
	for i, v := range h {
		f[i] = float16.Float16(v).Float32()
	}
	return f
}
