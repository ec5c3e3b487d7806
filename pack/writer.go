package pack

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/nlpodyssey/safetensors"
)

// Writer writes a checkpoint one part at a time (a decoder block's
// tensors, say) into a temporary directory beside the destination. Finish
// gathers the parts into shards of at most MaxShardBytes, writes the index
// and config, and renames the directory into place: an interrupted run
// leaves nothing behind.
type Writer struct {
	final, tmp string
	force      bool
	// MaxShardBytes bounds a shard's tensor data (DefaultMaxShardBytes
	// when 0). A part is never split: one larger than the bound is a shard
	// of its own.
	MaxShardBytes int64
	parts         []part
	Format        string         // GPTQ checkpoint format of the layers written so far
	zbits         map[string]int // bit width of each .qzeros laid out, for the v2 switch
	Bytes         int64          // bytes of tensor data written
	// Card, if set, is written as the output's README.md (a model card).
	Card string
	kept bool // Abort leaves tmp: Finish could not move it into place, or Keep was called
}

// part is one WritePart call's file in the temporary directory.
type part struct {
	file  string
	bytes int64
}

// DefaultMaxShardBytes is the ecosystem's default shard size
// (transformers' save_pretrained: "5GB").
const DefaultMaxShardBytes = 5_000_000_000

// Marker is the file an llmq output directory holds; NewWriter replaces
// an existing directory only when it has one (or is empty, or is an
// earlier llmq output by its config).
const Marker = ".llmq-output"

// ErrNoOutput is NewWriter's error for an empty output directory name.
var ErrNoOutput = errors.New("no output directory given")

// NewWriter prepares to write a checkpoint to dir. An existing dir is an
// error (wrapping fs.ErrExist) unless force is set; even then only an
// empty directory or an earlier llmq output is replaced (at Finish), never
// anything else. The parts go to PartialDir(dir); one left there by an
// interrupted run is an error (ErrPartial) unless force is set, which
// starts over.
func NewWriter(dir string, force bool) (*Writer, error) {
	if dir == "" {
		return nil, ErrNoOutput
	}
	if st, err := os.Stat(dir); err == nil {
		if !force {
			return nil, fmt.Errorf("output directory %s: %w", dir, fs.ErrExist)
		}
		if !st.IsDir() {
			return nil, fmt.Errorf("output %s exists and is not a directory; not replacing it", dir)
		}
		if err := replaceable(dir); err != nil {
			return nil, err
		}
	}
	tmp := PartialDir(dir)
	if _, err := os.Stat(tmp); err == nil {
		if !force {
			return nil, fmt.Errorf("%s holds an interrupted run's parts: %w", tmp, ErrPartial)
		}
		if err := os.RemoveAll(tmp); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return nil, err
	}
	return &Writer{final: dir, tmp: tmp, force: force, Format: FormatGPTQ}, nil
}

// ErrPartial is NewWriter's error when an interrupted run's parts are
// waiting to be resumed.
var ErrPartial = errors.New("an interrupted run can be resumed")

// PartialDir is where the parts of dir are written until Finish renames it
// into place: a hidden directory beside it.
func PartialDir(dir string) string {
	clean := filepath.Clean(dir)
	return filepath.Join(filepath.Dir(clean), "."+filepath.Base(clean)+".partial")
}

// writerState is what Save records in the partial directory.
type writerState struct {
	Parts  []savedPart     `json:"parts"`
	Format string          `json:"format"`
	ZBits  map[string]int  `json:"zero_bits,omitempty"`
	Bytes  int64           `json:"bytes"`
	Caller json.RawMessage `json:"progress"`
}

type savedPart struct {
	File  string `json:"file"`
	Bytes int64  `json:"bytes"`
}

const stateFile = ".llmq-partial.json"

// Save records the writer's state and the caller's progress in the
// partial directory (atomically), so that ResumeWriter can continue after
// the parts written so far.
func (w *Writer) Save(progress any) error {
	raw, err := json.Marshal(progress)
	if err != nil {
		return err
	}
	st := writerState{Format: w.Format, ZBits: w.zbits, Bytes: w.Bytes, Caller: raw}
	for _, p := range w.parts {
		st.Parts = append(st.Parts, savedPart{File: p.file, Bytes: p.bytes})
	}
	data, err := json.Marshal(st)
	if err != nil {
		return err
	}
	tmp := filepath.Join(w.tmp, stateFile+".tmp")
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(w.tmp, stateFile))
}

// Keep makes Abort leave the partial directory for a later ResumeWriter
// (an interrupted run).
func (w *Writer) Keep() { w.kept = true }

// ResumeWriter reopens the partial directory of dir left by an
// interrupted run and decodes the progress its caller saved into
// progress. The parts written after the last Save are dropped.
func ResumeWriter(dir string, force bool, progress any) (*Writer, error) {
	tmp := PartialDir(dir)
	data, err := os.ReadFile(filepath.Join(tmp, stateFile))
	if err != nil {
		return nil, fmt.Errorf("nothing to resume for %s: %w", dir, err)
	}
	var st writerState
	if err := json.Unmarshal(data, &st); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(tmp, stateFile), err)
	}
	if err := json.Unmarshal(st.Caller, progress); err != nil {
		return nil, fmt.Errorf("%s: progress: %w", filepath.Join(tmp, stateFile), err)
	}
	if _, err := os.Stat(dir); err == nil && !force {
		return nil, fmt.Errorf("output directory %s: %w", dir, fs.ErrExist)
	}
	w := &Writer{final: dir, tmp: tmp, force: force, Format: st.Format, zbits: st.ZBits, Bytes: st.Bytes}
	known := map[string]bool{}
	for _, p := range st.Parts {
		if _, err := os.Stat(filepath.Join(tmp, p.File)); err != nil {
			return nil, fmt.Errorf("resuming %s: %w", dir, err)
		}
		w.parts = append(w.parts, part{file: p.File, bytes: p.Bytes})
		known[p.File] = true
	}
	entries, _ := os.ReadDir(tmp)
	for _, e := range entries { // a part written after the last Save
		if strings.HasPrefix(e.Name(), ".part-") && !known[e.Name()] {
			os.Remove(filepath.Join(tmp, e.Name()))
		}
	}
	return w, nil
}

// PartPath is the file of part i (for a resumed run to read back what
// it had written).
func (w *Writer) PartPath(i int) (string, error) {
	if i < 0 || i >= len(w.parts) {
		return "", fmt.Errorf("part %d of %d", i, len(w.parts))
	}
	return filepath.Join(w.tmp, w.parts[i].file), nil
}

// replaceable says whether an existing directory may be deleted to make
// room for a new output: it must be empty, hold the Marker, or be an
// llmq-quantized checkpoint written before the marker existed.
func replaceable(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if len(entries) == 0 {
		return nil
	}
	if _, err := os.Stat(filepath.Join(dir, Marker)); err == nil {
		return nil
	}
	if raw, err := os.ReadFile(filepath.Join(dir, "config.json")); err == nil {
		var cfg struct {
			Q struct {
				Meta struct {
					Quantizer string `json:"quantizer"`
				} `json:"meta"`
			} `json:"quantization_config"`
		}
		if json.Unmarshal(raw, &cfg) == nil && cfg.Q.Meta.Quantizer == "llmq" {
			return nil
		}
	}
	return fmt.Errorf("output directory %s is not empty and is not an llmq output (no %s); not replacing it", dir, Marker)
}

// AddGPTQ lays out a quantized layer in the current GPTQ format, switching
// the whole checkpoint to gptq_v2 the first time a zero of 0 appears: the
// parts already written and the layers already laid out in tensors (the
// part being built) are rewritten with zeros as they are.
func (w *Writer) AddGPTQ(tensors map[string]checkpoint.Out, prefix string, l *Linear) error {
	if w.zbits == nil {
		w.zbits = map[string]int{}
	}
	w.zbits[prefix+".qzeros"] = l.Grid.Bits
	if w.Format == FormatGPTQ && l.NeedsV2() {
		if err := w.convertToV2(); err != nil {
			return fmt.Errorf("switching the checkpoint to gptq_v2: %w", err)
		}
		for n, t := range tensors {
			if !strings.HasSuffix(n, ".qzeros") {
				continue
			}
			if t.DType != safetensors.I32 || len(t.Data)%4 != 0 {
				return fmt.Errorf("switching the checkpoint to gptq_v2: %s is %s, not I32", n, t.DType)
			}
			v := make([]int32, len(t.Data)/4)
			for i := range v {
				v[i] = int32(binary.LittleEndian.Uint32(t.Data[4*i:]))
			}
			v, err := shiftZeros(v, w.zbits[n], 1)
			if err != nil {
				return fmt.Errorf("switching the checkpoint to gptq_v2: %s: %w", n, err)
			}
			tensors[n] = checkpoint.I32(v, t.Shape...)
		}
	}
	t, err := l.GPTQTensors(prefix, w.Format)
	if err != nil {
		return err
	}
	for k, v := range t {
		tensors[k] = v
	}
	return nil
}

// convertToV2 rewrites the parts already written with zeros stored as
// they are (v1 stored zero − 1). Each part is rewritten through a new
// file renamed over it (checkpoint.WriteFile), inside the temporary
// directory.
func (w *Writer) convertToV2() error {
	for _, pt := range w.parts {
		p := filepath.Join(w.tmp, pt.file)
		if err := rewriteZeros(p, w.zbits); err != nil {
			return fmt.Errorf("%s: %w", pt.file, err)
		}
	}
	w.Format = FormatGPTQv2
	return nil
}

func rewriteZeros(path string, bits map[string]int) error {
	f, err := checkpoint.OpenFile(path)
	if err != nil {
		return err
	}
	defer f.Close()
	out := map[string]checkpoint.Out{}
	for _, n := range f.Names() {
		t, ok := f.Tensor(n)
		if !ok {
			return fmt.Errorf("tensor %q listed but not readable", n)
		}
		data := append([]byte(nil), t.Data...)
		if strings.HasSuffix(n, ".qzeros") {
			v, err := t.Int32()
			if err != nil {
				return fmt.Errorf("%s: %w", n, err)
			}
			b, ok := bits[n]
			if !ok {
				return fmt.Errorf("%s: bit width unknown", n)
			}
			if v, err = shiftZeros(v, b, 1); err != nil {
				return fmt.Errorf("%s: %w", n, err)
			}
			data = checkpoint.I32(v, t.Shape...).Data
		}
		out[n] = checkpoint.Out{DType: t.DType, Shape: t.Shape, Data: data, Float8: t.Float8}
	}
	return checkpoint.WriteFile(path, out, map[string]string{"format": "pt"})
}

// shiftZeros adds delta to every packed zero of bits bits.
func shiftZeros(words []int32, bits, delta int) ([]int32, error) {
	n := len(words) * 32 / bits
	v := UnpackBits(words, bits, n)
	mask := uint8(1<<bits - 1)
	for i := range v {
		v[i] = (v[i] + uint8(delta)) & mask
	}
	return PackBits(v, bits)
}

// WritePart writes the next part: tensors that will share a shard.
func (w *Writer) WritePart(tensors map[string]checkpoint.Out) error {
	name := fmt.Sprintf(".part-%05d.safetensors", len(w.parts))
	if err := checkpoint.WriteFile(filepath.Join(w.tmp, name), tensors, map[string]string{"format": "pt"}); err != nil {
		return err
	}
	var n int64
	for _, t := range tensors {
		n += int64(len(t.Data))
	}
	w.Bytes += n
	w.parts = append(w.parts, part{file: name, bytes: n})
	return nil
}

// shards gathers the parts, in order, into groups of at most
// MaxShardBytes.
func (w *Writer) shards() [][]part {
	max := w.MaxShardBytes
	if max <= 0 {
		max = DefaultMaxShardBytes
	}
	var out [][]part
	var size int64
	for _, p := range w.parts {
		if len(out) == 0 || size > 0 && size+p.bytes > max {
			out = append(out, nil)
			size = 0
		}
		out[len(out)-1] = append(out[len(out)-1], p)
		size += p.bytes
	}
	return out
}

// writeShards turns the parts into model.safetensors (one shard) or
// model-0000i-of-0000N.safetensors with their index.
func (w *Writer) writeShards() error {
	groups := w.shards()
	weightMap := map[string]string{}
	for i, g := range groups {
		name := "model.safetensors"
		if len(groups) > 1 {
			name = fmt.Sprintf("model-%05d-of-%05d.safetensors", i+1, len(groups))
		}
		if err := w.merge(g, name, weightMap); err != nil {
			return fmt.Errorf("writing %s: %w", name, err)
		}
	}
	if len(groups) > 1 {
		index := map[string]any{"metadata": map[string]any{"total_size": w.Bytes}, "weight_map": weightMap}
		return writeJSON(filepath.Join(w.tmp, "model.safetensors.index.json"), index)
	}
	return nil
}

// merge writes the parts g as the shard name, recording where each
// tensor went, and removes the parts.
func (w *Writer) merge(g []part, name string, weightMap map[string]string) error {
	tensors := map[string]checkpoint.Out{}
	var files []*checkpoint.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	for _, p := range g {
		f, err := checkpoint.OpenFile(filepath.Join(w.tmp, p.file))
		if err != nil {
			return err
		}
		files = append(files, f)
		for _, n := range f.Names() {
			t, ok := f.Tensor(n)
			if !ok {
				return fmt.Errorf("%s: tensor %q listed but not readable", p.file, n)
			}
			if _, dup := tensors[n]; dup {
				return fmt.Errorf("tensor %q written twice", n)
			}
			tensors[n] = checkpoint.Out{DType: t.DType, Shape: t.Shape, Data: t.Data, Float8: t.Float8}
			weightMap[n] = name
		}
	}
	if err := checkpoint.WriteFile(filepath.Join(w.tmp, name), tensors, map[string]string{"format": "pt"}); err != nil {
		return err
	}
	for _, p := range g {
		if err := os.Remove(filepath.Join(w.tmp, p.file)); err != nil {
			return err
		}
	}
	return nil
}

// Finish writes the shards, the index and config.json (the source's, with
// quantization_config set unless qc is nil), copies the tokenizer files,
// marks the directory as llmq's, and moves it into place (replacing an
// earlier output when forced).
func (w *Writer) Finish(srcDir string, qc *QuantConfig) error {
	if len(w.parts) == 0 {
		return fmt.Errorf("no tensors were written")
	}
	if qc != nil {
		qc.CheckpointFormat = w.Format
		if qc.QuantMethod == "awq" || qc.CT != nil {
			qc.CheckpointFormat = ""
		}
	}
	if err := w.writeShards(); err != nil {
		return err
	}
	raw, err := os.ReadFile(filepath.Join(srcDir, "config.json"))
	if err != nil {
		return err
	}
	var cfg map[string]any
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return fmt.Errorf("%s/config.json: %w", srcDir, err)
	}
	if qc != nil {
		cfg["quantization_config"] = qc
	}
	if err := writeJSON(filepath.Join(w.tmp, "config.json"), cfg); err != nil {
		return err
	}
	for _, name := range []string{"tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.model"} {
		if err := copyFile(filepath.Join(srcDir, name), filepath.Join(w.tmp, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	if w.Card != "" {
		if err := os.WriteFile(filepath.Join(w.tmp, "README.md"), []byte(w.Card), 0o644); err != nil {
			return err
		}
	}
	if err := os.Remove(filepath.Join(w.tmp, stateFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := os.WriteFile(filepath.Join(w.tmp, Marker), []byte("written by llmq; llmq --force may replace this directory\n"), 0o644); err != nil {
		return err
	}
	return w.moveIntoPlace()
}

// moveIntoPlace renames the temporary directory to the destination. An
// earlier output being replaced is first renamed aside and removed only
// once the new one is in place, so a failure leaves the old output where
// it was; when the new one cannot be put in place, it is kept and named in
// the error rather than deleted.
func (w *Writer) moveIntoPlace() error {
	keep := func(err error) error {
		w.kept = true
		return fmt.Errorf("%w; the finished output is kept in %s", err, w.tmp)
	}
	var aside, backup string // the earlier output goes to aside/old
	if _, err := os.Stat(w.final); err == nil && w.force {
		if err := replaceable(w.final); err != nil { // it may have changed since NewWriter
			return keep(err)
		}
		parent := filepath.Dir(filepath.Clean(w.final))
		if aside, err = os.MkdirTemp(parent, "."+filepath.Base(w.final)+".old-"); err != nil {
			return keep(err)
		}
		backup = filepath.Join(aside, "old")
		if err := os.Rename(w.final, backup); err != nil {
			os.Remove(aside)
			return keep(fmt.Errorf("moving the earlier output aside: %w", err))
		}
	}
	if err := os.Rename(w.tmp, w.final); err != nil {
		if backup != "" && os.Rename(backup, w.final) == nil {
			os.Remove(aside)
		}
		return keep(fmt.Errorf("moving the finished checkpoint into place: %w", err))
	}
	if aside != "" {
		return os.RemoveAll(aside)
	}
	return nil
}

// Abort removes everything written, unless Finish kept a finished output
// it could not put in place.
func (w *Writer) Abort() {
	if !w.kept {
		os.RemoveAll(w.tmp)
	}
}

func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(data, '\n'), 0o644)
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// Raw copies a source tensor unchanged (norms, embeddings, biases).
func Raw(t checkpoint.Tensor) checkpoint.Out {
	return checkpoint.Out{DType: t.DType, Shape: t.Shape, Data: t.Data, Float8: t.Float8}
}
