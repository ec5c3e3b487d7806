//go:build cgo

package cuda

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/llmq/llmq/gptq"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/calib"
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
			if gp.Damp, err = gptq.Damp(mean, tc.opt, func(l float64) (bool, error) { return c.GPTQFactor(h, gp.Perm, l) }); err != nil {
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

// TestCalibratorMatchesStages runs llama-tiny's first block over four
// windows of WikiText-2 on the GPU (Calibrator) and on the CPU (package
// llm's Stages, what the CPU quantize path runs): the four inputs'
// Hessians agree to within fp16 rounding of the activations, and so does
// the block's output, in both the one-pass and the true-sequential stages.
func TestCalibratorMatchesStages(t *testing.T) {
	lib := openLib(t)
	const T, N = 256, 4
	cfg, X, b := tinyBlock0(t, T, N)
	st := llm.NewStages(cfg)
	qd := cfg.Heads * cfg.HeadDim
	cpu := [4]*gptq.Hessian{gptq.NewHessian(cfg.Hidden), gptq.NewHessian(qd), gptq.NewHessian(cfg.Hidden), gptq.NewHessian(cfg.Intermediate)}
	var next [][]float32
	for _, x := range X {
		n := st.Norm(b.AttnNorm, x, T)
		att := st.Attention(b, n, T)
		h := append([]float32(nil), x...)
		st.AddLinear(h, b.O, att, T)
		m := st.Norm(b.MLPNorm, h, T)
		for i, in := range [][]float32{n, att, m, st.MLPAct(b, m, T)} {
			if err := cpu[i].Add(in, T); err != nil {
				t.Fatal(err)
			}
		}
		next = append(next, st.Block(b, x, T))
	}
	rel := func(got, want []float32) float64 {
		var d, n float64
		for i := range want {
			d += float64(got[i]-want[i]) * float64(got[i]-want[i])
			n += float64(want[i]) * float64(want[i])
		}
		return math.Sqrt(d / n)
	}
	for _, sequential := range []bool{false, true} {
		c, err := NewCalibrator(lib, cfg, X, T)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.SetBlock(b); err != nil {
			t.Fatal(err)
		}
		var hs [4]*Hessian
		for i, h := range cpu {
			if hs[i], err = c.NewHessian(h.In); err != nil {
				t.Fatal(err)
			}
		}
		ctx := context.Background()
		if sequential {
			for i, f := range []func(context.Context, *Hessian) error{c.AttentionInput, c.AttentionOutput, c.MLPInput, c.MLPAct} {
				if err := f(ctx, hs[i]); err != nil {
					t.Fatal(err)
				}
			}
			err = c.Outputs(ctx)
		} else if err = c.Statistics(ctx, Stats{hs[0], hs[1], hs[2], hs[3]}); err == nil {
			err = c.Propagate(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		for i, h := range hs {
			got := make([]float32, h.In*h.In)
			if err := Download(c.x, got, h.Sum); err != nil {
				t.Fatal(err)
			}
			want := cpu[i].Matrix()
			w32 := make([]float32, len(want))
			s := float64(h.Rows) / 2
			for j, v := range want {
				w32[j] = float32(v * s) // back to Σ x·xᵀ
			}
			e := rel(got, w32)
			t.Logf("sequential %v: Hessian %d (%d inputs, %d rows): relative difference %.2e", sequential, i, h.In, h.Rows, e)
			if h.Rows != N*T || e > 5e-3 {
				t.Errorf("Hessian %d: %d rows, relative difference %.2e from the CPU's", i, h.Rows, e)
			}
		}
		out, err := c.Download()
		if err != nil {
			t.Fatal(err)
		}
		for w := range out {
			if e := rel(out[w], next[w]); e > 5e-3 {
				t.Errorf("sequential %v: window %d: block output differs from the CPU's by %.2e", sequential, w, e)
			}
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// tinyBlock0 returns llama-tiny's config, the embeddings of its first N
// windows of T WikiText-2 tokens, and its first block (dense weights).
func tinyBlock0(t *testing.T, T, N int) (*checkpoint.Config, [][]float32, *llm.Block) {
	ck, err := checkpoint.Open(shared.Path(t, "models/llama-tiny"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ck.Close() }) // the block may read the mapped files
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	windows := make([][]int, N)
	for w := range windows {
		windows[w] = ids[w*T : (w+1)*T]
	}
	X, err := calib.Embed(ck, windows)
	if err != nil {
		t.Fatal(err)
	}
	b, err := llm.LoadBlock(ck, 0, llm.DenseLoader)
	if err != nil {
		t.Fatal(err)
	}
	return ck.Config, X, b
}
