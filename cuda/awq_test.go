//go:build cgo

package cuda

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/llmq/llmq/awq"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/pack"
)

// awqWeights are test weights [out][in] with the cases the grid code
// branches on: an all-zero group, a constant group, a group of one huge
// value among small ones, and otherwise Gaussian values.
func awqWeights(r *rand.Rand, out, in int) []float32 {
	W := make([]float32, out*in)
	for i := range W {
		W[i] = float32(r.NormFloat64() * 0.05)
	}
	for i := 0; i < 32; i++ {
		W[i] = 0 // row 0's first group: all zero (for groups of 32 and up)
		W[in+i] = 0.25
	}
	W[2*in+5] = 40
	return W
}

// TestAWQQuantMatchesCPU writes scaled candidates Q(W·s)/s on the GPU and
// with package awq on the CPU: the fp16 weights are the same bit for bit
// (the grid arithmetic is done in the same float32 operations), on AWQ's
// MinMax grid and on the GPTQ-style one (sym and asym), with and without
// scales.
func TestAWQQuantMatchesCPU(t *testing.T) {
	x := openContext(t)
	const out, in = 48, 256
	r := rand.New(rand.NewPCG(3, 4))
	W := awqWeights(r, out, in)
	s := make([]float32, in)
	for i := range s {
		s[i] = float32(math.Exp(r.NormFloat64()))
	}
	wb, err := AllocFrom(x, W)
	if err != nil {
		t.Fatal(err)
	}
	sb, err := AllocFrom(x, s)
	if err != nil {
		t.Fatal(err)
	}
	qb, err := x.Alloc(out * in * 2)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range []pack.Grid{
		{Bits: 4, GroupSize: 128, MinMax: true},
		{Bits: 3, GroupSize: 32, MinMax: true},
		{Bits: 4, GroupSize: 64},
		{Bits: 4, GroupSize: -1, Sym: true},
		{Bits: 8, GroupSize: 128, MinMax: true},
	} {
		for _, scaled := range []bool{false, true} {
			var want []float32
			sbuf := Buf{}
			if scaled {
				want = awq.ScaledQuant(W, out, in, s, g)
				sbuf = sb
			} else {
				want = awq.FakeQuant(W, out, in, g)
			}
			if err := x.AWQQuant(wb, sbuf, qb, out, in, g); err != nil {
				t.Fatal(err)
			}
			got := make([]uint16, out*in)
			if err := Download(x, got, qb); err != nil {
				t.Fatal(err)
			}
			diff := 0
			for i, v := range toF16(want) {
				if got[i] != v {
					if diff == 0 {
						t.Errorf("grid %+v scaled %v: weight %d: GPU %#04x, CPU %#04x", g, scaled, i, got[i], v)
					}
					diff++
				}
			}
			if diff > 0 {
				t.Errorf("grid %+v scaled %v: %d of %d weights differ", g, scaled, diff, out*in)
			}
		}
	}
}

// TestAWQClipMatchesCPU runs the clip search on the GPU (the Gram-matrix
// form) and with package awq on the CPU (partial outputs on the sampled
// rows) from the same inputs, exact in fp16: the thresholds agree where
// the choice is not a near tie, and the GPU's choices preserve the
// partial outputs as well as the CPU's (total error, measured the CPU's
// way in float64, within 0.1%).
func TestAWQClipMatchesCPU(t *testing.T) {
	x := openContext(t)
	const out, in, R = 64, 256, 512
	r := rand.New(rand.NewPCG(5, 6))
	W := awqWeights(r, out, in)
	X := make([]float32, R*in)
	for i := range X {
		X[i] = float32(r.IntN(257)-128) / 64
		if i%in == 3 {
			X[i] *= 8 // a salient channel
		}
	}
	s := make([]float32, in)
	for i := range s {
		s[i] = float32(math.Exp(r.NormFloat64() / 2))
	}
	g := pack.Grid{Bits: 4, GroupSize: 64, MinMax: true}
	const nShrink = 10

	// CPU: weights scaled by s, inputs divided by s (as awq.Apply leaves
	// them), every row sampled (R ≤ 512).
	Ws := append([]float32(nil), W...)
	awq.ScaleColumns(Ws, in, s)
	Xs := append([]float32(nil), X...)
	for i := range Xs {
		Xs[i] /= s[i%in]
	}
	cpu := append([]float32(nil), Ws...)
	awq.Clip(cpu, out, in, [][]float32{Xs}, awq.Options{Grid: g, NGrid: 2 * nShrink})

	// GPU: the Gram matrix of the unscaled inputs, the scales in the kernel.
	xb, err := AllocFrom(x, toF16(X))
	if err != nil {
		t.Fatal(err)
	}
	var bufs [7]Buf
	for i, n := range []int{in * in * 4, out * in * 4, out * in * 4, out * in * 4, out * (in / 64) * 8, out * (in / 64) * 4, in * 4} {
		if bufs[i], err = x.Alloc(n); err != nil {
			t.Fatal(err)
		}
	}
	H, wb, D, P, errs, best, sb := bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5], bufs[6]
	if err := x.Memset(H, 0, H.Bytes); err != nil {
		t.Fatal(err)
	}
	if err := x.HessianAdd(xb, H, R, in); err != nil {
		t.Fatal(err)
	}
	if err := Upload(x, wb, Ws); err != nil {
		t.Fatal(err)
	}
	if err := Upload(x, sb, s); err != nil {
		t.Fatal(err)
	}
	if err := x.AWQClip(wb, sb, H, D, P, errs, best, out, in, g, nShrink); err != nil {
		t.Fatal(err)
	}
	thr := make([]float32, out*(in/64))
	if err := Download(x, thr, best); err != nil {
		t.Fatal(err)
	}

	// errOf is the CPU's measure of a threshold m for row o, group gi.
	errOf := func(o, gi int, m float32) float64 {
		seg := Ws[o*in+gi*64 : o*in+(gi+1)*64]
		c := make([]float32, 64)
		for i, v := range seg {
			c[i] = min(max(v, -m), m)
		}
		scale, zero := g.Params(c)
		var e float64
		for t := 0; t < R; t++ {
			var d float64
			for i := range c {
				q := pack.Dequantize(g.Quantize(c[i], scale, zero), scale, zero)
				d += float64(Xs[t*in+gi*64+i]) * float64(q-seg[i])
			}
			e += d * d
		}
		return e
	}
	same := 0
	var eCPU, eGPU float64
	for o := 0; o < out; o++ {
		for gi := 0; gi < in/64; gi++ {
			var mx float32
			for _, v := range cpu[o*in+gi*64 : o*in+(gi+1)*64] {
				mx = max(mx, float32(math.Abs(float64(v))))
			}
			m := thr[o*(in/64)+gi]
			if m == mx || (mx == 0 && m == 0) {
				same++
			}
			eCPU += errOf(o, gi, mx)
			eGPU += errOf(o, gi, m)
		}
	}
	n := out * (in / 64)
	t.Logf("thresholds equal in %d of %d groups; partial-output error GPU %.6g, CPU %.6g", same, n, eGPU, eCPU)
	if same < n*9/10 {
		t.Errorf("thresholds equal in %d of %d groups: want ≥ 90%%", same, n)
	}
	if eGPU > eCPU*1.001 {
		t.Errorf("the GPU's thresholds lose %.6g, the CPU's %.6g", eGPU, eCPU)
	}
}

// TestAWQFeaturesMatchCPU collects AWQ's features of llama-tiny's first
// block on the GPU and with package awq on the CPU over four windows: x̄
// of the four inputs agrees to fp16 rounding; the searches' losses are
// exactly zero with the block's own weights (the search recomputes what
// AWQCollect kept, with the same kernels); a candidate's losses agree
// with the CPU's within 5% (fp16 activations against fp32); and the
// features advance X to the block's output.
func TestAWQFeaturesMatchCPU(t *testing.T) {
	lib := openLib(t)
	const T, N = 256, 4
	cfg, X, b := tinyBlock0(t, T, N)
	st := llm.NewStages(cfg)
	ctx := context.Background()
	f, err := awq.Collect(ctx, st, b, X, T, llm.ExpertCalib{})
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewCalibrator(lib, cfg, X, T)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.SetBlock(b); err != nil {
		t.Fatal(err)
	}
	gf, err := c.AWQCollect(ctx, N, awq.ClipStride(N*T))
	if err != nil {
		t.Fatal(err)
	}
	defer c.FreeAWQ(gf)
	dims := c.inDims()
	for i, xs := range [][][]float32{f.N, f.Att, f.M, f.Act} {
		want := awq.ChannelMean(xs, dims[i])
		var worst float64
		for j, v := range want {
			worst = max(worst, math.Abs(gf.Mean[i][j]-v)/(v+1e-3))
		}
		t.Logf("input %d: x̄ relative difference %.2e; Gram of %d rows", i, worst, gf.Gram[i].Rows)
		if worst > 5e-3 {
			t.Errorf("input %d: x̄ differs from the CPU's by %.2e", i, worst)
		}
		if want := (N*T + awq.ClipStride(N*T) - 1) / awq.ClipStride(N*T); gf.Gram[i].Rows != want {
			t.Errorf("input %d: Gram of %d rows, want %d", i, gf.Gram[i].Rows, want)
		}
	}
	g := pack.Grid{Bits: 4, GroupSize: 128, MinMax: true}
	layers := [4][]string{{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}, {"self_attn.o_proj"}, {"mlp.gate_proj", "mlp.up_proj"}, {"mlp.down_proj"}}
	for in := range layers {
		loss, err := c.AWQLoss(ctx, gf, in, N)
		if err != nil {
			t.Fatal(err)
		}
		if loss != 0 {
			t.Errorf("input %d: loss %g with the block's own weights, want 0", in, loss)
		}
	}
	// One candidate (α = 0.5) per group, against the CPU search's loss.
	opt := awq.Options{Grid: g, NGrid: 2}
	cpu, err := awq.SearchBlock(ctx, st, b, f, opt)
	if err != nil {
		t.Fatal(err)
	}
	choices := []awq.Choice{cpu.QKV, cpu.VO, cpu.GateUp, cpu.Down}
	for in, names := range layers {
		if choices[in].Loss == nil {
			continue // v → o does not apply (GQA)
		}
		s := make([]float32, dims[in])
		mean := gf.Mean[in]
		lo, hi := math.Inf(1), 0.0
		for _, v := range mean {
			v = math.Max(math.Sqrt(v), 1e-4)
			lo, hi = math.Min(lo, v), math.Max(hi, v)
		}
		for j, v := range mean {
			s[j] = float32(math.Max(math.Sqrt(v), 1e-4) / math.Sqrt(lo*hi))
		}
		if err := c.AWQQuantize(s, g, names...); err != nil {
			t.Fatal(err)
		}
		loss, err := c.AWQLoss(ctx, gf, in, N)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Restore(names...); err != nil {
			t.Fatal(err)
		}
		want := choices[in].Loss[1]
		t.Logf("input %d: α = 0.5 loss GPU %.6g, CPU %.6g", in, loss, want)
		if math.Abs(loss-want) > 0.05*want {
			t.Errorf("input %d: α = 0.5 loss %.6g on the GPU, %.6g on the CPU", in, loss, want)
		}
	}
	if err := c.AWQAdvance(ctx, gf); err != nil {
		t.Fatal(err)
	}
	out, err := c.Download()
	if err != nil {
		t.Fatal(err)
	}
	for w := range out {
		var d, n float64
		for i, v := range f.Out[w] {
			d += float64(out[w][i]-v) * float64(out[w][i]-v)
			n += float64(v) * float64(v)
		}
		if e := math.Sqrt(d / n); e > 5e-3 {
			t.Errorf("window %d: X after AWQAdvance differs from the block's output by %.2e", w, e)
		}
	}
}
