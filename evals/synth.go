package evals

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
	"github.com/llmq/llmq/pack"
	"github.com/nlpodyssey/safetensors"
)

// Preset is the architecture of a published model, for synthetic
// checkpoints that measure speed at real sizes. Its fields are keys of
// the family's config.json. Synth writes that config and the tensors the
// loader reads for it (llm.BlockLinears, llm.Block.Norms): what follows
// from the architecture alone — the q_norm and k_norm of Qwen3, Qwen3-MoE
// and Gemma 3, Gemma 3's four norms a layer stored as w for 1+w, its
// scaled embeddings and GeGLU — is therefore not a field.
type Preset struct {
	Arch, ModelType string // architectures[0], model_type

	Hidden, Intermediate, Layers, Heads, KVHeads, Vocab, MaxPositions int
	// HeadDim is head_dim where it is not Hidden/Heads (Qwen3, Gemma 3);
	// 0 means Hidden/Heads.
	HeadDim   int
	RopeTheta float64
	Tied      bool // tie_word_embeddings
	// QKVBias is attention_bias: q, k and v carry biases, and o too
	// outside Qwen2 (whose q, k and v always have them).
	QKVBias bool
	NormEps float64 // rms_norm_eps; 0 means 1e-5

	// A mixture of experts (Mixtral, Qwen3-MoE) replaces every layer's
	// MLP: Experts experts (num_local_experts for Mixtral, num_experts for
	// Qwen3-MoE), TopK of them per token (num_experts_per_tok), each a
	// gated MLP of MoEIntermediate units (Qwen3-MoE's
	// moe_intermediate_size; Mixtral's experts are Intermediate wide).
	// NormTopK renormalises the chosen experts' weights (Qwen3-MoE's
	// norm_topk_prob; Mixtral always does).
	Experts, TopK, MoEIntermediate int
	NormTopK                       bool
	// MLPOnly lists the layers of a Qwen3-MoE that keep a dense MLP of
	// Intermediate units (mlp_only_layers).
	MLPOnly []int

	// SlidingWindow, when positive, limits attention to the last
	// SlidingWindow positions (sliding_window): on every layer (Mistral),
	// or with SlidingPattern on all but every SlidingPattern-th layer
	// (Gemma 3's sliding_window_pattern). LocalRopeTheta is the rotary
	// base of Gemma 3's sliding layers (rope_local_base_freq); RopeFactor,
	// when positive, scales the rotary positions linearly (rope_scaling;
	// Gemma 3: of the full-attention layers).
	SlidingWindow, SlidingPattern int
	LocalRopeTheta, RopeFactor    float64
}

// Presets are the architectures of published models, from their Hugging
// Face config.json files (huggingface.co/ORG/MODEL/blob/main/config.json).
var Presets = map[string]Preset{
	"llama3-1b": {Arch: "LlamaForCausalLM", ModelType: "llama", Hidden: 2048, Intermediate: 8192, Layers: 16, Heads: 32, KVHeads: 8,
		Vocab: 128256, MaxPositions: 8192, RopeTheta: 500000, Tied: true},
	"llama3-8b": {Arch: "LlamaForCausalLM", ModelType: "llama", Hidden: 4096, Intermediate: 14336, Layers: 32, Heads: 32, KVHeads: 8,
		Vocab: 128256, MaxPositions: 8192, RopeTheta: 500000},
	"llama3-70b": {Arch: "LlamaForCausalLM", ModelType: "llama", Hidden: 8192, Intermediate: 28672, Layers: 80, Heads: 64, KVHeads: 8,
		Vocab: 128256, MaxPositions: 8192, RopeTheta: 500000},
	"llama2-7b": {Arch: "LlamaForCausalLM", ModelType: "llama", Hidden: 4096, Intermediate: 11008, Layers: 32, Heads: 32, KVHeads: 32,
		Vocab: 32000, MaxPositions: 4096, RopeTheta: 10000},
	"mistral-7b": {Arch: "MistralForCausalLM", ModelType: "mistral", Hidden: 4096, Intermediate: 14336, Layers: 32, Heads: 32, KVHeads: 8,
		Vocab: 32768, MaxPositions: 32768, RopeTheta: 1000000},
	"qwen2-7b": {Arch: "Qwen2ForCausalLM", ModelType: "qwen2", Hidden: 3584, Intermediate: 18944, Layers: 28, Heads: 28, KVHeads: 4,
		Vocab: 152064, MaxPositions: 32768, RopeTheta: 1000000, QKVBias: true},
	// Qwen/Qwen3-8B
	"qwen3-8b": {Arch: "Qwen3ForCausalLM", ModelType: "qwen3", Hidden: 4096, Intermediate: 12288, Layers: 36, Heads: 32, KVHeads: 8,
		HeadDim: 128, Vocab: 151936, MaxPositions: 40960, RopeTheta: 1000000, NormEps: 1e-6},
	// google/gemma-3-12b-it's text_config (Gemma3TextConfig's defaults
	// for what it leaves out: head_dim 256, vocab 262208, rope_theta 1e6,
	// rope_local_base_freq 10000, sliding_window_pattern 6, tied
	// embeddings) as Gemma3ForCausalLM: the language model without the
	// vision tower.
	"gemma3-12b": {Arch: "Gemma3ForCausalLM", ModelType: "gemma3_text", Hidden: 3840, Intermediate: 15360, Layers: 48, Heads: 16, KVHeads: 8,
		HeadDim: 256, Vocab: 262208, MaxPositions: 131072, RopeTheta: 1000000, Tied: true, NormEps: 1e-6,
		SlidingWindow: 1024, SlidingPattern: 6, LocalRopeTheta: 10000, RopeFactor: 8},
	// mistralai/Mixtral-8x7B-v0.1
	"mixtral-8x7b": {Arch: "MixtralForCausalLM", ModelType: "mixtral", Hidden: 4096, Intermediate: 14336, Layers: 32, Heads: 32, KVHeads: 8,
		Vocab: 32000, MaxPositions: 32768, RopeTheta: 1000000, Experts: 8, TopK: 2},
	// Qwen/Qwen3-30B-A3B
	"qwen3-30b-a3b": {Arch: "Qwen3MoeForCausalLM", ModelType: "qwen3_moe", Hidden: 2048, Intermediate: 6144, Layers: 48, Heads: 32, KVHeads: 4,
		HeadDim: 128, Vocab: 151936, MaxPositions: 40960, RopeTheta: 1000000, NormEps: 1e-6,
		Experts: 128, TopK: 8, MoEIntermediate: 768, NormTopK: true},
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

// config is the config.json Synth writes for the preset, in its family's
// spelling, with the special tokens of the tokenizers Synth copies (bos
// 0, eos 1).
func (p Preset) config() map[string]any {
	hd := p.HeadDim
	if hd == 0 && p.Heads > 0 {
		hd = p.Hidden / p.Heads
	}
	eps := p.NormEps
	if eps == 0 {
		eps = 1e-5
	}
	c := map[string]any{
		"architectures": []string{p.Arch}, "model_type": p.ModelType, "hidden_size": p.Hidden,
		"intermediate_size": p.Intermediate, "num_hidden_layers": p.Layers, "num_attention_heads": p.Heads,
		"num_key_value_heads": p.KVHeads, "head_dim": hd, "vocab_size": p.Vocab, "max_position_embeddings": p.MaxPositions,
		"rope_theta": p.RopeTheta, "rms_norm_eps": eps, "tie_word_embeddings": p.Tied, "attention_bias": p.QKVBias,
		"bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
	}
	if strings.HasPrefix(p.Arch, "Gemma3") {
		c["hidden_activation"] = "gelu_pytorch_tanh" // Gemma 3's key and value
	} else {
		c["hidden_act"] = "silu"
	}
	if p.Experts > 0 {
		c["num_experts_per_tok"] = p.TopK
		if p.Arch == "MixtralForCausalLM" {
			c["num_local_experts"] = p.Experts
		} else {
			c["num_experts"], c["moe_intermediate_size"], c["norm_topk_prob"] = p.Experts, p.MoEIntermediate, p.NormTopK
		}
		if len(p.MLPOnly) > 0 {
			c["mlp_only_layers"] = p.MLPOnly
		}
	}
	if p.SlidingWindow > 0 {
		c["sliding_window"] = p.SlidingWindow
	}
	if p.SlidingPattern > 0 {
		c["sliding_window_pattern"] = p.SlidingPattern
	}
	if p.LocalRopeTheta > 0 {
		c["rope_local_base_freq"] = p.LocalRopeTheta
	}
	if p.RopeFactor > 0 {
		c["rope_scaling"] = map[string]any{"rope_type": "linear", "factor": p.RopeFactor}
	}
	return c
}

// Config is the architecture as the loader reads it from the config.json
// Synth writes. Synth lays the tensors out by it, and its Params is the
// preset's parameter count, known without writing anything.
func (p Preset) Config() (*checkpoint.Config, error) {
	data, err := json.Marshal(p.config())
	if err != nil {
		return nil, err
	}
	return checkpoint.ParseConfig(data)
}

// SynthOptions choose what Synth writes.
type SynthOptions struct {
	Preset string
	Arch   *Preset // used instead of Presets[Preset] when set
	Bits   int     // 3, 4 or 8 (GPTQ layout, symmetric) or 16 (bf16)
	Group  int
	Layers int // override the preset's layer count (0: keep)
	// MLPOnly overrides a Qwen3-MoE preset's layers that keep a dense
	// MLP (mlp_only_layers; nil: keep): a model mixing dense and sparse
	// layers, as some checkpoints do.
	MLPOnly []int
	// QuantizeLMHead packs the LM head too, as quantize --quantize-lm-head
	// does (a quantized checkpoint with untied embeddings only).
	QuantizeLMHead bool
	Tokenizer      string // directory with tokenizer.json (and tokenizer_config.json)
	Out            string
	Force          bool
	// MaxShardBytes bounds a shard (pack.DefaultMaxShardBytes when 0).
	MaxShardBytes int64
	Progress      func(done, total int)
}

// A SynthOptionError is a SynthOptions field Synth cannot use: the field's
// name (Preset, Arch, Bits, Group, Tokenizer, MLPOnly, QuantizeLMHead), its value as text, and what
// was expected, or the error reading it. A command line names its own
// flag.
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
// fp16 scales — so that loading and running it costs what the real model
// costs. Quantized, it is what llmq's quantizer writes: every linear layer
// of the decoder (each expert's, in a mixture) packed, and the norms, the
// routers, the embeddings and the LM head in bf16 (the head packed too
// with QuantizeLMHead). Weights are uniform
// with standard deviation 0.02 (dequantized ones too), which keeps
// activations in range through every layer. It is deterministic.
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
	if opt.MLPOnly != nil {
		if p.Arch != "Qwen3MoeForCausalLM" {
			return &SynthOptionError{Field: "MLPOnly", Value: fmt.Sprint(opt.MLPOnly), Want: "a Qwen3-MoE preset (mlp_only_layers is Qwen3-MoE's)"}
		}
		for _, l := range opt.MLPOnly {
			if l < 0 || l >= p.Layers {
				return &SynthOptionError{Field: "MLPOnly", Value: fmt.Sprint(opt.MLPOnly), Want: fmt.Sprintf("layers 0 … %d", p.Layers-1)}
			}
		}
		p.MLPOnly = opt.MLPOnly
	}
	cfg, err := p.Config()
	if err != nil {
		if opt.Arch != nil {
			return &SynthOptionError{Field: "Arch", Value: p.Arch, Err: err}
		}
		return &SynthOptionError{Field: "Preset", Value: strconv.Quote(opt.Preset), Err: err}
	}
	if opt.QuantizeLMHead && (opt.Bits == 16 || cfg.TieEmbeddings) {
		return &SynthOptionError{Field: "QuantizeLMHead", Value: "true",
			Want: fmt.Sprintf("a quantized checkpoint (bits %d) whose lm_head is its own (tie_word_embeddings %v)", opt.Bits, cfg.TieEmbeddings)}
	}
	// The GPU kernel's layout takes groups of whole 16-row tiles (pack.GPULayout),
	// and synthetic checkpoints are made to be run there.
	widths := inputWidths(cfg)
	if opt.Group <= 0 || opt.Group%16 != 0 || slices.ContainsFunc(widths, func(in int) bool { return in%opt.Group != 0 }) {
		return &SynthOptionError{Field: "Group", Value: strconv.Itoa(opt.Group), Want: "a multiple of 16 (the GPU kernel's tile) dividing " + andList(widths)}
	}
	src, err := os.MkdirTemp("", "llmq-synth-src-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(src)
	c := p.config()
	c["llmq_synthetic"] = fmt.Sprintf("random weights, preset %s", opt.Preset)
	data, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return err
	}
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
		if f == "tokenizer.json" {
			if b, err = spellEveryID(b, p.Vocab); err != nil {
				return &SynthOptionError{Field: "Tokenizer", Value: opt.Tokenizer, Err: err}
			}
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
	grid := pack.Grid{Bits: opt.Bits, GroupSize: opt.Group, Sym: true}
	norms := new(llm.Block).Norms(cfg) // a layer's norms, as the loader lists them
	for l := 0; l < cfg.Layers; l++ {
		pre := fmt.Sprintf("model.layers.%d.", l)
		t := map[string]checkpoint.Out{}
		for _, n := range norms {
			t[pre+n.Name] = ones(cfg, n.N)
		}
		if cfg.Sparse(l) { // the router stays in bf16, as the quantizer leaves it
			r := llm.RouterName(cfg, l)
			t[r+".weight"] = randomBF16(r, cfg.MoE.Experts*cfg.Hidden, cfg.MoE.Experts, cfg.Hidden)
		}
		for _, s := range llm.BlockLinears(cfg, l) { // attention, then the MLP or each expert's
			if opt.Bits == 16 {
				t[s.Name+".weight"] = randomBF16(s.Name, s.Out*s.In, s.Out, s.In)
			} else if err := w.AddGPTQ(t, s.Name, synthGPTQ(s.Name, s.In, s.Out, grid)); err != nil {
				return err
			}
			if s.Bias {
				t[s.Name+".bias"] = randomBF16(s.Name+".bias", s.Out, s.Out)
			}
		}
		if err := w.WritePart(t); err != nil {
			return err
		}
		if opt.Progress != nil {
			opt.Progress(l+1, cfg.Layers+1)
		}
	}
	t := map[string]checkpoint.Out{
		"model.embed_tokens.weight": randomBF16("embed", cfg.Vocab*cfg.Hidden, cfg.Vocab, cfg.Hidden),
		"model.norm.weight":         ones(cfg, cfg.Hidden),
	}
	switch {
	case opt.QuantizeLMHead:
		if err := w.AddGPTQ(t, "lm_head", synthGPTQ("lm_head", cfg.Hidden, cfg.Vocab, grid)); err != nil {
			return err
		}
	case !cfg.TieEmbeddings:
		t["lm_head.weight"] = randomBF16("lm_head", cfg.Vocab*cfg.Hidden, cfg.Vocab, cfg.Hidden)
	}
	if err := w.WritePart(t); err != nil {
		return err
	}
	var qc *pack.QuantConfig
	if opt.Bits != 16 {
		qc = &pack.QuantConfig{QuantMethod: "gptq", Bits: grid.Bits, GroupSize: grid.GroupSize, Sym: &grid.Sym,
			ModulesInBlockToQuantize: pack.ModulesInBlock(cfg), LMHead: opt.QuantizeLMHead,
			Meta: &pack.QuantMeta{Quantizer: "llmq", Method: "synthetic"}}
	}
	if err := w.Finish(src, qc); err != nil {
		return err
	}
	if opt.Progress != nil {
		opt.Progress(cfg.Layers+1, cfg.Layers+1)
	}
	ok = true
	return nil
}

// ones is an RMSNorm weight of n ones as the checkpoint stores it: w, or
// zeros where the config applies 1+w (Gemma 3).
func ones(c *checkpoint.Config, n int) checkpoint.Out {
	v := make([]float32, n)
	for i := range v {
		v[i] = 1
	}
	return checkpoint.BF16(llm.StoredNorm(c, v), n)
}

// inputWidths lists the distinct input widths of the decoder layers'
// linear layers, ascending: a quantization group must divide each.
func inputWidths(c *checkpoint.Config) []int {
	var w []int
	for l := 0; l < c.Layers; l++ {
		for _, s := range llm.BlockLinears(c, l) {
			w = append(w, s.In)
		}
	}
	slices.Sort(w)
	return slices.Compact(w)
}

// andList writes numbers as "1, 2 and 3".
func andList(v []int) string {
	s := make([]string, len(v))
	for i, n := range v {
		s[i] = strconv.Itoa(n)
	}
	if len(s) < 2 {
		return strings.Join(s, "")
	}
	return strings.Join(s[:len(s)-1], ", ") + " and " + s[len(s)-1]
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

// spellEveryID returns tokenizer.json with a BPE vocabulary covering ids
// 0 … vocab−1: the copied tokenizer's ids as they are, and each id it
// lacks (past its end, or a gap) as the token "synth<i>", which decodes to
// that text. No merge produces a filler; only a tokenizer that emits whole
// vocabulary words (ignore_merges) with a pre-tokenizer that keeps
// "synth<i>" in one piece would encode that text to it. A random-weight
// model picks ids all over its vocabulary; with a smaller tokenizer
// (llama-tiny's 8,192 under llama3-8b's 128,256) most of its tokens would
// decode to nothing, and a streaming server would send no event for them.
// Other model kinds (Unigram, WordPiece) are returned unchanged.
func spellEveryID(tokenizer []byte, vocab int) ([]byte, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(tokenizer, &top); err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	var model map[string]json.RawMessage
	if err := json.Unmarshal(top["model"], &model); err != nil {
		return nil, fmt.Errorf("tokenizer.json: model: %w", err)
	}
	var kind string
	if err := json.Unmarshal(model["type"], &kind); err != nil || kind != "BPE" {
		return tokenizer, nil
	}
	var ids map[string]int
	if err := json.Unmarshal(model["vocab"], &ids); err != nil {
		return nil, fmt.Errorf("tokenizer.json: model.vocab: %w", err)
	}
	if ids == nil {
		return nil, fmt.Errorf("tokenizer.json: model.vocab: missing (want an object of token → id)")
	}
	used := make(map[int]bool, len(ids))
	for _, id := range ids {
		used[id] = true
	}
	var added []struct {
		ID int `json:"id"`
	}
	if raw, ok := top["added_tokens"]; ok {
		if err := json.Unmarshal(raw, &added); err != nil {
			return nil, fmt.Errorf("tokenizer.json: added_tokens: %w", err)
		}
	}
	for _, a := range added {
		used[a.ID] = true
	}
	n := 0
	for id := 0; id < vocab; id++ {
		if used[id] {
			continue
		}
		tok := "synth" + strconv.Itoa(id)
		if _, taken := ids[tok]; taken {
			return nil, fmt.Errorf("tokenizer.json: the filler token %q for id %d is already in the vocabulary", tok, id)
		}
		ids[tok] = id
		n++
	}
	if n == 0 {
		return tokenizer, nil
	}
	var err error
	if model["vocab"], err = json.Marshal(ids); err != nil {
		return nil, fmt.Errorf("tokenizer.json: writing model.vocab: %w", err)
	}
	if top["model"], err = json.Marshal(model); err != nil {
		return nil, fmt.Errorf("tokenizer.json: writing model: %w", err)
	}
	out, err := json.Marshal(top)
	if err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	return out, nil
}
