package pack

import (
	"encoding/json"
	"fmt"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
)

// QuantConfig is the quantization_config entry of config.json, in the
// spelling transformers, vLLM and GPTQModel read (GPTQ) or AutoAWQ (AWQ).
type QuantConfig struct {
	QuantMethod      string     `json:"quant_method"`
	Bits             int        `json:"bits"`
	GroupSize        int        `json:"group_size"`
	DescAct          bool       `json:"desc_act,omitempty"`
	Sym              *bool      `json:"sym,omitempty"`
	StaticGroups     bool       `json:"static_groups,omitempty"`
	DampPercent      float64    `json:"damp_percent,omitempty"`
	TrueSequential   bool       `json:"true_sequential,omitempty"`
	CheckpointFormat string     `json:"checkpoint_format,omitempty"`
	LMHead           bool       `json:"lm_head,omitempty"`
	ZeroPoint        *bool      `json:"zero_point,omitempty"` // AWQ
	Version          string     `json:"version,omitempty"`    // AWQ: "gemm"
	Meta             *QuantMeta `json:"meta,omitempty"`
}

// QuantMeta records how llmq made the checkpoint.
type QuantMeta struct {
	Quantizer string `json:"quantizer"` // "llmq"
	Method    string `json:"method"`    // rtn, gptq, awq, awq+gptq
	NSamples  int    `json:"nsamples,omitempty"`
	SeqLen    int    `json:"seqlen,omitempty"`
	Calib     string `json:"calibration,omitempty"`
}

// ParseQuantConfig reads quantization_config; nil raw means unquantized.
func ParseQuantConfig(raw json.RawMessage) (*QuantConfig, error) {
	if len(raw) == 0 {
		return nil, nil
	}
	var q QuantConfig
	if err := json.Unmarshal(raw, &q); err != nil {
		return nil, fmt.Errorf("quantization_config: %w", err)
	}
	switch q.QuantMethod {
	case "gptq", "awq":
	default:
		return nil, fmt.Errorf("quantization_config: quant_method %q is not supported (gptq, awq)", q.QuantMethod)
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

// Grid is the grid the config describes.
func (q *QuantConfig) Grid() Grid {
	sym := q.Sym != nil && *q.Sym
	if q.QuantMethod == "awq" {
		sym = q.ZeroPoint != nil && !*q.ZeroPoint
	}
	return Grid{Bits: q.Bits, GroupSize: q.GroupSize, Sym: sym}
}

// Read reads one quantized layer in the checkpoint's layout.
func (q *QuantConfig) Read(ck *checkpoint.Checkpoint, prefix string, in, out int) (*Linear, error) {
	if q.QuantMethod == "awq" {
		return ReadAWQ(ck, prefix, in, out, q.Grid())
	}
	format := q.CheckpointFormat
	if format == "" {
		format = FormatGPTQ
	}
	if format != FormatGPTQ && format != FormatGPTQv2 {
		return nil, fmt.Errorf("checkpoint_format %q is not supported (gptq, gptq_v2)", format)
	}
	return ReadGPTQ(ck, prefix, in, out, q.Grid(), format)
}

// Loader returns the LinearLoader for a checkpoint: packed layers (those
// with a .qweight) are dequantized to float32 for the CPU backend, others
// read as they are.
func Loader(cfg *checkpoint.Config) (llm.LinearLoader, error) {
	q, err := ParseQuantConfig(cfg.Quantization)
	if err != nil || q == nil {
		return llm.DenseLoader, err
	}
	return func(ck *checkpoint.Checkpoint, name string, in, out int, bias bool) (llm.Linear, error) {
		if !ck.Has(name + ".qweight") {
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
