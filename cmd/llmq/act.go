package main

import (
	"fmt"

	"github.com/llmq/llmq/actquant"
	"github.com/llmq/llmq/backend"
	"github.com/spf13/cobra"
)

// actFlags are the activation quantization flags of eval ppl.
type actFlags struct {
	bits           int
	scheme, format string
	scales         string
}

func (a *actFlags) register(cmd *cobra.Command) {
	f := cmd.Flags()
	f.IntVar(&a.bits, "act-bits", 0, "quantize every linear layer's input to this many bits (8; 0: off), simulated (quantize-dequantize), on the CPU or the GPU")
	f.StringVar(&a.scheme, "act-scheme", "per-token", "per-token (dynamic: each token's max |x|) or per-tensor (static: thresholds from --act-scales)")
	f.StringVar(&a.format, "act-format", "int", "int (symmetric integers) or fp8 (E4M3; --act-bits 8)")
	f.StringVar(&a.scales, "act-scales", "", "thresholds (and SmoothQuant factors) from llmq calibrate")
}

// scheme checks the flags and returns the scheme they describe.
func (a *actFlags) parse() (actquant.Scheme, error) {
	s := actquant.Scheme{Bits: a.bits}
	switch a.scheme {
	case "per-token":
		s.PerToken = true
	case "per-tensor":
	default:
		return s, fmt.Errorf("--act-scheme %q: want per-token or per-tensor", a.scheme)
	}
	switch a.format {
	case "int":
	case "fp8":
		s.FP8 = true
	default:
		return s, fmt.Errorf("--act-format %q: want int or fp8", a.format)
	}
	if err := s.Validate(); err != nil {
		return s, fmt.Errorf("--act-bits %d --act-format %s: %w", a.bits, a.format, err)
	}
	return s, nil
}

// backendOptions turns the flags into the backend's activation scheme
// (nothing when --act-bits is 0).
func (a *actFlags) backendOptions(cmd *cobra.Command) (backend.Options, error) {
	if a.bits == 0 {
		for _, f := range []string{"act-scheme", "act-format", "act-scales"} {
			if cmd.Flags().Changed(f) {
				return backend.Options{}, fmt.Errorf("--%s needs --act-bits", f)
			}
		}
		return backend.Options{}, nil
	}
	s, err := a.parse()
	if err != nil {
		return backend.Options{}, err
	}
	var sc *actquant.Scales
	if a.scales != "" {
		if sc, err = actquant.ReadScales(a.scales); err != nil {
			return backend.Options{}, fmt.Errorf("--act-scales: %w", err)
		}
	} else if !s.PerToken {
		return backend.Options{}, fmt.Errorf("--act-scheme per-tensor needs --act-scales FILE (from llmq calibrate)")
	}
	return backend.Options{Act: &backend.Act{Scheme: s, Scales: sc, Source: "--act-scales " + a.scales}}, nil
}

func (a *actFlags) describe() map[string]any {
	s, _ := a.parse()
	return map[string]any{"scheme": s.String(), "scales": a.scales}
}
