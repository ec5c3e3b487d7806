package quantize

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// A run writes each block's part as it finishes and records its progress
// beside it (pack.Writer.Save). An interrupted run keeps them; Options.
// Resume continues it: the finished blocks are not quantized again, only
// replayed to compute the next block's calibration input exactly as the
// uninterrupted run did (the block as written, dequantized — or, for a
// method whose next input comes from the unquantized block, that block).

// progress is what the driver saves after each block.
type progress struct {
	Fingerprint string `json:"fingerprint"` // of every setting that decides the output
	Blocks      int    `json:"blocks"`      // finished blocks
	// Experts are the finished blocks' experts, for the report and the
	// checkpoint's meta.
	Experts []ExpertReport `json:"experts,omitempty"`
}

// unquantizedNext is implemented by methods whose next block reads the
// unquantized block's outputs (AWQ), which a resumed run replays.
type unquantizedNext interface{ NextFromUnquantized() bool }

// NextFromUnquantized: AWQ's next block reads the unquantized outputs.
func (AWQ) NextFromUnquantized() bool { return true }

// fingerprint digests the settings that decide the output, so that a
// resumed run refuses to continue one made with others.
func (d *driver) fingerprint() (string, error) {
	qc := d.quantConfig()
	qc.Meta.Version = "" // another llmq may finish the run
	key := map[string]any{"config": qc, "format": d.opt.Format, "lm_head": d.opt.QuantizeLMHead,
		"method": fmt.Sprintf("%s %+v", d.m.Name(), methodKey(d.m))}
	if d.opt.Smooth != nil {
		key["smooth"] = d.opt.Smooth.Smooth
	}
	if d.m.Calibrated() {
		abs, err := filepath.Abs(d.opt.Calib)
		if err != nil {
			return "", err
		}
		st, err := os.Stat(abs)
		if err != nil {
			return "", fmt.Errorf("%w: %w", ErrCalibration, err)
		}
		key["calibration"] = fmt.Sprintf("%s %d %d", abs, st.Size(), st.ModTime().UnixNano())
	}
	data, err := json.Marshal(key)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("%x", sha256.Sum256(data)), nil
}

// methodKey is a method's settings without function values (loggers).
func methodKey(m Method) any {
	switch m := m.(type) {
	case AWQ:
		o := m.Opt
		o.Log = nil
		return o
	case AWQGPTQ:
		o, g := m.Scales, m.GPTQ.Opt
		o.Log, g.Log = nil, nil
		return [2]any{o, g}
	case GPTQ:
		o := m.Opt
		o.Log = nil
		return o
	}
	return m
}

// replay advances X past finished block l without quantizing it again.
func (d *driver) replay(ctx context.Context, l int) error {
	if d.X == nil {
		return nil
	}
	var b *llm.Block
	var err error
	if u, ok := d.m.(unquantizedNext); ok && u.NextFromUnquantized() {
		b, err = llm.LoadBlock(d.ck, l, llm.DenseLoader)
	} else if b, err = d.asWritten(l); err != nil {
		err = fmt.Errorf("reading back block %d: %w", l, err)
	}
	if err != nil {
		return err
	}
	return d.propagate(ctx, b, func(string) {})
}

// asWritten reads block l as part l holds it: its norms, biases and
// router as written, its layers dequantized.
func (d *driver) asWritten(l int) (*llm.Block, error) {
	path, err := d.w.PartPath(l)
	if err != nil {
		return nil, err
	}
	part, err := checkpoint.OpenFiles(d.ck.Config, path)
	if err != nil {
		return nil, err
	}
	defer part.Close()
	return llm.LoadBlock(part, l, func(ck *checkpoint.Checkpoint, name string, in, out int, bias bool) (llm.Linear, error) {
		g, quantized := d.opt.Plan.For(name, d.m.Grid())
		if !quantized {
			return llm.DenseLoader(ck, name, in, out, bias)
		}
		b, err := llm.ReadBias(ck, name, out, bias)
		if err != nil {
			return nil, err
		}
		var lin *pack.Linear
		if d.opt.Format == "awq" {
			lin, err = pack.ReadAWQ(ck, name, in, out, g)
		} else {
			lin, err = pack.ReadGPTQ(ck, name, in, out, g, d.w.Format)
		}
		if err != nil {
			return nil, err
		}
		return llm.NewDense(lin.Dequantize(), b, in, out), nil
	})
}
