// Package checkpoint reads Hugging Face model directories: config.json (both
// the transformers-4 and transformers-5 styles) and safetensors weights,
// single-file or sharded, memory-mapped so that a model never has to fit in
// RAM at once. Every tensor is checked against the shape the config implies
// before use, and every error names the file and tensor at fault.
package checkpoint

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// Config is the architecture of a Llama-family decoder (Llama, Mistral,
// Qwen2, Qwen3, Gemma 3, and the mixture-of-experts Mixtral and Qwen3-MoE),
// normalised from config.json. The fields past SlidingWindow describe
// what the later families changed; their zero values are Llama's.
type Config struct {
	Architecture  string  // e.g. "LlamaForCausalLM"
	ModelType     string  // e.g. "llama"
	Hidden        int     // hidden_size
	Intermediate  int     // intermediate_size
	Layers        int     // num_hidden_layers
	Heads         int     // num_attention_heads
	KVHeads       int     // num_key_value_heads (GQA); = Heads when absent
	HeadDim       int     // head_dim; = Hidden/Heads when absent
	Vocab         int     // vocab_size
	MaxPositions  int     // max_position_embeddings
	RMSNormEps    float64 // rms_norm_eps
	TieEmbeddings bool    // tie_word_embeddings: lm_head reuses embed_tokens
	QKVBias       bool    // q/k/v projections carry a bias (Qwen2, attention_bias)
	OBias         bool    // o_proj carries a bias (Llama/Mistral's attention_bias; not Qwen2)
	DType         string  // torch_dtype or dtype, e.g. "bfloat16"
	Rope          Rope
	// SlidingWindow, when positive, limits attention to the last
	// SlidingWindow positions (a query at p sees keys p−W+1 … p), as
	// Mistral's sliding_window does.
	SlidingWindow int
	// SlidingLayers, when not nil, says which layers the window applies
	// to (Gemma 3's layer_types: "sliding_attention" or "full_attention");
	// nil means every layer when SlidingWindow is positive (Mistral).
	SlidingLayers []bool
	// LocalRope, when not nil, is the rotary embedding of the sliding
	// layers (Gemma 3: rope_local_base_freq, no scaling); Rope is then the
	// full-attention layers'.
	LocalRope *Rope
	BOS       int   // bos_token_id, -1 when absent
	EOS       []int // eos_token_id (one or several)

	// Act is the gated MLP's activation: "silu" (SwiGLU) or
	// "gelu_pytorch_tanh" (Gemma's GeGLU with the tanh approximation).
	Act string
	// QKNorm: queries and keys get a per-head RMSNorm (q_norm, k_norm,
	// weights [head_dim]) before RoPE (Qwen3, Qwen3-MoE, Gemma 3).
	QKNorm bool
	// Gemma 3's changes: RMSNorm weights are stored as w and applied as
	// (1+w) (NormPlusOne); attention and MLP outputs are normed before
	// the residual add (SandwichNorm: post_attention_layernorm,
	// pre/post_feedforward_layernorm); embeddings are multiplied by
	// EmbedScale (√hidden; 0 means 1); attention scores are scaled by
	// QueryPreAttnScalar^-½ instead of head_dim^-½ (0: head_dim).
	NormPlusOne        bool
	SandwichNorm       bool
	EmbedScale         float64
	QueryPreAttnScalar float64
	// MoE, when not nil, replaces the MLP of the sparse layers by a
	// mixture of experts.
	MoE *MoE

	// Quantization is config.json's quantization_config, verbatim, or nil;
	// or, when config.json has none, the JSON of a legacy settings file
	// (QuantizationFile names it).
	Quantization     json.RawMessage
	QuantizationFile string
}

// Rope describes rotary position embeddings. Type is "default", "linear" or
// "llama3" (Llama-3.1's frequency-dependent scaling).
type Rope struct {
	Theta                float64
	Type                 string
	Factor               float64
	LowFreqFactor        float64
	HighFreqFactor       float64
	OriginalMaxPositions int
}

// MoE is a mixture-of-experts MLP: a router (a [experts][hidden] linear
// layer) scores each token, the TopK best experts (SwiGLU MLPs of
// Intermediate units) run on it and their outputs are summed with the
// router's softmax probabilities as weights, renormalised over the chosen
// ones when NormTopK is set.
type MoE struct {
	Experts      int  // num_experts (Qwen3-MoE) or num_local_experts (Mixtral)
	TopK         int  // num_experts_per_tok
	Intermediate int  // moe_intermediate_size (Qwen3-MoE); intermediate_size (Mixtral)
	NormTopK     bool // norm_topk_prob (Qwen3-MoE); always for Mixtral
	// Layer l keeps a plain MLP of Config.Intermediate units when it is
	// in MLPOnly or (l+1) is not a multiple of SparseStep (Qwen3-MoE's
	// mlp_only_layers and decoder_sparse_step; 1 and none for Mixtral).
	SparseStep int
	MLPOnly    map[int]bool
}

// Sparse reports whether layer l's MLP is the mixture of experts.
func (c *Config) Sparse(l int) bool {
	return c.MoE != nil && !c.MoE.MLPOnly[l] && (l+1)%c.MoE.SparseStep == 0
}

// Window is layer l's sliding window, or 0 when it attends to every
// earlier position.
func (c *Config) Window(l int) int {
	if c.SlidingWindow <= 0 || c.SlidingLayers != nil && !c.SlidingLayers[l] {
		return 0
	}
	return c.SlidingWindow
}

// LayerRope is the rotary embedding of layer l.
func (c *Config) LayerRope(l int) Rope {
	if c.LocalRope != nil && c.SlidingLayers[l] {
		return *c.LocalRope
	}
	return c.Rope
}

// architectures we can run.
var supportedArchitectures = map[string]bool{
	"LlamaForCausalLM":               true,
	"MistralForCausalLM":             true,
	"Qwen2ForCausalLM":               true,
	"Qwen3ForCausalLM":               true,
	"Qwen3MoeForCausalLM":            true,
	"MixtralForCausalLM":             true,
	"Gemma3ForCausalLM":              true,
	"Gemma3ForConditionalGeneration": true,
}

// SupportedArchitectures lists the architectures ParseConfig accepts.
func SupportedArchitectures() []string {
	var out []string
	for a := range supportedArchitectures {
		out = append(out, a)
	}
	sort.Strings(out)
	return out
}

type rawRope struct {
	RopeTheta            *float64 `json:"rope_theta"`
	RopeType             string   `json:"rope_type"`
	Type                 string   `json:"type"` // older spelling of rope_type
	Factor               float64  `json:"factor"`
	LowFreqFactor        float64  `json:"low_freq_factor"`
	HighFreqFactor       float64  `json:"high_freq_factor"`
	OriginalMaxPositions int      `json:"original_max_position_embeddings"`
}

type rawConfig struct {
	Architectures         []string        `json:"architectures"`
	ModelType             string          `json:"model_type"`
	HiddenSize            int             `json:"hidden_size"`
	IntermediateSize      int             `json:"intermediate_size"`
	NumHiddenLayers       int             `json:"num_hidden_layers"`
	NumAttentionHeads     int             `json:"num_attention_heads"`
	NumKeyValueHeads      int             `json:"num_key_value_heads"`
	HeadDim               int             `json:"head_dim"`
	VocabSize             int             `json:"vocab_size"`
	MaxPositionEmbeddings int             `json:"max_position_embeddings"`
	RMSNormEps            float64         `json:"rms_norm_eps"`
	TieWordEmbeddings     *bool           `json:"tie_word_embeddings"`
	AttentionBias         bool            `json:"attention_bias"`
	TorchDType            string          `json:"torch_dtype"`
	DType                 string          `json:"dtype"`
	HiddenAct             string          `json:"hidden_act"`
	RopeTheta             *float64        `json:"rope_theta"`
	RopeScaling           *rawRope        `json:"rope_scaling"`
	RopeParameters        json.RawMessage `json:"rope_parameters"`
	BOSTokenID            *int            `json:"bos_token_id"`
	EOSTokenID            json.RawMessage `json:"eos_token_id"`
	QuantizationConfig    json.RawMessage `json:"quantization_config"`
	SlidingWindow         *int            `json:"sliding_window"`
	UseSlidingWindow      *bool           `json:"use_sliding_window"`
	LayerTypes            []string        `json:"layer_types"`

	// Gemma 3
	HiddenActivation          string   `json:"hidden_activation"`
	QueryPreAttnScalar        *float64 `json:"query_pre_attn_scalar"`
	RopeLocalBaseFreq         *float64 `json:"rope_local_base_freq"`
	SlidingWindowPattern      *int     `json:"sliding_window_pattern"`
	FinalLogitSoftcapping     *float64 `json:"final_logit_softcapping"`
	AttnLogitSoftcapping      *float64 `json:"attn_logit_softcapping"`
	UseBidirectionalAttention *bool    `json:"use_bidirectional_attention"`
	// Gemma3ForConditionalGeneration: the language model's config
	TextConfig json.RawMessage `json:"text_config"`

	// mixture of experts (Mixtral, Qwen3-MoE)
	NumExperts          *int  `json:"num_experts"`
	NumLocalExperts     *int  `json:"num_local_experts"`
	NumExpertsPerTok    int   `json:"num_experts_per_tok"`
	MoEIntermediateSize int   `json:"moe_intermediate_size"`
	NormTopKProb        *bool `json:"norm_topk_prob"`
	DecoderSparseStep   *int  `json:"decoder_sparse_step"`
	MLPOnlyLayers       []int `json:"mlp_only_layers"`
	SharedExpertSize    int   `json:"shared_expert_intermediate_size"`
}

// gemma3Defaults are Gemma3TextConfig's defaults in transformers, which a
// Gemma 3 config.json relies on for the fields it leaves out (the text
// config of Gemma3ForConditionalGeneration leaves out most).
func gemma3Defaults() rawConfig {
	f := func(v float64) *float64 { return &v }
	i := func(v int) *int { return &v }
	t := true
	return rawConfig{
		VocabSize: 262208, HiddenSize: 2304, IntermediateSize: 9216, NumHiddenLayers: 26,
		NumAttentionHeads: 8, NumKeyValueHeads: 4, HeadDim: 256, MaxPositionEmbeddings: 131072,
		RMSNormEps: 1e-6, TieWordEmbeddings: &t, BOSTokenID: i(2), EOSTokenID: json.RawMessage("1"),
		HiddenActivation: "gelu_pytorch_tanh", QueryPreAttnScalar: f(256), SlidingWindow: i(4096),
		RopeTheta: f(1e6), RopeLocalBaseFreq: f(1e4), SlidingWindowPattern: i(6),
	}
}

// LoadConfig reads and validates dir/config.json.
func LoadConfig(dir string) (*Config, error) {
	path := filepath.Join(dir, "config.json")
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading model config: %w", err)
	}
	cfg, err := ParseConfig(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}

// ParseConfig parses the bytes of a config.json.
func ParseConfig(data []byte) (*Config, error) {
	var r rawConfig
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("invalid JSON: %w", err)
	}
	if len(r.Architectures) == 0 {
		return nil, fmt.Errorf("no \"architectures\" entry: cannot tell which model this is")
	}
	arch := r.Architectures[0]
	if !supportedArchitectures[arch] {
		return nil, fmt.Errorf("unknown architecture %q: llmq runs %s", arch, strings.Join(SupportedArchitectures(), ", "))
	}
	switch arch {
	case "Gemma3ForCausalLM":
		r = gemma3Defaults()
		if err := json.Unmarshal(data, &r); err != nil {
			return nil, fmt.Errorf("invalid JSON: %w", err)
		}
	case "Gemma3ForConditionalGeneration":
		if err := gemma3Text(&r, data); err != nil {
			return nil, err
		}
	}
	act := r.HiddenAct
	if strings.HasPrefix(arch, "Gemma3") {
		act = r.HiddenActivation
	}
	switch {
	case act == "" || act == "silu":
		act = "silu"
	case act == "gelu_pytorch_tanh" && strings.HasPrefix(arch, "Gemma3"):
	default:
		return nil, fmt.Errorf("hidden_act %q is not supported (silu; gelu_pytorch_tanh for Gemma 3)", act)
	}
	c := &Config{
		Architecture: arch,
		ModelType:    r.ModelType,
		Hidden:       r.HiddenSize,
		Intermediate: r.IntermediateSize,
		Layers:       r.NumHiddenLayers,
		Heads:        r.NumAttentionHeads,
		KVHeads:      r.NumKeyValueHeads,
		HeadDim:      r.HeadDim,
		Vocab:        r.VocabSize,
		MaxPositions: r.MaxPositionEmbeddings,
		RMSNormEps:   r.RMSNormEps,
		QKVBias:      r.AttentionBias || arch == "Qwen2ForCausalLM",
		OBias:        r.AttentionBias && arch != "Qwen2ForCausalLM",
		DType:        r.DType,
		BOS:          -1,
		Quantization: r.QuantizationConfig,
		Act:          act,
	}
	if r.TieWordEmbeddings != nil {
		c.TieEmbeddings = *r.TieWordEmbeddings
	}
	if c.DType == "" {
		c.DType = r.TorchDType
	}
	if string(c.Quantization) == "null" {
		c.Quantization = nil
	}
	if c.KVHeads == 0 {
		c.KVHeads = c.Heads
	}
	if c.Heads > 0 && c.HeadDim == 0 {
		c.HeadDim = c.Hidden / c.Heads
	}
	if c.RMSNormEps == 0 {
		c.RMSNormEps = 1e-6
	}
	if r.BOSTokenID != nil {
		c.BOS = *r.BOSTokenID
	}
	if len(r.EOSTokenID) > 0 && string(r.EOSTokenID) != "null" {
		var one int
		if err := json.Unmarshal(r.EOSTokenID, &one); err == nil {
			c.EOS = []int{one}
		} else if err := json.Unmarshal(r.EOSTokenID, &c.EOS); err != nil {
			return nil, fmt.Errorf("eos_token_id: want an integer or a list of integers, got %s", r.EOSTokenID)
		}
	}
	if err := c.parseRope(&r); err != nil {
		return nil, err
	}
	if err := c.parseSlidingWindow(&r); err != nil {
		return nil, err
	}
	if err := c.parseFamily(&r); err != nil {
		return nil, err
	}
	return c, c.validate()
}

// gemma3Text reads Gemma3ForConditionalGeneration's config: its language
// model is text_config (over Gemma3TextConfig's defaults); the dtype,
// special tokens and quantization at the top level apply to it unless it
// has its own. The vision tower is not loaded.
func gemma3Text(r *rawConfig, data []byte) error {
	top := *r
	if len(top.TextConfig) == 0 || string(top.TextConfig) == "null" {
		return fmt.Errorf("text_config: Gemma3ForConditionalGeneration needs its language model's config")
	}
	*r = gemma3Defaults()
	r.BOSTokenID, r.EOSTokenID = nil, nil
	if err := json.Unmarshal(top.TextConfig, r); err != nil {
		return fmt.Errorf("text_config: %w", err)
	}
	r.Architectures = top.Architectures
	if r.DType == "" && r.TorchDType == "" {
		r.DType, r.TorchDType = top.DType, top.TorchDType
	}
	if r.BOSTokenID == nil {
		r.BOSTokenID = top.BOSTokenID
	}
	if r.BOSTokenID == nil {
		r.BOSTokenID = gemma3Defaults().BOSTokenID
	}
	if len(r.EOSTokenID) == 0 {
		r.EOSTokenID = top.EOSTokenID
	}
	if len(r.EOSTokenID) == 0 {
		r.EOSTokenID = json.RawMessage("1")
	}
	if len(r.QuantizationConfig) == 0 {
		r.QuantizationConfig = top.QuantizationConfig
	}
	return nil
}

// parseFamily reads what Qwen3, Gemma 3 and the mixtures of experts add to
// the Llama architecture, and refuses the settings of those families that
// change the computation and are not implemented.
func (c *Config) parseFamily(r *rawConfig) error {
	switch c.Architecture {
	case "Qwen3ForCausalLM", "Qwen3MoeForCausalLM":
		c.QKNorm = true
		if r.AttentionBias {
			return fmt.Errorf("attention_bias: %s's biases (o_proj's included) are not supported", c.Architecture)
		}
	case "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration":
		c.QKNorm, c.NormPlusOne, c.SandwichNorm = true, true, true
		c.EmbedScale = math.Sqrt(float64(c.Hidden))
		c.QueryPreAttnScalar = 256
		if r.QueryPreAttnScalar != nil {
			c.QueryPreAttnScalar = *r.QueryPreAttnScalar
		}
		if !(c.QueryPreAttnScalar > 0) {
			return fmt.Errorf("query_pre_attn_scalar must be positive, got %v", c.QueryPreAttnScalar)
		}
		switch {
		case r.AttentionBias:
			return fmt.Errorf("attention_bias: Gemma 3's attention biases are not supported")
		case r.AttnLogitSoftcapping != nil:
			return fmt.Errorf("attn_logit_softcapping %v: soft-capping of attention scores is not supported", *r.AttnLogitSoftcapping)
		case r.FinalLogitSoftcapping != nil:
			return fmt.Errorf("final_logit_softcapping %v: soft-capping of the logits is not supported", *r.FinalLogitSoftcapping)
		case r.UseBidirectionalAttention != nil && *r.UseBidirectionalAttention:
			return fmt.Errorf("use_bidirectional_attention: only causal attention is supported")
		}
	}
	if r.SharedExpertSize != 0 {
		return fmt.Errorf("shared_expert_intermediate_size %d: shared experts are not supported", r.SharedExpertSize)
	}
	switch c.Architecture {
	case "MixtralForCausalLM", "Qwen3MoeForCausalLM":
		return c.parseMoE(r)
	}
	return nil
}

// parseMoE reads the experts of Mixtral and Qwen3-MoE. Qwen3-MoE's layer
// l is sparse unless listed in mlp_only_layers or (l+1) is not a multiple
// of decoder_sparse_step, as transformers decides.
func (c *Config) parseMoE(r *rawConfig) error {
	m := &MoE{TopK: r.NumExpertsPerTok, Intermediate: c.Intermediate, NormTopK: true, SparseStep: 1}
	switch {
	case r.NumExperts != nil && r.NumLocalExperts != nil && *r.NumExperts != *r.NumLocalExperts:
		return fmt.Errorf("num_experts %d and num_local_experts %d disagree", *r.NumExperts, *r.NumLocalExperts)
	case r.NumExperts != nil:
		m.Experts = *r.NumExperts
	case r.NumLocalExperts != nil:
		m.Experts = *r.NumLocalExperts
	}
	if m.Experts <= 0 {
		return fmt.Errorf("num_experts must be a positive integer, got %d", m.Experts)
	}
	if m.TopK <= 0 || m.TopK > m.Experts {
		return fmt.Errorf("num_experts_per_tok %d: want 1 … %d (the number of experts)", m.TopK, m.Experts)
	}
	if c.Architecture == "Qwen3MoeForCausalLM" {
		m.Intermediate = r.MoEIntermediateSize
		if m.Intermediate <= 0 {
			return fmt.Errorf("moe_intermediate_size must be a positive integer, got %d", m.Intermediate)
		}
		m.NormTopK = r.NormTopKProb != nil && *r.NormTopKProb
		if r.DecoderSparseStep != nil {
			m.SparseStep = *r.DecoderSparseStep
		}
		if m.SparseStep <= 0 {
			return fmt.Errorf("decoder_sparse_step must be a positive integer, got %d", m.SparseStep)
		}
		for _, l := range r.MLPOnlyLayers {
			if l < 0 || l >= c.Layers {
				return fmt.Errorf("mlp_only_layers: layer %d outside 0 … %d", l, c.Layers-1)
			}
			if m.MLPOnly == nil {
				m.MLPOnly = map[int]bool{}
			}
			m.MLPOnly[l] = true
		}
	}
	c.MoE = m
	return nil
}

// parseSlidingWindow reads the sliding window. Mistral's and Mixtral's
// sliding_window (null or absent: full attention) applies to every layer.
// Qwen2/Qwen3 configs carry a sliding_window that applies only with
// use_sliding_window, and then to the layers past max_window_layers: that
// variant is refused rather than run wrongly. Gemma 3 slides on the layers
// layer_types calls "sliding_attention" (when absent, all but every
// sliding_window_pattern-th layer, as transformers derives them).
func (c *Config) parseSlidingWindow(r *rawConfig) error {
	switch c.Architecture {
	case "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM":
		if r.UseSlidingWindow != nil && *r.UseSlidingWindow {
			return fmt.Errorf("use_sliding_window: %s's per-layer sliding window is not supported", c.Architecture)
		}
		return nil
	case "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration":
		return c.gemmaLayers(r)
	}
	if r.SlidingWindow == nil {
		return nil
	}
	w := *r.SlidingWindow
	if w <= 0 {
		return fmt.Errorf("sliding_window %d: want a positive window or null", w)
	}
	if w < c.MaxPositions || c.MaxPositions == 0 {
		c.SlidingWindow = w
	}
	return nil
}

// gemmaLayers reads Gemma 3's layer types and window.
func (c *Config) gemmaLayers(r *rawConfig) error {
	if r.SlidingWindow != nil {
		if *r.SlidingWindow <= 0 {
			return fmt.Errorf("sliding_window %d: want a positive window or null", *r.SlidingWindow)
		}
		c.SlidingWindow = *r.SlidingWindow
	}
	if r.LayerTypes == nil {
		p := 6
		if r.SlidingWindowPattern != nil {
			p = *r.SlidingWindowPattern
		}
		if p <= 0 {
			return fmt.Errorf("sliding_window_pattern %d: want a positive integer", p)
		}
		if c.Layers <= 0 || c.Layers > maxLayers {
			return fmt.Errorf("num_hidden_layers must be in 1 … %d, got %d", maxLayers, c.Layers)
		}
		c.SlidingLayers = make([]bool, c.Layers)
		for l := range c.SlidingLayers {
			c.SlidingLayers[l] = (l+1)%p != 0
		}
		return nil
	}
	if len(r.LayerTypes) != c.Layers {
		return fmt.Errorf("layer_types has %d entries for %d layers (num_hidden_layers)", len(r.LayerTypes), c.Layers)
	}
	c.SlidingLayers = make([]bool, c.Layers)
	for l, t := range r.LayerTypes {
		switch t {
		case "sliding_attention":
			c.SlidingLayers[l] = true
		case "full_attention":
		default:
			return fmt.Errorf("layer_types[%d] %q: want sliding_attention or full_attention", l, t)
		}
	}
	return nil
}

// maxLayers bounds num_hidden_layers where a list per layer is built.
const maxLayers = 1 << 16

// parseRope merges the transformers-4 style (top-level rope_theta and
// rope_scaling) with the transformers-5 style (rope_parameters). Gemma 3
// has two: rope_theta and rope_scaling for the full-attention layers,
// rope_local_base_freq (unscaled) for the sliding ones; in the
// transformers-5 style rope_parameters holds one per layer type.
func (c *Config) parseRope(r *rawConfig) error {
	gemma := strings.HasPrefix(c.Architecture, "Gemma3")
	c.Rope = Rope{Theta: 10000, Type: "default", Factor: 1}
	if r.RopeTheta != nil {
		c.Rope.Theta = *r.RopeTheta
	}
	params := []*rawRope{r.RopeScaling}
	var local *rawRope
	if len(r.RopeParameters) > 0 && string(r.RopeParameters) != "null" {
		var perType struct {
			Full    *rawRope `json:"full_attention"`
			Sliding *rawRope `json:"sliding_attention"`
		}
		var flat rawRope
		if err := json.Unmarshal(r.RopeParameters, &perType); err != nil {
			return fmt.Errorf("rope_parameters: %w", err)
		}
		switch {
		case perType.Full != nil || perType.Sliding != nil:
			if !gemma {
				return fmt.Errorf("rope_parameters: rotary parameters per layer type are supported for Gemma 3 only")
			}
			params, local = append(params, perType.Full), perType.Sliding
		default:
			if err := json.Unmarshal(r.RopeParameters, &flat); err != nil {
				return fmt.Errorf("rope_parameters: %w", err)
			}
			params = append(params, &flat)
		}
	}
	if err := c.Rope.merge(params...); err != nil {
		return err
	}
	if gemma {
		lr := Rope{Theta: 10000, Type: "default", Factor: 1}
		if r.RopeLocalBaseFreq != nil {
			lr.Theta = *r.RopeLocalBaseFreq
		}
		if err := lr.merge(local); err != nil {
			return fmt.Errorf("sliding layers: %w", err)
		}
		c.LocalRope = &lr
	}
	return nil
}

// merge applies rope_scaling / rope_parameters entries (nil ones skipped)
// and checks the result.
func (rp *Rope) merge(params ...*rawRope) error {
	for _, p := range params {
		if p == nil {
			continue
		}
		if p.RopeTheta != nil {
			rp.Theta = *p.RopeTheta
		}
		typ := p.RopeType
		if typ == "" {
			typ = p.Type
		}
		if typ != "" {
			rp.Type = typ
		}
		if p.Factor != 0 {
			rp.Factor = p.Factor
		}
		if p.LowFreqFactor != 0 {
			rp.LowFreqFactor = p.LowFreqFactor
		}
		if p.HighFreqFactor != 0 {
			rp.HighFreqFactor = p.HighFreqFactor
		}
		if p.OriginalMaxPositions != 0 {
			rp.OriginalMaxPositions = p.OriginalMaxPositions
		}
	}
	switch rp.Type {
	case "default", "linear":
	case "llama3":
		if rp.LowFreqFactor <= 0 || rp.HighFreqFactor <= rp.LowFreqFactor || rp.OriginalMaxPositions <= 0 {
			return fmt.Errorf("rope type llama3 needs low_freq_factor < high_freq_factor and original_max_position_embeddings, got %+v", *rp)
		}
	default:
		return fmt.Errorf("rope type %q is not supported (default, linear, llama3)", rp.Type)
	}
	if rp.Theta <= 0 {
		return fmt.Errorf("rope_theta must be positive, got %v", rp.Theta)
	}
	return nil
}

func (c *Config) validate() error {
	checks := []struct {
		name string
		v    int
	}{
		{"hidden_size", c.Hidden}, {"intermediate_size", c.Intermediate},
		{"num_hidden_layers", c.Layers}, {"num_attention_heads", c.Heads},
		{"num_key_value_heads", c.KVHeads}, {"head_dim", c.HeadDim}, {"vocab_size", c.Vocab},
	}
	for _, ch := range checks {
		if ch.v <= 0 {
			return fmt.Errorf("%s must be a positive integer, got %d", ch.name, ch.v)
		}
	}
	if c.Heads%c.KVHeads != 0 {
		return fmt.Errorf("num_attention_heads %d is not a multiple of num_key_value_heads %d", c.Heads, c.KVHeads)
	}
	if c.HeadDim%2 != 0 {
		return fmt.Errorf("head_dim %d must be even for rotary embeddings", c.HeadDim)
	}
	if c.MaxPositions <= 0 {
		c.MaxPositions = 2048
	}
	return nil
}

// Params is the number of parameters the architecture has (embeddings
// counted once when tied).
func (c *Config) Params() int64 {
	h, hd := int64(c.Hidden), int64(c.HeadDim)
	q, kv := int64(c.Heads)*hd, int64(c.KVHeads)*hd
	attn := h*q + 2*h*kv + q*h
	if c.QKVBias {
		attn += q + 2*kv
	}
	if c.OBias {
		attn += h
	}
	if c.QKNorm {
		attn += 2 * hd
	}
	norms := 2 * h
	if c.SandwichNorm {
		norms = 4 * h
	}
	layers, sparse := int64(c.Layers), int64(0)
	if c.MoE != nil {
		sparse = layers / int64(c.MoE.SparseStep)
		for l := range c.MoE.MLPOnly {
			if (l+1)%c.MoE.SparseStep == 0 {
				sparse--
			}
		}
	}
	n := layers*(attn+norms) + (layers-sparse)*3*h*int64(c.Intermediate)
	if sparse > 0 { // router [experts][hidden] and the experts' MLPs
		n += sparse * int64(c.MoE.Experts) * (h + 3*h*int64(c.MoE.Intermediate))
	}
	n += int64(c.Vocab)*h + h
	if !c.TieEmbeddings {
		n += int64(c.Vocab) * h
	}
	return n
}
