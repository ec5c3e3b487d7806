package gguf

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/llmq/llmq/pack"
	"github.com/x448/float16"
)

// Mapping is how a quantized layer becomes a GGUF tensor.
type Mapping struct {
	Type  TensorType
	Exact bool   // the GGUF blocks hold the layer's own codes and scales
	Why   string // why it is re-quantized, when it is not exact
}

// blocksUniform reports whether every block of 32 input channels lies in
// one quantization group (always so without act-order when the group size
// is a multiple of 32, or per channel).
func blocksUniform(l *pack.Linear) bool {
	if l.In%BlockSize != 0 {
		return false
	}
	for b := 0; b < l.In; b += BlockSize {
		g := l.GIdx[b]
		for _, h := range l.GIdx[b+1 : b+BlockSize] {
			if h != g {
				return false
			}
		}
	}
	return true
}

func allZeros(l *pack.Linear, z uint8) bool {
	for _, v := range l.Zero {
		if v != z {
			return false
		}
	}
	return true
}

// Map decides a quantized layer's GGUF type: 4-bit layers whose blocks of
// 32 lie in one group map exactly onto Q4_0 (every zero 8) or Q4_1 (any
// zeros; exact up to the float16 rounding of m = −scale·zero), 8-bit ones
// with every zero 128 onto Q8_0. Everything else is re-quantized from the
// dequantized weights: 8-bit to Q8_0, fewer bits to Q4_0.
func Map(l *pack.Linear) Mapping {
	uniform := blocksUniform(l)
	switch {
	case l.Grid.FP8:
		return Mapping{Type: Q8_0, Why: "FP8 E4M3 weights have no GGUF block type"}
	case l.In%BlockSize != 0:
		return Mapping{Type: Q4_0, Why: fmt.Sprintf("input width %d is not a multiple of %d", l.In, BlockSize)}
	case l.Grid.Bits == 4 && uniform && allZeros(l, 8):
		return Mapping{Type: Q4_0, Exact: true}
	case l.Grid.Bits == 4 && uniform:
		return Mapping{Type: Q4_1, Exact: true}
	case l.Grid.Bits == 8 && uniform && allZeros(l, 128):
		return Mapping{Type: Q8_0, Exact: true}
	case l.Grid.Bits == 8 && !uniform:
		return Mapping{Type: Q8_0, Why: "act-order groups mix inside blocks of 32"}
	case l.Grid.Bits == 8:
		return Mapping{Type: Q8_0, Why: "8-bit asymmetric zeros (Q8_0 is symmetric)"}
	case l.Grid.Bits == 4:
		return Mapping{Type: Q4_0, Why: fmt.Sprintf("groups (size %d, act-order %v) do not cover whole blocks of 32", l.Grid.Group(l.In), !isSequential(l))}
	}
	return Mapping{Type: Q4_0, Why: fmt.Sprintf("%d-bit codes have no GGUF block type", l.Grid.Bits)}
}

func isSequential(l *pack.Linear) bool {
	g := l.Grid.Group(l.In)
	for i, v := range l.GIdx {
		if int(v) != i/g {
			return false
		}
	}
	return true
}

func f16(x float32) uint16 { return float16.Fromfloat32(x).Bits() }

func fromF16(b []byte) float32 { return float16.Frombits(binary.LittleEndian.Uint16(b)).Float32() }

// EncodeExact lays out a layer whose Map is exact in blocks of typ, row by
// row (output channel o is ggml row o).
func EncodeExact(l *pack.Linear, typ TensorType) ([]byte, error) {
	rb, err := typ.RowBytes(l.In)
	if err != nil {
		return nil, err
	}
	if !blocksUniform(l) {
		return nil, fmt.Errorf("groups mix inside blocks of %d", BlockSize)
	}
	out := make([]byte, l.Out*rb)
	for o := 0; o < l.Out; o++ {
		row := out[o*rb : (o+1)*rb]
		q := l.Q[o*l.In : (o+1)*l.In]
		for b := 0; b < l.In/BlockSize; b++ {
			g := int(l.GIdx[b*BlockSize])
			scale, zero := l.Scale[g*l.Out+o], l.Zero[g*l.Out+o]
			if RoundF16Exact(scale) != scale {
				return nil, fmt.Errorf("row %d group %d: scale %v is not a float16 value", o, g, scale)
			}
			qb := q[b*BlockSize : (b+1)*BlockSize]
			switch typ {
			case Q4_0:
				if zero != 8 {
					return nil, fmt.Errorf("row %d group %d: zero %d, Q4_0 needs 8", o, g, zero)
				}
				blk := row[b*18 : (b+1)*18]
				binary.LittleEndian.PutUint16(blk, f16(scale))
				putNibbles(blk[2:], qb)
			case Q4_1:
				blk := row[b*20 : (b+1)*20]
				binary.LittleEndian.PutUint16(blk, f16(scale))
				binary.LittleEndian.PutUint16(blk[2:], f16(-scale*float32(zero)))
				putNibbles(blk[4:], qb)
			case Q8_0:
				if zero != 128 {
					return nil, fmt.Errorf("row %d group %d: zero %d, Q8_0 needs 128", o, g, zero)
				}
				blk := row[b*34 : (b+1)*34]
				binary.LittleEndian.PutUint16(blk, f16(scale))
				for j, v := range qb {
					blk[2+j] = byte(int8(int(v) - 128))
				}
			default:
				return nil, fmt.Errorf("no exact mapping onto %s", typ)
			}
		}
	}
	return out, nil
}

// RoundF16Exact rounds x to float16 and back.
func RoundF16Exact(x float32) float32 { return float16.Fromfloat32(x).Float32() }

// putNibbles packs 32 codes: code j in the low nibble of byte j, code
// j+16 in its high nibble.
func putNibbles(dst []byte, q []uint8) {
	for j := 0; j < 16; j++ {
		dst[j] = q[j]&15 | q[j+16]<<4
	}
}

// Quantize re-quantizes float32 rows [rows][n] to Q4_0 or Q8_0 (n a
// multiple of 32), or converts them to F16 or F32. Blocks are fitted
// as ggml's reference quantizer does: Q4_0 takes d = −m/8 where m is the
// block's value of largest magnitude (so m lands exactly on a grid end),
// Q8_0 d = max|x|/127; the codes are computed with the float16-rounded d.
func Quantize(w []float32, n int, typ TensorType) ([]byte, error) {
	rb, err := typ.RowBytes(n)
	if err != nil {
		return nil, err
	}
	if len(w)%n != 0 {
		return nil, fmt.Errorf("%d values do not make rows of %d", len(w), n)
	}
	rows := len(w) / n
	out := make([]byte, rows*rb)
	switch typ {
	case F32:
		for i, v := range w {
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(v))
		}
		return out, nil
	case F16:
		for i, v := range w {
			binary.LittleEndian.PutUint16(out[2*i:], f16(v))
		}
		return out, nil
	case Q4_0, Q8_0:
	default:
		return nil, fmt.Errorf("cannot quantize to %s", typ)
	}
	nb := len(w) / BlockSize
	for b := 0; b < nb; b++ {
		x := w[b*BlockSize : (b+1)*BlockSize]
		var m, amax float32
		for _, v := range x {
			if a := float32(math.Abs(float64(v))); a > amax {
				amax, m = a, v
			}
		}
		if typ == Q4_0 {
			blk := out[b*18 : (b+1)*18]
			d := RoundF16Exact(-m / 8)
			var q [BlockSize]uint8
			if d != 0 {
				for j, v := range x {
					q[j] = uint8(min(max(math.Round(float64(v/d))+8, 0), 15))
				}
			} else {
				for j := range q {
					q[j] = 8
				}
			}
			binary.LittleEndian.PutUint16(blk, f16(d))
			putNibbles(blk[2:], q[:])
		} else {
			blk := out[b*34 : (b+1)*34]
			d := RoundF16Exact(amax / 127)
			binary.LittleEndian.PutUint16(blk, f16(d))
			if d != 0 {
				for j, v := range x {
					blk[2+j] = byte(int8(min(max(math.Round(float64(v/d)), -127), 127)))
				}
			}
		}
	}
	return out, nil
}

// Dequantize decodes n elements of typ, as ggml's reference dequantizers
// compute them in float32.
func Dequantize(data []byte, typ TensorType, n int) ([]float32, error) {
	rb, err := typ.RowBytes(n)
	if err != nil {
		return nil, err
	}
	if len(data) != rb {
		return nil, fmt.Errorf("%s: %d bytes for %d elements, want %d", typ, len(data), n, rb)
	}
	out := make([]float32, n)
	switch typ {
	case F32:
		for i := range out {
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
		}
	case F16:
		for i := range out {
			out[i] = fromF16(data[2*i:])
		}
	case Q4_0:
		for b := 0; b < n/BlockSize; b++ {
			blk := data[b*18:]
			d := fromF16(blk)
			for j := 0; j < 16; j++ {
				out[b*BlockSize+j] = float32(int(blk[2+j]&15)-8) * d
				out[b*BlockSize+j+16] = float32(int(blk[2+j]>>4)-8) * d
			}
		}
	case Q4_1:
		for b := 0; b < n/BlockSize; b++ {
			blk := data[b*20:]
			d, m := fromF16(blk), fromF16(blk[2:])
			for j := 0; j < 16; j++ {
				out[b*BlockSize+j] = float32(float32(blk[4+j]&15)*d) + m
				out[b*BlockSize+j+16] = float32(float32(blk[4+j]>>4)*d) + m
			}
		}
	case Q8_0:
		for b := 0; b < n/BlockSize; b++ {
			blk := data[b*34:]
			d := fromF16(blk)
			for j := 0; j < BlockSize; j++ {
				out[b*BlockSize+j] = float32(int8(blk[2+j])) * d
			}
		}
	}
	return out, nil
}

// RelError is ‖a − b‖ / ‖b‖.
func RelError(a, b []float32) float64 {
	var num, den float64
	for i := range a {
		d := float64(a[i]) - float64(b[i])
		num += d * d
		den += float64(b[i]) * float64(b[i])
	}
	if den == 0 {
		return math.Sqrt(num)
	}
	return math.Sqrt(num / den)
}
