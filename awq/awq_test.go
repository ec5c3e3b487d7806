package awq

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

func tinyBlock(t *testing.T) (*llm.Stages, *llm.Block, [][]float32, int) {
	t.Helper()
	ck, err := checkpoint.Open(shared.Path(t, "models/llama-tiny"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ck.Close() })
	b, err := llm.LoadBlock(ck, 1, llm.DenseLoader)
	if err != nil {
		t.Fatal(err)
	}
	E, _ := ck.Float32("model.embed_tokens.weight", 8192, 256)
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	const T = 64
	var X [][]float32
	for w := 0; w < 2; w++ {
		x := make([]float32, T*256)
		for i := 0; i < T; i++ {
			id := ids[w*T+i]
			copy(x[i*256:], E[id*256:(id+1)*256])
		}
		X = append(X, x)
	}
	return llm.NewStages(ck.Config), b, X, T
}

// TestFoldingPreservesFunction: with any positive scales folded into the
// norms and linear rows, the fp32 block output is unchanged (1e-5 relative).
func TestFoldingPreservesFunction(t *testing.T) {
	st, b, X, T := tinyBlock(t)
	want := st.Block(b, X[0], T)
	r := rand.New(rand.NewPCG(1, 2))
	randScales := func(n int) []float32 {
		s := make([]float32, n)
		for i := range s {
			s[i] = float32(math.Exp(r.NormFloat64()))
		}
		return s
	}
	sc := &Scales{QKV: Choice{Scales: randScales(256)}, GateUp: Choice{Scales: randScales(256)}, Down: Choice{Scales: randScales(768)}}
	if n := Apply(b, sc, nil); n != 0 {
		t.Fatalf("%d values clamped", n)
	}
	got := st.Block(b, X[0], T)
	var num, den float64
	for i := range want {
		num += float64(got[i]-want[i]) * float64(got[i]-want[i])
		den += float64(want[i]) * float64(want[i])
	}
	if rel := math.Sqrt(num / den); rel > 1e-5 {
		t.Fatalf("block output changed by %.2e relative after folding", rel)
	}
}

// TestFoldIntoLinearRows covers the v_proj → o_proj fold (shapes match
// only without GQA, which no shared model has): o(v(x)) is unchanged.
func TestFoldIntoLinearRows(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	d := 32
	v := llm.NewDense(make([]float32, d*d), make([]float32, d), d, d)
	o := llm.NewDense(make([]float32, d*d), nil, d, d)
	for i := range v.W {
		v.W[i], o.W[i] = float32(r.NormFloat64()), float32(r.NormFloat64())
	}
	for i := range v.B {
		v.B[i] = float32(r.NormFloat64())
	}
	x := make([]float32, 4*d)
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	run := func() []float32 {
		h, y := make([]float32, 4*d), make([]float32, 4*d)
		v.Forward(h, x, 4)
		o.Forward(y, h, 4)
		return y
	}
	want := run()
	s := make([]float32, d)
	for i := range s {
		s[i] = 0.1 + 5*r.Float32()
	}
	DivideRows(v.W, v.B, d, s)
	ScaleColumns(o.W, d, s)
	got := run()
	for i := range want {
		if math.Abs(float64(got[i]-want[i])) > 1e-4*(1+math.Abs(float64(want[i]))) {
			t.Fatalf("output %d: %v → %v", i, want[i], got[i])
		}
	}
}

// TestScaleSearchMatchesDefinition checks the α search on a real down_proj
// against the definition computed independently in float64: for each α on
// the grid, s = max(x̄^α, 1e-4) / sqrt(max·min), the weights W·diag(s)
// rounded on AWQ's grid and divided by s again, and the loss the mean
// squared difference of the layer's outputs on the calibration tokens.
// The recorded loss curve must be that curve, the chosen α its minimum,
// and (the down_proj input having outlier channels) scaling must beat
// plain round-to-nearest (α = 0).
func TestScaleSearchMatchesDefinition(t *testing.T) {
	st, b, X, T := tinyBlock(t)
	f, err := Collect(context.Background(), st, b, X, T, llm.ExpertCalib{})
	if err != nil {
		t.Fatal(err)
	}
	opt := Options{Grid: pack.Grid{Bits: 4, GroupSize: 128, MinMax: true}}
	down := dense(b.Down)
	out, in := down.Out(), down.In()
	c, err := searchLinear(down, f.Act, f.orgM, opt)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Loss) != 20 {
		t.Fatalf("%d losses recorded, want 20", len(c.Loss))
	}
	xbar := make([]float64, in)
	for _, x := range f.Act {
		for k, v := range x {
			xbar[k%in] += math.Abs(float64(v)) / float64(len(f.Act)*T)
		}
	}
	want := make([]float64, 20)
	for r := range want {
		alpha := float64(r) / 20
		s := make([]float64, in)
		lo, hi := math.Inf(1), 0.0
		for k, x := range xbar {
			s[k] = math.Max(math.Pow(x, alpha), 1e-4)
			lo, hi = math.Min(lo, s[k]), math.Max(hi, s[k])
		}
		s32 := make([]float32, in)
		for k := range s {
			s32[k] = float32(s[k] / math.Sqrt(lo*hi))
		}
		wq := make([]float64, out*in)
		for o := 0; o < out; o++ {
			for g := 0; g < in; g += 128 {
				seg := make([]float32, 128)
				for k := range seg {
					seg[k] = down.W[o*in+g+k] * s32[g+k]
				}
				scale, zero := opt.Grid.Params(seg)
				for k, v := range seg {
					wq[o*in+g+k] = float64(pack.Dequantize(opt.Grid.Quantize(v, scale, zero), scale, zero) / s32[g+k])
				}
			}
		}
		for _, x := range f.Act {
			var se float64
			for tk := 0; tk < T; tk++ {
				row := x[tk*in : (tk+1)*in]
				for o := 0; o < out; o++ {
					var a, q float64
					for k, v := range row {
						a += float64(down.W[o*in+k]) * float64(v)
						q += wq[o*in+k] * float64(v)
					}
					se += (a - q) * (a - q)
				}
			}
			want[r] += se / float64(T*out) / float64(len(f.Act))
		}
	}
	best := 0
	for r, l := range want {
		// The layer runs in float32, the definition in float64.
		if math.Abs(c.Loss[r]-l) > 1e-3*l {
			t.Errorf("α=%.2f: loss %.6g recorded, the definition gives %.6g", float64(r)/20, c.Loss[r], l)
		}
		if l < want[best] {
			best = r
		}
	}
	if a := float64(best) / 20; c.Alpha != a && math.Abs(want[int(c.Alpha*20)]-want[best]) > 1e-3*want[best] {
		t.Errorf("chose α=%.2f (loss %.6g); the definition's minimum is α=%.2f (%.6g)", c.Alpha, want[int(c.Alpha*20)], a, want[best])
	}
	t.Logf("down_proj: α=%.2f, loss %.4g vs RTN (α=0) %.4g", c.Alpha, want[best], want[0])
	if best == 0 || want[best] >= 0.9*want[0] {
		t.Errorf("scaling does not pay off on down_proj: best α=%.2f, loss %.4g vs RTN %.4g", float64(best)/20, want[best], want[0])
	}
	w := append([]float32(nil), down.W...)
	shrink := Clip(w, out, in, f.Act, opt)
	if shrink <= 0.5 || shrink > 1 {
		t.Fatalf("mean shrink %v outside (0.5, 1]", shrink)
	}
}

// TestClipMatchesDefinition checks Clip against its definition computed
// plainly, one output channel and group at a time: for each shrink
// f = 1 − i/20 (i < 10) clamp the group to ±f·max|w|, quantize, and keep
// the f whose partial outputs on the subsampled rows are closest.
func TestClipMatchesDefinition(t *testing.T) {
	const out, in, T = 24, 256, 700
	r := rand.New(rand.NewPCG(3, 4))
	w := make([]float32, out*in)
	for i := range w {
		w[i] = float32(r.NormFloat64() * 0.02)
		if r.IntN(50) == 0 {
			w[i] *= 8 // a few large weights, so shrinking pays off somewhere
		}
	}
	xs := [][]float32{make([]float32, T*in), make([]float32, T*in)}
	for _, x := range xs {
		for i := range x {
			x[i] = float32(r.NormFloat64())
		}
	}
	// The reference subsamples every (rows/512)-th row: 1400/512 = 2.
	var rows [][]float32
	for k := 0; k < 2*T; k += 2 {
		rows = append(rows, xs[k/T][(k%T)*in:(k%T+1)*in])
	}
	for _, bits := range []int{3, 4} {
		g := pack.Grid{Bits: bits, GroupSize: 128, MinMax: true}
		want := append([]float32(nil), w...)
		for o := 0; o < out; o++ {
			for s := 0; s < in; s += 128 {
				seg := want[o*in+s : o*in+s+128]
				var mx float64
				for _, v := range seg {
					mx = math.Max(mx, math.Abs(float64(v)))
				}
				best, bestF := math.Inf(1), 1.0
				for i := 0; i < 10; i++ {
					m := float32(mx) * (1 - float32(i)/20)
					q := make([]float32, 128)
					for j, v := range seg {
						q[j] = min(max(v, -m), m)
					}
					scale, zero := g.Params(q)
					var e float64
					for _, x := range rows {
						var a, b float64
						for j, v := range seg {
							a += float64(x[s+j]) * float64(v)
							b += float64(x[s+j]) * float64(pack.Dequantize(g.Quantize(q[j], scale, zero), scale, zero))
						}
						e += (a - b) * (a - b)
					}
					if e < best {
						best, bestF = e, 1-float64(i)/20
					}
				}
				m := float32(mx) * float32(bestF)
				for j, v := range seg {
					seg[j] = min(max(v, -m), m)
				}
			}
		}
		got := append([]float32(nil), w...)
		Clip(got, out, in, xs, Options{Grid: g})
		diff := 0
		for i := range got {
			if got[i] != want[i] {
				diff++
			}
		}
		if diff > 0 {
			t.Errorf("%d bits: %d of %d clipped weights differ from the definition", bits, diff, len(got))
		}
	}
}

// TestFoldingPreservesFunctionZoo: in Qwen3-MoE's and Mixtral's sparse
// blocks (one gate/up scale for every expert, compensated in the router;
// a down scale per expert) and Gemma 3's (norms held as 1+w), folding
// random positive scales leaves the fp32 block output unchanged (1e-5
// relative): the router's columns must carry the scale, or routing and
// weights would follow the scaled input.
func TestFoldingPreservesFunctionZoo(t *testing.T) {
	for _, name := range []string{"qwen3moe-rand", "mixtral-rand", "gemma3-rand"} {
		ck, err := checkpoint.Open(shared.Path(t, "models/archzoo/"+name))
		if err != nil {
			t.Fatal(err)
		}
		defer ck.Close()
		c := ck.Config
		b, err := llm.LoadBlock(ck, 1, llm.DenseLoader)
		if err != nil {
			t.Fatal(err)
		}
		st := llm.NewStages(c)
		const T = 48
		r := rand.New(rand.NewPCG(5, 6))
		x := make([]float32, T*c.Hidden)
		for i := range x {
			x[i] = float32(r.NormFloat64())
		}
		want := st.Block(b, x, T)
		randScales := func(n int) []float32 {
			s := make([]float32, n)
			for i := range s {
				s[i] = float32(math.Exp(0.5 * r.NormFloat64()))
			}
			return s
		}
		sc := &Scales{QKV: Choice{Scales: randScales(c.Hidden)}, GateUp: Choice{Scales: randScales(c.Hidden)}}
		if b.MoE != nil {
			for range b.MoE.Experts {
				sc.ExpertDown = append(sc.ExpertDown, Choice{Scales: randScales(c.MoE.Intermediate)})
			}
		} else {
			sc.Down = Choice{Scales: randScales(c.Intermediate)}
		}
		if n := Apply(b, sc, nil); n != 0 {
			t.Fatalf("%s: %d values clamped", name, n)
		}
		got := st.Block(b, x, T)
		var num, den float64
		for i := range want {
			num += float64(got[i]-want[i]) * float64(got[i]-want[i])
			den += float64(want[i]) * float64(want[i])
		}
		if rel := math.Sqrt(num / den); rel > 1e-5 {
			t.Errorf("%s: block output changed by %.2e relative after folding", name, rel)
		}
	}
}
