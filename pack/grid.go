// Package pack holds what every quantization method shares: the integer
// grid weights are rounded to, the bit packing of checkpoints, the GPTQ,
// AWQ and compressed-tensors layouts (FP8 weights included), and the
// loader that turns packed tensors back into weights.
//
// # The grid
//
// Weights are quantized per group of GroupSize consecutive input channels
// of one output channel (GroupSize -1: the whole row is one group), exactly
// as the reference GPTQ Quantizer does it (IST-DASLab/gptq, quant.py):
//
//	maxq  = 2^bits − 1
//	xmin  = min(min(x), 0),  xmax = max(max(x), 0)        (the range holds 0)
//	sym:  xmax = max(|xmin|, xmax); xmin = −xmax if xmin < 0
//	xmin = −1, xmax = +1 if both are 0                    (an all-zero group)
//	scale = (xmax − xmin) / maxq
//	zero  = 2^(bits−1) (sym)  or  round(−xmin / scale) (asym)
//	q     = clamp(round(x / scale) + zero, 0, maxq)       (round half to even)
//	x̂     = scale · (q − zero)
//
// One deliberate difference: scale is rounded to float16 as soon as it is
// found, and everything after uses the rounded value. Checkpoints store
// float16 scales, so the weights GPTQ compensates for are exactly the
// weights a loader dequantizes — bit for bit, which the round-trip tests
// check. AWQ's grid (MinMax) is the exception: it follows llm-awq's
// arithmetic exactly, float32 scale included, because the AWQ searches'
// near-ties depend on it; RTN rounds its scale to float16 when storing it.
//
// # Bit packing
//
// Values of b bits are packed into int32 words as a little-endian bit
// stream: value j occupies bits b·j … b·j+b−1 of the stream, word w holding
// stream bits 32w … 32w+31. For b = 2, 4, 8 this is the familiar nibble
// packing (value j of a word at bits b·(j mod 32/b)); for b = 3 it is
// exactly GPTQ's layout of 32 values in 3 words.
//
// # GPTQ layout (checkpoint_format "gptq", and "gptq_v2")
//
// For a linear layer with in inputs, out outputs, G = in/group groups:
//
//	qweight  int32 [in·bits/32, out]  column o is the bit stream of q[o, 0..in)
//	qzeros   int32 [G, out·bits/32]   row g is the bit stream of zero[g, 0..out)
//	scales   fp16  [G, out]
//	g_idx    int32 [in]               the group of each input channel
//
// and w[o, i] = scales[g_idx[i], o] · (q[o, i] − zero[g_idx[i], o]).
// Format "gptq" (v1, what transformers, vLLM and AutoGPTQ read) stores
// zero − 1 and loaders add 1 back, so an asymmetric zero of 0 cannot be
// stored (−1 wraps to 2^bits − 1); we write v1 when no zero is 0 and
// "gptq_v2" (zeros as they are, GPTQModel's format) otherwise.
//
// # AWQ layout (AutoAWQ "gemm")
//
//	qweight int32 [in, out/8]   8 outputs a word, in the order 0,2,4,6,1,3,5,7
//	qzeros  int32 [G, out/8]    likewise
//	scales  fp16  [G, out]
//
// with w[o, i] = scales[i/group, o] · (q[o, i] − zero[i/group, o]), zeros
// stored as they are, 4 bits only.
//
// # compressed-tensors (quant_method "compressed-tensors")
//
// The format llm-compressor writes and vLLM loads natively (Neural Magic /
// Red Hat, github.com/neuralmagic/compressed-tensors). quantization_config
// holds config_groups, each a scheme {targets, weights, input_activations,
// output_activations, format}: targets are class names ("Linear"), module
// names, or "re:"-prefixed regular expressions matched from the start of
// the name; "ignore" lists the modules left unquantized (same syntax). A
// module takes the scheme of the group whose target matches it best (an
// exact name before a regular expression before a class name). weights is
// a QuantizationArgs: num_bits, type ("int" or "float"), symmetric,
// strategy ("tensor", "channel", "group", …; inferred from group_size when
// absent: none → tensor, −1 → channel, > 0 → group), group_size, actorder,
// dynamic. format (of the config, or of a group under "mixed-precision")
// says how the weights are stored. llmq reads and writes two formats.
//
// pack-quantized (integer weights, group or channel strategy), for a layer
// of out outputs, in inputs, b bits, p = ⌊32/b⌋ values a word and G groups
// (G = 1 for channel):
//
//	weight_packed      int32 [out, ⌈in/p⌉]  value k of row o at bits b·(k mod p) of word k/p
//	weight_scale       float [out, G]       (the model's float dtype; llmq writes F16)
//	weight_zero_point  int32 [⌈out/p⌉, G]   asymmetric only: zeros packed the same way along out
//	weight_shape       int   [2]            (out, in)
//	weight_g_idx       int32 [in]           act-order only: the group of each input
//
// The quantized values are signed, q ∈ [−2^(b−1), 2^(b−1)−1], with
// w = scale·(q − zero), and zero = 0 when symmetric (no zero tensor is
// stored). Packing adds 2^(b−1) to every value and zero, so the stored
// fields are exactly GPTQ's unsigned codes and zeros: with llmq's grid
// (codes in [0, 2^b−1], symmetric zero 2^(b−1)) the stored numbers are
// Linear.Q and Linear.Zero as they are. Unlike GPTQ's bit stream, words
// never straddle: for b = 3 a word holds 10 values and 2 bits of padding,
// and rows are padded to whole words. Older writers stored an asymmetric
// zero point unpacked, int8 [out, G], signed; llmq reads both.
//
// float-quantized (FP8 E4M3 weights, tensor or channel strategy):
//
//	weight        F8_E4M3 [out, in]       the codes, float8_e4m3fn
//	weight_scale  float   [1] or [out, 1] one scale, or one per output
//
// with w = scale·e4m3(code). int-quantized (llm-compressor's W8A8 INT8) is
// read too: weight int8 [out, in] as it is, weight_scale [out, 1] or [1],
// and int8 zero points when asymmetric. llm-compressor's FP8_DYNAMIC scheme stores
// scales per channel and quantizes activations per token at run time;
// its FP8 scheme scales weights per tensor with static activation scales
// (input_scale). llmq's CPU loader dequantizes the weights; activation
// quantization is simulated separately (eval --act-bits 8 --act-format fp8).
package pack

import (
	"fmt"
	"math"

	"github.com/x448/float16"
)

// Grid is a quantization grid: bit width, group size along the input
// dimension (−1 for one group per row) and symmetry.
//
// MinMax selects AWQ's variant (llm-awq pseudo_quantize_tensor): the range
// is the group's own [min, max] (not stretched to hold 0), clamped to at
// least 1e-5, and zero = clamp(−round(min/scale), 0, maxq).
//
// FP8 selects FP8 E4M3 codes instead of integers (compressed-tensors'
// float-quantized format): Bits 8, symmetric, GroupSize −1 (a scale per
// output channel) or PerTensor (one scale for the layer); a Linear then
// holds E4M3 bytes in Q and w = Scale·e4m3(Q).
type Grid struct {
	Bits      int
	GroupSize int
	Sym       bool
	MinMax    bool
	FP8       bool
	PerTensor bool
}

// A GridError is a grid parameter that cannot be used: which one ("bits"
// or "group size"), its value, and what was expected. A command line names
// its own flag for Field.
type GridError struct {
	Field string
	Value int
	Want  string
}

func (e *GridError) Error() string { return fmt.Sprintf("%s %d: want %s", e.Field, e.Value, e.Want) }

// Validate checks the grid against a layer's input width (in ≤ 0: any
// width). Bits are 2, 3, 4 or 8 (the widths the bit-stream layouts and
// their loaders read); the group size is −1 (one group per row) or any
// size dividing the input width: GPTQ and AWQ checkpoints use 32 to 256.
func (g Grid) Validate(in int) error {
	if g.FP8 {
		if g.Bits != 8 || g.GroupSize != -1 || !g.Sym || g.MinMax {
			return fmt.Errorf("an FP8 grid is 8 bits, symmetric, per channel or per tensor (have bits %d, group %d, sym %v)", g.Bits, g.GroupSize, g.Sym)
		}
		return nil
	}
	if g.PerTensor {
		return fmt.Errorf("a per-tensor scale is only supported for FP8 weights")
	}
	switch g.Bits {
	case 2, 3, 4, 8:
	default:
		return &GridError{Field: "bits", Value: g.Bits, Want: "2, 3, 4 or 8"}
	}
	if g.GroupSize == 0 || g.GroupSize < -1 {
		return &GridError{Field: "group size", Value: g.GroupSize, Want: "a positive size, or -1 for one group per row"}
	}
	if in > 0 && g.GroupSize > 0 && in%g.GroupSize != 0 {
		return &GridError{Field: "group size", Value: g.GroupSize, Want: fmt.Sprintf("a size dividing the layer's %d input features", in)}
	}
	return nil
}

// Group returns the effective group size for a layer of in inputs.
func (g Grid) Group(in int) int {
	if g.GroupSize <= 0 {
		return in
	}
	return g.GroupSize
}

// GPUPacked says whether the GPU runtime holds a layer of this grid packed
// for its kernels (integer codes of 2 to 4 bits, one per nibble, or of 8
// bits, one per byte); other widths and FP8 grids are dequantized to fp16
// there.
func (g Grid) GPUPacked() bool { return !g.FP8 && (g.Bits >= 2 && g.Bits <= 4 || g.Bits == 8) }

// MaxQ is 2^bits − 1.
func (g Grid) MaxQ() int { return 1<<g.Bits - 1 }

// Params fits scale and zero to the values of one group (reference GPTQ
// find_params), with the scale rounded to float16 (except on AWQ's MinMax
// grid: see ParamsRange).
func (g Grid) Params(x []float32) (scale float32, zero int) {
	xmin, xmax := x[0], x[0]
	for _, v := range x {
		xmin = min(xmin, v)
		xmax = max(xmax, v)
	}
	return g.ParamsRange(xmin, xmax)
}

// ParamsRange is Params given the group's minimum and maximum.
func (g Grid) ParamsRange(xmin, xmax float32) (scale float32, zero int) {
	maxq := float32(g.MaxQ())
	if g.MinMax && !g.Sym {
		// As llm-awq computes it on the GPU: PyTorch divides a tensor by a
		// scalar through the scalar's float32 reciprocal. The last bit
		// matters: it decides, for a group clipped to ±m, whether m/scale
		// is exactly maxq/2 (rounding away, to an asymmetric grid) or just
		// below. The scale is not rounded to float16 here: the codes are
		// the reference's, and the checkpoint stores the scale in float16
		// (at most 2⁻¹¹ relative away).
		scale = max(xmax-xmin, 1e-5) * (1 / maxq)
		z := -math.RoundToEven(float64(xmin / scale))
		return scale, int(min(max(z, 0), float64(g.MaxQ())))
	}
	xmin, xmax = min(xmin, 0), max(xmax, 0)
	if g.Sym {
		xmax = max(-xmin, xmax)
		if xmin < 0 {
			xmin = -xmax
		}
	}
	if xmin == 0 && xmax == 0 {
		xmin, xmax = -1, 1
	}
	scale = RoundF16((xmax - xmin) / maxq)
	if scale == 0 { // range below float16's smallest subnormal
		scale = RoundF16(6e-8)
	}
	if g.Sym {
		return scale, (g.MaxQ() + 1) / 2
	}
	z := math.RoundToEven(float64(-xmin / scale))
	return scale, int(min(max(z, 0), float64(g.MaxQ())))
}

// Quantize maps x to its grid index.
func (g Grid) Quantize(x, scale float32, zero int) int {
	q := math.RoundToEven(float64(x/scale)) + float64(zero)
	return int(min(max(q, 0), float64(g.MaxQ())))
}

// Dequantize maps a grid index back to a weight.
func Dequantize(q int, scale float32, zero int) float32 {
	return scale * float32(q-zero)
}

// RoundF16 rounds a float32 to the nearest float16 value.
func RoundF16(x float32) float32 { return float16.Fromfloat32(x).Float32() }

// Describe names the grid's number format: "4 bits", "FP8 E4M3".
func (g Grid) Describe() string {
	if g.FP8 {
		return "FP8 E4M3"
	}
	return fmt.Sprintf("%d bits", g.Bits)
}
