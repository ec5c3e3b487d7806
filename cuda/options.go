package cuda

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
	// decode steps, short prefills) for the kernel that follows to finish
	// and zero: the RoPE kernel q/k/v's, the next norm o's and down's
	// (SplitSums). LLMQ_SPLIT_SUMS=0 in the environment sets it too, and
	// LLMQ_SPLIT_SUMS=od keeps q/k/v's fp16 outputs only: the switches a
	// same-binary A/B (device-model.sh envab) turns.
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
