package pack

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/llm/checkpoint"
)

// TestCTFixture decodes testdata/compressed-tensors, written by
// make_fixture.py from the published description of the format (stdlib
// Python, none of llmq's code), and requires exactly the weights the
// script computed from its hand-chosen values: W4 asymmetric groups with
// packed zero points padded along the outputs, W8 per channel with bf16
// scales and an I32 weight_shape, W3 (10 values a word), act-order g_idx,
// unpacked int8 zero points, FP8 per channel and per tensor (with a
// static input_scale), and int-quantized int8 per channel and per tensor
// (asymmetric).
func TestCTFixture(t *testing.T) {
	dir := filepath.Join("testdata", "compressed-tensors")
	ck, err := checkpoint.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	q, err := ParseQuantConfig(ck.Config.Quantization)
	if err != nil {
		t.Fatal(err)
	}
	var expected map[string]struct {
		Out, In int
		W       [][]float64
	}
	raw, err := os.ReadFile(filepath.Join(dir, "expected.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &expected); err != nil {
		t.Fatal(err)
	}
	if len(expected) != 9 {
		t.Fatalf("%d layers in expected.json, want 9", len(expected))
	}
	for name, e := range expected {
		if !q.Stored(ck, name) {
			t.Fatalf("%s: not seen as stored quantized", name)
		}
		l, err := q.Read(ck, name, e.In, e.Out)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		w := l.Dequantize()
		for o := range e.W {
			for i, want := range e.W[o] {
				if got := w[o*e.In+i]; float64(got) != want {
					t.Fatalf("%s: w[%d][%d] = %v, the fixture says %v", name, o, i, got, want)
				}
			}
		}
	}
	if _, ok := q.GridFor("lm_head"); ok {
		t.Error("lm_head is in ignore, yet GridFor says it is quantized")
	}
	if g, ok := q.GridFor("layers.f"); !ok || !g.FP8 || g.PerTensor {
		t.Errorf("layers.f: grid %+v, %v; want FP8 per channel", g, ok)
	}
	if l, err := q.Read(ck, "layers.g", 4, 2); err != nil || l.InputScale != 0.75 {
		t.Errorf("layers.g: input scale %v (%v), the fixture says 0.75", l.InputScale, err)
	}
	if g, ok := q.GridFor("layers.a"); !ok || g != (Grid{Bits: 4, GroupSize: 8}) {
		t.Errorf("layers.a: grid %+v, %v; want 4 bits, groups of 8, asymmetric", g, ok)
	}
	dt := ck.DTypes()
	if dt[checkpoint.DTypeF8E4M3] != 2 {
		t.Errorf("dtypes %v: want 2 F8_E4M3 tensors", dt)
	}
}

// TestCTRoundTrip: layers written by CTTensors read back with the same
// codes, scales, zeros and g_idx, hence bit-identical weights.
func TestCTRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	for _, c := range []struct {
		name     string
		out, in  int
		grid     Grid
		actOrder bool
	}{
		{"w4-asym-g128", 64, 256, Grid{Bits: 4, GroupSize: 128}, false},
		{"w4-sym-g32-actorder", 64, 256, Grid{Bits: 4, GroupSize: 32, Sym: true}, true},
		{"w4-asym-channel-out20", 20, 64, Grid{Bits: 4, GroupSize: -1}, false},
		{"w8-sym-channel", 24, 64, Grid{Bits: 8, GroupSize: -1, Sym: true}, false},
		{"w8-asym-g32", 24, 64, Grid{Bits: 8, GroupSize: 32}, false},
		{"w3-asym-g64-out20", 20, 128, Grid{Bits: 3, GroupSize: 64}, false},
		{"w2-sym-g32", 32, 64, Grid{Bits: 2, GroupSize: 32, Sym: true}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			l := randomLinear(r, c.out, c.in, c.grid, c.actOrder)
			if c.grid.Sym {
				for i := range l.Zero {
					l.Zero[i] = 1 << (c.grid.Bits - 1)
				}
			}
			tensors, err := l.CTTensors("layer")
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := tensors["layer.weight_zero_point"]; ok == c.grid.Sym {
				t.Fatalf("weight_zero_point written: %v, symmetric: %v", ok, c.grid.Sym)
			}
			if _, ok := tensors["layer.weight_g_idx"]; ok != c.actOrder {
				t.Fatalf("weight_g_idx written: %v, act-order: %v", ok, c.actOrder)
			}
			dir := t.TempDir()
			writeCheckpoint(t, dir, tensors)
			ck, err := checkpoint.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			back, err := ReadCTPacked(ck, "layer", c.in, c.out, c.grid)
			if err != nil {
				t.Fatal(err)
			}
			sameLinear(t, back, l)
		})
	}
	for _, perTensor := range []bool{false, true} {
		w := make([]float32, 24*40)
		for i := range w {
			w[i] = float32(r.NormFloat64()) * float32(1+i/40)
		}
		l, err := FP8(w, 24, 40, perTensor)
		if err != nil {
			t.Fatal(err)
		}
		tensors, err := l.CTTensors("layer")
		if err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		writeCheckpoint(t, dir, tensors)
		ck, err := checkpoint.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		back, err := ReadCTFloat(ck, "layer", 40, 24, l.Grid)
		if err != nil {
			t.Fatal(err)
		}
		sameLinear(t, back, l)
		st, _ := ck.Tensor("layer.weight_scale")
		if want := map[bool]int{false: 24, true: 1}[perTensor]; st.Numel() != want {
			t.Errorf("per-tensor %v: %d scales stored, want %d", perTensor, st.Numel(), want)
		}
		ck.Close()
	}
}

func sameLinear(t *testing.T, got, want *Linear) {
	t.Helper()
	for name, eq := range map[string]bool{
		"Q":     string(got.Q) == string(want.Q),
		"Zero":  string(got.Zero) == string(want.Zero),
		"Scale": len(got.Scale) == len(want.Scale),
		"GIdx":  len(got.GIdx) == len(want.GIdx),
	} {
		if !eq {
			t.Fatalf("%s differs", name)
		}
	}
	for i := range want.Scale {
		if got.Scale[i] != want.Scale[i] {
			t.Fatalf("scale %d: %v, want %v", i, got.Scale[i], want.Scale[i])
		}
	}
	for i := range want.GIdx {
		if got.GIdx[i] != want.GIdx[i] {
			t.Fatalf("g_idx %d: %v, want %v", i, got.GIdx[i], want.GIdx[i])
		}
	}
	assertSameWeights(t, got.Dequantize(), want.Dequantize())
}

// TestFP8ByHand: scale = max|w|/448 and E4M3 codes worked out by hand.
// Row 0: max 3.5, scale 2⁻⁷: w/s = 128 (2⁷: exponent field 14 → 0x70),
// −256 (2⁸, negative → 0xF8), 64 (0x68), 448 (1.75·2⁸ → 0x7E). Row 1 per
// tensor: 0.3/2⁻⁷ = 38.4, between 36 and 40 on E4M3's step-4 grid of
// [32, 64): 40 = 1.25·2⁵ → 0x62, read back as 0.3125. Per channel, row 1's
// own scale 0.3/448 maps 0.3 to 448 (0x7E).
func TestFP8ByHand(t *testing.T) {
	w := []float32{1, -2, 0.5, 3.5, 0.3, 0, 0, 0}
	pt, err := FP8(w, 2, 4, true)
	if err != nil {
		t.Fatal(err)
	}
	wantQ := []byte{0x70, 0xF8, 0x68, 0x7E, 0x62, 0, 0, 0}
	if string(pt.Q) != string(wantQ) || pt.Scale[0] != 1.0/128 || pt.Scale[1] != 1.0/128 {
		t.Fatalf("per tensor: codes % x scales %v; want % x, 2⁻⁷", pt.Q, pt.Scale, wantQ)
	}
	if got := pt.Dequantize(); got[3] != 3.5 || got[1] != -2 || got[4] != 0.3125 {
		t.Errorf("per tensor: dequantized %v", got)
	}
	pc, err := FP8(w, 2, 4, false)
	if err != nil {
		t.Fatal(err)
	}
	if pc.Q[4] != 0x7E || pc.Scale[1] != float32(0.3)/448 {
		t.Errorf("per channel row 1: code %#x scale %v", pc.Q[4], pc.Scale[1])
	}
	if got := pc.Dequantize()[4]; math.Abs(float64(got-0.3)) > 1e-7 {
		t.Errorf("per channel: 0.3 read back as %v", got)
	}
	if _, err := FP8([]float32{float32(math.NaN()), 0}, 1, 2, false); err == nil {
		t.Error("NaN weight accepted")
	}
}

// TestCTConfigErrors: unsupported settings are refused with the field
// that holds them.
func TestCTConfigErrors(t *testing.T) {
	base := func(weights, format string) string {
		return `{"quant_method": "compressed-tensors", "format": "` + format + `", "ignore": ["lm_head"],
			"config_groups": {"group_0": {"targets": ["Linear"], "weights": ` + weights + `}}}`
	}
	w4 := `{"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 128}`
	for _, c := range []struct{ cfg, want string }{
		{base(w4, "marlin-24"), `format "marlin-24"`},
		{base(w4, "int-quantized"), `config_groups.group_0.weights: type "int", num_bits 4: format int-quantized holds int8`},
		{base(`{"num_bits": 8, "type": "int", "strategy": "group", "group_size": 64}`, "int-quantized"), `config_groups.group_0.weights.strategy "group"`},
		{base(w4, "bitmask"), `format "bitmask"`},
		{base(`{"num_bits": 5, "type": "int", "strategy": "channel"}`, "pack-quantized"), "config_groups.group_0.weights.num_bits 5"},
		{base(`{"num_bits": 4, "type": "int", "strategy": "block", "block_structure": [128, 128]}`, "pack-quantized"), `config_groups.group_0.weights.strategy "block"`},
		{base(`{"num_bits": 4, "type": "int", "strategy": "tensor"}`, "pack-quantized"), `config_groups.group_0.weights.strategy "tensor"`},
		{base(`{"num_bits": 4, "type": "int", "strategy": "group"}`, "pack-quantized"), `config_groups.group_0.weights.strategy "group" needs a positive group_size`},
		{base(`{"num_bits": 4, "type": "uint", "strategy": "channel"}`, "pack-quantized"), `config_groups.group_0.weights.type "uint"`},
		{base(`{"num_bits": 4, "type": "float", "strategy": "channel"}`, "float-quantized"), "config_groups.group_0.weights: type \"float\", num_bits 4"},
		{base(`{"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}`, "float-quantized"), `config_groups.group_0.weights.strategy "group"`},
		{base(`{"num_bits": 8, "type": "float", "symmetric": false, "strategy": "channel"}`, "float-quantized"), "config_groups.group_0.weights.symmetric false"},
		{base(w4, "mixed-precision"), "config_groups.group_0.format: missing"},
		{`{"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}`, "config_groups: empty"},
		{`{"quant_method": "compressed-tensors", "format": "pack-quantized", "kv_cache_scheme": {"num_bits": 8}, "config_groups": {"g": {"targets": ["Linear"], "weights": ` + w4 + `}}}`, "kv_cache_scheme"},
		{`{"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"targets": ["re:(?=x)"], "weights": ` + w4 + `}}}`, "config_groups.g.targets"},
	} {
		_, err := ParseQuantConfig(json.RawMessage(c.cfg))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s\n  error %v, want one naming %q", c.cfg, err, c.want)
		}
	}
}

// TestCTReadErrors: a layer whose tensors disagree with the config or the
// model is refused, naming the tensor.
func TestCTReadErrors(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	grid := Grid{Bits: 4, GroupSize: 32}
	l := randomLinear(r, 16, 64, grid, false)
	tensors, err := l.CTTensors("layer")
	if err != nil {
		t.Fatal(err)
	}
	tensors["layer.weight_shape"] = checkpoint.I64([]int64{16, 32}, 2)
	delete(tensors, "layer.weight_zero_point")
	dir := t.TempDir()
	writeCheckpoint(t, dir, tensors)
	ck, err := checkpoint.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if _, err := ReadCTPacked(ck, "layer", 64, 16, grid); err == nil || !strings.Contains(err.Error(), "layer.weight_shape") {
		t.Errorf("wrong weight_shape: %v", err)
	}
	if _, err := ReadCTFloat(ck, "layer", 64, 16, Grid{Bits: 8, GroupSize: -1, Sym: true, FP8: true}); err == nil || !strings.Contains(err.Error(), "layer.weight") {
		t.Errorf("FP8 read of a packed layer: %v", err)
	}
}
