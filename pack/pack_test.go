package pack

import (
	"bytes"
	"encoding/json"
	"errors"
	"io/fs"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/llmq/llmq/llm/checkpoint"
)

// TestGridByHand checks find_params/quantize on cases worked out by hand.
func TestGridByHand(t *testing.T) {
	g := Grid{Bits: 4, GroupSize: 128}
	// asym: range [-1, 2] → scale 3/15 = 0.2, zero round(1/0.2) = 5
	s, z := g.Params([]float32{-1, 0.5, 2})
	if s != RoundF16(0.2) || z != 5 {
		t.Errorf("asym [-1,2]: scale %v zero %d, want %v 5", s, z, RoundF16(0.2))
	}
	// scale is float16 0.19995117: 0.5/scale = 2.5006 → 3, + zero 5 = 8
	if q := g.Quantize(0.5, s, z); q != 8 {
		t.Errorf("quantize(0.5) = %d, want 8", q)
	}
	// all positive: the range is stretched to include 0
	s, z = g.Params([]float32{1, 3})
	if s != RoundF16(3.0/15) || z != 0 {
		t.Errorf("asym [1,3]: scale %v zero %d, want %v 0", s, z, RoundF16(0.2))
	}
	// sym: xmax = max(|xmin|, xmax) = 2, xmin = -2, scale 4/15, zero 8
	gs := Grid{Bits: 4, GroupSize: 128, Sym: true}
	s, z = gs.Params([]float32{-1, 2})
	if s != RoundF16(4.0/15) || z != 8 {
		t.Errorf("sym [-1,2]: scale %v zero %d", s, z)
	}
	// sym, all positive: the reference leaves xmin at 0 → scale xmax/15
	s, z = gs.Params([]float32{1, 3})
	if s != RoundF16(3.0/15) || z != 8 {
		t.Errorf("sym [1,3]: scale %v zero %d", s, z)
	}
	// all-zero group: range ±1
	s, z = g.Params([]float32{0, 0})
	if s != RoundF16(2.0/15) || z != 8 {
		t.Errorf("zeros: scale %v zero %d", s, z)
	}
	// clamping
	if q := g.Quantize(100, 0.1, 3); q != 15 {
		t.Errorf("clamp high: %d", q)
	}
	if q := g.Quantize(-100, 0.1, 3); q != 0 {
		t.Errorf("clamp low: %d", q)
	}
	// 3-bit: maxq 7
	s, z = Grid{Bits: 3, GroupSize: 32}.Params([]float32{-0.7, 0.7})
	if s != RoundF16(1.4/7) || z != 4 {
		t.Errorf("3-bit: scale %v zero %d", s, z)
	}
}

func TestGridValidate(t *testing.T) {
	for _, c := range []struct {
		grid  Grid
		in    int
		field string
		want  string // the error's text
	}{
		{Grid{Bits: 5, GroupSize: 128}, 256, "bits", "bits 5: want 2, 3, 4 or 8"},
		{Grid{Bits: 1, GroupSize: -1}, 256, "bits", "bits 1: want 2, 3, 4 or 8"},
		{Grid{Bits: 4, GroupSize: 0}, 256, "group size", "group size 0: want a positive size, or -1 for one group per row"},
		{Grid{Bits: 4, GroupSize: -2}, 0, "group size", "group size -2: want a positive size, or -1 for one group per row"},
		{Grid{Bits: 4, GroupSize: 100}, 256, "group size", "group size 100: want a size dividing the layer's 256 input features"},
		{Grid{Bits: 4, GroupSize: 128}, 320, "group size", "group size 128: want a size dividing the layer's 320 input features"},
		{Grid{Bits: 4, GroupSize: 512}, 256, "group size", "group size 512: want a size dividing the layer's 256 input features"},
	} {
		err := c.grid.Validate(c.in)
		var ge *GridError
		if !errors.As(err, &ge) || ge.Field != c.field || err.Error() != c.want {
			t.Errorf("%+v on %d inputs: %v, want a GridError %q", c.grid, c.in, err, c.want)
		}
	}
	// Every group size that divides the input width is accepted (GPTQ and
	// AWQ checkpoints use 32 to 256), and -1; without a width, any size.
	for _, c := range []struct{ group, in int }{{256, 4096}, {256, 11008 - 11008%256}, {96, 288}, {7, 14}, {-1, 4096}, {256, 0}, {1000, 0}} {
		if err := (Grid{Bits: 4, GroupSize: c.group}).Validate(c.in); err != nil {
			t.Errorf("group %d on %d inputs refused: %v", c.group, c.in, err)
		}
	}
}

// TestGroup256Checkpoints: quantization_config with group_size 256, as
// GPTQModel/AutoGPTQ and AutoAWQ write it, is accepted, and layers with
// groups of 256 read back through it bit for bit in both layouts.
func TestGroup256Checkpoints(t *testing.T) {
	gptqConfig := `{"bits": 4, "group_size": 256, "damp_percent": 0.01, "desc_act": false, "static_groups": false,
		"sym": true, "true_sequential": true, "model_name_or_path": null, "model_file_base_name": null,
		"quant_method": "gptq", "checkpoint_format": "gptq"}`
	awqConfig := `{"quant_method": "awq", "zero_point": true, "group_size": 256, "bits": 4, "version": "gemm",
		"modules_to_not_convert": null}`
	r := rand.New(rand.NewPCG(13, 14))
	for _, c := range []struct {
		name, config string
		grid         Grid
		tensors      func(l *Linear) (map[string]checkpoint.Out, error)
	}{
		{"gptq", gptqConfig, Grid{Bits: 4, GroupSize: 256, Sym: true}, func(l *Linear) (map[string]checkpoint.Out, error) { return l.GPTQTensors("layer", FormatGPTQ) }},
		{"awq", awqConfig, Grid{Bits: 4, GroupSize: 256}, func(l *Linear) (map[string]checkpoint.Out, error) { return l.AWQTensors("layer") }},
	} {
		t.Run(c.name, func(t *testing.T) {
			q, err := ParseQuantConfig([]byte(c.config))
			if err != nil {
				t.Fatal(err)
			}
			if got := q.Grid(); got != c.grid {
				t.Fatalf("grid %+v, want %+v", got, c.grid)
			}
			l := randomLinear(r, 64, 768, c.grid, false) // 3 groups of 256
			tensors, err := c.tensors(l)
			if err != nil {
				t.Fatal(err)
			}
			dir := t.TempDir()
			writeCheckpoint(t, dir, tensors)
			ck, err := checkpoint.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			back, err := q.Read(ck, "layer", 768, 64)
			if err != nil {
				t.Fatal(err)
			}
			assertSameWeights(t, back.Dequantize(), l.Dequantize())
			if _, err := back.GPULayout(); err != nil {
				t.Errorf("GPU layout of groups of 256: %v", err)
			}
		})
	}
	if _, err := ParseQuantConfig([]byte(`{"quant_method": "gptq", "bits": 4, "group_size": -7}`)); err == nil || !strings.Contains(err.Error(), "group size -7") {
		t.Errorf("group_size -7: %v", err)
	}
}

func TestPackBitsRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, b := range []int{2, 3, 4, 8} {
		v := make([]uint8, 96)
		for i := range v {
			v[i] = uint8(r.IntN(1 << b))
		}
		words, err := PackBits(v, b)
		if err != nil {
			t.Fatal(err)
		}
		if len(words) != 96*b/32 {
			t.Fatalf("%d bits: %d words", b, len(words))
		}
		got := UnpackBits(words, b, len(v))
		for i := range v {
			if got[i] != v[i] {
				t.Fatalf("%d bits: value %d: %d != %d", b, i, got[i], v[i])
			}
		}
		// Fewer values than the words hold: a part of the last word.
		if got := UnpackBits(words, b, len(v)-3); !slices.Equal(got, v[:len(v)-3]) {
			t.Fatalf("%d bits, %d values: %v, want %v", b, len(v)-3, got, v[:len(v)-3])
		}
	}
	// 4-bit layout by hand: values 1..8 → 0x87654321
	w, _ := PackBits([]uint8{1, 2, 3, 4, 5, 6, 7, 8}, 4)
	if uint32(w[0]) != 0x87654321 {
		t.Errorf("nibble order: %#x", uint32(w[0]))
	}
	// 3-bit layout as GPTQ's pack: value 10 straddles words 0 and 1
	v := make([]uint8, 32)
	v[10] = 0b111
	w, _ = PackBits(v, 3)
	if uint32(w[0]) != 0b11<<30 || uint32(w[1]) != 1 || w[2] != 0 {
		t.Errorf("3-bit straddle: %#x %#x %#x", uint32(w[0]), uint32(w[1]), uint32(w[2]))
	}
}

func randomLinear(r *rand.Rand, out, in int, grid Grid, actOrder bool) *Linear {
	w := make([]float32, out*in)
	for i := range w {
		w[i] = float32(r.NormFloat64() * 0.05)
	}
	l, _ := RTN(w, out, in, grid)
	if actOrder {
		perm := r.Perm(in)
		group := grid.Group(in)
		for j, src := range perm {
			l.GIdx[src] = int32(j / group)
		}
	}
	return l
}

// TestCheckpointRoundTrip writes layers in each layout, reads them back
// through a checkpoint and requires bit-identical dequantized weights.
func TestCheckpointRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, c := range []struct {
		name     string
		grid     Grid
		actOrder bool
		format   string
	}{
		{"asym-v2", Grid{Bits: 4, GroupSize: 128}, false, FormatGPTQv2},
		{"sym-v1", Grid{Bits: 4, GroupSize: 128, Sym: true}, false, FormatGPTQ},
		{"asym-actorder-v2", Grid{Bits: 4, GroupSize: 64}, true, FormatGPTQv2},
		{"sym-actorder-v1", Grid{Bits: 4, GroupSize: 32, Sym: true}, true, FormatGPTQ},
		{"3bit-v2", Grid{Bits: 3, GroupSize: 128}, false, FormatGPTQv2},
		{"2bit-perchannel", Grid{Bits: 2, GroupSize: -1, Sym: true}, false, FormatGPTQ},
		{"8bit", Grid{Bits: 8, GroupSize: 128, Sym: true}, false, FormatGPTQ},
	} {
		t.Run(c.name, func(t *testing.T) {
			l := randomLinear(r, 64, 256, c.grid, c.actOrder)
			dir := t.TempDir()
			tensors, err := l.GPTQTensors("layer", c.format)
			if err != nil {
				t.Fatal(err)
			}
			writeCheckpoint(t, dir, tensors)
			ck, err := checkpoint.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			back, err := ReadGPTQ(ck, "layer", 256, 64, c.grid, c.format)
			if err != nil {
				t.Fatal(err)
			}
			assertSameWeights(t, back.Dequantize(), l.Dequantize())
		})
	}
}

// TestV1RejectsZeroZero: format gptq stores zero−1, so 0 must be refused.
func TestV1RejectsZeroZero(t *testing.T) {
	l := &Linear{In: 8, Out: 8, Grid: Grid{Bits: 4, GroupSize: -1}, Q: make([]uint8, 64), Scale: make([]float32, 8), Zero: make([]uint8, 8), GIdx: make([]int32, 8)}
	if _, err := l.GPTQTensors("x", FormatGPTQ); err == nil {
		t.Fatal("zero point 0 written in v1")
	}
	if !l.NeedsV2() {
		t.Fatal("NeedsV2 false with zero 0")
	}
}

// TestAWQAndGPTQLayoutsAgree: the same layer exported both ways
// dequantizes to identical weights.
func TestAWQAndGPTQLayoutsAgree(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	grid := Grid{Bits: 4, GroupSize: 128}
	l := randomLinear(r, 64, 256, grid, false)
	dir := t.TempDir()
	awq, err := l.AWQTensors("a")
	if err != nil {
		t.Fatal(err)
	}
	gq, _ := l.GPTQTensors("g", FormatGPTQv2)
	for k, v := range gq {
		awq[k] = v
	}
	writeCheckpoint(t, dir, awq)
	ck, err := checkpoint.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	a, err := ReadAWQ(ck, "a", 256, 64, grid)
	if err != nil {
		t.Fatal(err)
	}
	g, err := ReadGPTQ(ck, "g", 256, 64, grid, FormatGPTQv2)
	if err != nil {
		t.Fatal(err)
	}
	assertSameWeights(t, a.Dequantize(), g.Dequantize())
	assertSameWeights(t, a.Dequantize(), l.Dequantize())
	// AWQ's interleave by hand: nibble k of word j holds output 8j+order[k]
	qw, _ := ck.Tensor("a.qweight")
	v, _ := qw.Int32()
	word := uint32(v[0])
	for k, o := range []int{0, 2, 4, 6, 1, 3, 5, 7} {
		if got := uint8(word>>(4*k)) & 15; got != l.Q[o*256] {
			t.Fatalf("nibble %d = %d, want q[output %d] = %d", k, got, o, l.Q[o*256])
		}
	}
}

func writeCheckpoint(t *testing.T, dir string, tensors map[string]checkpoint.Out) {
	t.Helper()
	cfg := `{"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8}`
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := checkpoint.WriteFile(filepath.Join(dir, "model.safetensors"), tensors, nil); err != nil {
		t.Fatal(err)
	}
}

func assertSameWeights(t *testing.T, got, want []float32) {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("weight %d: %v != %v", i, got[i], want[i])
		}
	}
}

// TestGPULayoutDecodes: the kernel layout decodes back to the layer's
// weights (rows in kernel order), with and without act-order, for 4-bit
// codes, the 2- and 3-bit codes it holds in nibbles and 8-bit codes in
// bytes; FP8 and 5- to 7-bit layers are refused with an error naming their
// grid.
func TestGPULayoutDecodes(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	for _, act := range []bool{false, true} {
		for _, grid := range []Grid{{Bits: 4, GroupSize: 128}, {Bits: 4, GroupSize: -1, Sym: true}, {Bits: 4, GroupSize: 32},
			{Bits: 3, GroupSize: 64}, {Bits: 2, GroupSize: 32, Sym: true}, {Bits: 8, GroupSize: 128}, {Bits: 8, GroupSize: -1, Sym: true},
			{Bits: 8, GroupSize: 32}} {
			l := randomLinear(r, 128, 256, grid, act && grid.GroupSize > 0)
			g, err := l.GPULayout()
			if err != nil {
				t.Fatal(err)
			}
			if (g.Perm != nil) != (act && grid.GroupSize > 0) {
				t.Fatalf("act-order %v: perm present = %v", act, g.Perm != nil)
			}
			W := g.Dequantize()
			ref := l.Dequantize() // [out][in]
			for k := 0; k < l.In; k++ {
				src := k
				if g.Perm != nil {
					src = int(g.Perm[k])
				}
				for n := 0; n < l.Out; n++ {
					if want := RoundF16(ref[n*l.In+src]); W[k*l.Out+n] != want {
						t.Fatalf("grid %+v act %v: W[%d][%d] = %v, want %v", grid, act, k, n, W[k*l.Out+n], want)
					}
				}
			}
		}
	}
	for _, grid := range []Grid{{Bits: 6, GroupSize: 128}, {Bits: 8, FP8: true, GroupSize: -1}} {
		l := randomLinear(r, 64, 128, Grid{Bits: 4, GroupSize: 128}, false)
		l.Grid = grid
		if _, err := l.GPULayout(); err == nil || !strings.Contains(err.Error(), grid.Describe()) {
			t.Errorf("%+v: error %v, want one naming the grid", grid, err)
		}
	}
}

// TestConcatGPU: layers joined side by side decode to their weights side
// by side (W[k][n] of layer i at column offset Σ earlier outs), for a
// grouped, a per-channel and an act-order grid; layers that disagree on
// K, group or permutation are refused.
// InterleaveGPU's tile t holds gate's columns 32t … 32t+31 then up's:
// checked through Dequantize, the kernels' CPU reference, for 4- and
// 8-bit codes and a per-channel grid; mismatched layers are refused.
func TestInterleaveGPU(t *testing.T) {
	r := rand.New(rand.NewPCG(15, 16))
	for _, grid := range []Grid{{Bits: 4, GroupSize: 32}, {Bits: 3, GroupSize: 64, Sym: true}, {Bits: 4, GroupSize: -1}, {Bits: 8, GroupSize: 32}} {
		gate, err := randomLinear(r, 192, 128, grid, false).GPULayout()
		if err != nil {
			t.Fatal(err)
		}
		up, err := randomLinear(r, 192, 128, grid, false).GPULayout()
		if err != nil {
			t.Fatal(err)
		}
		il, err := InterleaveGPU(gate, up)
		if err != nil {
			t.Fatal(err)
		}
		if il.N != 2*gate.N || il.K != gate.K {
			t.Fatalf("grid %+v: interleaved %d×%d, want %d×%d", grid, il.K, il.N, gate.K, 2*gate.N)
		}
		W, Wg, Wu := il.Dequantize(), gate.Dequantize(), up.Dequantize()
		H := gate.N
		for k := 0; k < gate.K; k++ {
			for n := 0; n < 2*H; n++ {
				src, col := Wg, n/64*32+n%32
				if n%64 >= 32 {
					src = Wu
				}
				if got, want := W[k*2*H+n], src[k*H+col]; got != want {
					t.Fatalf("grid %+v: interleaved W[%d][%d] = %v, want %v (column %d of %s)", grid, k, n, got, want, col,
						map[bool]string{true: "gate", false: "up"}[n%64 < 32])
				}
			}
		}
	}
	a, _ := randomLinear(r, 128, 64, Grid{Bits: 4, GroupSize: 32}, false).GPULayout()
	b, _ := randomLinear(r, 192, 64, Grid{Bits: 4, GroupSize: 32}, false).GPULayout()
	c, _ := randomLinear(r, 128, 64, Grid{Bits: 8, GroupSize: 32}, false).GPULayout()
	for name, pair := range map[string][2]*GPUWeights{"width": {a, b}, "bits": {a, c}} {
		if _, err := InterleaveGPU(pair[0], pair[1]); err == nil {
			t.Errorf("layers differing in %s were interleaved", name)
		}
	}
}

func TestConcatGPU(t *testing.T) {
	r := rand.New(rand.NewPCG(13, 14))
	for _, grid := range []Grid{{Bits: 4, GroupSize: 32}, {Bits: 4, GroupSize: -1, Sym: true}, {Bits: 8, GroupSize: 32}} {
		ls := []*Linear{randomLinear(r, 128, 96, grid, false), randomLinear(r, 64, 96, grid, false), randomLinear(r, 192, 96, grid, false)}
		var gs []*GPUWeights
		for _, l := range ls {
			g, err := l.GPULayout()
			if err != nil {
				t.Fatal(err)
			}
			gs = append(gs, g)
		}
		cat, err := ConcatGPU(gs...)
		if err != nil {
			t.Fatal(err)
		}
		W := cat.Dequantize()
		off := 0
		for _, g := range gs {
			Wi := g.Dequantize()
			for k := 0; k < g.K; k++ {
				for n := 0; n < g.N; n++ {
					if got, want := W[k*cat.N+off+n], Wi[k*g.N+n]; got != want {
						t.Fatalf("grid %+v: joined W[%d][%d] = %v, layer's W[%d][%d] = %v", grid, k, off+n, got, k, n, want)
					}
				}
			}
			off += g.N
		}
		if off != cat.N {
			t.Fatalf("joined N %d, want %d", cat.N, off)
		}
	}
	a, _ := randomLinear(r, 64, 96, Grid{Bits: 4, GroupSize: 32}, false).GPULayout()
	b, _ := randomLinear(r, 64, 96, Grid{Bits: 4, GroupSize: 96}, false).GPULayout()
	c, _ := randomLinear(r, 64, 64, Grid{Bits: 4, GroupSize: 32}, false).GPULayout()
	d, _ := randomLinear(r, 64, 96, Grid{Bits: 4, GroupSize: 32}, true).GPULayout()
	e, _ := randomLinear(r, 64, 96, Grid{Bits: 8, GroupSize: 32}, false).GPULayout()
	for name, pair := range map[string][2]*GPUWeights{"group": {a, b}, "in": {a, c}, "permutation": {a, d}, "bits": {a, e}} {
		if _, err := ConcatGPU(pair[0], pair[1]); err == nil {
			t.Errorf("layers differing in %s were joined", name)
		} else {
			t.Log(err)
		}
	}
}

// TestAWQGridByHand: AWQ's grid keeps the group's own range, and computes
// the scale as llm-awq does on the GPU, (max − min)·float32(1/maxq).
func TestAWQGridByHand(t *testing.T) {
	g := Grid{Bits: 4, GroupSize: 128, MinMax: true}
	inv15 := float32(1) / 15
	// [1, 4]: scale 3/15 = 0.2, zero clamp(−round(1/0.2), 0, 15) = 0 → 1 is not representable exactly
	s, z := g.Params([]float32{1, 2.5, 4})
	if s != 3*inv15 || z != 0 {
		t.Errorf("[1,4]: scale %v zero %d", s, z)
	}
	// [-3, 1.5]: scale 4.5/15 = 0.3, zero round(3/0.3) = 10
	s, z = g.Params([]float32{-3, 1.5})
	if s != 4.5*inv15 || z != 10 {
		t.Errorf("[-3,1.5]: scale %v zero %d", s, z)
	}
	// constant group: range clamped to 1e-5
	s, _ = g.Params([]float32{0.5, 0.5})
	if s != float32(1e-5)*inv15 {
		t.Errorf("constant group: scale %v", s)
	}
	// A 3-bit group clipped to ±0.3: 0.6·float32(1/7) makes 0.3/scale
	// 3.4999998, so zero = 3 and both ends land on ±3 steps (true division
	// gives exactly 3.5, zero 4, and −0.3 would go to −4 steps).
	g3 := Grid{Bits: 3, GroupSize: 128, MinMax: true}
	s, z = g3.Params([]float32{-0.3, 0.1, 0.3})
	lo, hi := Dequantize(g3.Quantize(-0.3, s, z), s, z), Dequantize(g3.Quantize(0.3, s, z), s, z)
	if z != 3 || lo != -3*s || hi != 3*s {
		t.Errorf("±0.3 at 3 bits: scale %v zero %d, −0.3 → %v, 0.3 → %v; want zero 3, ±%v", s, z, lo, hi, 3*s)
	}
	// RTN keeps the codes of that scale and stores it as float16, the value
	// a checkpoint holds.
	l, err := RTN([]float32{-0.3, 0.1, 0.3, 0.2}, 1, 4, Grid{Bits: 3, GroupSize: -1, MinMax: true})
	if err != nil {
		t.Fatal(err)
	}
	if l.Scale[0] != RoundF16(s) || l.Zero[0] != 3 || l.Q[0] != 0 || l.Q[2] != 6 {
		t.Errorf("RTN on AWQ's grid: scale %v (want %v), zero %d, codes %v", l.Scale[0], RoundF16(s), l.Zero[0], l.Q)
	}
}

// TestWriterRefusesExistingOutput: an existing directory is an fs.ErrExist
// (a command line adds how to replace it) unless force is set.
func TestWriterRefusesExistingOutput(t *testing.T) {
	dir := t.TempDir()
	if _, err := NewWriter(dir, false); !errors.Is(err, fs.ErrExist) || !strings.Contains(err.Error(), dir) {
		t.Errorf("existing output: %v, want fs.ErrExist naming %s", err, dir)
	}
	if _, err := NewWriter("", false); !errors.Is(err, ErrNoOutput) {
		t.Error("empty output directory accepted")
	}
	w, err := NewWriter(dir, true)
	if err != nil {
		t.Fatalf("with force: %v", err)
	}
	os.RemoveAll(w.tmp)
}

// finishSrc is a source directory with the one file Finish needs.
func finishSrc(t *testing.T) string {
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "config.json"), []byte(`{"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8}`), 0o644); err != nil {
		t.Fatal(err)
	}
	return src
}

// TestWriterForceReplacesOnlyOutputs: --force replaces an empty directory
// or an earlier llmq output (marker file), never a directory of other
// files or a plain file, and leaves those untouched.
func TestWriterForceReplacesOnlyOutputs(t *testing.T) {
	tmp := t.TempDir()
	home := filepath.Join(tmp, "home")
	os.MkdirAll(home, 0o755)
	precious := filepath.Join(home, "notes.txt")
	os.WriteFile(precious, []byte("keep me"), 0o644)
	if _, err := NewWriter(home, true); err == nil || !strings.Contains(err.Error(), home) || !strings.Contains(err.Error(), "not an llmq output") {
		t.Errorf("forced over a foreign directory: %v", err)
	}
	if b, err := os.ReadFile(precious); err != nil || string(b) != "keep me" {
		t.Fatalf("foreign file touched: %q, %v", b, err)
	}
	file := filepath.Join(tmp, "file")
	os.WriteFile(file, []byte("x"), 0o644)
	if _, err := NewWriter(file, true); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Errorf("forced over a file: %v", err)
	}
	// An output written by the Writer carries the marker and can be
	// replaced; the replacement holds only the new files.
	out := filepath.Join(tmp, "out")
	for i, force := range []bool{false, true} {
		w, err := NewWriter(out, force)
		if err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		if err := w.WritePart(map[string]checkpoint.Out{"t": checkpoint.F32([]float32{float32(i)}, 1)}); err != nil {
			t.Fatal(err)
		}
		if err := w.Finish(finishSrc(t), nil); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
	}
	entries, _ := os.ReadDir(out)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if want := []string{Marker, "config.json", "model.safetensors"}; !slices.Equal(names, want) {
		t.Errorf("output holds %v, want %v", names, want)
	}
	left, _ := os.ReadDir(tmp)
	if len(left) != 3 { // home, file, out: no temporary directory left
		t.Errorf("left in the parent: %v", left)
	}
}

// TestWriterShardsBySize: parts are gathered, in order and never split,
// into shards of at most MaxShardBytes; one shard is model.safetensors
// without an index, several are model-0000i-of-0000N with an index that
// maps every tensor to its shard; the tensors read back unchanged.
func TestWriterShardsBySize(t *testing.T) {
	part := func(name string, n int) map[string]checkpoint.Out {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(len(name)*1000 + i)
		}
		return map[string]checkpoint.Out{name: checkpoint.F32(v, n)}
	}
	parts := []map[string]checkpoint.Out{part("a", 100), part("bb", 100), part("ccc", 300), part("dddd", 10)}
	for _, c := range []struct {
		max   int64
		files map[string][]string // shard → tensors
	}{
		{0, map[string][]string{"model.safetensors": {"a", "bb", "ccc", "dddd"}}},
		// 400-byte parts a, bb; 1200-byte ccc (over the bound: alone); 40-byte dddd.
		{800, map[string][]string{"model-00001-of-00003.safetensors": {"a", "bb"}, "model-00002-of-00003.safetensors": {"ccc"},
			"model-00003-of-00003.safetensors": {"dddd"}}},
	} {
		out := filepath.Join(t.TempDir(), "out")
		w, err := NewWriter(out, false)
		if err != nil {
			t.Fatal(err)
		}
		w.MaxShardBytes = c.max
		for _, p := range parts {
			if err := w.WritePart(p); err != nil {
				t.Fatal(err)
			}
		}
		if err := w.Finish(finishSrc(t), nil); err != nil {
			t.Fatal(err)
		}
		var index struct {
			WeightMap map[string]string `json:"weight_map"`
		}
		raw, err := os.ReadFile(filepath.Join(out, "model.safetensors.index.json"))
		if len(c.files) == 1 != (err != nil) {
			t.Fatalf("max %d: index present %v with %d shards", c.max, err == nil, len(c.files))
		}
		json.Unmarshal(raw, &index)
		for file, names := range c.files {
			f, err := checkpoint.OpenFile(filepath.Join(out, file))
			if err != nil {
				t.Fatalf("max %d: %v", c.max, err)
			}
			got := f.Names()
			slices.Sort(got)
			if !slices.Equal(got, names) {
				t.Errorf("max %d: %s holds %v, want %v", c.max, file, got, names)
			}
			for _, n := range names {
				if len(c.files) > 1 && index.WeightMap[n] != file {
					t.Errorf("max %d: index maps %s to %q, want %s", c.max, n, index.WeightMap[n], file)
				}
				tt, _ := f.Tensor(n)
				for _, p := range parts {
					if want, ok := p[n]; ok && !bytes.Equal(tt.Data, want.Data) {
						t.Errorf("max %d: tensor %s changed", c.max, n)
					}
				}
			}
			f.Close()
		}
	}
}

// TestWriterV2SwitchReadError: a part that cannot be read back when the
// checkpoint switches to gptq_v2 is an error naming it, not a silently
// wrong shard.
func TestWriterV2SwitchReadError(t *testing.T) {
	w, err := NewWriter(filepath.Join(t.TempDir(), "out"), false)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Abort()
	g := Grid{Bits: 4, GroupSize: -1}
	positive := &Linear{In: 8, Out: 8, Grid: g, Q: make([]uint8, 64), Scale: make([]float32, 8), Zero: make([]uint8, 8), GIdx: make([]int32, 8)}
	for i := range positive.Zero {
		positive.Zero[i], positive.Scale[i] = 8, 1
	}
	tensors := map[string]checkpoint.Out{}
	if err := w.AddGPTQ(tensors, "l0", positive); err != nil {
		t.Fatal(err)
	}
	if err := w.WritePart(tensors); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(w.tmp, w.parts[0].file), 20); err != nil {
		t.Fatal(err)
	}
	zero := *positive
	zero.Zero = make([]uint8, 8) // a zero of 0 needs gptq_v2
	err = w.AddGPTQ(map[string]checkpoint.Out{}, "l1", &zero)
	if err == nil || !strings.Contains(err.Error(), w.parts[0].file) || !strings.Contains(err.Error(), "gptq_v2") {
		t.Errorf("unreadable part: %v", err)
	}
}

// FuzzParseQuantConfig: no quantization_config panics the parser, and one
// it accepts describes a grid the loaders can read.
func FuzzParseQuantConfig(f *testing.F) {
	f.Add([]byte(`{"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": true, "sym": false, "checkpoint_format": "gptq_v2"}`))
	f.Add([]byte(`{"quant_method": "awq", "bits": 4, "group_size": 256, "zero_point": true, "version": "gemm"}`))
	f.Add([]byte(`{"quant_method": "gptq", "bits": 3, "group_size": -1}`))
	f.Add([]byte(`{"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*down_proj"],
		"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": false, "strategy": "group", "group_size": 128}}}}`))
	f.Add([]byte(`{"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {
		"a": {"targets": ["re:.*q_proj"], "format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
		"b": {"targets": ["Linear"], "format": "int-quantized", "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		q, err := ParseQuantConfig(data)
		if err != nil || q == nil {
			return
		}
		if q.CT != nil {
			for _, name := range []string{"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"} {
				if g, ok := q.GridFor(name); ok {
					if err := g.Validate(0); err != nil {
						t.Fatalf("accepted %s with an invalid grid for %s: %v", data, name, err)
					}
				}
			}
			return
		}
		if err := q.Grid().Validate(0); err != nil {
			t.Fatalf("accepted %s with an invalid grid: %v", data, err)
		}
	})
}

// TestWriterV2SwitchInsideAPart: when a layer needing gptq_v2 comes after
// layers of the same part were laid out in v1, those are rewritten too,
// so every layer reads back as it was quantized (2-bit, group 32 hit this
// in block 0: q/k/v/o read back wrong when gate_proj switched).
func TestWriterV2SwitchInsideAPart(t *testing.T) {
	out := filepath.Join(t.TempDir(), "out")
	w, err := NewWriter(out, false)
	if err != nil {
		t.Fatal(err)
	}
	g := Grid{Bits: 2, GroupSize: -1}
	r := rand.New(rand.NewPCG(7, 8))
	layer := func(zero uint8) *Linear {
		l := &Linear{In: 16, Out: 16, Grid: g, Q: make([]uint8, 256), Scale: make([]float32, 16), Zero: make([]uint8, 16), GIdx: make([]int32, 16)}
		for i := range l.Q {
			l.Q[i] = uint8(r.IntN(4))
		}
		for i := range l.Scale {
			l.Scale[i], l.Zero[i] = RoundF16(0.01*float32(i+1)), zero
		}
		return l
	}
	a, b := layer(1), layer(0) // b has a zero of 0: v1 cannot store it
	tensors := map[string]checkpoint.Out{}
	if err := w.AddGPTQ(tensors, "a", a); err != nil {
		t.Fatal(err)
	}
	if err := w.AddGPTQ(tensors, "b", b); err != nil {
		t.Fatal(err)
	}
	if err := w.WritePart(tensors); err != nil {
		t.Fatal(err)
	}
	if err := w.Finish(finishSrc(t), &QuantConfig{QuantMethod: "gptq", Bits: 2, GroupSize: -1}); err != nil {
		t.Fatal(err)
	}
	ck, err := checkpoint.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	for name, l := range map[string]*Linear{"a": a, "b": b} {
		back, err := ReadGPTQ(ck, name, 16, 16, g, FormatGPTQv2)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(back.Dequantize(), l.Dequantize()) {
			t.Errorf("layer %s reads back different weights", name)
		}
	}
}

// TestWriterForceEdgeCases: an output from before the marker existed (an
// llmq quantization_config in its config.json) may be replaced; a
// directory that became foreign between NewWriter and Finish is not, and
// the finished output is then kept beside it and named, not deleted.
func TestWriterForceEdgeCases(t *testing.T) {
	tmp := t.TempDir()
	old := filepath.Join(tmp, "old")
	os.MkdirAll(old, 0o755)
	os.WriteFile(filepath.Join(old, "config.json"), []byte(`{"quantization_config": {"quant_method": "gptq", "meta": {"quantizer": "llmq"}}}`), 0o644)
	write := func(dir string, between func()) error {
		w, err := NewWriter(dir, true)
		if err != nil {
			return err
		}
		defer w.Abort()
		if err := w.WritePart(map[string]checkpoint.Out{"t": checkpoint.F32([]float32{1}, 1)}); err != nil {
			return err
		}
		if between != nil {
			between()
		}
		return w.Finish(finishSrc(t), nil)
	}
	if err := write(old, nil); err != nil {
		t.Fatalf("replacing a pre-marker llmq output: %v", err)
	}
	if _, err := os.Stat(filepath.Join(old, Marker)); err != nil {
		t.Errorf("the replacement has no marker: %v", err)
	}
	victim := filepath.Join(tmp, "victim")
	os.MkdirAll(victim, 0o755)
	err := write(victim, func() { os.WriteFile(filepath.Join(victim, "notes.txt"), []byte("mine"), 0o644) })
	if err == nil || !strings.Contains(err.Error(), "not an llmq output") || !strings.Contains(err.Error(), "kept in") {
		t.Fatalf("a directory that became foreign: %v", err)
	}
	kept := strings.TrimSpace(err.Error()[strings.LastIndex(err.Error(), "kept in ")+len("kept in "):])
	if _, err := os.Stat(filepath.Join(kept, "model.safetensors")); err != nil {
		t.Errorf("the finished output was not kept: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(victim, "notes.txt")); err != nil || string(b) != "mine" {
		t.Errorf("the foreign directory was touched: %q %v", b, err)
	}
}

// TestDynamicRules: GPTQModel's "dynamic" object reads and writes in its
// key order, the first matching rule wins, "-:" skips, unset values keep
// the config's, and patterns match from the start of the name.
func TestDynamicRules(t *testing.T) {
	raw := `{"-:model\\.layers\\.3\\.mlp\\.up_proj": {}, "+:.*\\.down_proj": {"bits": 8, "group_size": 64}, "model\\.layers\\.0\\.": {"bits": 3, "sym": true}, "+:.*": {"bits": 2}}`
	var d Dynamic
	if err := json.Unmarshal([]byte(raw), &d); err != nil {
		t.Fatal(err)
	}
	base := Grid{Bits: 4, GroupSize: 128}
	for name, want := range map[string]struct {
		g  Grid
		ok bool
	}{
		"model.layers.3.mlp.up_proj":       {Grid{}, false},
		"model.layers.0.mlp.down_proj":     {Grid{Bits: 8, GroupSize: 64}, true}, // down_proj's rule comes first
		"model.layers.0.self_attn.q_proj":  {Grid{Bits: 3, GroupSize: 128, Sym: true}, true},
		"model.layers.1.self_attn.k_proj":  {Grid{Bits: 2, GroupSize: 128}, true},
		"xmodel.layers.0.self_attn.q_proj": {Grid{Bits: 2, GroupSize: 128}, true}, // matched from the start only
		"model.layers.10.self_attn.q_proj": {Grid{Bits: 2, GroupSize: 128}, true}, // the dot after 0 is escaped
	} {
		if g, ok := d.For(name, base); g != want.g || ok != want.ok {
			t.Errorf("%s: %+v %v, want %+v %v", name, g, ok, want.g, want.ok)
		}
	}
	out, err := json.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"-:model\\.layers\\.3\\.mlp\\.up_proj":{},"+:.*\\.down_proj":{"bits":8,"group_size":64},"+:model\\.layers\\.0\\.":{"bits":3,"sym":true},"+:.*":{"bits":2}}`
	if string(out) != want {
		t.Errorf("written as\n%s\nwant\n%s", out, want)
	}
	if err := json.Unmarshal([]byte(`{"+:(": {}}`), &d); err == nil || !strings.Contains(err.Error(), `"("`) {
		t.Errorf("bad pattern: %v", err)
	}
}
