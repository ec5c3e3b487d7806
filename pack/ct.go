package pack

import (
	"encoding/json"
	"fmt"
	"math"
	"regexp"
	"sort"
	"strings"

	"github.com/llmq/llmq/actquant"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/nlpodyssey/safetensors"
)

// Names of compressed-tensors checkpoints and their formats.
const (
	MethodCT         = "compressed-tensors"
	CTPackQuantized  = "pack-quantized"
	CTFloatQuantized = "float-quantized"
	CTIntQuantized   = "int-quantized"
	CTMixed          = "mixed-precision"
)

// CTConfig is a compressed-tensors quantization_config.
type CTConfig struct {
	QuantMethod        string               `json:"quant_method"`
	Format             string               `json:"format"`
	ConfigGroups       map[string]*CTScheme `json:"config_groups"`
	Ignore             []string             `json:"ignore"`
	QuantizationStatus string               `json:"quantization_status,omitempty"`
	// KVCacheScheme must be absent or null: llmq does not quantize the
	// KV cache.
	KVCacheScheme          json.RawMessage `json:"kv_cache_scheme"`
	GlobalCompressionRatio *float64        `json:"global_compression_ratio"`
	// SparsityConfig must be absent, null or empty.
	SparsityConfig json.RawMessage `json:"sparsity_config,omitempty"`
	Meta           *QuantMeta      `json:"meta,omitempty"`

	groups []string       // config_groups' names, sorted
	ignore []*ctTarget    // compiled Ignore
	match  map[string]int // per group: compiled targets follow in targets
}

// CTScheme is one config group.
type CTScheme struct {
	Targets           []string `json:"targets"`
	Weights           *CTArgs  `json:"weights"`
	InputActivations  *CTArgs  `json:"input_activations"`
	OutputActivations *CTArgs  `json:"output_activations"`
	Format            string   `json:"format,omitempty"`

	targets []*ctTarget
}

// CTArgs is a QuantizationArgs. Pointers are the fields the format gives
// defaults for when they are absent (num_bits 8, type int, symmetric).
type CTArgs struct {
	NumBits        *int           `json:"num_bits"`
	Type           string         `json:"type"`
	Symmetric      *bool          `json:"symmetric"`
	GroupSize      *int           `json:"group_size"`
	Strategy       string         `json:"strategy"`
	BlockStructure any            `json:"block_structure"`
	Dynamic        any            `json:"dynamic"` // false, true or "local"
	Actorder       any            `json:"actorder"`
	Observer       *string        `json:"observer"`
	ObserverKwargs map[string]any `json:"observer_kwargs"`
}

type ctTarget struct {
	text string
	re   *regexp.Regexp // "re:" targets
}

// Priorities of a target's match: an exact name wins over a regular
// expression, which wins over a class name.
const (
	matchNone = iota
	matchClass
	matchRegexp
	matchName
)

func (t *ctTarget) match(name string) int {
	switch {
	case t.re != nil:
		if t.re.MatchString(name) {
			return matchRegexp
		}
	case t.text == name:
		return matchName
	case t.text == "Linear": // every layer llmq reads through a config is a linear layer
		return matchClass
	}
	return matchNone
}

func compileTarget(field, t string) (*ctTarget, error) {
	if p, ok := strings.CutPrefix(t, "re:"); ok {
		re, err := regexp.Compile("^(?:" + p + ")")
		if err != nil {
			return nil, fmt.Errorf("%s %q: %w", field, t, err)
		}
		return &ctTarget{text: t, re: re}, nil
	}
	return &ctTarget{text: t}, nil
}

// ints with their defaults.
func (a *CTArgs) bits() int {
	if a.NumBits == nil {
		return 8
	}
	return *a.NumBits
}

func (a *CTArgs) sym() bool { return a.Symmetric == nil || *a.Symmetric }

// normalize lowercases type and strategy and infers the strategy from the
// group size, as QuantizationArgs does; field names the args in errors.
func (a *CTArgs) normalize(field string) error {
	a.Type, a.Strategy = strings.ToLower(a.Type), strings.ToLower(a.Strategy)
	if a.Type == "" {
		a.Type = "int"
	}
	if a.Type != "int" && a.Type != "float" {
		return fmt.Errorf("%s.type %q: want int or float", field, a.Type)
	}
	if a.GroupSize != nil && *a.GroupSize < -1 {
		return fmt.Errorf("%s.group_size %d: want a positive size, or -1 (channel)", field, *a.GroupSize)
	}
	if a.Strategy == "" {
		switch {
		case a.GroupSize == nil:
			a.Strategy = "tensor"
		case *a.GroupSize > 0:
			a.Strategy = "group"
		case *a.GroupSize == -1:
			a.Strategy = "channel"
		default:
			return fmt.Errorf("%s.group_size %d: want a positive size, or -1 (channel)", field, *a.GroupSize)
		}
	}
	if a.Strategy == "group" && (a.GroupSize == nil || *a.GroupSize <= 0) {
		return fmt.Errorf("%s.strategy \"group\" needs a positive group_size", field)
	}
	return nil
}

// grid is the grid of weights with these args in the given format.
func (a *CTArgs) grid(field, format string) (Grid, error) {
	switch format {
	case CTPackQuantized:
		if a.Type != "int" {
			return Grid{}, fmt.Errorf("%s.type %q: format %s holds int weights", field, a.Type, format)
		}
		g := Grid{Bits: a.bits(), Sym: a.sym()}
		switch a.Strategy {
		case "group":
			g.GroupSize = *a.GroupSize
		case "channel":
			g.GroupSize = -1
		default:
			return Grid{}, fmt.Errorf("%s.strategy %q: llmq reads %s weights by group or channel", field, a.Strategy, format)
		}
		if err := g.Validate(0); err != nil {
			if ge, ok := err.(*GridError); ok && ge.Field == "bits" {
				return Grid{}, fmt.Errorf("%s.num_bits %d: want 2, 3, 4 or 8", field, ge.Value)
			}
			return Grid{}, fmt.Errorf("%s: %w", field, err)
		}
		return g, nil
	case CTIntQuantized:
		if a.Type != "int" || a.bits() != 8 {
			return Grid{}, fmt.Errorf("%s: type %q, num_bits %d: format %s holds int8 (type int, num_bits 8) weights", field, a.Type, a.bits(), format)
		}
		if a.Strategy != "channel" && a.Strategy != "tensor" {
			return Grid{}, fmt.Errorf("%s.strategy %q: llmq reads %s weights per tensor or per channel", field, a.Strategy, format)
		}
		// A per-tensor scale is read as the same scale for every channel.
		return Grid{Bits: 8, GroupSize: -1, Sym: a.sym()}, nil
	case CTFloatQuantized:
		if a.Type != "float" || a.bits() != 8 {
			return Grid{}, fmt.Errorf("%s: type %q, num_bits %d: format %s holds FP8 (type float, num_bits 8) weights", field, a.Type, a.bits(), format)
		}
		if !a.sym() {
			return Grid{}, fmt.Errorf("%s.symmetric false: FP8 weights are symmetric", field)
		}
		switch a.Strategy {
		case "tensor":
			return Grid{Bits: 8, GroupSize: -1, Sym: true, FP8: true, PerTensor: true}, nil
		case "channel":
			return Grid{Bits: 8, GroupSize: -1, Sym: true, FP8: true}, nil
		}
		return Grid{}, fmt.Errorf("%s.strategy %q: llmq reads FP8 weights per tensor or per channel", field, a.Strategy)
	}
	return Grid{}, fmt.Errorf("format %q is not supported (%s, %s, %s)", format, CTPackQuantized, CTFloatQuantized, CTIntQuantized)
}

// parseCT reads and checks a compressed-tensors quantization_config.
func parseCT(raw json.RawMessage) (*CTConfig, error) {
	var c CTConfig
	if err := json.Unmarshal(raw, &c); err != nil {
		return nil, err
	}
	if n := strings.TrimSpace(string(c.KVCacheScheme)); n != "" && n != "null" {
		return nil, fmt.Errorf("kv_cache_scheme: a quantized KV cache is not supported")
	}
	if n := strings.TrimSpace(string(c.SparsityConfig)); n != "" && n != "null" && n != "{}" {
		return nil, fmt.Errorf("sparsity_config: sparse checkpoints are not supported")
	}
	if len(c.ConfigGroups) == 0 {
		return nil, fmt.Errorf("config_groups: empty; nothing says how layers are quantized")
	}
	for _, t := range c.Ignore {
		ct, err := compileTarget("ignore", t)
		if err != nil {
			return nil, err
		}
		c.ignore = append(c.ignore, ct)
	}
	for name := range c.ConfigGroups {
		c.groups = append(c.groups, name)
	}
	sort.Strings(c.groups)
	for _, name := range c.groups {
		s := c.ConfigGroups[name]
		field := "config_groups." + name
		if s == nil {
			return nil, fmt.Errorf("%s: null scheme", field)
		}
		if len(s.Targets) == 0 {
			return nil, fmt.Errorf("%s.targets: empty", field)
		}
		for _, t := range s.Targets {
			ct, err := compileTarget(field+".targets", t)
			if err != nil {
				return nil, err
			}
			s.targets = append(s.targets, ct)
		}
		format := s.Format
		if format == "" {
			format = c.Format
		}
		if format == CTMixed || format == "" {
			return nil, fmt.Errorf("%s.format: missing (the config's format is %q)", field, c.Format)
		}
		if s.OutputActivations != nil {
			return nil, fmt.Errorf("%s.output_activations: output quantization is not supported", field)
		}
		if s.InputActivations != nil {
			if err := s.InputActivations.normalize(field + ".input_activations"); err != nil {
				return nil, err
			}
		}
		if s.Weights == nil {
			return nil, fmt.Errorf("%s.weights: missing (llmq reads weight quantization)", field)
		}
		if err := s.Weights.normalize(field + ".weights"); err != nil {
			return nil, err
		}
		if _, err := s.Weights.grid(field+".weights", format); err != nil {
			if strings.HasPrefix(err.Error(), "format ") {
				return nil, fmt.Errorf("%s: %w", field, err)
			}
			return nil, err
		}
	}
	return &c, nil
}

// scheme returns the group of a module (its name, its grid and format),
// ok false when no group targets it or it is ignored.
func (c *CTConfig) scheme(module string) (group string, g Grid, format string, ok bool) {
	for _, t := range c.ignore {
		if t.match(module) != matchNone {
			return "", Grid{}, "", false
		}
	}
	best := matchNone
	for _, name := range c.groups {
		for _, t := range c.ConfigGroups[name].targets {
			if p := t.match(module); p > best {
				best, group = p, name
			}
		}
	}
	if best == matchNone {
		return "", Grid{}, "", false
	}
	s := c.ConfigGroups[group]
	format = s.Format
	if format == "" {
		format = c.Format
	}
	g, _ = s.Weights.grid("", format) // checked by parseCT
	return group, g, format, true
}

// ctStored reports whether a layer is stored quantized in a
// compressed-tensors checkpoint.
func ctStored(ck *checkpoint.Checkpoint, prefix string) bool {
	return ck.Has(prefix+".weight_packed") || ck.Has(prefix+".weight_scale")
}

// Read reads one quantized layer of a compressed-tensors checkpoint.
func (c *CTConfig) Read(ck *checkpoint.Checkpoint, prefix string, in, out int) (*Linear, error) {
	group, g, format, ok := c.scheme(prefix)
	if !ok {
		return nil, fmt.Errorf("%s is stored quantized, but no config_groups target covers it (or ignore lists it)", prefix)
	}
	switch format {
	case CTPackQuantized:
		return ReadCTPacked(ck, prefix, in, out, g)
	case CTFloatQuantized:
		return ReadCTFloat(ck, prefix, in, out, g)
	case CTIntQuantized:
		return ReadCTInt8(ck, prefix, in, out, g)
	}
	return nil, fmt.Errorf("%s: config_groups.%s: format %q is not supported", prefix, group, format)
}

// ctPackFactor is the number of b-bit values in an int32 word.
func ctPackFactor(b int) int { return 32 / b }

// ReadCTPacked reads a layer in compressed-tensors' pack-quantized format.
func ReadCTPacked(ck *checkpoint.Checkpoint, prefix string, in, out int, grid Grid) (*Linear, error) {
	if err := grid.Validate(in); err != nil {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	b := grid.Bits
	p := ctPackFactor(b)
	l := &Linear{In: in, Out: out, Grid: grid}
	G := l.Groups()
	if err := checkWeightShape(ck, prefix+".weight_shape", out, in); err != nil {
		return nil, err
	}
	cols := (in + p - 1) / p
	qw, err := int32Tensor(ck, prefix+".weight_packed", out, cols)
	if err != nil {
		return nil, err
	}
	l.Q = make([]uint8, out*in)
	mask := uint32(1)<<b - 1
	for o := 0; o < out; o++ {
		for i := 0; i < in; i++ {
			l.Q[o*in+i] = uint8(uint32(qw[o*cols+i/p]) >> (b * (i % p)) & mask)
		}
	}
	s, err := ck.Float32(prefix+".weight_scale", out, G)
	if err != nil {
		return nil, err
	}
	l.Scale = transpose(s, out, G)
	offset := uint8(1) << (b - 1)
	l.Zero = make([]uint8, G*out)
	if grid.Sym {
		for i := range l.Zero {
			l.Zero[i] = offset
		}
	} else if l.Zero, err = readCTZeros(ck, prefix+".weight_zero_point", out, G, b); err != nil {
		return nil, err
	}
	if l.GIdx, err = readCTGIdx(ck, prefix+".weight_g_idx", in, G); err != nil {
		return nil, err
	}
	if l.GIdx == nil {
		l.GIdx = SequentialGIdx(in, grid.Group(in))
	}
	return l, nil
}

// readCTZeros reads an asymmetric layer's zero points as llmq's unsigned
// zeros [G][out]: packed int32 [⌈out/p⌉, G] (stored as zero + 2^(b−1)), or
// unpacked signed int8 [out, G].
func readCTZeros(ck *checkpoint.Checkpoint, name string, out, G, b int) ([]uint8, error) {
	t, err := ck.Tensor(name)
	if err != nil {
		return nil, fmt.Errorf("asymmetric weights need their zero points: %w", err)
	}
	z := make([]uint8, G*out)
	offset := 1 << (b - 1)
	switch t.DType {
	case safetensors.I32:
		p := ctPackFactor(b)
		rows := (out + p - 1) / p
		if err := t.CheckShape(rows, G); err != nil {
			return nil, err
		}
		v, err := t.Int32()
		if err != nil {
			return nil, err
		}
		mask := uint32(1)<<b - 1
		for o := 0; o < out; o++ {
			for g := 0; g < G; g++ {
				z[g*out+o] = uint8(uint32(v[(o/p)*G+g]) >> (b * (o % p)) & mask)
			}
		}
	case safetensors.I8:
		if t.Float8 {
			return nil, fmt.Errorf("tensor %q in %s: dtype %s, expected I32 (packed) or I8", name, t.File, t.DTypeName())
		}
		if err := t.CheckShape(out, G); err != nil {
			return nil, err
		}
		for o := 0; o < out; o++ {
			for g := 0; g < G; g++ {
				v := int(int8(t.Data[o*G+g]))
				if v < -offset || v >= offset {
					return nil, fmt.Errorf("tensor %q in %s: zero point %d at [%d, %d] is outside the %d-bit range [%d, %d]", name, t.File, v, o, g, b, -offset, offset-1)
				}
				z[g*out+o] = uint8(v + offset)
			}
		}
	default:
		return nil, fmt.Errorf("tensor %q in %s: dtype %s, expected I32 (packed) or I8", name, t.File, t.DTypeName())
	}
	return z, nil
}

// readCTGIdx reads weight_g_idx when present and not the "unset" value
// (all −1); nil otherwise.
func readCTGIdx(ck *checkpoint.Checkpoint, name string, in, G int) ([]int32, error) {
	if !ck.Has(name) {
		return nil, nil
	}
	gi, err := int32Tensor(ck, name, in)
	if err != nil {
		return nil, err
	}
	unset := 0
	for i, g := range gi {
		if g == -1 {
			unset++
			continue
		}
		if g < 0 || int(g) >= G {
			return nil, fmt.Errorf("%s[%d] = %d is outside [0, %d)", name, i, g, G)
		}
	}
	switch unset {
	case 0:
		return gi, nil
	case in:
		return nil, nil
	}
	return nil, fmt.Errorf("%s: %d of %d entries are -1 (unset), the others are not", name, unset, in)
}

// checkWeightShape checks weight_shape (int32 or int64 [2]) against the
// layer's shape.
func checkWeightShape(ck *checkpoint.Checkpoint, name string, out, in int) error {
	t, err := ck.Tensor(name)
	if err != nil {
		return err
	}
	if err := t.CheckShape(2); err != nil {
		return err
	}
	var shape [2]int64
	switch {
	case t.DType == safetensors.I64:
		for i := range shape {
			shape[i] = int64(le64(t.Data[8*i:]))
		}
	case t.DType == safetensors.I32:
		v, _ := t.Int32()
		shape = [2]int64{int64(v[0]), int64(v[1])}
	default:
		return fmt.Errorf("tensor %q in %s: dtype %s, expected I64 or I32", name, t.File, t.DTypeName())
	}
	if shape != [2]int64{int64(out), int64(in)} {
		return fmt.Errorf("tensor %q in %s: the layer is %v, the model's config wants [%d %d]", name, t.File, shape, out, in)
	}
	return nil
}

func le64(b []byte) uint64 {
	return uint64(b[0]) | uint64(b[1])<<8 | uint64(b[2])<<16 | uint64(b[3])<<24 |
		uint64(b[4])<<32 | uint64(b[5])<<40 | uint64(b[6])<<48 | uint64(b[7])<<56
}

// transpose turns [rows][cols] into [cols][rows].
func transpose(v []float32, rows, cols int) []float32 {
	t := make([]float32, len(v))
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c++ {
			t[c*rows+r] = v[r*cols+c]
		}
	}
	return t
}

// ReadCTInt8 reads an int8 layer in compressed-tensors' int-quantized
// format (llm-compressor's W8A8 INT8): weight int8 [out, in] holding the
// signed values, weight_scale [out, 1] (or one scale), and when asymmetric
// weight_zero_point int8 of the same shape. Values and zeros are shifted by
// 128 into llmq's unsigned codes.
func ReadCTInt8(ck *checkpoint.Checkpoint, prefix string, in, out int, grid Grid) (*Linear, error) {
	name := prefix + ".weight"
	t, err := ck.Tensor(name)
	if err != nil {
		return nil, err
	}
	if t.DType != safetensors.I8 {
		return nil, fmt.Errorf("tensor %q in %s: dtype %s, expected I8", name, t.File, t.DTypeName())
	}
	if err := t.CheckShape(out, in); err != nil {
		return nil, err
	}
	l := &Linear{In: in, Out: out, Grid: grid, Q: make([]uint8, out*in), Zero: make([]uint8, out), GIdx: make([]int32, in)}
	for i, b := range t.Data {
		l.Q[i] = b ^ 0x80 // int8 v → v + 128
	}
	if l.Scale, err = perOutput(ck, prefix+".weight_scale", out); err != nil {
		return nil, err
	}
	for i := range l.Zero {
		l.Zero[i] = 128
	}
	if !grid.Sym {
		zt, err := ck.Tensor(prefix + ".weight_zero_point")
		if err != nil {
			return nil, fmt.Errorf("asymmetric weights need their zero points: %w", err)
		}
		if zt.DType != safetensors.I8 || (zt.Numel() != out && zt.Numel() != 1) {
			return nil, fmt.Errorf("tensor %q in %s: %s %v, expected I8 with one zero point per output (or one)", zt.Name, zt.File, zt.DTypeName(), zt.Shape)
		}
		for o := range l.Zero {
			l.Zero[o] = zt.Data[o%zt.Numel()] ^ 0x80
		}
	}
	for i, v := range l.Scale {
		if !(v > 0) || math.IsInf(float64(v), 0) {
			return nil, fmt.Errorf("tensor %q: scale %v at %d: want a positive finite scale", prefix+".weight_scale", v, i)
		}
	}
	return l, nil
}

// perOutput reads a scale tensor holding one value per output ([out, 1] or
// [out]) or one for the layer ([1] or a scalar), as a value per output.
func perOutput(ck *checkpoint.Checkpoint, name string, out int) ([]float32, error) {
	t, err := ck.Tensor(name)
	if err != nil {
		return nil, err
	}
	if t.Numel() != out && t.Numel() != 1 || len(t.Shape) > 2 {
		return nil, fmt.Errorf("tensor %q in %s: shape %v, expected [%d, 1] or one value", name, t.File, t.Shape, out)
	}
	v, err := ck.Float32(name, t.Shape...)
	if err != nil {
		return nil, err
	}
	if len(v) == out {
		return v, nil
	}
	s := make([]float32, out)
	for i := range s {
		s[i] = v[0]
	}
	return s, nil
}

// ReadCTFloat reads an FP8 layer in compressed-tensors' float-quantized
// format.
func ReadCTFloat(ck *checkpoint.Checkpoint, prefix string, in, out int, grid Grid) (*Linear, error) {
	name := prefix + ".weight"
	t, err := ck.Tensor(name)
	if err != nil {
		return nil, err
	}
	if !t.Float8 {
		return nil, fmt.Errorf("tensor %q in %s: dtype %s, expected %s", name, t.File, t.DTypeName(), checkpoint.DTypeF8E4M3)
	}
	if err := t.CheckShape(out, in); err != nil {
		return nil, err
	}
	for i, c := range t.Data {
		if c&0x7f == 0x7f {
			return nil, fmt.Errorf("tensor %q in %s: element %d is NaN (code %#x)", name, t.File, i, c)
		}
	}
	st, err := ck.Tensor(prefix + ".weight_scale")
	if err != nil {
		return nil, err
	}
	var s []float32
	if grid.PerTensor {
		if st.Numel() != 1 || len(st.Shape) > 2 {
			return nil, fmt.Errorf("tensor %q in %s: shape %v, expected one scale (per-tensor strategy)", st.Name, st.File, st.Shape)
		}
		one, err := ck.Float32(st.Name, st.Shape...)
		if err != nil {
			return nil, err
		}
		s = make([]float32, out)
		for i := range s {
			s[i] = one[0]
		}
	} else if s, err = ck.Float32(st.Name, out, 1); err != nil {
		return nil, err
	}
	for i, v := range s {
		if !(v > 0) || math.IsInf(float64(v), 0) {
			return nil, fmt.Errorf("tensor %q in %s: scale %v at %d: want a positive finite scale", st.Name, st.File, v, i)
		}
	}
	l := &Linear{In: in, Out: out, Grid: grid, Q: append([]uint8(nil), t.Data...), Scale: s,
		Zero: make([]uint8, out), GIdx: make([]int32, in)}
	if ck.Has(prefix + ".input_scale") {
		it, _ := ck.Tensor(prefix + ".input_scale")
		if it.Numel() != 1 || len(it.Shape) > 1 {
			return nil, fmt.Errorf("tensor %q in %s: shape %v, expected one static input scale", it.Name, it.File, it.Shape)
		}
		v, err := ck.Float32(it.Name, it.Shape...)
		if err != nil {
			return nil, err
		}
		if !(v[0] > 0) {
			return nil, fmt.Errorf("tensor %q in %s: input scale %v: want a positive finite scale", it.Name, it.File, v[0])
		}
		l.InputScale = v[0]
	}
	return l, nil
}

// CTTensors lays the layer out in compressed-tensors' format for its grid:
// float-quantized for FP8, else pack-quantized (scales in F16, which holds
// llmq's scales exactly, weight_shape in I64 as the reference compressor
// writes it, weight_g_idx only for act-order).
func (l *Linear) CTTensors(prefix string) (map[string]checkpoint.Out, error) {
	if l.Grid.FP8 {
		t := map[string]checkpoint.Out{prefix + ".weight": checkpoint.F8E4M3(l.Q, l.Out, l.In)}
		if l.Grid.PerTensor {
			t[prefix+".weight_scale"] = checkpoint.F32(l.Scale[:1], 1)
		} else {
			t[prefix+".weight_scale"] = checkpoint.F32(l.Scale, l.Out, 1)
		}
		if l.InputScale > 0 {
			t[prefix+".input_scale"] = checkpoint.F32([]float32{l.InputScale}, 1)
		}
		return t, nil
	}
	b := l.Grid.Bits
	p := ctPackFactor(b)
	G := l.Groups()
	offset := uint8(1) << (b - 1)
	cols := (l.In + p - 1) / p
	packed := make([]int32, l.Out*cols)
	for o := 0; o < l.Out; o++ {
		for i := 0; i < l.In; i++ {
			packed[o*cols+i/p] |= int32(uint32(l.Q[o*l.In+i]) << (b * (i % p)))
		}
	}
	t := map[string]checkpoint.Out{
		prefix + ".weight_packed": checkpoint.I32(packed, l.Out, cols),
		prefix + ".weight_scale":  checkpoint.F16(transpose(l.Scale, G, l.Out), l.Out, G),
		prefix + ".weight_shape":  checkpoint.I64([]int64{int64(l.Out), int64(l.In)}, 2),
	}
	if l.Grid.Sym {
		for i, z := range l.Zero {
			if z != offset {
				return nil, fmt.Errorf("%s: symmetric layer with zero %d at %d: compressed-tensors stores none, implying %d", prefix, z, i, offset)
			}
		}
	} else {
		rows := (l.Out + p - 1) / p
		zp := make([]int32, rows*G)
		for g := 0; g < G; g++ {
			for o := 0; o < l.Out; o++ {
				zp[(o/p)*G+g] |= int32(uint32(l.Zero[g*l.Out+o]) << (b * (o % p)))
			}
		}
		t[prefix+".weight_zero_point"] = checkpoint.I32(zp, rows, G)
	}
	group := l.Grid.Group(l.In)
	for i, g := range l.GIdx {
		if int(g) != i/group {
			t[prefix+".weight_g_idx"] = checkpoint.I32(l.GIdx, l.In)
			break
		}
	}
	return t, nil
}

// FP8 quantizes w [out][in] to FP8 E4M3 with one scale per output channel,
// or one for the whole layer: scale = max|w| / 448 (E4M3's largest value;
// 1 for an all-zero row or layer), codes = e4m3(w / scale), rounded to
// nearest even and saturating.
func FP8(w []float32, out, in int, perTensor bool) (*Linear, error) {
	if len(w) != out*in {
		return nil, fmt.Errorf("FP8: %d weights for %d×%d", len(w), out, in)
	}
	if err := CheckFinite(w); err != nil {
		return nil, err
	}
	l := &Linear{In: in, Out: out, Grid: Grid{Bits: 8, GroupSize: -1, Sym: true, FP8: true, PerTensor: perTensor},
		Q: make([]uint8, out*in), Scale: make([]float32, out), Zero: make([]uint8, out), GIdx: make([]int32, in)}
	scaleOf := func(v []float32) float32 {
		var m float32
		for _, x := range v {
			m = max(m, float32(math.Abs(float64(x))))
		}
		if m == 0 {
			return 1
		}
		return m / actquant.E4M3Max
	}
	var all float32
	if perTensor {
		all = scaleOf(w)
	}
	for o := 0; o < out; o++ {
		row := w[o*in : (o+1)*in]
		s := all
		if !perTensor {
			s = scaleOf(row)
		}
		l.Scale[o] = s
		for i, x := range row {
			l.Q[o*in+i] = actquant.EncodeE4M3(x / s)
		}
	}
	return l, nil
}
