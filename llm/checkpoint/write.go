package checkpoint

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"path/filepath"

	"github.com/nlpodyssey/safetensors"
	"github.com/x448/float16"
)

// Out is a tensor to be written.
type Out struct {
	DType safetensors.DType
	Shape []int
	Data  []byte
}

// view adapts Out to the safetensors library's View.
type view struct{ o Out }

func (v view) DType() safetensors.DType { return v.o.DType }
func (v view) Shape() []uint64 {
	s := make([]uint64, len(v.o.Shape))
	for i, d := range v.o.Shape {
		s[i] = uint64(d)
	}
	return s
}
func (v view) Data() []byte    { return v.o.Data }
func (v view) DataLen() uint64 { return uint64(len(v.o.Data)) }

// WriteFile writes tensors to a safetensors file via a temporary file and a
// rename, so a failed write never leaves a partial file at path.
func WriteFile(path string, tensors map[string]Out, meta map[string]string) error {
	views := make(map[string]view, len(tensors))
	for name, t := range tensors {
		n := 1
		for _, d := range t.Shape {
			n *= d
		}
		if uint64(n)*t.DType.Size() != uint64(len(t.Data)) {
			return fmt.Errorf("tensor %q: %d bytes of data for shape %v of %s", name, len(t.Data), t.Shape, t.DType)
		}
		views[name] = view{t}
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-*.safetensors")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	w := bufio.NewWriterSize(tmp, 1<<20)
	if err := safetensors.SerializeToWriter(views, meta, w); err != nil {
		tmp.Close()
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := w.Flush(); err != nil {
		tmp.Close()
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// F32 makes an F32 tensor.
func F32(data []float32, shape ...int) Out {
	b := make([]byte, 4*len(data))
	for i, v := range data {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
	return Out{safetensors.F32, shape, b}
}

// F16 makes an F16 tensor (values rounded to nearest even).
func F16(data []float32, shape ...int) Out {
	b := make([]byte, 2*len(data))
	for i, v := range data {
		binary.LittleEndian.PutUint16(b[2*i:], float16.Fromfloat32(v).Bits())
	}
	return Out{safetensors.F16, shape, b}
}

// BF16 makes a BF16 tensor (values rounded to nearest even).
func BF16(data []float32, shape ...int) Out {
	b := make([]byte, 2*len(data))
	for i, v := range data {
		binary.LittleEndian.PutUint16(b[2*i:], ToBF16(v))
	}
	return Out{safetensors.BF16, shape, b}
}

// ToBF16 rounds a float32 to bfloat16 bits, nearest even.
func ToBF16(v float32) uint16 {
	u := math.Float32bits(v)
	if v != v {
		return uint16(u>>16) | 0x40
	}
	u += 0x7fff + (u>>16)&1
	return uint16(u >> 16)
}

// I32 makes an I32 tensor.
func I32(data []int32, shape ...int) Out {
	b := make([]byte, 4*len(data))
	for i, v := range data {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(v))
	}
	return Out{safetensors.I32, shape, b}
}
