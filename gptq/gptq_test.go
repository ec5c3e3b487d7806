package gptq

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

func randn(r *rand.Rand, n int, std float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64() * std)
	}
	return x
}

// TestIdentityHessianIsRTN: with H ∝ I the inverse factor is diagonal, no
// error propagates, and GPTQ must reduce to round-to-nearest exactly.
func TestIdentityHessianIsRTN(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	out, in := 48, 256
	w := randn(r, out*in, 0.05)
	H := make([]float64, in*in)
	for i := 0; i < in; i++ {
		H[i*in+i] = 3
	}
	for _, g := range []pack.Grid{{Bits: 4, GroupSize: 128}, {Bits: 4, GroupSize: 32, Sym: true}, {Bits: 3, GroupSize: -1}} {
		for _, act := range []bool{false, true} {
			opt := Options{Grid: g, ActOrder: act}
			p, err := Prepare(H, in, opt)
			if err != nil {
				t.Fatal(err)
			}
			res, err := Quantize(w, out, in, p, opt)
			if err != nil {
				t.Fatal(err)
			}
			rtn, _ := pack.RTN(w, out, in, g)
			a, b := res.Linear.Dequantize(), rtn.Dequantize()
			for i := range a {
				if a[i] != b[i] {
					t.Fatalf("grid %+v act-order %v: weight %d GPTQ %v RTN %v", g, act, i, a[i], b[i])
				}
			}
		}
	}
}

// outputError is ‖(W − Ŵ) Xᵀ‖² over calibration rows X [n][in].
func outputError(w, wq, x []float32, out, in, n int) float64 {
	var s float64
	for o := 0; o < out; o++ {
		for t := 0; t < n; t++ {
			var d float64
			for i := 0; i < in; i++ {
				d += float64(w[o*in+i]-wq[o*in+i]) * float64(x[t*in+i])
			}
			s += d * d
		}
	}
	return s
}

// TestBeatsRTNOnCorrelatedInputs: on inputs with strongly correlated
// channels and a few outlier channels (as in real LLMs), GPTQ's output
// error is well below RTN's, with and without act-order and static groups.
func TestBeatsRTNOnCorrelatedInputs(t *testing.T) {
	r := rand.New(rand.NewPCG(2, 2))
	out, in, n := 64, 256, 2048
	w := randn(r, out*in, 0.05)
	base := randn(r, n*16, 1)
	mix := randn(r, 16*in, 1)
	x := make([]float32, n*in)
	for t := 0; t < n; t++ {
		for i := 0; i < in; i++ {
			var v float32
			for k := 0; k < 16; k++ {
				v += base[t*16+k] * mix[k*in+i]
			}
			v += float32(r.NormFloat64() * 0.1)
			if i%37 == 0 {
				v *= 8 // outlier channels
			}
			x[t*in+i] = v
		}
	}
	H := NewHessian(in)
	if err := H.Add(x, n); err != nil {
		t.Fatal(err)
	}
	grid := pack.Grid{Bits: 4, GroupSize: 128}
	rtn, _ := pack.RTN(w, out, in, grid)
	eRTN := outputError(w, rtn.Dequantize(), x, out, in, n)
	for _, o := range []Options{{Grid: grid}, {Grid: grid, ActOrder: true}, {Grid: grid, ActOrder: true, StaticGroups: true}} {
		p, err := Prepare(H.Matrix(), in, o)
		if err != nil {
			t.Fatal(err)
		}
		res, err := Quantize(w, out, in, p, o)
		if err != nil {
			t.Fatal(err)
		}
		e := outputError(w, res.Linear.Dequantize(), x, out, in, n)
		t.Logf("act-order %v static %v: GPTQ/RTN output error %.3f", o.ActOrder, o.StaticGroups, e/eRTN)
		if e > 0.7*eRTN {
			t.Errorf("act-order %v static %v: GPTQ error %.4g not well below RTN %.4g", o.ActOrder, o.StaticGroups, e, eRTN)
		}
	}
}

func TestDeadColumnsAndDampingRetry(t *testing.T) {
	in := 128
	H := make([]float64, in*in) // all zero: every column dead
	var notes []string
	p, err := Prepare(H, in, Options{Log: func(f string, a ...any) { notes = append(notes, f) }})
	if err != nil {
		t.Fatal(err)
	}
	for i, d := range p.Dead {
		if !d {
			t.Fatalf("column %d not marked dead", i)
		}
	}
	// An indefinite Hessian: Cholesky fails at every damping.
	for i := 0; i < in; i++ {
		H[i*in+i] = 1
	}
	H[0*in+1], H[1*in+0] = 50, 50
	if _, err := Prepare(H, in, Options{Log: func(f string, a ...any) { notes = append(notes, f) }}); err == nil || !strings.Contains(err.Error(), "not positive definite") {
		t.Fatalf("indefinite Hessian: %v", err)
	}
	if len(notes) == 0 {
		t.Error("no note logged about increased damping")
	}
}

func TestNonFiniteRejected(t *testing.T) {
	H := NewHessian(4)
	if err := H.Add([]float32{1, float32(math.NaN()), 0, 0}, 1); err == nil {
		t.Error("NaN activation accepted")
	}
	w := []float32{1, float32(math.Inf(1)), 0, 0}
	p, _ := Prepare([]float64{1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1}, 4, Options{})
	if _, err := Quantize(w, 1, 4, p, Options{Grid: pack.Grid{Bits: 4, GroupSize: -1}}); err == nil {
		t.Error("Inf weight accepted")
	}
}

// unpackGPTQ4 decodes a 4-bit GPTQ tensor set by hand, independently of
// pack's bit-stream code: w[o][i] = scale[g][o]·(nibble(i) − zero).
func unpackGPTQ4(t *testing.T, ck *checkpoint.Checkpoint, prefix string, in, out int, v1 bool) []float32 {
	t.Helper()
	get := func(n string) checkpoint.Tensor {
		tn, err := ck.Tensor(prefix + n)
		if err != nil {
			t.Fatal(err)
		}
		return tn
	}
	qw, qz, sc, gi := get(".qweight"), get(".qzeros"), get(".scales"), get(".g_idx")
	u32 := func(tn checkpoint.Tensor, i int) uint32 { return binary.LittleEndian.Uint32(tn.Data[4*i:]) }
	scales := make([]float32, sc.Numel())
	sc.ToFloat32(scales)
	w := make([]float32, out*in)
	for o := 0; o < out; o++ {
		for i := 0; i < in; i++ {
			q := (u32(qw, (i/8)*out+o) >> (4 * (i % 8))) & 15
			g := int(int32(u32(gi, i)))
			z := (u32(qz, g*(out/8)+o/8) >> (4 * (o % 8))) & 15
			if v1 {
				z = (z + 1) & 15
			}
			w[o*in+i] = scales[g*out+o] * float32(int(q)-int(z))
		}
	}
	return w
}

// TestWrittenLayerRoundTrip quantizes a real layer of llama-tiny with a real
// Hessian, writes it with the checkpoint writer and reads it back with the
// hand decoder above: the weights must equal GPTQ's own fake-quantized
// weights bit for bit, for sym and asym, with and without act-order.
func TestWrittenLayerRoundTrip(t *testing.T) {
	ck, err := checkpoint.Open(shared.Path(t, "models/llama-tiny"))
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	in, out := 256, 768
	w, err := ck.Float32("model.layers.1.mlp.up_proj.weight", out, in)
	if err != nil {
		t.Fatal(err)
	}
	E, _ := ck.Float32("model.embed_tokens.weight", 8192, in)
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")[:512]
	x := make([]float32, len(ids)*in)
	for i, id := range ids {
		copy(x[i*in:], E[id*in:(id+1)*in])
	}
	H := NewHessian(in)
	H.Add(x, len(ids))
	for _, c := range []struct {
		sym, act bool
	}{{false, false}, {true, false}, {false, true}, {true, true}} {
		opt := Options{Grid: pack.Grid{Bits: 4, GroupSize: 128, Sym: c.sym}, ActOrder: c.act}
		p, err := Prepare(H.Matrix(), in, opt)
		if err != nil {
			t.Fatal(err)
		}
		res, err := Quantize(w, out, in, p, opt)
		if err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(t.TempDir(), "out")
		wr, err := pack.NewWriter(dir, false)
		if err != nil {
			t.Fatal(err)
		}
		tensors := map[string]checkpoint.Out{}
		if err := wr.AddGPTQ(tensors, "layer", res.Linear); err != nil {
			t.Fatal(err)
		}
		if err := wr.WritePart(tensors); err != nil {
			t.Fatal(err)
		}
		if err := wr.Finish(shared.Path(t, "models/llama-tiny"), &pack.QuantConfig{QuantMethod: "gptq", Bits: 4, GroupSize: 128}); err != nil {
			t.Fatal(err)
		}
		back, err := checkpoint.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		got := unpackGPTQ4(t, back, "layer", in, out, wr.Format == pack.FormatGPTQ)
		want := res.Linear.Dequantize()
		for i := range want {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("sym %v act-order %v format %s: weight %d reads back %v, GPTQ produced %v", c.sym, c.act, wr.Format, i, got[i], want[i])
			}
		}
		back.Close()
	}
}

// TestWriterSwitchesToV2: a zero of 0 in a later layer rewrites the shards
// already written in v1 so that the whole checkpoint is gptq_v2.
func TestWriterSwitchesToV2(t *testing.T) {
	grid := pack.Grid{Bits: 4, GroupSize: -1}
	r := rand.New(rand.NewPCG(9, 9))
	mixed, _ := pack.RTN(randn(r, 8*32, 1), 8, 32, grid) // zeros ≈ 8
	pos := make([]float32, 8*32)
	for i := range pos {
		pos[i] = 1 + r.Float32() // all ≥ 0: zero = 0
	}
	positive, _ := pack.RTN(pos, 8, 32, grid)
	dir := filepath.Join(t.TempDir(), "out")
	wr, _ := pack.NewWriter(dir, false)
	for i, l := range []*pack.Linear{mixed, positive} {
		tensors := map[string]checkpoint.Out{}
		if err := wr.AddGPTQ(tensors, "l"+string(rune('0'+i)), l); err != nil {
			t.Fatal(err)
		}
		if err := wr.WritePart(tensors); err != nil {
			t.Fatal(err)
		}
	}
	if err := wr.Finish(shared.Path(t, "models/llama-tiny"), &pack.QuantConfig{QuantMethod: "gptq", Bits: 4, GroupSize: -1}); err != nil {
		t.Fatal(err)
	}
	if wr.Format != pack.FormatGPTQv2 {
		t.Fatalf("format %s, want gptq_v2", wr.Format)
	}
	ck, err := checkpoint.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if !strings.Contains(string(ck.Config.Quantization), `"checkpoint_format": "gptq_v2"`) {
		t.Errorf("config: %s", ck.Config.Quantization)
	}
	for i, l := range []*pack.Linear{mixed, positive} {
		back, err := pack.ReadGPTQ(ck, "l"+string(rune('0'+i)), 32, 8, grid, pack.FormatGPTQv2)
		if err != nil {
			t.Fatal(err)
		}
		a, b := back.Dequantize(), l.Dequantize()
		for j := range a {
			if a[j] != b[j] {
				t.Fatalf("layer %d weight %d: %v != %v", i, j, a[j], b[j])
			}
		}
	}
}

// TestGroupsFromBlockStart: with GroupsFromBlockStart, a group that starts
// inside the first 128-column block is fitted on the weights as the block
// began — there, the original weights, so its scale and zero are exactly
// round-to-nearest's; without it, on weights the block's earlier columns
// have already updated. Groups as wide as the block are fitted alike.
func TestGroupsFromBlockStart(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	out, in, n := 16, 256, 512
	w := randn(r, out*in, 0.05)
	x := randn(r, n*in, 1)
	for t := 0; t < n; t++ { // correlated inputs, so errors propagate
		for i := 1; i < in; i++ {
			x[t*in+i] += 0.8 * x[t*in+i-1]
		}
	}
	H := NewHessian(in)
	if err := H.Add(x, n); err != nil {
		t.Fatal(err)
	}
	run := func(g pack.Grid, fromStart bool) *pack.Linear {
		o := Options{Grid: g, GroupsFromBlockStart: fromStart}
		p, err := Prepare(H.Matrix(), in, o)
		if err != nil {
			t.Fatal(err)
		}
		res, err := Quantize(w, out, in, p, o)
		if err != nil {
			t.Fatal(err)
		}
		return res.Linear
	}
	g32 := pack.Grid{Bits: 4, GroupSize: 32}
	rtn, _ := pack.RTN(w, out, in, g32)
	ref, upd := run(g32, true), run(g32, false)
	differ := 0
	for g := 0; g < 4; g++ { // the four groups of the first block
		for o := 0; o < out; o++ {
			i := g*out + o
			if ref.Scale[i] != rtn.Scale[i] || ref.Zero[i] != rtn.Zero[i] {
				t.Fatalf("group %d row %d fitted from the block's start: scale %v zero %d, the original weights give %v %d",
					g, o, ref.Scale[i], ref.Zero[i], rtn.Scale[i], rtn.Zero[i])
			}
			if g > 0 && (upd.Scale[i] != rtn.Scale[i] || upd.Zero[i] != rtn.Zero[i]) {
				differ++
			}
		}
	}
	if differ < out { // of 48 later groups, most are refitted on updated weights
		t.Errorf("only %d of %d later groups fitted on updated weights", differ, 3*out)
	}
	a, b := run(pack.Grid{Bits: 4, GroupSize: 128}, true).Dequantize(), run(pack.Grid{Bits: 4, GroupSize: 128}, false).Dequantize()
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("group 128: weight %d differs between the two fits (%v, %v)", i, a[i], b[i])
		}
	}
}
