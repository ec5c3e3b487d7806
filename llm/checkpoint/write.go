package checkpoint

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"

	"github.com/nlpodyssey/safetensors"
	"github.com/x448/float16"
)

// Out is a tensor to be written.
type Out struct {
	DType safetensors.DType
	Shape []int
	Data  []byte
	// Float8 writes the tensor as "F8_E4M3" (DType must be U8: the bytes
	// are E4M3 codes).
	Float8 bool
}

// F8E4M3 makes an F8_E4M3 tensor from E4M3 codes.
func F8E4M3(codes []byte, shape ...int) Out {
	return Out{DType: safetensors.U8, Shape: shape, Data: codes, Float8: true}
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
		if t.Float8 && t.DType != safetensors.U8 {
			return fmt.Errorf("tensor %q: an F8_E4M3 tensor is given as U8 codes, not %s", name, t.DType)
		}
		views[name] = view{t}
	}
	header, order, err := headerFor(tensors, meta)
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-*.safetensors")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	w := bufio.NewWriterSize(tmp, 1<<20)
	if header == nil {
		err = safetensors.SerializeToWriter(views, meta, w)
	} else {
		err = writeRaw(w, header, order, tensors)
	}
	if err != nil {
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
	return Out{DType: safetensors.F32, Shape: shape, Data: b}
}

// F16 makes an F16 tensor (values rounded to nearest even).
func F16(data []float32, shape ...int) Out {
	b := make([]byte, 2*len(data))
	for i, v := range data {
		binary.LittleEndian.PutUint16(b[2*i:], float16.Fromfloat32(v).Bits())
	}
	return Out{DType: safetensors.F16, Shape: shape, Data: b}
}

// BF16 makes a BF16 tensor (values rounded to nearest even).
func BF16(data []float32, shape ...int) Out {
	b := make([]byte, 2*len(data))
	for i, v := range data {
		binary.LittleEndian.PutUint16(b[2*i:], ToBF16(v))
	}
	return Out{DType: safetensors.BF16, Shape: shape, Data: b}
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
	return Out{DType: safetensors.I32, Shape: shape, Data: b}
}

// headerFor returns nil when no tensor is Float8 (the library writes the
// file). Otherwise it builds the header itself, as the safetensors format
// defines it: an 8-byte little-endian length, then a JSON object mapping
// each name to its dtype, shape and [begin, end) byte offsets in the data
// that follows (plus "__metadata__"), padded with spaces to a multiple of
// 8 bytes. Tensors are laid out by decreasing element size, then by name,
// as the library does, so every tensor is aligned to its element size.
func headerFor(tensors map[string]Out, meta map[string]string) ([]byte, []string, error) {
	any8 := false
	for _, t := range tensors {
		any8 = any8 || t.Float8
	}
	if !any8 {
		return nil, nil, nil
	}
	order := make([]string, 0, len(tensors))
	for n := range tensors {
		if n == "__metadata__" {
			return nil, nil, fmt.Errorf("a tensor cannot be named __metadata__")
		}
		order = append(order, n)
	}
	sort.Slice(order, func(i, j int) bool {
		a, b := tensors[order[i]], tensors[order[j]]
		if sa, sb := a.DType.Size(), b.DType.Size(); sa != sb {
			return sa > sb
		}
		return order[i] < order[j]
	})
	type entry struct {
		DType   string   `json:"dtype"`
		Shape   []int    `json:"shape"`
		Offsets [2]int64 `json:"data_offsets"`
	}
	hdr := map[string]any{}
	if len(meta) > 0 {
		hdr["__metadata__"] = meta
	}
	var off int64
	for _, n := range order {
		t := tensors[n]
		dt := t.DType.String()
		if t.Float8 {
			dt = DTypeF8E4M3
		}
		shape := t.Shape
		if shape == nil {
			shape = []int{}
		}
		hdr[n] = entry{DType: dt, Shape: shape, Offsets: [2]int64{off, off + int64(len(t.Data))}}
		off += int64(len(t.Data))
	}
	js, err := json.Marshal(hdr)
	if err != nil {
		return nil, nil, err
	}
	for len(js)%8 != 0 {
		js = append(js, ' ')
	}
	return js, order, nil
}

// writeRaw writes a file with a header from headerFor.
func writeRaw(w io.Writer, header []byte, order []string, tensors map[string]Out) error {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(header)))
	if _, err := w.Write(n[:]); err != nil {
		return err
	}
	if _, err := w.Write(header); err != nil {
		return err
	}
	for _, name := range order {
		if _, err := w.Write(tensors[name].Data); err != nil {
			return err
		}
	}
	return nil
}

// I64 makes an I64 tensor.
func I64(data []int64, shape ...int) Out {
	b := make([]byte, 8*len(data))
	for i, v := range data {
		binary.LittleEndian.PutUint64(b[8*i:], uint64(v))
	}
	return Out{DType: safetensors.I64, Shape: shape, Data: b}
}
