package cuda

import (
	"fmt"
	"strings"
)

// LoadOptions change how a checkpoint runs on the GPU (LoadWith).
type LoadOptions struct {
	// Separate keeps q, k, v and gate, up as separate GEMMs (they are
	// joined into one GEMM each when packed alike).
	Separate bool
	// Act, when set, quantizes and dequantizes every decoder linear
	// layer's input before its GEMM (a W8A8-style simulation).
	Act *ActQuant
	// HalfDeltas has the joined q/k/v, the attention's output projection
	// and the MLP's down projection write their fp16 outputs (the GEMM
	// finishing its K splits' sums itself), as before API 21, instead of
	// leaving their fp32 sums in the workspace (passes of up to 8 rows:
	// decode steps, short prefills) for later kernels to finish and zero:
	// q/k/v's the RoPE kernel; a dense block's o's and down's the next
	// norm; a mixture block's o's the combine after its experts (the norm
	// with the router reads them first). LLMQ_SPLIT_SUMS=0 in the
	// environment sets it too; other values pick parts (splitSumsFrom).
	HalfDeltas bool
}

// ActQuant is the simulated quantization of every decoder linear layer's
// input, as package actquant does it on the CPU: Bits-bit symmetric
// integers or E4M3 (FP8, Bits 8), with a scale per token (PerToken) or
// from each layer's calibrated threshold (Thresholds, by layer name:
// "model.layers.N.self_attn.q_proj").
type ActQuant struct {
	Bits       int
	FP8        bool
	PerToken   bool
	Thresholds map[string]float32
}

// SumsMaxRows is the most rows whose q/k/v, o and down leave their sums
// to the kernel after them (GemmW4Sums on the GEMV kernels): the
// library's kSumsMaxM (w4a16.cu), the rows of the GEMV kernels that have
// an instantiation for it — a decode step's up to batch 8, or a prefill as
// short. Larger passes write fp16 outputs: their K splits are fewer and
// their tail a small part of the GEMM.
const SumsMaxRows = 8

// splitSums is which layers leave their K splits' fp32 sums in the
// pass's workspace for the kernel after them to finish (runSums), in
// passes of at most SumsMaxRows rows: q/k/v for the RoPE kernel (qkv), a
// dense block's o and down for the norms after them (od), a mixture
// block's o for the norm with its router, which reads them, and the
// combine after its experts, which adds and zeroes them (moe).
type splitSums struct{ qkv, od, moe bool }

// splitSumsFrom is the parts that leave their sums: none with
// LoadOptions.HalfDeltas or LLMQ_SPLIT_SUMS=0; all when the variable is
// unset or empty; else the parts it names, comma-separated ("od" keeps
// q/k/v's and the mixtures' fp16 outputs): the switches a same-binary A/B
// (device-model.sh envab) turns.
func splitSumsFrom(halfDeltas bool, env string) (splitSums, error) {
	switch {
	case halfDeltas || env == "0":
		return splitSums{}, nil
	case env == "":
		return splitSums{qkv: true, od: true, moe: true}, nil
	}
	var s splitSums
	for _, part := range strings.Split(env, ",") {
		switch part {
		case "qkv":
			s.qkv = true
		case "od":
			s.od = true
		case "moe":
			s.moe = true
		default:
			return s, fmt.Errorf("LLMQ_SPLIT_SUMS=%q: %q is not a part (want 0, or some of qkv,od,moe)", env, part)
		}
	}
	return s, nil
}
