package cuda

// LoadOptions change how a checkpoint runs on the GPU (LoadWith).
type LoadOptions struct {
	// Separate keeps q, k, v and gate, up as separate GEMMs (they are
	// joined into one GEMM each when packed alike).
	Separate bool
	// Act, when set, quantizes and dequantizes every decoder linear
	// layer's input before its GEMM (a W8A8-style simulation).
	Act *ActQuant
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
