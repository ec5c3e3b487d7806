package gguf

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// TestWriterRoundTrip writes every metadata type and a tensor of each type
// and reads them back.
func TestWriterRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.gguf")
	w := NewWriter()
	kvs := []KV{
		{"a.u8", uint8(7)}, {"a.i8", int8(-7)}, {"a.u16", uint16(700)}, {"a.i16", int16(-700)},
		{"a.u32", uint32(70000)}, {"a.i32", int32(-70000)}, {"a.f32", float32(1.5)}, {"a.bool", true},
		{"a.str", "héllo"}, {"a.u64", uint64(1 << 40)}, {"a.i64", int64(-1 << 40)}, {"a.f64", 2.25},
		{"a.strs", []string{"x", "", "y z"}}, {"a.i32s", []int32{1, -2, 3}}, {"a.f32s", []float32{0.5, -1}},
		{"a.bools", []bool{true, false}},
	}
	for _, kv := range kvs {
		if err := w.Add(kv.Key, kv.Value); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Add("a.u8", uint8(1)); err == nil {
		t.Error("a key set twice was accepted")
	}
	if err := w.Add("a.bad", struct{}{}); err == nil {
		t.Error("an unsupported value type was accepted")
	}
	r := rand.New(rand.NewPCG(1, 2))
	data := map[string][]byte{}
	for i, typ := range []TensorType{F32, F16, Q4_0, Q4_1, Q8_0} {
		name := "t." + typ.String()
		if err := w.AddTensor(name, typ, 64, 3+i); err != nil {
			t.Fatal(err)
		}
		n, _ := typ.RowBytes(64)
		data[name] = make([]byte, n*(3+i))
		for j := range data[name] {
			data[name][j] = byte(r.Uint32())
		}
	}
	if err := w.AddTensor("bad", Q4_0, 48, 2); err == nil || !strings.Contains(err.Error(), "multiple of 32") {
		t.Errorf("a Q4_0 row of 48 elements: %v", err)
	}
	if err := w.Create(path); err != nil {
		t.Fatal(err)
	}
	if err := w.WriteTensor("t.F16", data["t.F16"]); err == nil {
		t.Error("a tensor written out of order was accepted")
	}
	for _, ti := range w.Tensors() {
		if err := w.WriteTensor(ti.Name, data[ti.Name]); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	f, err := Read(path)
	if err != nil {
		t.Fatal(err)
	}
	if f.KV["general.alignment"] != uint32(32) {
		t.Errorf("general.alignment = %v", f.KV["general.alignment"])
	}
	for _, kv := range kvs {
		if !reflect.DeepEqual(f.KV[kv.Key], kv.Value) {
			t.Errorf("%s = %#v, want %#v", kv.Key, f.KV[kv.Key], kv.Value)
		}
	}
	for name, want := range data {
		ti, got, err := f.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		if ti.Offset%Alignment != 0 || string(got) != string(want) || ti.Dims[0] != 64 {
			t.Errorf("%s: offset %d, dims %v, data equal %v", name, ti.Offset, ti.Dims, string(got) == string(want))
		}
	}
	st, _ := os.Stat(path)
	if st.Size()%Alignment != 0 {
		t.Errorf("file size %d is not padded to the alignment", st.Size())
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Errorf("temporary files left behind: %v", entries)
	}
	// Truncations and corruptions are errors, never panics.
	b, _ := os.ReadFile(path)
	last := f.Tensors[len(f.Tensors)-1]
	lastBytes, _ := last.Bytes()
	end := int(f.dataFrom+last.Offset) + lastBytes // the padding after it is optional
	for _, n := range []int{0, 3, 4, 8, 24, 40, 100, len(b) / 2, end - 1} {
		if _, err := Parse(b[:n]); err == nil {
			t.Errorf("a file cut at %d bytes parsed", n)
		}
	}
}

// TestBlockLayout checks the Q4_0/Q4_1/Q8_0 byte layouts against ggml's
// definitions written out by hand: one block, fp16 d first, then element
// j in the low nibble of byte j and element j+16 in its high nibble.
func TestBlockLayout(t *testing.T) {
	q := make([]uint8, 32)
	for j := range q {
		q[j] = uint8(j % 16)
	}
	l := &pack.Linear{In: 32, Out: 1, Grid: pack.Grid{Bits: 4, GroupSize: 32, Sym: true},
		Q: q, Scale: []float32{0.5}, Zero: []uint8{8}, GIdx: pack.SequentialGIdx(32, 32)}
	b, err := EncodeExact(l, Q4_0)
	if err != nil {
		t.Fatal(err)
	}
	// 0.5 in fp16 is 0x3800.
	want := []byte{0x00, 0x38}
	for j := 0; j < 16; j++ {
		want = append(want, byte(j)|byte(j)<<4) // q[j] = j, q[j+16] = j
	}
	if string(b) != string(want) {
		t.Errorf("Q4_0 block % x, want % x", b, want)
	}
	x, _ := Dequantize(b, Q4_0, 32)
	if x[0] != -4 || x[17] != -3.5 || x[31] != 3.5 {
		t.Errorf("Q4_0 decodes to %v", x)
	}
	l.Zero = []uint8{3}
	b, _ = EncodeExact(l, Q4_1)
	// m = −0.5·3 = −1.5: fp16 0xBE00.
	if b[0] != 0x00 || b[1] != 0x38 || b[2] != 0x00 || b[3] != 0xBE || b[4] != 0x00 || b[5] != 0x11 {
		t.Errorf("Q4_1 block starts % x", b[:6])
	}
	q8 := make([]uint8, 32)
	for j := range q8 {
		q8[j] = uint8(120 + j)
	}
	l8 := &pack.Linear{In: 32, Out: 1, Grid: pack.Grid{Bits: 8, GroupSize: -1, Sym: true},
		Q: q8, Scale: []float32{0.25}, Zero: []uint8{128}, GIdx: make([]int32, 32)}
	b, _ = EncodeExact(l8, Q8_0)
	if len(b) != 34 || b[0] != 0x00 || b[1] != 0x34 || int8(b[2]) != -8 || int8(b[33]) != 23 {
		t.Errorf("Q8_0 block % x", b)
	}
}

// TestRopePermutationByHand: for a head of 8 dimensions transformers
// rotates pairs (0,4), (1,5), (2,6), (3,7); ggml's normal RoPE rotates
// (0,1), (2,3), …, so the rows must come out in the order 0,4,1,5,2,6,3,7
// (and likewise within every head).
func TestRopePermutationByHand(t *testing.T) {
	got := RopePermutation(16, 2)
	want := []int{0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("permutation %v, want %v", got, want)
	}
}

// TestRopePermutationRotates checks the permutation by what it is for:
// applying transformers' rotate-half RoPE to q·W and ggml's adjacent-pair
// RoPE to q·W' (W' the permuted rows) gives the same vectors up to that
// permutation, so every attention score q·k is unchanged.
func TestRopePermutationRotates(t *testing.T) {
	const d, heads, pos = 16, 2, 7
	r := rand.New(rand.NewPCG(3, 4))
	x := make([]float64, heads*d)
	for i := range x {
		x[i] = r.NormFloat64()
	}
	theta := func(i int) float64 { return pos / math.Pow(10000, float64(2*i)/d) }
	hf := make([]float64, len(x)) // rotate-half on the original rows
	for h := 0; h < heads; h++ {
		for i := 0; i < d/2; i++ {
			a, b := x[h*d+i], x[h*d+i+d/2]
			c, s := math.Cos(theta(i)), math.Sin(theta(i))
			hf[h*d+i], hf[h*d+i+d/2] = a*c-b*s, a*s+b*c
		}
	}
	p := RopePermutation(heads*d, heads)
	y := make([]float64, len(x))
	for n, o := range p {
		y[n] = x[o]
	}
	gg := make([]float64, len(x)) // adjacent pairs on the permuted rows
	for h := 0; h < heads; h++ {
		for i := 0; i < d/2; i++ {
			a, b := y[h*d+2*i], y[h*d+2*i+1]
			c, s := math.Cos(theta(i)), math.Sin(theta(i))
			gg[h*d+2*i], gg[h*d+2*i+1] = a*c-b*s, a*s+b*c
		}
	}
	for n, o := range p {
		if math.Abs(gg[n]-hf[o]) > 1e-12 {
			t.Fatalf("row %d (from %d): ggml %v, transformers %v", n, o, gg[n], hf[o])
		}
	}
}

// packTiny quantizes llama-tiny by RTN with grid and writes it as llmq's
// GPTQ output; actOrder shuffles g_idx as GPTQ's act-order does.
func packTiny(t *testing.T, grid pack.Grid, actOrder bool) string {
	t.Helper()
	src := shared.Path(t, "models/llama-tiny")
	ck, err := checkpoint.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	dir := filepath.Join(t.TempDir(), "tiny-packed")
	w, err := pack.NewWriter(dir, false)
	if err != nil {
		t.Fatal(err)
	}
	c := ck.Config
	tensors := map[string]checkpoint.Out{}
	r := rand.New(rand.NewPCG(9, 9))
	for _, name := range ck.Names() {
		tt, _ := ck.Tensor(name)
		if len(tt.Shape) != 2 || !strings.Contains(name, "layers.") {
			tensors[name] = pack.Raw(tt)
			continue
		}
		out, in := tt.Shape[0], tt.Shape[1]
		x, err := ck.Float32(name, out, in)
		if err != nil {
			t.Fatal(err)
		}
		var l *pack.Linear
		if actOrder {
			// Quantize with a random input permutation, as act-order does,
			// and record it in g_idx.
			perm := r.Perm(in)
			xp := make([]float32, len(x))
			for o := 0; o < out; o++ {
				for i, p := range perm {
					xp[o*in+i] = x[o*in+p]
				}
			}
			lp, err := pack.RTN(xp, out, in, grid)
			if err != nil {
				t.Fatal(err)
			}
			l = &pack.Linear{In: in, Out: out, Grid: grid, Q: make([]uint8, len(lp.Q)), Scale: lp.Scale, Zero: lp.Zero, GIdx: make([]int32, in)}
			for i, p := range perm {
				l.GIdx[p] = lp.GIdx[i]
				for o := 0; o < out; o++ {
					l.Q[o*in+p] = lp.Q[o*in+i]
				}
			}
		} else if l, err = pack.RTN(x, out, in, grid); err != nil {
			t.Fatal(err)
		}
		if err := w.AddGPTQ(tensors, strings.TrimSuffix(name, ".weight"), l); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.WritePart(tensors); err != nil {
		t.Fatal(err)
	}
	sym := grid.Sym
	if err := w.Finish(src, &pack.QuantConfig{QuantMethod: "gptq", Bits: grid.Bits, GroupSize: grid.GroupSize, Sym: &sym, DescAct: actOrder}); err != nil {
		t.Fatal(err)
	}
	_ = c
	return dir
}

// TestExportTiny exports packed and unquantized llama-tiny and reads every
// tensor back: exact mappings dequantize bit for bit to llmq's weights
// (q/k rows permuted as llama.cpp expects), Q4_1 within the float16
// rounding of m, re-quantized layers with the error reported.
func TestExportTiny(t *testing.T) {
	type cse struct {
		name     string
		grid     pack.Grid
		actOrder bool
		typ      TensorType
		exact    bool
	}
	for _, c := range []cse{
		{"w4-g32-sym", pack.Grid{Bits: 4, GroupSize: 32, Sym: true}, false, Q4_0, true},
		{"w4-g128-sym", pack.Grid{Bits: 4, GroupSize: 128, Sym: true}, false, Q4_0, true},
		{"w4-perchannel-sym", pack.Grid{Bits: 4, GroupSize: -1, Sym: true}, false, Q4_0, true},
		{"w4-g64-asym", pack.Grid{Bits: 4, GroupSize: 64}, false, Q4_1, true},
		{"w8-g32-sym", pack.Grid{Bits: 8, GroupSize: 32, Sym: true}, false, Q8_0, true},
		{"w4-g32-sym-actorder", pack.Grid{Bits: 4, GroupSize: 32, Sym: true}, true, Q4_0, false},
		{"w3-g128", pack.Grid{Bits: 3, GroupSize: 128}, false, Q4_0, false},
		{"unquantized", pack.Grid{}, false, F16, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := shared.Path(t, "models/llama-tiny")
			if c.grid.Bits != 0 {
				dir = packTiny(t, c.grid, c.actOrder)
			}
			path := filepath.Join(t.TempDir(), "m.gguf")
			var warnings []string
			rep, err := Export(dir, path, Options{Warnf: func(f string, a ...any) { warnings = append(warnings, f) }})
			if err != nil {
				t.Fatal(err)
			}
			if c.grid.Bits != 0 && !c.exact && len(warnings) != 28 {
				t.Errorf("%d warnings for 28 re-quantized layers", len(warnings))
			}
			if c.exact && len(warnings) != 0 {
				t.Errorf("warnings for exact mappings: %v", warnings)
			}
			f, err := Read(path)
			if err != nil {
				t.Fatal(err)
			}
			m, err := pack.OpenModel(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			ck := m.Checkpoint
			cfg := ck.Config
			qc, _ := pack.ParseQuantConfig(cfg.Quantization)
			var maxQ41 float64
			for _, tr := range rep.Tensors {
				if !strings.HasPrefix(tr.Name, "blk.") || !strings.Contains(tr.Name, "ffn_") && !strings.Contains(tr.Name, "attn_") || strings.HasSuffix(tr.Name, "norm.weight") {
					continue
				}
				ti, data, err := f.Tensor(tr.Name)
				if err != nil {
					t.Fatal(err)
				}
				if ti.Type != c.typ {
					t.Fatalf("%s: type %s, want %s", tr.Name, ti.Type, c.typ)
				}
				in, out := int(ti.Dims[0]), int(ti.Dims[1])
				var want []float32
				if qc != nil {
					l, err := qc.Read(ck, tr.Source, in, out)
					if err != nil {
						t.Fatal(err)
					}
					want = l.Dequantize()
				} else if want, err = ck.Float32(tr.Source, out, in); err != nil {
					t.Fatal(err)
				}
				if strings.Contains(tr.Name, "attn_q") || strings.Contains(tr.Name, "attn_k") {
					heads := cfg.Heads
					if strings.Contains(tr.Name, "attn_k") {
						heads = cfg.KVHeads
					}
					want = permuteRows(want, out, in, heads)
				}
				got, err := Dequantize(data, ti.Type, in*out)
				if err != nil {
					t.Fatal(err)
				}
				// Weights reads the same values back in the checkpoint's row order.
				back, err := f.Weights(tr)
				if err != nil {
					t.Fatal(err)
				}
				if tr.RopeHeads > 0 {
					back = permuteRows(back, out, in, tr.RopeHeads)
				}
				if !slices.Equal(back, got) {
					t.Errorf("%s: Weights (rope heads %d) is not the tensor in the checkpoint's order", tr.Name, tr.RopeHeads)
				}
				var maxErr float64
				for i := range got {
					maxErr = max(maxErr, math.Abs(float64(got[i])-float64(want[i])))
				}
				rel := RelError(got, want)
				switch {
				case c.typ == Q4_1:
					maxQ41 = max(maxQ41, maxErr)
					if maxErr > 1e-3 {
						t.Errorf("%s: Q4_1 max error %g", tr.Name, maxErr)
					}
				case c.exact:
					if maxErr != 0 {
						t.Fatalf("%s: exact mapping differs by up to %g", tr.Name, maxErr)
					}
				case c.typ == F16:
					if rel > 1e-3 {
						t.Errorf("%s: F16 relative error %g", tr.Name, rel)
					}
				default:
					if math.Abs(rel-tr.RelErr) > 1e-9 || rel > 0.2 {
						t.Errorf("%s: re-quantized, relative error %g (reported %g)", tr.Name, rel, tr.RelErr)
					}
				}
			}
			if c.typ == Q4_1 {
				t.Logf("Q4_1: max |ŵ − w| %.3g over all layers (float16 rounding of m)", maxQ41)
			}
			checkMetadata(t, f, dir, cfg)
		})
	}
}

func checkMetadata(t *testing.T, f *File, dir string, c *checkpoint.Config) {
	t.Helper()
	for k, v := range map[string]any{
		"general.architecture":                   "llama",
		"general.alignment":                      uint32(32),
		"llama.context_length":                   uint32(c.MaxPositions),
		"llama.embedding_length":                 uint32(c.Hidden),
		"llama.block_count":                      uint32(c.Layers),
		"llama.feed_forward_length":              uint32(c.Intermediate),
		"llama.attention.head_count":             uint32(c.Heads),
		"llama.attention.head_count_kv":          uint32(c.KVHeads),
		"llama.rope.dimension_count":             uint32(c.HeadDim),
		"llama.rope.freq_base":                   float32(c.Rope.Theta),
		"llama.attention.layer_norm_rms_epsilon": float32(c.RMSNormEps),
		"llama.vocab_size":                       uint32(c.Vocab),
		"tokenizer.ggml.model":                   "gpt2",
		"tokenizer.ggml.pre":                     "gpt-2",
		"tokenizer.ggml.bos_token_id":            uint32(c.BOS),
		"tokenizer.ggml.eos_token_id":            uint32(c.EOS[0]),
		"tokenizer.ggml.add_bos_token":           true,
	} {
		if !reflect.DeepEqual(f.KV[k], v) {
			t.Errorf("%s = %#v, want %#v", k, f.KV[k], v)
		}
	}
	toks, _ := f.KV["tokenizer.ggml.tokens"].([]string)
	types, _ := f.KV["tokenizer.ggml.token_type"].([]int32)
	merges, _ := f.KV["tokenizer.ggml.merges"].([]string)
	if len(toks) != c.Vocab || len(types) != c.Vocab || len(merges) == 0 {
		t.Fatalf("%d tokens, %d types, %d merges", len(toks), len(types), len(merges))
	}
	var tj struct {
		Model struct {
			Vocab  map[string]int `json:"vocab"`
			Merges [][2]string    `json:"merges"`
		} `json:"model"`
	}
	data, _ := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err := json.Unmarshal(data, &tj); err != nil {
		t.Fatal(err)
	}
	for s, id := range tj.Model.Vocab {
		if toks[id] != s {
			t.Fatalf("token %d = %q, want %q", id, toks[id], s)
		}
	}
	if len(merges) != len(tj.Model.Merges) || merges[0] != tj.Model.Merges[0][0]+" "+tj.Model.Merges[0][1] {
		t.Errorf("merges: %d, first %q", len(merges), merges[0])
	}
	if types[0] != tokenControl || types[100] != tokenNormal {
		t.Errorf("token types %d (BOS), %d", types[0], types[100])
	}
	if tmpl, _ := f.KV["tokenizer.chat_template"].(string); !strings.Contains(tmpl, "start_header_id") {
		t.Errorf("chat template %q", tmpl)
	}
}

// TestExportZoo exports the architecture zoo's Qwen2 (no permutation:
// llama.cpp runs qwen2 with rotate-half RoPE; q/k/v biases; tied
// embeddings), Mistral (head_dim ≠ hidden/heads) and Llama-3.1 (rope_freqs)
// checkpoints and checks what each needs.
func TestExportZoo(t *testing.T) {
	for _, name := range []string{"qwen2-rand", "mistral-rand", "llama31-rand"} {
		t.Run(name, func(t *testing.T) {
			dir := shared.Path(t, "models/archzoo/"+name)
			path := filepath.Join(t.TempDir(), name+".gguf")
			if _, err := Export(dir, path, Options{}); err != nil {
				t.Fatal(err)
			}
			f, err := Read(path)
			if err != nil {
				t.Fatal(err)
			}
			ck, err := checkpoint.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			c := ck.Config
			arch, _ := f.KV["general.architecture"].(string)
			q, _ := ck.Float32("model.layers.0.self_attn.q_proj.weight", c.Heads*c.HeadDim, c.Hidden)
			_, data, err := f.Tensor("blk.0.attn_q.weight")
			if err != nil {
				t.Fatal(err)
			}
			got, _ := Dequantize(data, F16, len(q))
			want := make([]float32, len(q))
			for i, v := range q {
				want[i] = RoundF16Exact(v)
			}
			switch name {
			case "qwen2-rand":
				if arch != "qwen2" {
					t.Errorf("architecture %q", arch)
				}
				if _, _, err := f.Tensor("output.weight"); err == nil {
					t.Error("tied embeddings written as output.weight")
				}
				for _, b := range []string{"attn_q", "attn_k", "attn_v"} {
					if ti, _, err := f.Tensor("blk.1." + b + ".bias"); err != nil || ti.Type != F32 {
						t.Errorf("%s.bias: %v %v", b, ti, err)
					}
				}
			case "mistral-rand":
				if f.KV["llama.attention.key_length"] != uint32(c.HeadDim) || f.KV["llama.attention.value_length"] != uint32(c.HeadDim) {
					t.Errorf("key/value length %v %v, head_dim %d", f.KV["llama.attention.key_length"], f.KV["llama.attention.value_length"], c.HeadDim)
				}
				want = permuteRows(want, c.Heads*c.HeadDim, c.Hidden, c.Heads)
			case "llama31-rand":
				want = permuteRows(want, c.Heads*c.HeadDim, c.Hidden, c.Heads)
				ti, data, err := f.Tensor("rope_freqs.weight")
				if err != nil || ti.Type != F32 || ti.Dims[0] != uint64(c.HeadDim/2) {
					t.Fatalf("rope_freqs: %v %v", ti, err)
				}
				fr, _ := Dequantize(data, F32, c.HeadDim/2)
				// The highest frequencies are kept (factor 1), the lowest
				// divided by the full factor, monotone between.
				if fr[0] != 1 || fr[len(fr)-1] != float32(c.Rope.Factor) {
					t.Errorf("rope_freqs %v", fr)
				}
				for i := 1; i < len(fr); i++ {
					if fr[i] < fr[i-1] {
						t.Errorf("rope_freqs not monotone: %v", fr)
					}
				}
			}
			if !reflect.DeepEqual(got, want) {
				t.Error("blk.0.attn_q.weight is not the checkpoint's q_proj (permuted for llama)")
			}
		})
	}
}
