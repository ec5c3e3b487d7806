//go:build cgo

package cuda

import (
	"fmt"

	"github.com/llmq/llmq/pack"
)

// W4 is a layer of 2- to 4-bit codes (Bits 4) or 8-bit codes (Bits 8)
// resident on the GPU in the kernels' layout (pack.GPUWeights).
type W4 struct {
	K, N, Group int
	Bits        int // 4 or 8; 0 reads as 4
	B, S, Z     Buf
	Perm        Buf   // zero when the layer has no act-order permutation
	Cols        []int // a joined layer's parts (pack.ConcatGPU), their widths; nil for one layer
	// Gated: a gated MLP's gate and up interleaved (pack.InterleaveGPU),
	// whose GEMM writes act(gate)·up, N/2 columns: GatedSiLU or
	// GatedGELU; 0 (NotGated) for a plain layer.
	Gated Gating
}

// Gating is what a W4 layer's GEMM applies in its epilogue.
type Gating int

const (
	NotGated  Gating = iota
	GatedSiLU        // SwiGLU's act(gate)·up
	GatedGELU        // GeGLU's, GELU with the tanh approximation
)

// act is the library's code for g: −1 none, 0 SiLU, 1 GELU-tanh (as
// gated_act's).
func (g Gating) act() int { return int(g) - 1 }

// codeBits is the layout's code width, as the library takes it.
func (w *W4) codeBits() int {
	if w.Bits == 8 {
		return 8
	}
	return 4
}

// UploadW4 copies a repacked layer to the GPU.
func (x *Context) UploadW4(g *pack.GPUWeights) (*W4, error) {
	w := &W4{K: g.K, N: g.N, Group: g.Group, Bits: g.Bits}
	var err error
	if w.B, err = AllocFrom(x, g.B); err == nil {
		if w.S, err = AllocFrom(x, g.Scales); err == nil {
			if w.Z, err = AllocFrom(x, g.Zeros); err == nil && g.Perm != nil {
				w.Perm, err = AllocFrom(x, g.Perm)
			}
		}
	}
	if err != nil {
		w.Free(x)
		return nil, err
	}
	return w, nil
}

// UploadExperts copies a mixture's expert layers of one kind, all alike
// (same K, N, group, no act order), to the GPU one after another, as
// MoEGemv reads them: a W4 whose K, N and Group are one expert's.
func (x *Context) UploadExperts(gs []*pack.GPUWeights) (*W4, error) {
	if len(gs) == 0 {
		return nil, fmt.Errorf("no experts")
	}
	g0 := gs[0]
	for e, g := range gs {
		if g.K != g0.K || g.N != g0.N || g.Group != g0.Group || len(g.B) != len(g0.B) || len(g.Scales) != len(g0.Scales) || len(g.Zeros) != len(g0.Zeros) {
			return nil, fmt.Errorf("expert %d is %d×%d with group %d, expert 0 %d×%d with group %d: the grouped kernel needs them alike",
				e, g.N, g.K, g.Group, g0.N, g0.K, g0.Group)
		}
		if g.Perm != nil {
			return nil, fmt.Errorf("expert %d has an act-order permutation: the grouped expert kernel does not run act order yet", e)
		}
		if g.Bits == 8 {
			return nil, fmt.Errorf("expert %d has 8-bit codes: the grouped expert kernel runs 2- to 4-bit codes", e)
		}
	}
	w := &W4{K: g0.K, N: g0.N, Group: g0.Group}
	var err error
	for _, p := range []struct {
		dst   *Buf
		bytes int
		put   func(Buf, int) error
	}{
		{&w.B, len(g0.B) * 4, func(b Buf, e int) error { return Upload(x, b, gs[e].B) }},
		{&w.S, len(g0.Scales) * 2, func(b Buf, e int) error { return Upload(x, b, gs[e].Scales) }},
		{&w.Z, len(g0.Zeros) * 4, func(b Buf, e int) error { return Upload(x, b, gs[e].Zeros) }},
	} {
		if *p.dst, err = x.Alloc(p.bytes * len(gs)); err != nil {
			break
		}
		for e := range gs {
			if err = p.put(p.dst.Offset(e*p.bytes), e); err != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	if err != nil {
		w.Free(x)
		return nil, err
	}
	return w, nil
}

// Bytes is the device memory the layer takes.
func (w *W4) Bytes() int64 { return int64(w.B.Bytes + w.S.Bytes + w.Z.Bytes + w.Perm.Bytes) }

// Free releases the layer's device memory.
func (w *W4) Free(x *Context) {
	for _, b := range []Buf{w.B, w.S, w.Z, w.Perm} {
		x.Free(b)
	}
}
