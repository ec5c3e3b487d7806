//go:build cgo

package cuda

import (
	"math/rand/v2"
	"testing"

	"github.com/llmq/llmq/actquant"
)

// TestFakeQuantMatchesCPU: the GPU's activation fake-quantization gives
// package actquant's values bit for bit (after the fp16 store) for INT8
// and INT4 per token, INT8 per tensor with saturation, FP8 per token and
// per tensor, and leaves an all-zero row as it is.
func TestFakeQuantMatchesCPU(t *testing.T) {
	x := openContext(t)
	r := rand.New(rand.NewPCG(31, 32))
	const rows, cols = 9, 1000
	in := make([]float32, rows*cols)
	for i := range in {
		in[i] = float32(r.NormFloat64() * float64(1+i%7))
	}
	for i := 0; i < cols; i++ {
		in[4*cols+i] = 0 // a zero row
	}
	in[2*cols+5] = 300 // an outlier
	in = fromF16(toF16(in))
	src, err := AllocFrom(x, toF16(in))
	if err != nil {
		t.Fatal(err)
	}
	defer x.Free(src)
	dst, _ := x.Alloc(rows * cols * 2)
	defer x.Free(dst)
	for _, tc := range []struct {
		s         actquant.Scheme
		threshold float32
	}{
		{actquant.Scheme{Bits: 8, PerToken: true}, 0}, {actquant.Scheme{Bits: 4, PerToken: true}, 0},
		{actquant.Scheme{Bits: 8}, 6.5}, {actquant.Scheme{Bits: 8, FP8: true, PerToken: true}, 0},
		{actquant.Scheme{Bits: 8, FP8: true}, 20},
	} {
		a := &ActQuant{Bits: tc.s.Bits, FP8: tc.s.FP8, PerToken: tc.s.PerToken}
		if err := x.FakeQuant(src, dst, rows, cols, a, tc.threshold); err != nil {
			t.Fatal(err)
		}
		got := make([]uint16, rows*cols)
		if err := Download(x, got, dst); err != nil {
			t.Fatal(err)
		}
		want := append([]float32(nil), in...)
		tc.s.FakeQuant(want, rows, cols, tc.threshold)
		w16 := toF16(want)
		diff := 0
		for i := range got {
			if got[i] != w16[i] {
				if diff == 0 {
					t.Logf("%s: first difference at %d: GPU %v, CPU %v (input %v)", tc.s, i, fromF16(got[i : i+1])[0], want[i], in[i])
				}
				diff++
			}
		}
		t.Logf("%s (threshold %g): %d of %d values differ", tc.s, tc.threshold, diff, len(got))
		if diff > 0 {
			t.Errorf("%s: the GPU's fake quantization differs from the CPU's", tc.s)
		}
	}
	if err := x.FakeQuant(src, dst, rows, cols, &ActQuant{Bits: 4, FP8: true}, 1); err == nil {
		t.Error("FP8 with 4 bits accepted")
	}
}
