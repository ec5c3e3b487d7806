package pack

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
)

// QuantConfig is the quantization_config entry of config.json, in the
// spelling transformers, vLLM and GPTQModel read (GPTQ) or AutoAWQ (AWQ).
type QuantConfig struct {
	QuantMethod      string  `json:"quant_method"`
	Bits             int     `json:"bits"`
	GroupSize        int     `json:"group_size"`
	DescAct          bool    `json:"desc_act,omitempty"`
	Sym              *bool   `json:"sym,omitempty"`
	StaticGroups     bool    `json:"static_groups,omitempty"`
	DampPercent      float64 `json:"damp_percent,omitempty"`
	TrueSequential   bool    `json:"true_sequential,omitempty"`
	CheckpointFormat string  `json:"checkpoint_format,omitempty"`
	LMHead           bool    `json:"lm_head,omitempty"`
	ZeroPoint        *bool   `json:"zero_point,omitempty"` // AWQ
	Version          string  `json:"version,omitempty"`    // AWQ: "gemm"
	// Dynamic is a mixed-precision plan: per-module bits and group sizes,
	// and modules left unquantized (GPTQModel's "dynamic").
	Dynamic Dynamic `json:"dynamic,omitempty"`
	// ModulesInBlockToQuantize lists the linear layers of a block that
	// are quantized (names relative to the block), grouped by input, as
	// transformers' GPTQ integration and vLLM read it: written for
	// mixtures of experts, whose routers stay unquantized.
	ModulesInBlockToQuantize [][]string `json:"modules_in_block_to_quantize,omitempty"`
	// ModulesToNotConvert names modules an AWQ checkpoint keeps
	// unquantized (matched as substrings of module names): the routers.
	ModulesToNotConvert []string   `json:"modules_to_not_convert,omitempty"`
	Meta                *QuantMeta `json:"meta,omitempty"`
	// CT is the whole config of a compressed-tensors checkpoint
	// (QuantMethod MethodCT), which is written as it is.
	CT *CTConfig `json:"-"`
}

// MarshalJSON writes the config: a compressed-tensors one in its own
// spelling, the others with the fields above.
func (q *QuantConfig) MarshalJSON() ([]byte, error) {
	if q.CT != nil {
		ct := *q.CT
		ct.QuantMethod, ct.Meta = MethodCT, q.Meta
		return json.Marshal(&ct)
	}
	type plain QuantConfig
	return json.Marshal((*plain)(q))
}

// ModulesInBlock lists, for a model with mixtures of experts, the linear
// layers of a block by input (names relative to the block: q, k, v; o;
// every gate and up; every down), as GPTQ checkpoints of mixtures on the
// hub spell modules_in_block_to_quantize: the routers, which stay
// unquantized, are not among them. It is nil for dense models.
func ModulesInBlock(cfg *checkpoint.Config) [][]string {
	if cfg.MoE == nil {
		return nil
	}
	groups := make([][]string, 4)
	seen := map[string]bool{}
	for l := 0; l < cfg.Layers; l++ { // dense and sparse layers alike
		p := fmt.Sprintf("model.layers.%d.", l)
		for _, s := range llm.BlockLinears(cfg, l) {
			n := strings.TrimPrefix(s.Name, p)
			if seen[n] {
				continue
			}
			seen[n] = true
			groups[s.Input] = append(groups[s.Input], n)
		}
	}
	return groups
}

// QuantMeta records how llmq made the checkpoint.
type QuantMeta struct {
	Quantizer string `json:"quantizer"`         // "llmq"
	Version   string `json:"version,omitempty"` // the llmq commit that wrote it
	// GroupsFromBlockStart records GPTQ's choice of which weights a group
	// is fitted on (gptq.Options.GroupsFromBlockStart).
	GroupsFromBlockStart bool   `json:"groups_from_block_start,omitempty"`
	Method               string `json:"method"` // rtn, gptq, awq, awq+gptq
	NSamples             int    `json:"nsamples,omitempty"`
	SeqLen               int    `json:"seqlen,omitempty"`
	Calib                string `json:"calibration,omitempty"`
	Seed                 uint64 `json:"seed,omitempty"` // windows sampled at random offsets with this seed
	// SmoothAlpha is SmoothQuant's α when its factors were folded into
	// the norms and weights before quantization (Options.Smooth).
	SmoothAlpha float64 `json:"smooth_alpha,omitempty"`
	// MoE records how a mixture's experts were calibrated and how many
	// calibration tokens each received.
	MoE *MoEMeta `json:"moe,omitempty"`
}

// MoEMeta is how the experts of a mixture were calibrated.
type MoEMeta struct {
	Calib     string `json:"calibration"` // "routed" or "all"
	MinTokens int    `json:"min_tokens"`  // experts routed fewer were calibrated on all tokens
	// Layers are the sparse layers, with the calibration tokens the
	// router sent each expert.
	Layers []MoELayer `json:"layers,omitempty"`
}

// MoELayer is one sparse layer's experts.
type MoELayer struct {
	Layer int `json:"layer"`
	// Routed[e] is how many calibration tokens the router sent expert e.
	Routed []int `json:"routed_tokens"`
	// AllTokens lists the experts calibrated on every token (all of them
	// with calibration "all"; else those routed fewer than min_tokens).
	AllTokens []int `json:"all_tokens,omitempty"`
}

// ParseQuantConfig reads quantization_config; nil raw means unquantized.
// It also reads the settings files of older quantizers: AutoGPTQ's
// quantize_config.json (no quant_method: GPTQ) and AutoAWQ's
// quant_config.json (w_bit, q_group_size, zero_point, version "GEMM"),
// and takes quant_method and version in any case.
func ParseQuantConfig(raw json.RawMessage) (*QuantConfig, error) {
	if len(raw) == 0 {
		return nil, nil
	}
	var method struct {
		QuantMethod string `json:"quant_method"`
	}
	if err := json.Unmarshal(raw, &method); err != nil {
		return nil, fmt.Errorf("quantization_config: %w", err)
	}
	if strings.ToLower(method.QuantMethod) == MethodCT {
		ct, err := parseCT(raw)
		if err != nil {
			return nil, fmt.Errorf("quantization_config (compressed-tensors): %w", err)
		}
		return &QuantConfig{QuantMethod: MethodCT, CT: ct, Meta: ct.Meta}, nil
	}
	var q QuantConfig
	if err := json.Unmarshal(raw, &q); err != nil {
		return nil, fmt.Errorf("quantization_config: %w", err)
	}
	var awq struct {
		WBit       *int `json:"w_bit"`
		QGroupSize *int `json:"q_group_size"`
	}
	if err := json.Unmarshal(raw, &awq); err != nil {
		return nil, fmt.Errorf("quantization_config: %w", err)
	}
	if awq.WBit != nil && q.Bits == 0 {
		q.Bits = *awq.WBit
	}
	if awq.QGroupSize != nil && q.GroupSize == 0 {
		q.GroupSize = *awq.QGroupSize
	}
	q.QuantMethod, q.Version = strings.ToLower(q.QuantMethod), strings.ToLower(q.Version)
	if q.QuantMethod == "" {
		switch {
		case awq.WBit != nil || awq.QGroupSize != nil || q.ZeroPoint != nil:
			q.QuantMethod = "awq"
		case q.Bits != 0:
			q.QuantMethod = "gptq"
		}
	}
	switch q.QuantMethod {
	case "gptq", "awq":
	default:
		return nil, fmt.Errorf("quantization_config: quant_method %q is not supported (gptq, awq, compressed-tensors)", q.QuantMethod)
	}
	if q.GroupSize == 0 {
		q.GroupSize = -1
	}
	if err := q.Grid().Validate(0); err != nil {
		return nil, fmt.Errorf("quantization_config: %w", err)
	}
	if q.QuantMethod == "awq" && q.Version != "" && q.Version != "gemm" {
		return nil, fmt.Errorf("quantization_config: AWQ version %q is not supported (gemm)", q.Version)
	}
	return &q, nil
}

// Grid is the grid the config describes (the zero Grid for a
// compressed-tensors config: see GridFor).
func (q *QuantConfig) Grid() Grid {
	if q.CT != nil {
		return Grid{}
	}
	sym := q.Sym != nil && *q.Sym
	if q.QuantMethod == "awq" {
		sym = q.ZeroPoint != nil && !*q.ZeroPoint
	}
	return Grid{Bits: q.Bits, GroupSize: q.GroupSize, Sym: sym}
}

// GridFor is the grid of one module (its dynamic rule's, else the
// config's; a compressed-tensors config's group's), and whether it is
// quantized at all.
func (q *QuantConfig) GridFor(name string) (Grid, bool) {
	if q.CT != nil {
		_, g, _, ok := q.CT.scheme(name)
		return g, ok
	}
	return q.Dynamic.For(name, q.Grid())
}

// Stored reports whether the checkpoint holds the layer quantized
// (prefix.qweight; compressed-tensors: prefix.weight_packed or a
// prefix.weight_scale), rather than as a plain prefix.weight.
func (q *QuantConfig) Stored(ck *checkpoint.Checkpoint, prefix string) bool {
	if q.CT != nil {
		return ctStored(ck, prefix)
	}
	return ck.Has(prefix + ".qweight")
}

// Read reads one quantized layer in the checkpoint's layout.
func (q *QuantConfig) Read(ck *checkpoint.Checkpoint, prefix string, in, out int) (*Linear, error) {
	if q.CT != nil {
		return q.CT.Read(ck, prefix, in, out)
	}
	g, ok := q.GridFor(prefix)
	if !ok {
		return nil, fmt.Errorf("%s is packed, but quantization_config's dynamic rules leave it unquantized", prefix)
	}
	if err := g.Validate(in); err != nil {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	if q.QuantMethod == "awq" {
		return ReadAWQ(ck, prefix, in, out, g)
	}
	format := q.CheckpointFormat
	if format == "" {
		format = FormatGPTQ
	}
	if format != FormatGPTQ && format != FormatGPTQv2 {
		return nil, fmt.Errorf("checkpoint_format %q is not supported (gptq, gptq_v2)", format)
	}
	return ReadGPTQ(ck, prefix, in, out, g, format)
}

// Unexplained is the error for a layer stored packed (name.qweight) in a
// checkpoint without quantization settings, nil otherwise: without it the
// loader would only say that name.weight is missing.
func Unexplained(ck *checkpoint.Checkpoint, name string) error {
	packed := ""
	switch {
	case ck.Has(name+".qweight") && !ck.Has(name+".weight"):
		packed = name + ".qweight"
	case ck.Has(name + ".weight_packed"):
		packed = name + ".weight_packed (compressed-tensors)"
	case ck.Has(name + ".weight_scale"):
		packed = name + ".weight_scale (compressed-tensors)"
	default:
		return nil
	}
	return fmt.Errorf("%s holds %s, a packed layer, but no quantization settings: config.json has no quantization_config and there is no %s",
		ck.Dir, packed, strings.Join(checkpoint.LegacyQuantConfigs, " or "))
}

// Loader returns the LinearLoader for a checkpoint: packed layers (those
// with a .qweight) are dequantized to float32 for the CPU backend, others
// read as they are.
func Loader(cfg *checkpoint.Config) (llm.LinearLoader, error) {
	q, err := ParseQuantConfig(cfg.Quantization)
	if err != nil {
		if cfg.QuantizationFile != "" { // settings from a legacy file
			return nil, fmt.Errorf("%s: %w", cfg.QuantizationFile, err)
		}
		return nil, err
	}
	if q == nil {
		return func(ck *checkpoint.Checkpoint, name string, in, out int, bias bool) (llm.Linear, error) {
			if err := Unexplained(ck, name); err != nil {
				return nil, err
			}
			return llm.DenseLoader(ck, name, in, out, bias)
		}, nil
	}
	return func(ck *checkpoint.Checkpoint, name string, in, out int, bias bool) (llm.Linear, error) {
		if !q.Stored(ck, name) {
			return llm.DenseLoader(ck, name, in, out, bias)
		}
		l, err := q.Read(ck, name, in, out)
		if err != nil {
			return nil, err
		}
		b, err := llm.ReadBias(ck, name, out, bias)
		if err != nil {
			return nil, err
		}
		return llm.NewDense(l.Dequantize(), b, in, out), nil
	}, nil
}
