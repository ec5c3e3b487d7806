// Package checkpoint reads Hugging Face model directories: config.json (both
// the transformers-4 and transformers-5 styles) and safetensors weights,
// single-file or sharded, memory-mapped so that a model never has to fit in
// RAM at once. Every tensor is checked against the shape the config implies
// before use, and every error names the file and tensor at fault.
package checkpoint

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// Config is the architecture of a Llama-family decoder (Llama, Mistral,
// Qwen2), normalised from config.json.
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
	DType         string  // torch_dtype or dtype, e.g. "bfloat16"
	Rope          Rope
	// SlidingWindow, when positive, limits attention to the last
	// SlidingWindow positions (a query at p sees keys p−W+1 … p), as
	// Mistral's sliding_window does.
	SlidingWindow int
	BOS           int   // bos_token_id, -1 when absent
	EOS           []int // eos_token_id (one or several)

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

// architectures we can run, and the model_type each implies.
var supportedArchitectures = map[string]bool{
	"LlamaForCausalLM":   true,
	"MistralForCausalLM": true,
	"Qwen2ForCausalLM":   true,
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
	TieWordEmbeddings     bool            `json:"tie_word_embeddings"`
	AttentionBias         bool            `json:"attention_bias"`
	TorchDType            string          `json:"torch_dtype"`
	DType                 string          `json:"dtype"`
	HiddenAct             string          `json:"hidden_act"`
	RopeTheta             *float64        `json:"rope_theta"`
	RopeScaling           *rawRope        `json:"rope_scaling"`
	RopeParameters        *rawRope        `json:"rope_parameters"`
	BOSTokenID            *int            `json:"bos_token_id"`
	EOSTokenID            json.RawMessage `json:"eos_token_id"`
	QuantizationConfig    json.RawMessage `json:"quantization_config"`
	SlidingWindow         *int            `json:"sliding_window"`
	UseSlidingWindow      *bool           `json:"use_sliding_window"`
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
		return nil, fmt.Errorf("unknown architecture %q: llmq runs LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM", arch)
	}
	if r.HiddenAct != "" && r.HiddenAct != "silu" {
		return nil, fmt.Errorf("hidden_act %q is not supported (only silu)", r.HiddenAct)
	}
	c := &Config{
		Architecture:  arch,
		ModelType:     r.ModelType,
		Hidden:        r.HiddenSize,
		Intermediate:  r.IntermediateSize,
		Layers:        r.NumHiddenLayers,
		Heads:         r.NumAttentionHeads,
		KVHeads:       r.NumKeyValueHeads,
		HeadDim:       r.HeadDim,
		Vocab:         r.VocabSize,
		MaxPositions:  r.MaxPositionEmbeddings,
		RMSNormEps:    r.RMSNormEps,
		TieEmbeddings: r.TieWordEmbeddings,
		QKVBias:       r.AttentionBias || arch == "Qwen2ForCausalLM",
		DType:         r.DType,
		BOS:           -1,
		Quantization:  r.QuantizationConfig,
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
	return c, c.validate()
}

// parseSlidingWindow reads Mistral's sliding_window (null or absent: full
// attention). Qwen2 configs carry a sliding_window that applies only with
// use_sliding_window, and then to the layers past max_window_layers: that
// variant is refused rather than run wrongly.
func (c *Config) parseSlidingWindow(r *rawConfig) error {
	if r.SlidingWindow == nil {
		return nil
	}
	w := *r.SlidingWindow
	if c.Architecture == "Qwen2ForCausalLM" {
		if r.UseSlidingWindow != nil && *r.UseSlidingWindow {
			return fmt.Errorf("use_sliding_window: Qwen2's per-layer sliding window is not supported")
		}
		return nil
	}
	if w <= 0 {
		return fmt.Errorf("sliding_window %d: want a positive window or null", w)
	}
	if w < c.MaxPositions || c.MaxPositions == 0 {
		c.SlidingWindow = w
	}
	return nil
}

// parseRope merges the transformers-4 style (top-level rope_theta and
// rope_scaling) with the transformers-5 style (rope_parameters).
func (c *Config) parseRope(r *rawConfig) error {
	c.Rope = Rope{Theta: 10000, Type: "default", Factor: 1}
	if r.RopeTheta != nil {
		c.Rope.Theta = *r.RopeTheta
	}
	for _, p := range []*rawRope{r.RopeScaling, r.RopeParameters} {
		if p == nil {
			continue
		}
		if p.RopeTheta != nil {
			c.Rope.Theta = *p.RopeTheta
		}
		typ := p.RopeType
		if typ == "" {
			typ = p.Type
		}
		if typ != "" {
			c.Rope.Type = typ
		}
		if p.Factor != 0 {
			c.Rope.Factor = p.Factor
		}
		if p.LowFreqFactor != 0 {
			c.Rope.LowFreqFactor = p.LowFreqFactor
		}
		if p.HighFreqFactor != 0 {
			c.Rope.HighFreqFactor = p.HighFreqFactor
		}
		if p.OriginalMaxPositions != 0 {
			c.Rope.OriginalMaxPositions = p.OriginalMaxPositions
		}
	}
	switch c.Rope.Type {
	case "default", "linear":
	case "llama3":
		if c.Rope.LowFreqFactor <= 0 || c.Rope.HighFreqFactor <= c.Rope.LowFreqFactor || c.Rope.OriginalMaxPositions <= 0 {
			return fmt.Errorf("rope type llama3 needs low_freq_factor < high_freq_factor and original_max_position_embeddings, got %+v", c.Rope)
		}
	default:
		return fmt.Errorf("rope type %q is not supported (default, linear, llama3)", c.Rope.Type)
	}
	if c.Rope.Theta <= 0 {
		return fmt.Errorf("rope_theta must be positive, got %v", c.Rope.Theta)
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
	mlp := 3 * h * int64(c.Intermediate)
	block := attn + mlp + 2*h
	n := int64(c.Layers)*block + int64(c.Vocab)*h + h
	if !c.TieEmbeddings {
		n += int64(c.Vocab) * h
	}
	return n
}
