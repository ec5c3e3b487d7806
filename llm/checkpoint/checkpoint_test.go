package checkpoint

import (
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
)

func TestConfigStyles(t *testing.T) {
	// transformers-5 style (rope_parameters, dtype), GQA, tied
	small, err := LoadConfig(shared.Path(t, "models/llama-small"))
	if err != nil {
		t.Fatal(err)
	}
	if small.KVHeads != 4 || small.Heads != 8 || small.HeadDim != 64 || !small.TieEmbeddings || small.DType != "bfloat16" || small.Rope.Theta != 10000 {
		t.Errorf("llama-small config parsed as %+v", small)
	}
	if got := small.Params(); got != 29_368_832 {
		t.Errorf("llama-small has %d parameters, REFERENCE.md says 29,368,832", got)
	}
	tiny, err := LoadConfig(shared.Path(t, "models/llama-tiny"))
	if err != nil {
		t.Fatal(err)
	}
	if got := tiny.Params(); got != 7_342_336 {
		t.Errorf("llama-tiny has %d parameters, REFERENCE.md says 7,342,336", got)
	}
	// transformers-4 style with Llama-3.1 rope_scaling and torch_dtype
	l31, err := LoadConfig(shared.Path(t, "models/archzoo/llama31-rand"))
	if err != nil {
		t.Fatal(err)
	}
	want := Rope{Theta: 500000, Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 1024}
	if l31.Rope != want || l31.DType != "bfloat16" {
		t.Errorf("llama31 rope %+v dtype %q, want %+v bfloat16", l31.Rope, l31.DType, want)
	}
	mis, err := LoadConfig(shared.Path(t, "models/archzoo/mistral-rand"))
	if err != nil {
		t.Fatal(err)
	}
	if mis.HeadDim != 48 || mis.Hidden/mis.Heads == 48 {
		t.Errorf("mistral head_dim %d", mis.HeadDim)
	}
	qw, err := LoadConfig(shared.Path(t, "models/archzoo/qwen2-rand"))
	if err != nil {
		t.Fatal(err)
	}
	if !qw.QKVBias || qw.Rope.Theta != 1e6 {
		t.Errorf("qwen2: bias %v theta %v", qw.QKVBias, qw.Rope.Theta)
	}
}

func TestConfigErrors(t *testing.T) {
	cases := map[string]string{
		`{"architectures": ["GPT2LMHeadModel"]}`: `unknown architecture "GPT2LMHeadModel"`,
		`{}`:                                     "no \"architectures\"",
		`{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}`: "intermediate_size must be a positive integer",
		`{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 10}`: "not a multiple of num_key_value_heads",
		`{"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "use_sliding_window": true}`:                                                                                      "use_sliding_window",
		`{"architectures": ["MistralForCausalLM"], "sliding_window": 0}`:                                                                                                                   "sliding_window 0",
		`{"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn"}}`:                                                                                                   `rope type "yarn" is not supported`,
	}
	for in, want := range cases {
		if _, err := ParseConfig([]byte(in)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseConfig(%s) = %v, want an error mentioning %q", in, err, want)
		}
	}
}

func writeTiny(t *testing.T, dir string) string {
	t.Helper()
	p := filepath.Join(dir, "model.safetensors")
	err := WriteFile(p, map[string]Out{
		"a": F32([]float32{1, 2, 3, 4, 5, 6}, 2, 3),
		"b": BF16([]float32{1.5, -2}, 2),
		"c": F16([]float32{0.25}, 1),
		"d": I32([]int32{-7, 9}, 2),
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestWriteReadRoundTrip(t *testing.T) {
	p := writeTiny(t, t.TempDir())
	f, err := OpenFile(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	check := func(name string, want []float32) {
		tn, ok := f.Tensor(name)
		if !ok {
			t.Fatalf("%s missing", name)
		}
		got := make([]float32, tn.Numel())
		if err := tn.ToFloat32(got); err != nil {
			t.Fatal(err)
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("%s = %v, want %v", name, got, want)
			}
		}
	}
	check("a", []float32{1, 2, 3, 4, 5, 6})
	check("b", []float32{1.5, -2})
	check("c", []float32{0.25})
	d, _ := f.Tensor("d")
	if v, err := d.Int32(); err != nil || v[0] != -7 || v[1] != 9 {
		t.Fatalf("d = %v %v", v, err)
	}
	a, _ := f.Tensor("a")
	if err := a.CheckShape(3, 2); err == nil || !strings.Contains(err.Error(), `"a"`) {
		t.Errorf("shape mismatch error should name the tensor: %v", err)
	}
	if err := d.ToFloat32(make([]float32, 2)); err == nil || !strings.Contains(err.Error(), "I32 is not supported") {
		t.Errorf("decoding I32 as weights: %v", err)
	}
}

func TestBrokenSafetensors(t *testing.T) {
	dir := t.TempDir()
	good, err := os.ReadFile(writeTiny(t, dir))
	if err != nil {
		t.Fatal(err)
	}
	hdrLen := binary.LittleEndian.Uint64(good)
	bad := func(name string, data []byte, want string) {
		p := filepath.Join(dir, name)
		os.WriteFile(p, data, 0o644)
		_, err := OpenFile(p)
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: error %v, want one naming the file and saying %q", name, err, want)
		}
	}
	bad("short.safetensors", good[:5], "too short")
	bad("truncated.safetensors", good[:len(good)-3], "truncated")
	huge := append([]byte(nil), good...)
	binary.LittleEndian.PutUint64(huge, hdrLen+1000)
	bad("hdrlen.safetensors", huge, "runs past the end")
	notJSON := append([]byte(nil), good...)
	notJSON[8] = 'x'
	bad("json.safetensors", notJSON, "not valid JSON")
	dt := strings.Replace(string(good), `"F32"`, `"Q4X"`, 1)
	bad("dtype.safetensors", []byte(dt), `unsupported dtype "Q4X"`)
}

// copyModel copies a shared model directory so a test can break it.
func copyModel(t *testing.T, rel string) string {
	t.Helper()
	src := shared.Path(t, rel)
	dst := t.TempDir()
	entries, _ := os.ReadDir(src)
	for _, e := range entries {
		data, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(dst, e.Name()), data, 0o644)
	}
	return dst
}

func TestShardedCheckpoint(t *testing.T) {
	ck, err := Open(shared.Path(t, "models/llama-small"))
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if len(ck.files) != 4 {
		t.Errorf("opened %d shards, want 4", len(ck.files))
	}
	if _, err := ck.Float32("model.layers.7.mlp.down_proj.weight", 512, 1536); err != nil {
		t.Error(err)
	}
	if _, err := ck.Float32("model.layers.7.mlp.down_proj.weight", 1536, 512); err == nil || !strings.Contains(err.Error(), "down_proj") {
		t.Errorf("wrong shape accepted or error unnamed: %v", err)
	}

	dir := copyModel(t, "models/llama-small")
	os.Remove(filepath.Join(dir, "model-00003-of-00004.safetensors"))
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "model-00003-of-00004.safetensors") {
		t.Errorf("missing shard: %v", err)
	}
}

func TestUnknownArchitectureNamed(t *testing.T) {
	dir := copyModel(t, "models/llama-tiny")
	cfg, _ := os.ReadFile(filepath.Join(dir, "config.json"))
	os.WriteFile(filepath.Join(dir, "config.json"), []byte(strings.Replace(string(cfg), "LlamaForCausalLM", "FalconForCausalLM", 1)), 0o644)
	_, err := Open(dir)
	if err == nil || !strings.Contains(err.Error(), "FalconForCausalLM") || !strings.Contains(err.Error(), "config.json") {
		t.Errorf("unknown architecture error: %v", err)
	}
}

// FuzzHeader: no byte string makes opening a safetensors file panic, and
// every tensor of a file that opens decodes within bounds.
func FuzzHeader(f *testing.F) {
	dir := f.TempDir()
	p := filepath.Join(dir, "seed.safetensors")
	WriteFile(p, map[string]Out{"w": F32([]float32{1, 2}, 2), "b": BF16([]float32{3}, 1)}, map[string]string{"format": "pt"})
	seed, _ := os.ReadFile(p)
	f.Add(seed)
	WriteFile(p, map[string]Out{"w": F8E4M3([]byte{1, 2, 3}, 3), "s": F32([]float32{1}, 1)}, nil)
	seed8, _ := os.ReadFile(p)
	f.Add(seed8)
	f.Add([]byte{8, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '})
	// One file a worker process, rewritten for each input (the inputs of a
	// process run one after another): a directory made and removed per
	// input made the filesystem, not the parser, the cost.
	in := filepath.Join(dir, "f.safetensors")
	f.Fuzz(func(t *testing.T, data []byte) {
		p := in
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		file, err := OpenFile(p)
		if err != nil {
			return
		}
		defer file.Close()
		for _, n := range file.Names() {
			tn, _ := file.Tensor(n)
			_ = tn.ToFloat32(make([]float32, tn.Numel()))
		}
	})
}

// TestNonFiniteWeightsNamed: a weight that overflowed to Inf (70000 does
// not fit in fp16) or is NaN is refused with the tensor and the index;
// the largest finite float32 is accepted.
func TestNonFiniteWeightsNamed(t *testing.T) {
	dir := copyModel(t, "models/llama-tiny")
	p := filepath.Join(dir, "model.safetensors")
	f, err := OpenFile(p)
	if err != nil {
		t.Fatal(err)
	}
	tensors := map[string]Out{}
	for _, n := range f.Names() {
		tn, _ := f.Tensor(n)
		tensors[n] = Out{DType: tn.DType, Shape: tn.Shape, Data: append([]byte(nil), tn.Data...)}
	}
	f.Close()
	norm := make([]float32, 256)
	norm[7] = 70000
	tensors["model.norm.weight"] = F16(norm, 256)
	ln := make([]float32, 256)
	ln[3] = float32(math.NaN())
	tensors["model.layers.1.input_layernorm.weight"] = F32(ln, 256)
	big := make([]float32, 256)
	big[0] = math.MaxFloat32
	tensors["model.layers.0.input_layernorm.weight"] = F32(big, 256)
	if err := WriteFile(p, tensors, nil); err != nil {
		t.Fatal(err)
	}
	ck, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	for name, want := range map[string]string{
		"model.norm.weight":                     `tensor "model.norm.weight": element 7 is +Inf`,
		"model.layers.1.input_layernorm.weight": `tensor "model.layers.1.input_layernorm.weight": element 3 is NaN`,
	} {
		if _, err := ck.Float32(name, 256); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", name, err, want)
		}
	}
	if v, err := ck.Float32("model.layers.0.input_layernorm.weight", 256); err != nil || v[0] != math.MaxFloat32 {
		t.Errorf("the largest finite float32: %v, %v", v[0], err)
	}
}

// FuzzParseConfig: no config.json, however malformed, panics the parser,
// and a config it accepts describes a runnable shape (positive sizes,
// heads dividing evenly, a sliding window only when positive).
func FuzzParseConfig(f *testing.F) {
	for _, m := range []string{"llama-tiny", "llama-small", "archzoo/qwen2-rand", "archzoo/mistral-swa-rand", "archzoo/llama31-rand",
		"archzoo/qwen3-rand", "archzoo/qwen3moe-rand", "archzoo/mixtral-rand", "archzoo/gemma3-rand"} {
		if data, err := os.ReadFile(filepath.Join(shared.Root(), "models", m, "config.json")); err == nil {
			f.Add(data)
		}
	}
	f.Add([]byte(`{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10, "rope_scaling": {"rope_type": "llama3", "factor": 8}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(data)
		if err != nil {
			return
		}
		if c.Hidden <= 0 || c.Layers <= 0 || c.Heads <= 0 || c.KVHeads <= 0 || c.HeadDim <= 0 || c.Vocab <= 0 || c.Heads%c.KVHeads != 0 || c.SlidingWindow < 0 {
			t.Fatalf("accepted an unrunnable config: %+v", c)
		}
	})
}
