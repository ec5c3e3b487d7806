//go:build cgo

package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/llmq/llmq/gptq"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// TestGPTQOnGPUMatchesCPU runs GPTQ on one layer on the GPU and with
// package gptq on the CPU, from the same calibration rows (values exact in
// fp16, so both Hessians sum the same products): the inverse Cholesky
// factors agree to float32 rounding, and so do the codes, scales and the
// loss, for plain groups, act-order with symmetric 3-bit groups of 32,
// one group per row, and static groups. A dead input is among the rows.
func TestGPTQOnGPUMatchesCPU(t *testing.T) {
	lib := openLib(t)
	cfg, err := checkpoint.LoadConfig(shared.Path(t, "models/llama-tiny"))
	if err != nil {
		t.Fatal(err)
	}
	const in, out, rows = 256, 64, 512
	r := rand.New(rand.NewPCG(1, 2))
	X := make([]float32, rows*in)
	for i := range X {
		X[i] = float32(r.IntN(129)-64) / 64
		if j := i % in; j > 0 && j%5 == 0 {
			X[i] += X[i-1] / 2 // correlated inputs
		}
		if i%in == 7 {
			X[i] = 0 // a dead input
		}
	}
	W := make([]float32, out*in)
	for i := range W {
		W[i] = float32(r.NormFloat64() * 0.05)
	}
	c, err := NewCalibrator(lib, cfg, [][]float32{make([]float32, 16*cfg.Hidden)}, 16)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	h, err := c.NewHessian(in)
	if err != nil {
		t.Fatal(err)
	}
	xb, err := AllocFrom(c.x, toF16(X))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.x.HessianAdd(xb, h.Sum, rows, in); err != nil {
		t.Fatal(err)
	}
	h.Rows = rows
	cpuH := gptq.NewHessian(in)
	if err := cpuH.Add(X, rows); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name string
		opt  gptq.Options
	}{
		{"w4 g128", gptq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 128}}},
		{"w3 g32 sym act-order", gptq.Options{Grid: pack.Grid{Bits: 3, GroupSize: 32, Sym: true}, ActOrder: true}},
		{"w4 per-channel", gptq.Options{Grid: pack.Grid{Bits: 4, GroupSize: -1}}},
		{"w4 g64 static", gptq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 64}, StaticGroups: true, ActOrder: true}},
		{"w4 g32 groups from block start", gptq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 32}, GroupsFromBlockStart: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.opt.Damp = 0.01
			p, err := gptq.Prepare(cpuH.Matrix(), in, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			want, err := gptq.Quantize(W, out, in, p, tc.opt)
			if err != nil {
				t.Fatal(err)
			}

			diag, err := c.Diag(h)
			if err != nil {
				t.Fatal(err)
			}
			gp, mean := gptq.Order(diag, tc.opt.ActOrder)
			for i := range gp.Perm {
				if gp.Perm[i] != p.Perm[i] || gp.Dead[i] != p.Dead[i] {
					t.Fatalf("column order or dead inputs differ at %d", i)
				}
			}
			if err := gptq.Damp(mean, tc.opt, func(l float64) (bool, error) { return c.GPTQFactor(h, gp.Perm, l) }, &gp.Damp); err != nil {
				t.Fatal(err)
			}
			U := make([]float32, in*in)
			if err := Download(c.x, U, c.hinv); err != nil {
				t.Fatal(err)
			}
			var worst, scale float64
			for i, v := range p.Hinv {
				worst = max(worst, math.Abs(float64(v-U[i])))
				scale = max(scale, math.Abs(float64(v)))
			}
			t.Logf("max |ΔU| %.2e of max |U| %.2e", worst, scale)
			if worst > 1e-5*scale {
				t.Errorf("inverse Cholesky factors differ by %.2e (max |U| %.2e)", worst, scale)
			}

			lay, err := gptq.NewLayout(W, out, in, gp, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			q, loss, err := c.GPTQ(h, lay.W, out, in, lay.GroupOf, lay.Linear.Scale, lay.Linear.Zero, tc.opt.Grid, lay.Fit, tc.opt.GroupsFromBlockStart)
			if err != nil {
				t.Fatal(err)
			}
			got := lay.Finish(q)
			same := 0
			for i := range got.Q {
				if got.Q[i] == want.Linear.Q[i] {
					same++
				}
			}
			scales := 0
			for i := range got.Scale {
				if got.Scale[i] == want.Linear.Scale[i] && got.Zero[i] == want.Linear.Zero[i] {
					scales++
				}
			}
			frac := float64(same) / float64(len(got.Q))
			t.Logf("codes equal %.4f, scales/zeros equal %d/%d, loss %.6g (CPU %.6g)", frac, scales, len(got.Scale), loss, want.Loss)
			if frac < 0.995 || float64(scales) < 0.98*float64(len(got.Scale)) {
				t.Errorf("codes equal %.4f, scales and zeros %d of %d: want ≥ 0.995 and ≥ 98%%", frac, scales, len(got.Scale))
			}
			if math.Abs(loss-want.Loss) > 1e-3*want.Loss {
				t.Errorf("loss %.6g, CPU %.6g", loss, want.Loss)
			}
			for i := range got.GIdx {
				if got.GIdx[i] != want.Linear.GIdx[i] {
					t.Fatalf("g_idx differs at %d", i)
				}
			}
		})
	}
}
