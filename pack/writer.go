package pack

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/llmq/llmq/llm/checkpoint"
)

// Writer writes a quantized checkpoint one shard at a time into a
// temporary directory beside the destination, and renames it into place
// only when Finish succeeds: an interrupted run leaves nothing behind.
type Writer struct {
	final, tmp string
	force      bool
	nShards    int
	shards     []string
	weightMap  map[string]string
	Format     string // GPTQ checkpoint format of the layers written so far
	bits       int    // bit width of the layers written
	Bytes      int64  // bytes of tensor data written
}

// ErrNoOutput is NewWriter's error for an empty output directory name.
var ErrNoOutput = errors.New("no output directory given")

// NewWriter prepares to write nShards shards to dir. An existing dir is an
// error (wrapping fs.ErrExist) unless force is set (it is then replaced at
// Finish).
func NewWriter(dir string, force bool, nShards int) (*Writer, error) {
	if dir == "" {
		return nil, ErrNoOutput
	}
	if _, err := os.Stat(dir); err == nil && !force {
		return nil, fmt.Errorf("output directory %s: %w", dir, fs.ErrExist)
	}
	parent := filepath.Dir(filepath.Clean(dir))
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp(parent, "."+filepath.Base(dir)+".tmp-")
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		os.RemoveAll(tmp)
		return nil, err
	}
	return &Writer{final: dir, tmp: tmp, force: force, nShards: nShards, weightMap: map[string]string{}, Format: FormatGPTQ}, nil
}

// AddGPTQ lays out a quantized layer in the current GPTQ format, switching
// the whole checkpoint to gptq_v2 the first time a zero of 0 appears.
func (w *Writer) AddGPTQ(tensors map[string]checkpoint.Out, prefix string, l *Linear) error {
	w.bits = l.Grid.Bits
	if w.Format == FormatGPTQ && l.NeedsV2() {
		if err := w.convertToV2(); err != nil {
			return err
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

// convertToV2 rewrites the shards already written with zeros stored as
// they are (v1 stored zero − 1).
func (w *Writer) convertToV2() error {
	for _, name := range w.shards {
		p := filepath.Join(w.tmp, name)
		f, err := checkpoint.OpenFile(p)
		if err != nil {
			return err
		}
		out := map[string]checkpoint.Out{}
		for _, n := range f.Names() {
			t, _ := f.Tensor(n)
			data := append([]byte(nil), t.Data...)
			if strings.HasSuffix(n, ".qzeros") {
				v, _ := t.Int32()
				var err error
				if v, err = shiftZeros(v, w.bits, 1); err != nil {
					f.Close()
					return err
				}
				data = checkpoint.I32(v, t.Shape...).Data
			}
			out[n] = checkpoint.Out{DType: t.DType, Shape: t.Shape, Data: data}
		}
		f.Close()
		if err := checkpoint.WriteFile(p, out, nil); err != nil {
			return err
		}
	}
	w.Format = FormatGPTQv2
	return nil
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

// WriteShard writes the next shard.
func (w *Writer) WriteShard(tensors map[string]checkpoint.Out) error {
	if len(w.shards) >= w.nShards {
		return fmt.Errorf("more shards than the %d announced", w.nShards)
	}
	name := fmt.Sprintf("model-%05d-of-%05d.safetensors", len(w.shards)+1, w.nShards)
	if err := checkpoint.WriteFile(filepath.Join(w.tmp, name), tensors, map[string]string{"format": "pt"}); err != nil {
		return err
	}
	for n, t := range tensors {
		w.weightMap[n] = name
		w.Bytes += int64(len(t.Data))
	}
	w.shards = append(w.shards, name)
	return nil
}

// Finish writes the shard index and config.json (the source's, with
// quantization_config set unless qc is nil), copies the tokenizer files, and moves the
// directory into place.
func (w *Writer) Finish(srcDir string, qc *QuantConfig) error {
	if len(w.shards) != w.nShards {
		return fmt.Errorf("wrote %d of %d shards", len(w.shards), w.nShards)
	}
	if qc != nil {
		qc.CheckpointFormat = w.Format
		if qc.QuantMethod == "awq" {
			qc.CheckpointFormat = ""
		}
	}
	index := map[string]any{"metadata": map[string]any{"total_size": w.Bytes}, "weight_map": w.weightMap}
	if err := writeJSON(filepath.Join(w.tmp, "model.safetensors.index.json"), index); err != nil {
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
	if w.force {
		if err := os.RemoveAll(w.final); err != nil {
			return err
		}
	}
	if err := os.Rename(w.tmp, w.final); err != nil {
		return fmt.Errorf("moving the finished checkpoint into place: %w", err)
	}
	return nil
}

// Abort removes everything written.
func (w *Writer) Abort() { os.RemoveAll(w.tmp) }

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
	return checkpoint.Out{DType: t.DType, Shape: t.Shape, Data: t.Data}
}
