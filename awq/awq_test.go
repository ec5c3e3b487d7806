package awq

import (
	"context"
	"math"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/gptq"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
	"github.com/nlpodyssey/safetensors"
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

// TestScaleSearchBeatsRTN: on a real block, the searched scales give a
// module output error no worse than α = 0 (plain RTN), and clipping does
// not increase the partial-output error.
func TestScaleSearchBeatsRTN(t *testing.T) {
	st, b, X, T := tinyBlock(t)
	f, err := Collect(context.Background(), st, b, X, T)
	if err != nil {
		t.Fatal(err)
	}
	opt := Options{Grid: pack.Grid{Bits: 4, GroupSize: 128, MinMax: true}}
	var errs []float64
	down := dense(b.Down)
	eval := func(qw [][]float32) (float64, error) {
		ql := llm.NewDense(qw[0], nil, down.In(), down.Out())
		var s float64
		for w, a := range f.Act {
			out := make([]float32, T*down.Out())
			ql.Forward(out, a, T)
			s += MSE(out, f.orgM[w])
		}
		errs = append(errs, s)
		return s, nil
	}
	c, err := Search([][]float32{down.W}, down.In(), ChannelMean(f.Act, down.In()), eval, opt)
	if err != nil {
		t.Fatal(err)
	}
	scales, alpha := c.Scales, c.Alpha
	if len(c.Loss) != 20 || len(errs) != 20 {
		t.Fatalf("%d losses recorded for %d candidates", len(c.Loss), len(errs))
	}
	for i, e := range c.Loss {
		if e != errs[i] {
			t.Fatalf("loss %d recorded as %v, the candidate scored %v", i, e, errs[i])
		}
	}
	rtnErr := errs[0] // α = 0: s ≡ 1, plain round-to-nearest
	got, _ := eval([][]float32{ScaledQuant(down.W, down.Out(), down.In(), scales, opt.Grid)})
	t.Logf("down_proj: α=%.2f, error %.4g vs RTN (α=0) %.4g", alpha, got, rtnErr)
	// The down_proj input has outlier channels, so scaling must pay off here,
	// and the returned scales must be the ones that scored best.
	if alpha == 0 || got >= 0.9*rtnErr {
		t.Fatalf("search chose α=%.2f with error %.4g; RTN (α=0) has %.4g", alpha, got, rtnErr)
	}
	for _, e := range errs[:len(errs)-1] {
		if e < got {
			t.Fatalf("returned scales score %.4g, but a candidate scored %.4g", got, e)
		}
	}
	w := append([]float32(nil), down.W...)
	shrink := Clip(w, down.Out(), down.In(), f.Act, opt)
	if shrink <= 0.5 || shrink > 1 {
		t.Fatalf("mean shrink %v outside (0.5, 1]", shrink)
	}
}

// TestExportsAgree quantizes llama-tiny with AWQ (a short calibration) into
// the GPTQ layout and the AutoAWQ layout: both load, carry the right
// quantization_config, and dequantize to identical weights.
func TestExportsAgree(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	dir := t.TempDir()
	opt := Options{Grid: pack.Grid{Bits: 4, GroupSize: 128, MinMax: true}, Clip: true}
	var stats []LinearStats
	run := func(format string, st *[]LinearStats) string {
		out := filepath.Join(dir, format)
		_, err := gptq.Run(context.Background(), gptq.RunOptions{Src: src, Out: out, Method: "awq", Format: format,
			Custom: Quantizer(opt, st), GPTQ: gptq.Options{Grid: opt.Grid}, Calib: shared.Path(t, "data/calib.txt"),
			NSamples: 4, SeqLen: 64})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	a, b := run("gptq", &stats), run("awq", nil)
	cka, err := checkpoint.Open(a)
	if err != nil {
		t.Fatal(err)
	}
	defer cka.Close()
	ckb, err := checkpoint.Open(b)
	if err != nil {
		t.Fatal(err)
	}
	defer ckb.Close()
	qa, _ := pack.ParseQuantConfig(cka.Config.Quantization)
	qb, _ := pack.ParseQuantConfig(ckb.Config.Quantization)
	if qa.QuantMethod != "gptq" || qb.QuantMethod != "awq" || qb.Version != "gemm" || qb.ZeroPoint == nil || !*qb.ZeroPoint {
		t.Fatalf("configs: %+v / %+v", qa, qb)
	}
	for _, name := range []string{"model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj"} {
		in, out := 256, 256
		if name == "model.layers.3.mlp.down_proj" {
			in = 768
		}
		la, err := qa.Read(cka, name, in, out)
		if err != nil {
			t.Fatal(err)
		}
		lb, err := qb.Read(ckb, name, in, out)
		if err != nil {
			t.Fatal(err)
		}
		wa, wb := la.Dequantize(), lb.Dequantize()
		for i := range wa {
			if wa[i] != wb[i] {
				t.Fatalf("%s weight %d: %v (gptq layout) vs %v (awq layout)", name, i, wa[i], wb[i])
			}
		}
	}
	// The folded norms are stored exactly, and the model runs.
	if nt, _ := cka.Tensor("model.layers.0.input_layernorm.weight"); nt.DType.String() != "F32" {
		t.Errorf("folded norm stored as %s", nt.DType)
	}
	// Stats: per block q/o/gate/down inputs; α and its loss curve for the
	// three groups llama-tiny has (no v→o under GQA), the chosen α the
	// curve's minimum; clip shrinks of the layers reading each input.
	if len(stats) != 16 {
		t.Fatalf("stats: %d entries, want 16", len(stats))
	}
	for i, st := range stats {
		if st.SaliencyMax < st.SaliencyP50 || st.Tokens != 4*64 {
			t.Errorf("%s: saliency max %v < p50 %v, or %d tokens", st.Layer, st.SaliencyMax, st.SaliencyP50, st.Tokens)
		}
		if i%4 == 1 {
			if st.Alpha != nil || len(st.ClipShrink) != 1 {
				t.Errorf("%s: α %v (want none), clip %v", st.Layer, st.Alpha, st.ClipShrink)
			}
			continue
		}
		if st.Alpha == nil || len(st.AlphaLoss) != 20 {
			t.Fatalf("%s: α %v, %d losses", st.Layer, st.Alpha, len(st.AlphaLoss))
		}
		best := 0
		for j, l := range st.AlphaLoss {
			if l < st.AlphaLoss[best] {
				best = j
			}
		}
		if float64(best)/20 != *st.Alpha {
			t.Errorf("%s: α %v, but the smallest loss is at %v", st.Layer, *st.Alpha, float64(best)/20)
		}
		wantClip := map[int]int{0: 1, 2: 2, 3: 1}[i%4]
		if len(st.ClipShrink) != wantClip {
			t.Errorf("%s: clip shrinks %v, want %d", st.Layer, st.ClipShrink, wantClip)
		}
		for name, v := range st.ClipShrink {
			if v < 0.55 || v > 1 {
				t.Errorf("%s: %s mean shrink %v outside [0.55, 1]", st.Layer, name, v)
			}
		}
	}
	m, err := pack.OpenModel(b)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if _, err := llm.Generate(context.Background(), m.Model, []int{0, 462}, llm.GenerateOptions{MaxTokens: 3}, nil); err != nil {
		t.Fatal(err)
	}
}

// awq+gptq: scales searched and folded into each block, then GPTQ on the
// scaled weights. The folded norms are written as F32 and differ from the
// originals, and the model stays close to the unquantized one (a scale
// applied on one side only would wreck its perplexity).
func TestAWQThenGPTQ(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	out := filepath.Join(t.TempDir(), "awq-gptq")
	grid := pack.Grid{Bits: 4, GroupSize: 128}
	_, err := gptq.Run(context.Background(), gptq.RunOptions{Src: src, Out: out, Method: "awq+gptq",
		Prepare: Prepare(Options{Grid: pack.Grid{Bits: 4, GroupSize: 128, MinMax: true}}),
		GPTQ:    gptq.Options{Grid: grid, Damp: 0.01, BlockSize: 128}, TrueSequential: true,
		Calib: shared.Path(t, "data/calib.txt"), NSamples: 4, SeqLen: 256})
	if err != nil {
		t.Fatal(err)
	}
	ck, err := checkpoint.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	orig, _ := checkpoint.Open(src)
	defer orig.Close()
	q, _ := pack.ParseQuantConfig(ck.Config.Quantization)
	if q == nil || q.Meta == nil || q.Meta.Method != "awq+gptq" || q.QuantMethod != "gptq" {
		t.Fatalf("quantization_config %+v", q)
	}
	name := "model.layers.0.input_layernorm.weight"
	tq, _ := ck.Tensor(name)
	a, _ := ck.Float32(name, 256)
	b, _ := orig.Float32(name, 256)
	same := true
	for i := range a {
		same = same && a[i] == b[i]
	}
	if tq.DType != safetensors.F32 || same {
		t.Errorf("%s: dtype %s, equal to the original: %v (scales not folded?)", name, tq.DType, same)
	}
	ppl := func(dir string) float64 {
		m, err := pack.OpenModel(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
		res, err := evals.Perplexity(context.Background(), m, ids, evals.PPLOptions{SeqLen: 512, Windows: 2})
		if err != nil {
			t.Fatal(err)
		}
		return res.Perplexity
	}
	pq, pf := ppl(out), ppl(src)
	t.Logf("awq+gptq w4 perplexity %.3f, unquantized %.3f (2 windows of 512)", pq, pf)
	if pq > pf*1.05 {
		t.Errorf("awq+gptq perplexity %.3f is more than 5%% above the unquantized %.3f", pq, pf)
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
