package pack

import (
	"errors"
	"fmt"

	"github.com/llmq/llmq/actquant"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
)

// Linear is a quantized linear layer in llmq's canonical in-memory form,
// from which every on-disk and on-GPU layout is derived.
//
// With an FP8 grid, Q holds E4M3 codes, Scale is float32 [1][out] (the
// same value throughout when the grid is PerTensor), Zero is all 0 and
// GIdx all 0.
type Linear struct {
	In, Out int
	Grid    Grid
	Q       []uint8   // [out][in] grid indices (FP8: E4M3 codes)
	Scale   []float32 // [groups][out], float16 values (FP8: float32)
	Zero    []uint8   // [groups][out]
	GIdx    []int32   // [in] the group of each input channel
	// InputScale is the static scale of the layer's input activations
	// (llm-compressor's FP8 scheme: x is run as e4m3(x / InputScale)),
	// 0 when they are quantized dynamically or not at all. Loaders record
	// it; they do not apply it.
	InputScale float32
}

// Groups is the number of quantization groups along the input dimension.
func (l *Linear) Groups() int { return l.In / l.Grid.Group(l.In) }

// Dequantize returns the weights [out][in] the layer stands for.
func (l *Linear) Dequantize() []float32 {
	w := make([]float32, l.Out*l.In)
	if l.Grid.FP8 {
		var dec [256]float32
		for c := range dec {
			dec[c] = actquant.DecodeE4M3(byte(c))
		}
		for o := 0; o < l.Out; o++ {
			s := l.Scale[o]
			for i := 0; i < l.In; i++ {
				w[o*l.In+i] = s * dec[l.Q[o*l.In+i]]
			}
		}
		return w
	}
	mat.ParallelFor(l.Out, 16, func(lo, hi int) {
		for o := lo; o < hi; o++ {
			for i := 0; i < l.In; i++ {
				g := int(l.GIdx[i])
				w[o*l.In+i] = Dequantize(int(l.Q[o*l.In+i]), l.Scale[g*l.Out+o], int(l.Zero[g*l.Out+o]))
			}
		}
	})
	return w
}

// NeedsV2 reports whether some zero is 0, which format "gptq" (v1, zero−1
// stored) cannot represent.
func (l *Linear) NeedsV2() bool {
	for _, z := range l.Zero {
		if z == 0 {
			return true
		}
	}
	return false
}

// Format names of GPTQ checkpoints.
const (
	FormatGPTQ   = "gptq"    // v1: zeros stored minus one
	FormatGPTQv2 = "gptq_v2" // zeros stored as they are
)

// GPTQTensors lays the layer out as prefix.qweight, .qzeros, .scales and
// .g_idx in the given GPTQ format.
func (l *Linear) GPTQTensors(prefix, format string) (map[string]checkpoint.Out, error) {
	if l.Grid.FP8 {
		return nil, fmt.Errorf("%s: FP8 weights have no GPTQ layout (write them as compressed-tensors)", prefix)
	}
	b := l.Grid.Bits
	if l.In*b%32 != 0 || l.Out*b%32 != 0 {
		return nil, fmt.Errorf("%s: %d×%d does not pack into 32-bit words at %d bits", prefix, l.Out, l.In, b)
	}
	rows := l.In * b / 32
	qweight := make([]int32, rows*l.Out)
	errs := make([]error, l.Out)
	mat.ParallelFor(l.Out, 16, func(lo, hi int) {
		for o := lo; o < hi; o++ {
			words, err := PackBits(l.Q[o*l.In:(o+1)*l.In], b)
			if err != nil {
				errs[o] = err
				return
			}
			for r, w := range words {
				qweight[r*l.Out+o] = w
			}
		}
	})
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	G := l.Groups()
	zcols := l.Out * b / 32
	qzeros := make([]int32, 0, G*zcols)
	mask := uint8(1<<b - 1)
	for g := 0; g < G; g++ {
		z := append([]uint8(nil), l.Zero[g*l.Out:(g+1)*l.Out]...)
		if format == FormatGPTQ {
			for i := range z {
				if z[i] == 0 {
					return nil, fmt.Errorf("%s: a zero point of 0 cannot be stored in format %q; use %q", prefix, FormatGPTQ, FormatGPTQv2)
				}
				z[i] = (z[i] - 1) & mask
			}
		}
		words, err := PackBits(z, b)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", prefix, err)
		}
		qzeros = append(qzeros, words...)
	}
	return map[string]checkpoint.Out{
		prefix + ".qweight": checkpoint.I32(qweight, rows, l.Out),
		prefix + ".qzeros":  checkpoint.I32(qzeros, G, zcols),
		prefix + ".scales":  checkpoint.F16(l.Scale, G, l.Out),
		prefix + ".g_idx":   checkpoint.I32(l.GIdx, l.In),
	}, nil
}

// ReadGPTQ reads a layer written in a GPTQ layout.
func ReadGPTQ(ck *checkpoint.Checkpoint, prefix string, in, out int, grid Grid, format string) (*Linear, error) {
	b := grid.Bits
	l := &Linear{In: in, Out: out, Grid: grid}
	if err := grid.Validate(in); err != nil {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	G := l.Groups()
	qw, err := int32Tensor(ck, prefix+".qweight", in*b/32, out)
	if err != nil {
		return nil, err
	}
	qz, err := int32Tensor(ck, prefix+".qzeros", G, out*b/32)
	if err != nil {
		return nil, err
	}
	if l.Scale, err = ck.Float32(prefix+".scales", G, out); err != nil {
		return nil, err
	}
	if ck.Has(prefix + ".g_idx") {
		if l.GIdx, err = int32Tensor(ck, prefix+".g_idx", in); err != nil {
			return nil, err
		}
		for i, g := range l.GIdx {
			if g < 0 || int(g) >= G {
				return nil, fmt.Errorf("%s.g_idx[%d] = %d is outside [0, %d)", prefix, i, g, G)
			}
		}
	} else {
		l.GIdx = SequentialGIdx(in, grid.Group(in))
	}
	rows := in * b / 32
	l.Q = make([]uint8, out*in)
	mat.ParallelFor(out, 64, func(lo, hi int) {
		col := make([]int32, rows)
		for o := lo; o < hi; o++ {
			for r := range col {
				col[r] = qw[r*out+o]
			}
			copy(l.Q[o*in:], UnpackBits(col, b, in))
		}
	})
	l.Zero = make([]uint8, 0, G*out)
	mask := uint8(1<<b - 1)
	for g := 0; g < G; g++ {
		z := UnpackBits(qz[g*out*b/32:(g+1)*out*b/32], b, out)
		if format != FormatGPTQv2 {
			for i := range z {
				z[i] = (z[i] + 1) & mask
			}
		}
		l.Zero = append(l.Zero, z...)
	}
	return l, nil
}

// SequentialGIdx is g_idx without act-order: channel i is in group i/group.
func SequentialGIdx(in, group int) []int32 {
	g := make([]int32, in)
	for i := range g {
		g[i] = int32(i / group)
	}
	return g
}

// awqOrder is AutoAWQ's interleaving of 8 outputs in a word: nibble k holds
// output awqOrder[k].
var awqOrder = [8]int{0, 2, 4, 6, 1, 3, 5, 7}

// AWQTensors lays a 4-bit layer out in AutoAWQ's GEMM layout. Act-order
// (a non-sequential g_idx) has no AWQ representation.
func (l *Linear) AWQTensors(prefix string) (map[string]checkpoint.Out, error) {
	if l.Grid.FP8 || l.Grid.Bits != 4 || l.Out%8 != 0 {
		return nil, fmt.Errorf("%s: the AWQ layout holds 4-bit weights with out %% 8 == 0 (have %d bits, out %d)", prefix, l.Grid.Bits, l.Out)
	}
	group := l.Grid.Group(l.In)
	for i, g := range l.GIdx {
		if int(g) != i/group {
			return nil, fmt.Errorf("%s: act-order (permuted g_idx) cannot be stored in the AWQ layout", prefix)
		}
	}
	G := l.Groups()
	w := l.Out / 8
	qweight := make([]int32, l.In*w)
	for i := 0; i < l.In; i++ {
		for j := 0; j < w; j++ {
			var word uint32
			for k, o := range awqOrder {
				word |= uint32(l.Q[(8*j+o)*l.In+i]) << (4 * k)
			}
			qweight[i*w+j] = int32(word)
		}
	}
	qzeros := make([]int32, G*w)
	for g := 0; g < G; g++ {
		for j := 0; j < w; j++ {
			var word uint32
			for k, o := range awqOrder {
				word |= uint32(l.Zero[g*l.Out+8*j+o]) << (4 * k)
			}
			qzeros[g*w+j] = int32(word)
		}
	}
	return map[string]checkpoint.Out{
		prefix + ".qweight": checkpoint.I32(qweight, l.In, w),
		prefix + ".qzeros":  checkpoint.I32(qzeros, G, w),
		prefix + ".scales":  checkpoint.F16(l.Scale, G, l.Out),
	}, nil
}

// ReadAWQ reads a layer in AutoAWQ's GEMM layout.
func ReadAWQ(ck *checkpoint.Checkpoint, prefix string, in, out int, grid Grid) (*Linear, error) {
	if grid.Bits != 4 || out%8 != 0 {
		return nil, fmt.Errorf("%s: AWQ GEMM layout needs 4 bits and out %% 8 == 0", prefix)
	}
	if err := grid.Validate(in); err != nil {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	l := &Linear{In: in, Out: out, Grid: grid, GIdx: SequentialGIdx(in, grid.Group(in))}
	G, w := l.Groups(), out/8
	qw, err := int32Tensor(ck, prefix+".qweight", in, w)
	if err != nil {
		return nil, err
	}
	qz, err := int32Tensor(ck, prefix+".qzeros", G, w)
	if err != nil {
		return nil, err
	}
	if l.Scale, err = ck.Float32(prefix+".scales", G, out); err != nil {
		return nil, err
	}
	l.Q = make([]uint8, out*in)
	l.Zero = make([]uint8, G*out)
	for i := 0; i < in; i++ {
		for j := 0; j < w; j++ {
			word := uint32(qw[i*w+j])
			for k, o := range awqOrder {
				l.Q[(8*j+o)*in+i] = uint8(word>>(4*k)) & 15
			}
		}
	}
	for g := 0; g < G; g++ {
		for j := 0; j < w; j++ {
			word := uint32(qz[g*w+j])
			for k, o := range awqOrder {
				l.Zero[g*out+8*j+o] = uint8(word>>(4*k)) & 15
			}
		}
	}
	return l, nil
}

func int32Tensor(ck *checkpoint.Checkpoint, name string, shape ...int) ([]int32, error) {
	t, err := ck.Tensor(name)
	if err != nil {
		return nil, err
	}
	if err := t.CheckShape(shape...); err != nil {
		return nil, err
	}
	return t.Int32()
}
