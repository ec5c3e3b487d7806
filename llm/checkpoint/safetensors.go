package checkpoint

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/llmq/llmq/llm/mat"
	"github.com/nlpodyssey/safetensors"
	"github.com/x448/float16"
)

// Tensor is a view of one tensor in a memory-mapped safetensors file.
type Tensor struct {
	Name  string
	File  string // the file it lives in, for error messages
	DType safetensors.DType
	Shape []int
	Data  []byte // little-endian, row-major; aliases the mapping
	// Float8 marks a tensor stored as "F8_E4M3" (PyTorch's float8_e4m3fn:
	// one byte an element, decoded by the reader that knows its scale).
	// The safetensors library has no such dtype: DType is then U8.
	Float8 bool
}

// DTypeName is the dtype as the file names it ("F8_E4M3" for Float8).
func (t Tensor) DTypeName() string {
	if t.Float8 {
		return DTypeF8E4M3
	}
	return t.DType.String()
}

// DTypeF8E4M3 is safetensors' name for FP8 E4M3 (float8_e4m3fn).
const DTypeF8E4M3 = "F8_E4M3"

// Numel is the number of elements.
func (t Tensor) Numel() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// File is one opened safetensors file.
type File struct {
	Path string
	st   safetensors.SafeTensors
	m    *mapping
	f8   map[string]bool // tensors stored as F8_E4M3
}

// OpenFile maps a safetensors file and validates its header: header length
// within the file, JSON well formed, tensor offsets contiguous and matching
// dtype × shape, and the data ending exactly at the end of the file.
func OpenFile(path string) (*File, error) {
	m, err := mapFile(path)
	if err != nil {
		return nil, err
	}
	f8, err := checkHeader(m.data)
	if err != nil {
		m.close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(f8) > 0 {
		// The library refuses F8_E4M3: map the file copy-on-write and
		// rename those dtypes U8 in the private copy of the header (same
		// length, padded with JSON spaces); the file is not touched.
		m.close()
		if m, err = mapFilePrivate(path); err != nil {
			return nil, err
		}
		patchF8(m.data)
	}
	st, err := safetensors.Deserialize(m.data)
	if err != nil {
		m.close()
		return nil, fmt.Errorf("%s: invalid safetensors file: %w", path, err)
	}
	return &File{Path: path, st: st, m: m, f8: f8}, nil
}

// f8Field and u8Field have the same length, so that replacing one by the
// other in a header keeps every offset.
var (
	f8Field = []byte(`"F8_E4M3"`)
	u8Field = []byte(`"U8"     `)
)

// patchF8 renames every "F8_E4M3" dtype of the header in buf to U8. (The
// string can only occur as a dtype value: a tensor name holding it is
// refused by checkHeader.)
func patchF8(buf []byte) {
	n := binary.LittleEndian.Uint64(buf[:8])
	hdr := buf[8 : 8+n]
	for i := bytes.Index(hdr, f8Field); i >= 0; i = bytes.Index(hdr, f8Field) {
		copy(hdr[i:], u8Field)
	}
}

// checkHeader gives precise messages for the common ways a file is broken
// (truncated downloads above all) before the library's generic validation.
// It returns the set of tensors stored as F8_E4M3.
func checkHeader(buf []byte) (map[string]bool, error) {
	if len(buf) < 8 {
		return nil, fmt.Errorf("file is %d bytes, too short for a safetensors header (8-byte length + JSON)", len(buf))
	}
	n := binary.LittleEndian.Uint64(buf[:8])
	if n > uint64(len(buf)-8) {
		return nil, fmt.Errorf("header length %d runs past the end of the file (%d bytes): truncated or not a safetensors file", n, len(buf))
	}
	var hdr map[string]json.RawMessage
	if err := json.Unmarshal(buf[8:8+n], &hdr); err != nil {
		return nil, fmt.Errorf("header is not valid JSON: %w", err)
	}
	var f8 map[string]bool
	if bytes.Contains(buf[8:8+n], f8Field) {
		f8 = map[string]bool{}
	}
	var end uint64
	for name, raw := range hdr {
		if name == "__metadata__" {
			continue
		}
		var info struct {
			DType       string    `json:"dtype"`
			DataOffsets [2]uint64 `json:"data_offsets"`
		}
		if err := json.Unmarshal(raw, &info); err != nil {
			return nil, fmt.Errorf("tensor %q: malformed header entry: %w", name, err)
		}
		if name == DTypeF8E4M3 && f8 != nil {
			return nil, fmt.Errorf("tensor %q: a name holding %q is not supported in a file with FP8 tensors", name, DTypeF8E4M3)
		}
		if info.DType == DTypeF8E4M3 {
			f8[name] = true
		} else if _, err := safetensors.ParseDType(info.DType); err != nil {
			return nil, fmt.Errorf("tensor %q: unsupported dtype %q", name, info.DType)
		}
		end = max(end, info.DataOffsets[1])
	}
	if f8 != nil {
		if raw, ok := hdr["__metadata__"]; ok && bytes.Contains(raw, f8Field) {
			return nil, fmt.Errorf("__metadata__ holding %q is not supported in a file with FP8 tensors", DTypeF8E4M3)
		}
	}
	have := uint64(len(buf)) - 8 - n
	if end > have {
		return nil, fmt.Errorf("truncated: tensors need %d bytes of data, the file has %d", end, have)
	}
	return f8, nil
}

// Names lists the tensors in the file, sorted.
func (f *File) Names() []string {
	names := f.st.Names()
	sort.Strings(names)
	return names
}

// Tensor returns the named tensor; ok is false when it is absent.
func (f *File) Tensor(name string) (Tensor, bool) {
	v, ok := f.st.Tensor(name)
	if !ok {
		return Tensor{}, false
	}
	shape := make([]int, len(v.Shape()))
	for i, d := range v.Shape() {
		shape[i] = int(d)
	}
	return Tensor{Name: name, File: f.Path, DType: v.DType(), Shape: shape, Data: v.Data(), Float8: f.f8[name]}, true
}

// Close unmaps the file; tensors taken from it must not be used afterwards.
func (f *File) Close() error { return f.m.close() }

// ToFloat32 decodes a BF16, F16 or F32 tensor into dst (len = Numel).
func (t Tensor) ToFloat32(dst []float32) error {
	n := t.Numel()
	if len(dst) != n {
		return fmt.Errorf("tensor %q in %s: destination has %d elements, tensor %d", t.Name, t.File, len(dst), n)
	}
	if t.Float8 {
		return fmt.Errorf("tensor %q in %s: dtype %s holds FP8 codes that need their weight_scale (read it through its quantization_config)", t.Name, t.File, DTypeF8E4M3)
	}
	var convert func(lo, hi int)
	switch t.DType {
	case safetensors.BF16:
		convert = func(lo, hi int) {
			for i := lo; i < hi; i++ {
				dst[i] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(t.Data[2*i:])) << 16)
			}
		}
	case safetensors.F16:
		convert = func(lo, hi int) {
			for i := lo; i < hi; i++ {
				dst[i] = float16.Frombits(binary.LittleEndian.Uint16(t.Data[2*i:])).Float32()
			}
		}
	case safetensors.F32:
		convert = func(lo, hi int) {
			for i := lo; i < hi; i++ {
				dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:]))
			}
		}
	default:
		return fmt.Errorf("tensor %q in %s: dtype %s is not supported for weights (BF16, F16, F32)", t.Name, t.File, t.DType)
	}
	mat.ParallelFor(len(dst), 1<<16, convert) // large tensors are read in parallel
	return nil
}

// Int32 decodes an I32 tensor.
func (t Tensor) Int32() ([]int32, error) {
	if t.DType != safetensors.I32 {
		return nil, fmt.Errorf("tensor %q in %s: dtype %s, expected I32", t.Name, t.File, t.DType)
	}
	out := make([]int32, t.Numel())
	for i := range out {
		out[i] = int32(binary.LittleEndian.Uint32(t.Data[4*i:]))
	}
	return out, nil
}

// CheckShape returns an error naming the tensor and file unless the tensor
// has exactly the wanted shape.
func (t Tensor) CheckShape(want ...int) error {
	if len(want) != len(t.Shape) {
		return fmt.Errorf("tensor %q in %s: shape %v, expected %v", t.Name, t.File, t.Shape, want)
	}
	for i := range want {
		if want[i] != t.Shape[i] {
			return fmt.Errorf("tensor %q in %s: shape %v, expected %v", t.Name, t.File, t.Shape, want)
		}
	}
	return nil
}

// Checkpoint is a model directory: its config and its weights, in one
// model.safetensors or in shards listed by model.safetensors.index.json.
type Checkpoint struct {
	Dir    string
	Config *Config
	files  []*File
	byName map[string]*File
	// alias maps the language model's usual names to those a multimodal
	// checkpoint stores them under (Gemma3ForConditionalGeneration).
	alias map[string]string
}

// ErrNoTensor is wrapped by Checkpoint.Tensor when a tensor is absent.
var ErrNoTensor = errors.New("tensor not found")

// Open reads dir/config.json and maps the weights. A quantized checkpoint
// whose config.json has no quantization_config may carry it in the file
// older quantizers wrote beside it (LegacyQuantConfigs).
func Open(dir string) (*Checkpoint, error) {
	cfg, err := LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	if cfg.Quantization == nil {
		if cfg.Quantization, cfg.QuantizationFile, err = legacyQuantConfig(dir); err != nil {
			return nil, err
		}
	}
	paths, err := WeightFiles(dir)
	if err != nil {
		return nil, err
	}
	c, err := OpenFiles(cfg, paths...)
	if err != nil {
		return nil, err
	}
	c.Dir = dir
	return c, nil
}

// LegacyQuantConfigs are the files where quantizers wrote their settings
// before they went into config.json: AutoGPTQ (until early 2024) and
// AutoAWQ (before 0.1.7).
var LegacyQuantConfigs = []string{"quantize_config.json", "quant_config.json"}

// legacyQuantConfig returns the first legacy settings file's JSON and name.
func legacyQuantConfig(dir string) (json.RawMessage, string, error) {
	for _, name := range LegacyQuantConfigs {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, "", err
		}
		if !json.Valid(data) {
			return nil, "", fmt.Errorf("%s: invalid JSON", filepath.Join(dir, name))
		}
		return json.RawMessage(data), name, nil
	}
	return nil, "", nil
}

// WeightFiles lists the safetensors files of a model directory: the shards
// named by model.safetensors.index.json, else model.safetensors, else the
// directory's only .safetensors file (AutoGPTQ named it
// gptq_model-4bit-128g.safetensors).
func WeightFiles(dir string) ([]string, error) {
	index := filepath.Join(dir, "model.safetensors.index.json")
	data, err := os.ReadFile(index)
	if errors.Is(err, os.ErrNotExist) {
		single := filepath.Join(dir, "model.safetensors")
		if _, err := os.Stat(single); err == nil {
			return []string{single}, nil
		}
		all, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
		switch len(all) {
		case 0:
			return nil, fmt.Errorf("no weights in %s: no model.safetensors.index.json and no .safetensors file", dir)
		case 1:
			return all, nil
		}
		for i := range all {
			all[i] = filepath.Base(all[i])
		}
		return nil, fmt.Errorf("%s holds %d .safetensors files (%s) but no model.safetensors.index.json saying which are the model's shards",
			dir, len(all), strings.Join(all, ", "))
	}
	if err != nil {
		return nil, fmt.Errorf("reading shard index: %w", err)
	}
	var idx struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(data, &idx); err != nil {
		return nil, fmt.Errorf("%s: invalid JSON: %w", index, err)
	}
	if len(idx.WeightMap) == 0 {
		return nil, fmt.Errorf("%s: empty weight_map", index)
	}
	seen := map[string]bool{}
	var paths []string
	for tensor, shard := range idx.WeightMap {
		if seen[shard] {
			continue
		}
		seen[shard] = true
		if filepath.Base(shard) != shard {
			return nil, fmt.Errorf("%s: shard %q for tensor %q is not a plain file name", index, shard, tensor)
		}
		p := filepath.Join(dir, shard)
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("%s names shard %s (for tensor %q), which is missing: %w", index, shard, tensor, err)
		}
		paths = append(paths, p)
	}
	sort.Strings(paths)
	return paths, nil
}

// Has reports whether the checkpoint holds the named tensor.
func (c *Checkpoint) Has(name string) bool { _, ok := c.byName[c.stored(name)]; return ok }

// stored is the name a tensor is stored under: name itself, or where a
// multimodal checkpoint keeps its language model's tensors.
func (c *Checkpoint) stored(name string) string {
	if s, ok := c.alias[name]; ok {
		return s
	}
	return name
}

// textPrefixes are where Gemma3ForConditionalGeneration checkpoints keep
// the language model's "model." tensors (transformers 4 and 5 layouts)
// and its lm_head.
var textPrefixes = []struct{ stored, as string }{
	{"language_model.model.", "model."}, {"model.language_model.", "model."}, {"language_model.lm_head.", "lm_head."},
}

// aliasText lets the language model of a multimodal checkpoint be read
// under the text model's names; the vision tower's tensors stay unread.
func (c *Checkpoint) aliasText() {
	c.alias = map[string]string{}
	for n := range c.byName {
		for _, p := range textPrefixes {
			if strings.HasPrefix(n, p.stored) {
				c.alias[p.as+n[len(p.stored):]] = n
			}
		}
	}
}

// Names lists every tensor in the checkpoint, sorted.
func (c *Checkpoint) Names() []string {
	names := make([]string, 0, len(c.byName))
	for n := range c.byName {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Tensor finds a tensor in whichever shard holds it.
func (c *Checkpoint) Tensor(name string) (Tensor, error) {
	f, ok := c.byName[c.stored(name)]
	if !ok {
		return Tensor{}, fmt.Errorf("%s: %w: %q", c.Dir, ErrNoTensor, name)
	}
	t, _ := f.Tensor(c.stored(name))
	return t, nil
}

// Float32 decodes the named tensor to float32 after checking its shape.
func (c *Checkpoint) Float32(name string, shape ...int) ([]float32, error) {
	t, err := c.Tensor(name)
	if err != nil {
		return nil, err
	}
	if err := t.CheckShape(shape...); err != nil {
		return nil, err
	}
	out := make([]float32, t.Numel())
	if err := t.ToFloat32(out); err != nil {
		return nil, err
	}
	if i := NonFinite(out); i >= 0 {
		return nil, fmt.Errorf("tensor %q: element %d is %v; weights must be finite", name, i, out[i])
	}
	return out, nil
}

// NonFinite is the index of the first NaN or ±Inf in x, or −1. (A bf16 or
// fp16 value that overflowed is stored as Inf, so this catches it.)
func NonFinite(x []float32) int {
	const chunk = 1 << 16
	first := make([]int, (len(x)+chunk-1)/chunk)
	mat.ParallelFor(len(first), 1, func(lo, hi int) {
		for c := lo; c < hi; c++ {
			first[c] = -1
			for i, v := range x[c*chunk : min(len(x), (c+1)*chunk)] {
				if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
					first[c] = c*chunk + i
					break
				}
			}
		}
	})
	for _, i := range first {
		if i >= 0 {
			return i
		}
	}
	return -1
}

// SizeOnDisk is the total size of the weight files in bytes.
func (c *Checkpoint) SizeOnDisk() int64 {
	var n int64
	for _, f := range c.files {
		n += int64(len(f.m.data))
	}
	return n
}

// DTypes counts tensors by dtype.
func (c *Checkpoint) DTypes() map[string]int {
	out := map[string]int{}
	for n, f := range c.byName {
		t, _ := f.Tensor(n)
		out[t.DTypeName()]++
	}
	return out
}

// Close unmaps every file.
func (c *Checkpoint) Close() error {
	var first error
	for _, f := range c.files {
		if err := f.Close(); err != nil && first == nil {
			first = err
		}
	}
	c.files = nil
	return first
}

// OpenFiles maps the given safetensors files as one checkpoint with the
// given config (a part of one, e.g. a quantization run's finished block).
func OpenFiles(cfg *Config, paths ...string) (*Checkpoint, error) {
	c := &Checkpoint{Dir: filepath.Dir(paths[0]), Config: cfg, byName: map[string]*File{}}
	for _, p := range paths {
		f, err := OpenFile(p)
		if err != nil {
			c.Close()
			return nil, err
		}
		c.files = append(c.files, f)
		for _, n := range f.st.Names() {
			c.byName[n] = f
		}
	}
	if cfg != nil && cfg.Architecture == "Gemma3ForConditionalGeneration" {
		c.aliasText()
	}
	return c, nil
}
