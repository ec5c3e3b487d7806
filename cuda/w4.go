//go:build cgo

package cuda

import "github.com/llmq/llmq/pack"

// W4 is a 4-bit layer resident on the GPU in the kernel's layout.
type W4 struct {
	K, N, Group int
	B, S, Z     Buf
	Perm        Buf // zero when the layer has no act-order permutation
}

// UploadW4 copies a repacked layer to the GPU.
func (l *Lib) UploadW4(g *pack.GPUWeights) (*W4, error) {
	w := &W4{K: g.K, N: g.N, Group: g.Group}
	var err error
	if w.B, err = AllocFrom(l, g.B); err != nil {
		return nil, err
	}
	if w.S, err = AllocFrom(l, g.Scales); err != nil {
		return nil, err
	}
	if w.Z, err = AllocFrom(l, g.Zeros); err != nil {
		return nil, err
	}
	if g.Perm != nil {
		if w.Perm, err = AllocFrom(l, g.Perm); err != nil {
			return nil, err
		}
	}
	return w, nil
}

// Free releases the layer's device memory.
func (w *W4) Free(l *Lib) {
	for _, b := range []Buf{w.B, w.S, w.Z, w.Perm} {
		l.Free(b)
	}
}
