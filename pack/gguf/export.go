package gguf

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// Options configure Export.
type Options struct {
	// Name is general.name; the model directory's base name when empty.
	Name string
	// Pre overrides tokenizer.ggml.pre, the name under which llama.cpp
	// knows the tokenizer's pre-tokenizer regex (detected otherwise).
	Pre string
	// Warnf receives warnings (re-quantized layers with their measured
	// weight error); nil discards them. Report.Tensors says which layers
	// were re-quantized (TensorReport.Requantized) and File.Weights reads
	// them back, to measure what that costs.
	Warnf func(format string, args ...any)
}

// TensorReport is what happened to one tensor.
type TensorReport struct {
	Name   string // GGUF name
	Source string // checkpoint name (prefix for packed layers)
	Type   TensorType
	Exact  bool    // packed codes carried over (quantized layers)
	RelErr float64 // ‖ŵ − w‖/‖w‖ against the checkpoint's (dequantized) weights
	MaxErr float64 // max |ŵ − w|
	// RopeHeads is the number of heads of RopePermutation when the rows
	// were reordered for llama.cpp's RoPE (q and k of Llama models), 0
	// when they keep the checkpoint's order.
	RopeHeads int
}

// Requantized says whether the tensor is a packed layer that could not be
// carried over and was re-quantized from its dequantized weights.
func (t TensorReport) Requantized() bool {
	return !t.Exact && (t.Type == Q4_0 || t.Type == Q4_1 || t.Type == Q8_0)
}

// Weights reads a linear layer's weight back from an exported file,
// dequantized as ggml computes it, as [out][in] in the checkpoint's row
// order (the RoPE permutation undone): the weights llama.cpp runs, laid
// out as llmq's model holds them.
func (f *File) Weights(t TensorReport) ([]float32, error) {
	ti, data, err := f.Tensor(t.Name)
	if err != nil {
		return nil, err
	}
	if len(ti.Dims) != 2 {
		return nil, fmt.Errorf("gguf: tensor %q has %d dimensions, not a linear layer's 2", t.Name, len(ti.Dims))
	}
	in, out := int(ti.Dims[0]), int(ti.Dims[1])
	w, err := Dequantize(data, ti.Type, in*out)
	if err != nil {
		return nil, fmt.Errorf("gguf: tensor %q: %w", t.Name, err)
	}
	if t.RopeHeads == 0 {
		return w, nil
	}
	orig := make([]float32, len(w))
	for r, src := range RopePermutation(out, t.RopeHeads) {
		copy(orig[src*in:(src+1)*in], w[r*in:(r+1)*in])
	}
	return orig, nil
}

// Report summarises an export.
type Report struct {
	Arch     string
	FileType uint32
	Tensors  []TensorReport
	Bytes    int64
}

// GGUF file types (enum llama_ftype) for general.file_type.
const (
	fileTypeF32  = 0
	fileTypeF16  = 1
	fileTypeQ4_0 = 2
	fileTypeQ4_1 = 3
	fileTypeQ8_0 = 7
)

// job is one tensor to write: its declaration and how to make its bytes.
type job struct {
	name, source string
	typ          TensorType
	dims         []int
	exact        bool
	encode       func() ([]byte, *TensorReport, error)
}

// Export writes the checkpoint in dir (unquantized, or packed by GPTQ or
// AWQ) as a GGUF file at path that llama.cpp and ollama load. See the
// package documentation and README for the mapping.
func Export(dir, path string, opt Options) (*Report, error) {
	warnf := opt.Warnf
	if warnf == nil {
		warnf = func(string, ...any) {}
	}
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return nil, err
	}
	defer ck.Close()
	c := ck.Config
	arch := "llama"
	permute := true
	switch c.Architecture {
	case "LlamaForCausalLM", "MistralForCausalLM":
	case "Qwen2ForCausalLM":
		// llama.cpp runs qwen2 with NeoX-style (rotate-half) RoPE, as
		// transformers does: no row permutation.
		arch, permute = "qwen2", false
	default:
		return nil, fmt.Errorf("%s: architecture %q cannot be exported to GGUF (Llama, Mistral, Qwen2)", dir, c.Architecture)
	}
	qc, err := pack.ParseQuantConfig(c.Quantization)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	name := opt.Name
	if name == "" {
		name = filepath.Base(filepath.Clean(dir))
	}

	w := NewWriter()
	add := func(k string, v any) {
		if err == nil {
			err = w.Add(k, v)
		}
	}
	add("general.architecture", arch)
	add("general.name", name)
	add("general.quantization_version", uint32(2))
	add(arch+".context_length", uint32(c.MaxPositions))
	add(arch+".embedding_length", uint32(c.Hidden))
	add(arch+".block_count", uint32(c.Layers))
	add(arch+".feed_forward_length", uint32(c.Intermediate))
	add(arch+".attention.head_count", uint32(c.Heads))
	add(arch+".attention.head_count_kv", uint32(c.KVHeads))
	add(arch+".rope.dimension_count", uint32(c.HeadDim))
	add(arch+".rope.freq_base", float32(c.Rope.Theta))
	add(arch+".attention.layer_norm_rms_epsilon", float32(c.RMSNormEps))
	add(arch+".vocab_size", uint32(c.Vocab))
	if c.HeadDim*c.Heads != c.Hidden {
		add(arch+".attention.key_length", uint32(c.HeadDim))
		add(arch+".attention.value_length", uint32(c.HeadDim))
	}
	switch c.Rope.Type {
	case "", "default":
	case "linear":
		add(arch+".rope.scaling.type", "linear")
		add(arch+".rope.scaling.factor", float32(c.Rope.Factor))
	case "llama3":
		// written as the rope_freqs tensor below
	default:
		return nil, fmt.Errorf("%s: rope type %q cannot be exported to GGUF", dir, c.Rope.Type)
	}
	if err != nil {
		return nil, err
	}
	if err := addTokenizer(w, dir, c, opt.Pre); err != nil {
		return nil, err
	}

	var jobs []job
	// dense adds a float tensor read from the checkpoint: weights [out][in]
	// (shape given outermost first) as F16, 1-D tensors as F32.
	dense := func(gname, src string, typ TensorType, perm int, shape ...int) {
		jobs = append(jobs, job{name: gname, source: src, typ: typ, dims: ggmlDims(shape), encode: func() ([]byte, *TensorReport, error) {
			x, err := ck.Float32(src, shape...)
			if err != nil {
				return nil, nil, err
			}
			if perm > 0 {
				x = permuteRows(x, shape[0], len(x)/shape[0], perm)
			}
			b, err := Quantize(x, shape[len(shape)-1], typ)
			if err != nil {
				return nil, nil, fmt.Errorf("tensor %q: %w", src, err)
			}
			return b, &TensorReport{RopeHeads: perm}, nil
		}})
	}
	// linear adds a linear layer, packed or not, and its bias.
	linear := func(gname, src string, in, out, perm int, bias bool) error {
		if qc == nil || !ck.Has(src+".qweight") {
			if err := pack.Unexplained(ck, src); err != nil {
				return err
			}
			dense(gname+".weight", src+".weight", F16, perm, out, in)
		} else {
			l, err := qc.Read(ck, src, in, out)
			if err != nil {
				return fmt.Errorf("%s: %w", dir, err)
			}
			m := Map(l)
			jobs = append(jobs, job{name: gname + ".weight", source: src, typ: m.Type, dims: []int{in, out}, exact: m.Exact,
				encode: func() ([]byte, *TensorReport, error) {
					l, err := qc.Read(ck, src, in, out)
					if err != nil {
						return nil, nil, err
					}
					if perm > 0 {
						l = permuteLinear(l, perm)
					}
					ref := l.Dequantize()
					var b []byte
					if m.Exact {
						b, err = EncodeExact(l, m.Type)
					} else {
						b, err = Quantize(ref, in, m.Type)
					}
					if err != nil {
						return nil, nil, fmt.Errorf("%s: %w", src, err)
					}
					r := &TensorReport{Exact: m.Exact, RopeHeads: perm}
					hat := make([]float32, len(ref))
					rb, _ := m.Type.RowBytes(in)
					for o := 0; o < out; o++ {
						got, err := Dequantize(b[o*rb:(o+1)*rb], m.Type, in)
						if err != nil {
							return nil, nil, err
						}
						copy(hat[o*in:], got)
					}
					for i, v := range hat {
						r.MaxErr = max(r.MaxErr, math.Abs(float64(v)-float64(ref[i])))
					}
					r.RelErr = RelError(hat, ref)
					if !m.Exact {
						warnf("%s: re-quantized to %s (%s): relative weight error %.4g", src, m.Type, m.Why, r.RelErr)
					}
					return b, r, nil
				}})
		}
		if bias {
			dense(gname+".bias", src+".bias", F32, perm, out)
		}
		return nil
	}

	dense("token_embd.weight", "model.embed_tokens.weight", F16, 0, c.Vocab, c.Hidden)
	if c.Rope.Type == "llama3" {
		f := ropeFactors(c)
		jobs = append(jobs, job{name: "rope_freqs.weight", source: "rope_scaling", typ: F32, dims: []int{len(f)}, encode: func() ([]byte, *TensorReport, error) {
			b, err := Quantize(f, len(f), F32)
			return b, &TensorReport{}, err
		}})
	}
	q, kv := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	for i := 0; i < c.Layers; i++ {
		p, g := fmt.Sprintf("model.layers.%d.", i), fmt.Sprintf("blk.%d.", i)
		qp, kp := 0, 0
		if permute {
			qp, kp = c.Heads, c.KVHeads
		}
		dense(g+"attn_norm.weight", p+"input_layernorm.weight", F32, 0, c.Hidden)
		for _, l := range []struct {
			g, s        string
			in, out, pm int
			bias        bool
		}{
			{"attn_q", "self_attn.q_proj", c.Hidden, q, qp, c.QKVBias},
			{"attn_k", "self_attn.k_proj", c.Hidden, kv, kp, c.QKVBias},
			{"attn_v", "self_attn.v_proj", c.Hidden, kv, 0, c.QKVBias},
			{"attn_output", "self_attn.o_proj", q, c.Hidden, 0, c.OBias},
			{"ffn_gate", "mlp.gate_proj", c.Hidden, c.Intermediate, 0, false},
			{"ffn_up", "mlp.up_proj", c.Hidden, c.Intermediate, 0, false},
			{"ffn_down", "mlp.down_proj", c.Intermediate, c.Hidden, 0, false},
		} {
			if err := linear(g+l.g, p+l.s, l.in, l.out, l.pm, l.bias); err != nil {
				return nil, err
			}
		}
		dense(g+"ffn_norm.weight", p+"post_attention_layernorm.weight", F32, 0, c.Hidden)
	}
	dense("output_norm.weight", "model.norm.weight", F32, 0, c.Hidden)
	if ck.Has("lm_head.weight") || ck.Has("lm_head.qweight") {
		if err := linear("output", "lm_head", c.Hidden, c.Vocab, 0, false); err != nil {
			return nil, err
		}
	} else if !c.TieEmbeddings {
		return nil, fmt.Errorf("%s: no lm_head.weight and tie_word_embeddings is false", dir)
	}
	// (tied: llama.cpp reuses token_embd when there is no output tensor)

	rep := &Report{Arch: arch, FileType: fileType(jobs)}
	if err := w.Add("general.file_type", rep.FileType); err != nil {
		return nil, err
	}
	for _, j := range jobs {
		if err := w.AddTensor(j.name, j.typ, j.dims...); err != nil {
			return nil, fmt.Errorf("%s: %w", j.source, err)
		}
	}
	if err := w.Create(path); err != nil {
		return nil, err
	}
	for _, j := range jobs {
		b, r, err := j.encode()
		if err == nil {
			err = w.WriteTensor(j.name, b)
		}
		if err != nil {
			w.Abort()
			return nil, fmt.Errorf("exporting %s (%s) to %s: %w", j.source, j.name, path, err)
		}
		r.Name, r.Source, r.Type = j.name, j.source, j.typ
		rep.Tensors = append(rep.Tensors, *r)
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	if st, err := os.Stat(path); err == nil {
		rep.Bytes = st.Size()
	}
	return rep, nil
}

// ggmlDims turns a shape given outermost first into ggml's ne order.
func ggmlDims(shape []int) []int {
	d := make([]int, len(shape))
	for i, s := range shape {
		d[len(shape)-1-i] = s
	}
	return d
}

// fileType is general.file_type: the type most linear weights have.
func fileType(jobs []job) uint32 {
	count := map[TensorType]int{}
	for _, j := range jobs {
		if strings.HasPrefix(j.name, "blk.") && strings.HasSuffix(j.name, ".weight") && len(j.dims) == 2 {
			count[j.typ]++
		}
	}
	best, n := F16, -1
	for _, t := range []TensorType{F16, Q4_0, Q4_1, Q8_0, F32} {
		if count[t] > n {
			best, n = t, count[t]
		}
	}
	return map[TensorType]uint32{F32: fileTypeF32, F16: fileTypeF16, Q4_0: fileTypeQ4_0, Q4_1: fileTypeQ4_1, Q8_0: fileTypeQ8_0}[best]
}

// RopePermutation is the row order llama.cpp's converter gives q_proj and
// k_proj of Llama models: transformers rotates dimension i of a head with
// dimension i + d/2 (rotate-half), ggml's LLAMA_ROPE_TYPE_NORM rotates
// dimensions 2i and 2i+1, so row h·d + 2i + j of the GGUF tensor is row
// h·d + j·d/2 + i of the checkpoint's (j ∈ {0, 1}). It returns, for each
// new row, the old row.
func RopePermutation(rows, heads int) []int {
	d := rows / heads
	p := make([]int, rows)
	for h := 0; h < heads; h++ {
		for i := 0; i < d/2; i++ {
			for j := 0; j < 2; j++ {
				p[h*d+2*i+j] = h*d + j*d/2 + i
			}
		}
	}
	return p
}

// permuteRows reorders the rows of x [rows][cols] by RopePermutation.
func permuteRows(x []float32, rows, cols, heads int) []float32 {
	out := make([]float32, len(x))
	for r, src := range RopePermutation(rows, heads) {
		copy(out[r*cols:(r+1)*cols], x[src*cols:(src+1)*cols])
	}
	return out
}

// permuteLinear reorders a packed layer's output channels: its code rows
// and the scale and zero columns.
func permuteLinear(l *pack.Linear, heads int) *pack.Linear {
	p := RopePermutation(l.Out, heads)
	n := *l
	n.Q = make([]uint8, len(l.Q))
	n.Scale = make([]float32, len(l.Scale))
	n.Zero = make([]uint8, len(l.Zero))
	G := l.Groups()
	for r, src := range p {
		copy(n.Q[r*l.In:(r+1)*l.In], l.Q[src*l.In:(src+1)*l.In])
		for g := 0; g < G; g++ {
			n.Scale[g*l.Out+r] = l.Scale[g*l.Out+src]
			n.Zero[g*l.Out+r] = l.Zero[g*l.Out+src]
		}
	}
	return &n
}

// ropeFactors are Llama-3.1's per-frequency divisors, the rope_freqs tensor
// llama.cpp divides each rotary frequency by: 1 for short wavelengths,
// factor for long ones, interpolated between.
func ropeFactors(c *checkpoint.Config) []float32 {
	r := c.Rope
	old := float64(r.OriginalMaxPositions)
	lowWave, highWave := old/r.LowFreqFactor, old/r.HighFreqFactor
	f := make([]float32, c.HeadDim/2)
	for i := range f {
		freq := 1 / math.Pow(r.Theta, float64(2*i)/float64(c.HeadDim))
		wave := 2 * math.Pi / freq
		switch {
		case wave < highWave:
			f[i] = 1
		case wave > lowWave:
			f[i] = float32(r.Factor)
		default:
			smooth := (old/wave - r.LowFreqFactor) / (r.HighFreqFactor - r.LowFreqFactor)
			f[i] = float32(1 / ((1-smooth)/r.Factor + smooth))
		}
	}
	return f
}

// Token types (llama_token_type / gguf TokenType).
const (
	tokenNormal      = 1
	tokenControl     = 3
	tokenUserDefined = 4
	tokenUnused      = 5
)

// Pre-tokenizer regexes llama.cpp knows by name.
const (
	llama3Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	qwen2Pattern  = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

type tokenizerJSON struct {
	AddedTokens []struct {
		ID      int    `json:"id"`
		Content string `json:"content"`
		Special bool   `json:"special"`
	} `json:"added_tokens"`
	PreTokenizer json.RawMessage `json:"pre_tokenizer"`
	Model        struct {
		Type   string          `json:"type"`
		Vocab  map[string]int  `json:"vocab"`
		Merges json.RawMessage `json:"merges"`
	} `json:"model"`
}

type preTokenizerJSON struct {
	Type          string             `json:"type"`
	UseRegex      *bool              `json:"use_regex"`
	PreTokenizers []preTokenizerJSON `json:"pretokenizers"`
	Pattern       struct {
		Regex  string `json:"Regex"`
		String string `json:"String"`
	} `json:"pattern"`
}

// detectPre names the pre-tokenizer the way llama.cpp's loader
// (tokenizer.ggml.pre) does: GPT-2's regex (a ByteLevel pre-tokenizer
// with use_regex), Llama-3's or Qwen2's (a Split with their pattern
// followed by a ByteLevel without regex).
func detectPre(raw json.RawMessage) (string, error) {
	var p preTokenizerJSON
	if err := json.Unmarshal(raw, &p); err != nil {
		return "", fmt.Errorf("pre_tokenizer: %w", err)
	}
	if p.Type == "ByteLevel" && (p.UseRegex == nil || *p.UseRegex) {
		return "gpt-2", nil
	}
	if p.Type == "Sequence" {
		for _, s := range p.PreTokenizers {
			if s.Type != "Split" {
				continue
			}
			switch s.Pattern.Regex {
			case llama3Pattern:
				return "llama-bpe", nil
			case qwen2Pattern:
				return "qwen2", nil
			}
			return "", fmt.Errorf("pre_tokenizer: the Split regex %q is not one llmq can name for llama.cpp (pass the name with --tokenizer-pre)", s.Pattern.Regex)
		}
	}
	return "", fmt.Errorf("pre_tokenizer of type %q is not a byte-level BPE one llmq can name for llama.cpp (pass the name with --tokenizer-pre)", p.Type)
}

// addTokenizer writes the tokenizer.ggml.* keys for a byte-level BPE
// tokenizer.json ("gpt2" in llama.cpp's terms) and the chat template.
func addTokenizer(w *Writer, dir string, c *checkpoint.Config, pre string) error {
	path := filepath.Join(dir, "tokenizer.json")
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("reading tokenizer: %w", err)
	}
	var t tokenizerJSON
	if err := json.Unmarshal(data, &t); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if t.Model.Type != "BPE" {
		return fmt.Errorf("%s: model type %q: GGUF export handles byte-level BPE tokenizers only", path, t.Model.Type)
	}
	if pre == "" {
		if pre, err = detectPre(t.PreTokenizer); err != nil {
			return fmt.Errorf("%s: %w (SentencePiece-style tokenizers, Llama-2's and Mistral's, are not exported yet)", path, err)
		}
	}
	n := c.Vocab
	tokens := make([]string, n)
	types := make([]int32, n)
	set := make([]bool, n)
	put := func(id int, s string, typ int32) error {
		if id < 0 || id >= n {
			return fmt.Errorf("%s: token %q has id %d outside the model's vocabulary [0, %d)", path, s, id, n)
		}
		tokens[id], types[id], set[id] = s, typ, true
		return nil
	}
	for s, id := range t.Model.Vocab {
		if err := put(id, s, tokenNormal); err != nil {
			return err
		}
	}
	for _, a := range t.AddedTokens {
		typ := int32(tokenUserDefined)
		if a.Special {
			typ = tokenControl
		}
		if err := put(a.ID, a.Content, typ); err != nil {
			return err
		}
	}
	for i := range tokens {
		if !set[i] {
			tokens[i], types[i] = fmt.Sprintf("[PAD%d]", i), tokenUnused
		}
	}
	merges, err := parseMerges(t.Model.Merges)
	if err != nil {
		return fmt.Errorf("%s: merges: %w", path, err)
	}
	var kv []KV
	kv = append(kv, KV{"tokenizer.ggml.model", "gpt2"}, KV{"tokenizer.ggml.pre", pre},
		KV{"tokenizer.ggml.tokens", tokens}, KV{"tokenizer.ggml.token_type", types},
		KV{"tokenizer.ggml.merges", merges})
	if c.BOS >= 0 {
		kv = append(kv, KV{"tokenizer.ggml.bos_token_id", uint32(c.BOS)})
	}
	if len(c.EOS) > 0 {
		kv = append(kv, KV{"tokenizer.ggml.eos_token_id", uint32(c.EOS[0])})
	}
	tc, err := readTokenizerConfig(dir)
	if err != nil {
		return err
	}
	if tc.AddBOS != nil {
		kv = append(kv, KV{"tokenizer.ggml.add_bos_token", *tc.AddBOS})
	}
	if tc.AddEOS != nil {
		kv = append(kv, KV{"tokenizer.ggml.add_eos_token", *tc.AddEOS})
	}
	if tc.ChatTemplate != "" {
		kv = append(kv, KV{"tokenizer.chat_template", tc.ChatTemplate})
	}
	for _, e := range kv {
		if err := w.Add(e.Key, e.Value); err != nil {
			return err
		}
	}
	return nil
}

// parseMerges reads merges as "a b" strings or ["a", "b"] pairs, giving
// the "a b" strings GGUF stores.
func parseMerges(raw json.RawMessage) ([]string, error) {
	var s []string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var pairs [][2]string
	if err := json.Unmarshal(raw, &pairs); err != nil {
		return nil, err
	}
	s = make([]string, len(pairs))
	for i, p := range pairs {
		if strings.Contains(p[0], " ") || strings.Contains(p[1], " ") {
			return nil, fmt.Errorf("merge %d (%q, %q) holds a space, which GGUF's \"a b\" spelling cannot", i, p[0], p[1])
		}
		s[i] = p[0] + " " + p[1]
	}
	return s, nil
}

type tokenizerConfig struct {
	AddBOS       *bool
	AddEOS       *bool
	ChatTemplate string
}

// readTokenizerConfig reads add_bos_token, add_eos_token and
// chat_template from tokenizer_config.json (absent: none of them). A
// template given as a list of named templates contributes its "default".
func readTokenizerConfig(dir string) (tokenizerConfig, error) {
	var tc tokenizerConfig
	path := filepath.Join(dir, "tokenizer_config.json")
	data, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return tc, nil
	}
	if err != nil {
		return tc, err
	}
	var raw struct {
		AddBOS       *bool           `json:"add_bos_token"`
		AddEOS       *bool           `json:"add_eos_token"`
		ChatTemplate json.RawMessage `json:"chat_template"`
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		return tc, fmt.Errorf("%s: %w", path, err)
	}
	tc.AddBOS, tc.AddEOS = raw.AddBOS, raw.AddEOS
	if len(raw.ChatTemplate) > 0 && string(raw.ChatTemplate) != "null" {
		if err := json.Unmarshal(raw.ChatTemplate, &tc.ChatTemplate); err != nil {
			var named []struct{ Name, Template string }
			if err := json.Unmarshal(raw.ChatTemplate, &named); err != nil {
				return tc, fmt.Errorf("%s: chat_template: %w", path, err)
			}
			sort.SliceStable(named, func(i, j int) bool { return named[i].Name == "default" })
			if len(named) > 0 {
				tc.ChatTemplate = named[0].Template
			}
		}
	}
	return tc, nil
}
