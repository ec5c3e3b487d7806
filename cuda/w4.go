//go:build cgo

package cuda

import "github.com/llmq/llmq/pack"

// W4 is a 4-bit layer resident on the GPU in the kernel's layout.
type W4 struct {
	K, N, Group int
	B, S, Z     Buf
	Perm        Buf   // zero when the layer has no act-order permutation
	Cols        []int // a joined layer's parts (pack.ConcatGPU), their widths; nil for one layer
}

// UploadW4 copies a repacked layer to the GPU.
func (x *Context) UploadW4(g *pack.GPUWeights) (*W4, error) {
	w := &W4{K: g.K, N: g.N, Group: g.Group}
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

// Bytes is the device memory the layer takes.
func (w *W4) Bytes() int64 { return int64(w.B.Bytes + w.S.Bytes + w.Z.Bytes + w.Perm.Bytes) }

// Free releases the layer's device memory.
func (w *W4) Free(x *Context) {
	for _, b := range []Buf{w.B, w.S, w.Z, w.Perm} {
		x.Free(b)
	}
}
