package evals

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
	"github.com/llmq/llmq/pack"
	"github.com/nlpodyssey/safetensors"
)

// Preset is the architecture of a published model, for synthetic
// checkpoints that measure speed at real sizes.
type Preset struct {
	Hidden, Intermediate, Layers, Heads, KVHeads, Vocab, MaxPositions int
	RopeTheta                                                         float64
	Tied, QKVBias                                                     bool
	Arch, ModelType                                                   string
}

// Presets are the configurations of Llama 2 and 3, Mistral and Qwen2 models
// (their Hugging Face config.json files).
var Presets = map[string]Preset{
	"llama3-1b":  {2048, 8192, 16, 32, 8, 128256, 8192, 500000, true, false, "LlamaForCausalLM", "llama"},
	"llama3-8b":  {4096, 14336, 32, 32, 8, 128256, 8192, 500000, false, false, "LlamaForCausalLM", "llama"},
	"llama3-70b": {8192, 28672, 80, 64, 8, 128256, 8192, 500000, false, false, "LlamaForCausalLM", "llama"},
	"llama2-7b":  {4096, 11008, 32, 32, 32, 32000, 4096, 10000, false, false, "LlamaForCausalLM", "llama"},
	"mistral-7b": {4096, 14336, 32, 32, 8, 32768, 32768, 1000000, false, false, "MistralForCausalLM", "mistral"},
	"qwen2-7b":   {3584, 18944, 28, 28, 4, 152064, 32768, 1000000, false, true, "Qwen2ForCausalLM", "qwen2"},
}

// PresetNames lists the presets, sorted.
func PresetNames() []string {
	var n []string
	for k := range Presets {
		n = append(n, k)
	}
	sort.Strings(n)
	return n
}

// SynthOptions choose what Synth writes.
type SynthOptions struct {
	Preset    string
	Arch      *Preset // used instead of Presets[Preset] when set
	Bits      int     // 3, 4 or 8 (GPTQ layout, symmetric) or 16 (bf16)
	Group     int
	Layers    int    // override the preset's layer count (0: keep)
	Tokenizer string // directory with tokenizer.json (and tokenizer_config.json)
	Out       string
	Force     bool
	// MaxShardBytes bounds a shard (pack.DefaultMaxShardBytes when 0).
	MaxShardBytes int64
	Progress      func(done, total int)
}

// A SynthOptionError is a SynthOptions field Synth cannot use: the field's
// name (Preset, Bits, Group, Tokenizer), its value as text, and what was
// expected, or the error reading it. A command line names its own flag.
type SynthOptionError struct {
	Field string
	Value string
	Want  string
	Err   error
}

func (e *SynthOptionError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("%s %s: %v", strings.ToLower(e.Field), e.Value, e.Err)
	}
	return fmt.Sprintf("%s %s: want %s", strings.ToLower(e.Field), e.Value, e.Want)
}

func (e *SynthOptionError) Unwrap() error { return e.Err }

// Synth writes a random-weight checkpoint with a preset's architecture in
// the layout real checkpoints use — bf16, or GPTQ at 3, 4 or 8 bits with
// fp16 scales —
// so that loading and running it costs what the real model costs. Weights
// are uniform with standard deviation 0.02 (dequantized ones too), which
// keeps activations in range through every layer. It is deterministic.
func Synth(opt SynthOptions) error {
	p, ok := Presets[opt.Preset]
	if opt.Arch != nil {
		p, ok = *opt.Arch, true
	}
	if !ok {
		return &SynthOptionError{Field: "Preset", Value: strconv.Quote(opt.Preset), Want: "one of " + strings.Join(PresetNames(), ", ")}
	}
	switch opt.Bits {
	case 3, 4, 8, 16:
	default:
		return &SynthOptionError{Field: "Bits", Value: strconv.Itoa(opt.Bits), Want: "3, 4 or 8 (GPTQ) or 16 (bf16)"}
	}
	if opt.Layers > 0 {
		p.Layers = opt.Layers
	}
	if opt.Group <= 0 || p.Hidden%opt.Group != 0 || p.Intermediate%opt.Group != 0 || opt.Group%8 != 0 {
		return &SynthOptionError{Field: "Group", Value: strconv.Itoa(opt.Group), Want: fmt.Sprintf("a multiple of 8 dividing %d and %d", p.Hidden, p.Intermediate)}
	}
	src, err := os.MkdirTemp("", "llmq-synth-src-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(src)
	hd := p.Hidden / p.Heads
	cfg := map[string]any{
		"architectures": []string{p.Arch}, "model_type": p.ModelType, "hidden_size": p.Hidden,
		"intermediate_size": p.Intermediate, "num_hidden_layers": p.Layers, "num_attention_heads": p.Heads,
		"num_key_value_heads": p.KVHeads, "head_dim": hd, "vocab_size": p.Vocab, "max_position_embeddings": p.MaxPositions,
		"rope_theta": p.RopeTheta, "rms_norm_eps": 1e-5, "tie_word_embeddings": p.Tied, "hidden_act": "silu",
		"bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
		"llmq_synthetic": fmt.Sprintf("random weights, preset %s", opt.Preset),
	}
	data, _ := json.MarshalIndent(cfg, "", "  ")
	if err := os.WriteFile(filepath.Join(src, "config.json"), data, 0o644); err != nil {
		return err
	}
	for _, f := range []string{"tokenizer.json", "tokenizer_config.json"} {
		b, err := os.ReadFile(filepath.Join(opt.Tokenizer, f))
		if err != nil {
			if f == "tokenizer.json" {
				return &SynthOptionError{Field: "Tokenizer", Value: opt.Tokenizer, Err: err}
			}
			continue
		}
		if err := os.WriteFile(filepath.Join(src, f), b, 0o644); err != nil {
			return err
		}
	}

	w, err := pack.NewWriter(opt.Out, opt.Force)
	if err != nil {
		return err
	}
	w.MaxShardBytes = opt.MaxShardBytes
	ok = false
	defer func() {
		if !ok {
			w.Abort()
		}
	}()
	qd, kvd := p.Heads*hd, p.KVHeads*hd
	grid := pack.Grid{Bits: opt.Bits, GroupSize: opt.Group, Sym: true}
	for l := 0; l < p.Layers; l++ {
		pre := fmt.Sprintf("model.layers.%d.", l)
		t := map[string]checkpoint.Out{
			pre + "input_layernorm.weight":          ones(p.Hidden),
			pre + "post_attention_layernorm.weight": ones(p.Hidden),
		}
		for _, lin := range []struct {
			name    string
			in, out int
		}{{"self_attn.q_proj", p.Hidden, qd}, {"self_attn.k_proj", p.Hidden, kvd}, {"self_attn.v_proj", p.Hidden, kvd},
			{"self_attn.o_proj", qd, p.Hidden}, {"mlp.gate_proj", p.Hidden, p.Intermediate}, {"mlp.up_proj", p.Hidden, p.Intermediate},
			{"mlp.down_proj", p.Intermediate, p.Hidden}} {
			name := pre + lin.name
			if opt.Bits == 16 {
				t[name+".weight"] = randomBF16(name, lin.out*lin.in, lin.out, lin.in)
			} else if err := w.AddGPTQ(t, name, synthGPTQ(name, lin.in, lin.out, grid)); err != nil {
				return err
			}
			if p.QKVBias && strings.HasPrefix(lin.name, "self_attn.") && lin.name != "self_attn.o_proj" {
				t[name+".bias"] = randomBF16(name+".bias", lin.out, lin.out)
			}
		}
		if err := w.WritePart(t); err != nil {
			return err
		}
		if opt.Progress != nil {
			opt.Progress(l+1, p.Layers+1)
		}
	}
	t := map[string]checkpoint.Out{
		"model.embed_tokens.weight": randomBF16("embed", p.Vocab*p.Hidden, p.Vocab, p.Hidden),
		"model.norm.weight":         ones(p.Hidden),
	}
	if !p.Tied {
		t["lm_head.weight"] = randomBF16("lm_head", p.Vocab*p.Hidden, p.Vocab, p.Hidden)
	}
	if err := w.WritePart(t); err != nil {
		return err
	}
	var qc *pack.QuantConfig
	if opt.Bits != 16 {
		qc = &pack.QuantConfig{QuantMethod: "gptq", Bits: grid.Bits, GroupSize: grid.GroupSize, Sym: &grid.Sym,
			Meta: &pack.QuantMeta{Quantizer: "llmq", Method: "synthetic"}}
	}
	if err := w.Finish(src, qc); err != nil {
		return err
	}
	if opt.Progress != nil {
		opt.Progress(p.Layers+1, p.Layers+1)
	}
	ok = true
	return nil
}

func ones(n int) checkpoint.Out {
	v := make([]float32, n)
	for i := range v {
		v[i] = 1
	}
	return checkpoint.BF16(v, n)
}

// random fills n values from a splitmix64 stream seeded by the tensor's
// name and the chunk, in parallel and reproducibly.
func random(name string, n int, put func(i int, r uint64)) {
	h := fnv.New64a()
	h.Write([]byte(name))
	seed := h.Sum64()
	const chunk = 1 << 16
	mat.ParallelFor((n+chunk-1)/chunk, 1, func(lo, hi int) {
		for c := lo; c < hi; c++ {
			s := seed ^ uint64(c)*0x9e3779b97f4a7c15
			for i := c * chunk; i < min(n, (c+1)*chunk); i++ {
				s += 0x9e3779b97f4a7c15
				z := s
				z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
				z = (z ^ z>>27) * 0x94d049bb133111eb
				put(i, z^z>>31)
			}
		}
	})
}

// randomBF16 is uniform on ±0.02·√3 (standard deviation 0.02).
func randomBF16(name string, n int, shape ...int) checkpoint.Out {
	b := make([]byte, 2*n)
	a := 0.02 * math.Sqrt(3)
	random(name, n, func(i int, r uint64) {
		u := float64(r>>40) / (1 << 24)
		binary.LittleEndian.PutUint16(b[2*i:], checkpoint.ToBF16(float32((2*u-1)*a)))
	})
	return checkpoint.Out{DType: safetensors.BF16, Shape: shape, Data: b}
}

// synthGPTQ is a symmetric layer on grid g with uniform random codes, for
// the writer to lay out in the GPTQ format (pack.Writer.AddGPTQ). A code
// minus its zero 2^(b−1) has RMS r_b = √(4^b/12 + 1/6); the scales are
// uniform around 0.0043·r₄/r_b, so that dequantized weights have standard
// deviation ≈ 0.02 at every width, like randomBF16's.
func synthGPTQ(name string, in, out int, g pack.Grid) *pack.Linear {
	group := g.Group(in)
	G := in / group
	l := &pack.Linear{In: in, Out: out, Grid: g, Q: make([]uint8, out*in), Scale: make([]float32, G*out),
		Zero: make([]uint8, G*out), GIdx: pack.SequentialGIdx(in, group)}
	mask := uint64(g.MaxQ())
	random(name+".qweight", (len(l.Q)+7)/8, func(i int, r uint64) {
		for j := 8 * i; j < min(len(l.Q), 8*i+8); j++ {
			l.Q[j] = uint8(r & mask)
			r >>= 8
		}
	})
	rms := func(b int) float64 { return math.Sqrt(math.Pow(4, float64(b))/12 + 1.0/6) }
	k := rms(4) / rms(g.Bits)
	random(name+".scales", len(l.Scale), func(i int, r uint64) {
		u := float64(r>>40) / (1 << 24)
		l.Scale[i] = pack.RoundF16(float32((0.0035 + 0.0016*u) * k))
	})
	for i := range l.Zero {
		l.Zero[i] = uint8((g.MaxQ() + 1) / 2)
	}
	return l
}
