// Package gguf writes and reads GGUF files, the single-file model format of
// ggml, llama.cpp and ollama, and exports llmq checkpoints (unquantized, or
// packed by GPTQ/AWQ) to it.
//
// # The file
//
// A GGUF (version 3) file is, all integers little-endian (the format's
// description is docs/gguf.md in the ggml-org/ggml repository):
//
//	magic        4 bytes "GGUF"
//	version      uint32 3
//	tensor_count uint64
//	kv_count     uint64
//	kv_count key/value pairs:   key (string), value type (uint32), value
//	tensor_count tensor infos:  name (string), n_dims (uint32),
//	                            ne[n_dims] (uint64), type (uint32),
//	                            offset (uint64, from the start of the data)
//	padding to general.alignment (32 when the key is absent)
//	tensor data, each tensor starting at a multiple of the alignment
//
// A string is a uint64 byte length and its UTF-8 bytes (no terminator). An
// array value is its element type (uint32), a uint64 count and the
// elements. Dimensions are ggml's: ne[0] is the innermost (contiguous)
// one, so a weight stored row-major as [out][in] has ne = [in, out].
//
// # Block types
//
// Quantized tensors are sequences of blocks of 32 consecutive elements
// along ne[0] (ggml/src/ggml-common.h), each with a float16 scale d:
//
//	Q4_0  18 bytes: d, 16 bytes of nibbles      x = d·(q − 8)
//	Q4_1  20 bytes: d, m, 16 bytes of nibbles   x = d·q + m
//	Q8_0  34 bytes: d, 32 int8                  x = d·q
//
// Nibbles: element j (0 ≤ j < 16) is the low nibble of byte j, element
// j+16 its high nibble.
package gguf

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"
)

// Magic is the first four bytes of a GGUF file; Version the version
// written.
const (
	Magic     = "GGUF"
	Version   = 3
	Alignment = 32 // general.alignment, written explicitly
)

// ValueType is the type tag of a metadata value.
type ValueType uint32

// Metadata value types.
const (
	TypeUint8 ValueType = iota
	TypeInt8
	TypeUint16
	TypeInt16
	TypeUint32
	TypeInt32
	TypeFloat32
	TypeBool
	TypeString
	TypeArray
	TypeUint64
	TypeInt64
	TypeFloat64
)

// TensorType is a ggml tensor type (enum ggml_type).
type TensorType uint32

// The tensor types llmq writes.
const (
	F32  TensorType = 0
	F16  TensorType = 1
	Q4_0 TensorType = 2
	Q4_1 TensorType = 3
	Q8_0 TensorType = 8
)

// BlockSize is the number of elements per block of the quantized types.
const BlockSize = 32

func (t TensorType) String() string {
	switch t {
	case F32:
		return "F32"
	case F16:
		return "F16"
	case Q4_0:
		return "Q4_0"
	case Q4_1:
		return "Q4_1"
	case Q8_0:
		return "Q8_0"
	}
	return fmt.Sprintf("type(%d)", uint32(t))
}

// RowBytes is the size of ne0 elements of type t, or an error when t is
// not one of llmq's types or ne0 is not a whole number of blocks.
func (t TensorType) RowBytes(ne0 int) (int, error) {
	var block, size int
	switch t {
	case F32:
		return 4 * ne0, nil
	case F16:
		return 2 * ne0, nil
	case Q4_0:
		block, size = BlockSize, 18
	case Q4_1:
		block, size = BlockSize, 20
	case Q8_0:
		block, size = BlockSize, 34
	default:
		return 0, fmt.Errorf("tensor type %s is not supported", t)
	}
	if ne0%block != 0 {
		return 0, fmt.Errorf("%s needs the innermost dimension to be a multiple of %d, have %d", t, block, ne0)
	}
	return ne0 / block * size, nil
}

// KV is one metadata key/value pair. Value holds one of: uint8, int8,
// uint16, int16, uint32, int32, float32, bool, string, uint64, int64,
// float64, or a slice of one of them ([]string, []int32, []float32, …).
type KV struct {
	Key   string
	Value any
}

// TensorInfo describes one tensor: its name, ggml dimensions (Dims[0]
// innermost), type and offset in the data section.
type TensorInfo struct {
	Name   string
	Dims   []uint64
	Type   TensorType
	Offset uint64
}

// Bytes is the tensor's data size.
func (ti TensorInfo) Bytes() (int, error) {
	if len(ti.Dims) == 0 {
		return 0, fmt.Errorf("tensor %q has no dimensions", ti.Name)
	}
	n, err := ti.Type.RowBytes(int(ti.Dims[0]))
	if err != nil {
		return 0, fmt.Errorf("tensor %q: %w", ti.Name, err)
	}
	for _, d := range ti.Dims[1:] {
		n *= int(d)
	}
	return n, nil
}

func pad(n uint64) uint64 { return (n + Alignment - 1) / Alignment * Alignment }

// A Writer builds a GGUF file: metadata and tensor declarations first
// (Add, AddTensor), then Create writes the header to a temporary file
// beside the destination, WriteTensor streams each tensor's data in the
// order declared, and Close pads and renames the file into place (Abort
// removes it).
type Writer struct {
	kvs     []KV
	keys    map[string]bool
	tensors []TensorInfo
	names   map[string]int
	next    int // the next tensor WriteTensor expects
	dataLen uint64

	path string
	tmp  *os.File
	bw   *bufio.Writer
	pos  uint64 // bytes written to the data section
}

// NewWriter returns a Writer with general.alignment set.
func NewWriter() *Writer {
	w := &Writer{keys: map[string]bool{}, names: map[string]int{}}
	w.Add("general.alignment", uint32(Alignment))
	return w
}

// Add appends a metadata key/value; a key may appear once.
func (w *Writer) Add(key string, value any) error {
	if w.keys[key] {
		return fmt.Errorf("gguf: metadata key %q set twice", key)
	}
	if _, err := valueType(value); err != nil {
		return fmt.Errorf("gguf: metadata key %q: %w", key, err)
	}
	w.keys[key] = true
	w.kvs = append(w.kvs, KV{key, value})
	return nil
}

// AddTensor declares a tensor with ggml dimensions dims (dims[0]
// innermost).
func (w *Writer) AddTensor(name string, typ TensorType, dims ...int) error {
	if _, dup := w.names[name]; dup {
		return fmt.Errorf("gguf: tensor %q declared twice", name)
	}
	ti := TensorInfo{Name: name, Type: typ, Offset: w.dataLen}
	for _, d := range dims {
		if d <= 0 {
			return fmt.Errorf("gguf: tensor %q: dimension %d", name, d)
		}
		ti.Dims = append(ti.Dims, uint64(d))
	}
	n, err := ti.Bytes()
	if err != nil {
		return fmt.Errorf("gguf: %w", err)
	}
	w.names[name] = len(w.tensors)
	w.tensors = append(w.tensors, ti)
	w.dataLen = pad(w.dataLen + uint64(n))
	return nil
}

// Tensors lists the declared tensors.
func (w *Writer) Tensors() []TensorInfo { return w.tensors }

// Create writes the header, metadata and tensor infos to a temporary file
// beside path.
func (w *Writer) Create(path string) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("gguf: %w", err)
	}
	w.path, w.tmp, w.bw = path, f, bufio.NewWriterSize(f, 1<<20)
	e := &encoder{w: w.bw}
	e.raw([]byte(Magic))
	e.u32(Version)
	e.u64(uint64(len(w.tensors)))
	e.u64(uint64(len(w.kvs)))
	for _, kv := range w.kvs {
		e.str(kv.Key)
		e.value(kv.Value, true)
	}
	for _, ti := range w.tensors {
		e.str(ti.Name)
		e.u32(uint32(len(ti.Dims)))
		for _, d := range ti.Dims {
			e.u64(d)
		}
		e.u32(uint32(ti.Type))
		e.u64(ti.Offset)
	}
	e.raw(make([]byte, pad(e.n)-e.n))
	if e.err != nil {
		w.Abort()
		return fmt.Errorf("gguf: writing %s: %w", path, e.err)
	}
	return nil
}

// WriteTensor writes the data of the next declared tensor, which must be
// name, of exactly its size.
func (w *Writer) WriteTensor(name string, data []byte) error {
	if w.bw == nil {
		return fmt.Errorf("gguf: WriteTensor(%q) before Create", name)
	}
	if w.next >= len(w.tensors) || w.tensors[w.next].Name != name {
		return fmt.Errorf("gguf: tensor %q written out of the declared order", name)
	}
	ti := w.tensors[w.next]
	n, _ := ti.Bytes()
	if len(data) != n {
		return fmt.Errorf("gguf: tensor %q: %d bytes of data, want %d (%s %v)", name, len(data), n, ti.Type, ti.Dims)
	}
	if _, err := w.bw.Write(make([]byte, ti.Offset-w.pos)); err != nil {
		return fmt.Errorf("gguf: writing %s: %w", w.path, err)
	}
	if _, err := w.bw.Write(data); err != nil {
		return fmt.Errorf("gguf: writing %s: tensor %q: %w", w.path, name, err)
	}
	w.pos = ti.Offset + uint64(n)
	w.next++
	return nil
}

// Close pads the last tensor, flushes, and renames the file into place.
func (w *Writer) Close() error {
	if w.bw == nil {
		return fmt.Errorf("gguf: Close before Create")
	}
	if w.next != len(w.tensors) {
		w.Abort()
		return fmt.Errorf("gguf: %s: %d of %d tensors written (next: %q)", w.path, w.next, len(w.tensors), w.tensors[w.next].Name)
	}
	_, err := w.bw.Write(make([]byte, w.dataLen-w.pos))
	if err == nil {
		err = w.bw.Flush()
	}
	if err == nil {
		err = w.tmp.Chmod(0o644)
	}
	if err == nil {
		err = w.tmp.Sync()
	}
	if cerr := w.tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(w.tmp.Name(), w.path)
	}
	if err != nil {
		os.Remove(w.tmp.Name())
		return fmt.Errorf("gguf: writing %s: %w", w.path, err)
	}
	w.bw = nil
	return nil
}

// Abort removes the temporary file.
func (w *Writer) Abort() {
	if w.tmp != nil {
		w.tmp.Close()
		os.Remove(w.tmp.Name())
	}
	w.bw = nil
}

type encoder struct {
	w   io.Writer
	n   uint64
	err error
	buf [8]byte
}

func (e *encoder) raw(b []byte) {
	if e.err != nil {
		return
	}
	_, e.err = e.w.Write(b)
	e.n += uint64(len(b))
}

func (e *encoder) u32(v uint32) {
	binary.LittleEndian.PutUint32(e.buf[:4], v)
	e.raw(e.buf[:4])
}

func (e *encoder) u64(v uint64) {
	binary.LittleEndian.PutUint64(e.buf[:8], v)
	e.raw(e.buf[:8])
}

func (e *encoder) str(s string) {
	e.u64(uint64(len(s)))
	e.raw([]byte(s))
}

func valueType(v any) (ValueType, error) {
	switch v.(type) {
	case uint8:
		return TypeUint8, nil
	case int8:
		return TypeInt8, nil
	case uint16:
		return TypeUint16, nil
	case int16:
		return TypeInt16, nil
	case uint32:
		return TypeUint32, nil
	case int32:
		return TypeInt32, nil
	case float32:
		return TypeFloat32, nil
	case bool:
		return TypeBool, nil
	case string:
		return TypeString, nil
	case uint64:
		return TypeUint64, nil
	case int64:
		return TypeInt64, nil
	case float64:
		return TypeFloat64, nil
	case []uint8, []int8, []uint16, []int16, []uint32, []int32, []float32, []bool, []string, []uint64, []int64, []float64:
		return TypeArray, nil
	}
	return 0, fmt.Errorf("unsupported value type %T", v)
}

// value writes v with its type tag when tagged (array elements are not).
func (e *encoder) value(v any, tagged bool) {
	t, _ := valueType(v)
	if tagged {
		e.u32(uint32(t))
	}
	le := binary.LittleEndian
	switch x := v.(type) {
	case uint8:
		e.raw([]byte{x})
	case int8:
		e.raw([]byte{byte(x)})
	case uint16:
		e.raw(le.AppendUint16(nil, x))
	case int16:
		e.raw(le.AppendUint16(nil, uint16(x)))
	case uint32:
		e.u32(x)
	case int32:
		e.u32(uint32(x))
	case float32:
		e.u32(math.Float32bits(x))
	case bool:
		b := byte(0)
		if x {
			b = 1
		}
		e.raw([]byte{b})
	case string:
		e.str(x)
	case uint64:
		e.u64(x)
	case int64:
		e.u64(uint64(x))
	case float64:
		e.u64(math.Float64bits(x))
	case []string:
		e.u32(uint32(TypeString))
		e.u64(uint64(len(x)))
		for _, s := range x {
			e.str(s)
		}
	default:
		arrayOf(e, v)
	}
}

func arrayOf(e *encoder, v any) {
	switch x := v.(type) {
	case []uint8:
		writeArray(e, TypeUint8, x)
	case []int8:
		writeArray(e, TypeInt8, x)
	case []uint16:
		writeArray(e, TypeUint16, x)
	case []int16:
		writeArray(e, TypeInt16, x)
	case []uint32:
		writeArray(e, TypeUint32, x)
	case []int32:
		writeArray(e, TypeInt32, x)
	case []float32:
		writeArray(e, TypeFloat32, x)
	case []bool:
		writeArray(e, TypeBool, x)
	case []uint64:
		writeArray(e, TypeUint64, x)
	case []int64:
		writeArray(e, TypeInt64, x)
	case []float64:
		writeArray(e, TypeFloat64, x)
	}
}

func writeArray[T any](e *encoder, t ValueType, xs []T) {
	e.u32(uint32(t))
	e.u64(uint64(len(xs)))
	for _, x := range xs {
		e.value(x, false)
	}
}

// File is a GGUF file read into memory (for tests and checks; models are
// small enough there).
type File struct {
	Version  uint32
	KV       map[string]any // values as in KV
	Keys     []string       // in file order
	Tensors  []TensorInfo
	data     []byte // the data section
	byName   map[string]int
	dataFrom uint64
}

// ErrFormat is wrapped by every error about a malformed file.
var ErrFormat = errors.New("not a valid GGUF file")

// Read reads and checks a whole GGUF file.
func Read(path string) (*File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	f, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return f, nil
}

// Parse reads a GGUF file's bytes.
func Parse(b []byte) (*File, error) {
	d := &decoder{b: b}
	if string(d.take(4)) != Magic {
		return nil, fmt.Errorf("%w: bad magic", ErrFormat)
	}
	f := &File{Version: d.u32(), KV: map[string]any{}, byName: map[string]int{}}
	if f.Version != Version {
		return nil, fmt.Errorf("%w: version %d (want %d)", ErrFormat, f.Version, Version)
	}
	nt, nkv := d.u64(), d.u64()
	if nt > uint64(len(b)) || nkv > uint64(len(b)) {
		return nil, fmt.Errorf("%w: counts %d tensors, %d keys exceed the file", ErrFormat, nt, nkv)
	}
	for i := uint64(0); i < nkv && d.err == nil; i++ {
		k := d.str()
		v := d.value(ValueType(d.u32()))
		if _, dup := f.KV[k]; dup {
			return nil, fmt.Errorf("%w: key %q twice", ErrFormat, k)
		}
		f.KV[k], f.Keys = v, append(f.Keys, k)
	}
	for i := uint64(0); i < nt && d.err == nil; i++ {
		ti := TensorInfo{Name: d.str()}
		nd := d.u32()
		if nd > 4 {
			return nil, fmt.Errorf("%w: tensor %q has %d dimensions", ErrFormat, ti.Name, nd)
		}
		for j := uint32(0); j < nd; j++ {
			ti.Dims = append(ti.Dims, d.u64())
		}
		ti.Type, ti.Offset = TensorType(d.u32()), d.u64()
		f.byName[ti.Name] = len(f.Tensors)
		f.Tensors = append(f.Tensors, ti)
	}
	if d.err != nil {
		return nil, d.err
	}
	align := uint64(Alignment)
	if a, ok := f.KV["general.alignment"].(uint32); ok && a > 0 {
		align = uint64(a)
	}
	f.dataFrom = (d.off + align - 1) / align * align
	if f.dataFrom > uint64(len(b)) {
		return nil, fmt.Errorf("%w: truncated before the data section", ErrFormat)
	}
	f.data = b[f.dataFrom:]
	for _, ti := range f.Tensors {
		n, err := ti.Bytes()
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrFormat, err)
		}
		if ti.Offset%align != 0 || ti.Offset+uint64(n) > uint64(len(f.data)) {
			return nil, fmt.Errorf("%w: tensor %q at offset %d (%d bytes) is misaligned or past the end", ErrFormat, ti.Name, ti.Offset, n)
		}
	}
	return f, nil
}

// Tensor returns a tensor's info and data.
func (f *File) Tensor(name string) (TensorInfo, []byte, error) {
	i, ok := f.byName[name]
	if !ok {
		return TensorInfo{}, nil, fmt.Errorf("gguf: no tensor %q", name)
	}
	ti := f.Tensors[i]
	n, _ := ti.Bytes()
	return ti, f.data[ti.Offset : ti.Offset+uint64(n)], nil
}

// Names lists the tensor names, sorted.
func (f *File) Names() []string {
	var s []string
	for _, t := range f.Tensors {
		s = append(s, t.Name)
	}
	sort.Strings(s)
	return s
}

type decoder struct {
	b   []byte
	off uint64
	err error
}

func (d *decoder) take(n uint64) []byte {
	if d.err != nil {
		return nil
	}
	if n > uint64(len(d.b))-d.off {
		d.err = fmt.Errorf("%w: truncated at byte %d", ErrFormat, d.off)
		return nil
	}
	s := d.b[d.off : d.off+n]
	d.off += n
	return s
}

func (d *decoder) u32() uint32 {
	if s := d.take(4); s != nil {
		return binary.LittleEndian.Uint32(s)
	}
	return 0
}

func (d *decoder) u64() uint64 {
	if s := d.take(8); s != nil {
		return binary.LittleEndian.Uint64(s)
	}
	return 0
}

func (d *decoder) str() string { return string(d.take(d.u64())) }

func (d *decoder) value(t ValueType) any {
	switch t {
	case TypeUint8:
		if s := d.take(1); s != nil {
			return s[0]
		}
	case TypeInt8:
		if s := d.take(1); s != nil {
			return int8(s[0])
		}
	case TypeUint16:
		if s := d.take(2); s != nil {
			return binary.LittleEndian.Uint16(s)
		}
	case TypeInt16:
		if s := d.take(2); s != nil {
			return int16(binary.LittleEndian.Uint16(s))
		}
	case TypeUint32:
		return d.u32()
	case TypeInt32:
		return int32(d.u32())
	case TypeFloat32:
		return math.Float32frombits(d.u32())
	case TypeBool:
		if s := d.take(1); s != nil {
			return s[0] != 0
		}
	case TypeString:
		return d.str()
	case TypeUint64:
		return d.u64()
	case TypeInt64:
		return int64(d.u64())
	case TypeFloat64:
		return math.Float64frombits(d.u64())
	case TypeArray:
		et, n := ValueType(d.u32()), d.u64()
		if n > uint64(len(d.b)) {
			d.err = fmt.Errorf("%w: array of %d elements at byte %d", ErrFormat, n, d.off)
			return nil
		}
		return d.array(et, int(n))
	default:
		d.err = fmt.Errorf("%w: value type %d at byte %d", ErrFormat, t, d.off)
	}
	return nil
}

func (d *decoder) array(et ValueType, n int) any {
	switch et {
	case TypeString:
		return readArray[string](d, et, n)
	case TypeInt32:
		return readArray[int32](d, et, n)
	case TypeUint32:
		return readArray[uint32](d, et, n)
	case TypeFloat32:
		return readArray[float32](d, et, n)
	case TypeUint8:
		return readArray[uint8](d, et, n)
	case TypeInt8:
		return readArray[int8](d, et, n)
	case TypeBool:
		return readArray[bool](d, et, n)
	case TypeUint64:
		return readArray[uint64](d, et, n)
	case TypeInt64:
		return readArray[int64](d, et, n)
	case TypeFloat64:
		return readArray[float64](d, et, n)
	case TypeUint16:
		return readArray[uint16](d, et, n)
	case TypeInt16:
		return readArray[int16](d, et, n)
	}
	d.err = fmt.Errorf("%w: array of value type %d at byte %d", ErrFormat, et, d.off)
	return nil
}

func readArray[T any](d *decoder, et ValueType, n int) []T {
	out := make([]T, 0, min(n, 1<<16))
	for i := 0; i < n && d.err == nil; i++ {
		v, _ := d.value(et).(T)
		out = append(out, v)
	}
	return out
}
