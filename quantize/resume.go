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
			return "", err
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
	b, err := llm.LoadBlock(d.ck, l, llm.DenseLoader)
	if err != nil {
		return err
	}
	if u, ok := d.m.(unquantizedNext); !ok || !u.NextFromUnquantized() {
		if err := d.asWritten(l, b); err != nil {
			return fmt.Errorf("reading back block %d: %w", l, err)
		}
	}
	return d.propagate(ctx, b, func(string) {})
}

// asWritten replaces b's norms, biases and layers by what part l holds.
func (d *driver) asWritten(l int, b *llm.Block) error {
	path, err := d.w.PartPath(l)
	if err != nil {
		return err
	}
	cfg := d.ck.Config
	part, err := checkpoint.OpenFiles(cfg, path)
	if err != nil {
		return err
	}
	defer part.Close()
	prefix := fmt.Sprintf("model.layers.%d.", l)
	if b.AttnNorm, err = part.Float32(prefix+"input_layernorm.weight", cfg.Hidden); err != nil {
		return err
	}
	if b.MLPNorm, err = part.Float32(prefix+"post_attention_layernorm.weight", cfg.Hidden); err != nil {
		return err
	}
	for _, nl := range b.Linears() {
		name := prefix + nl.Name
		in, out := (*nl.L).In(), (*nl.L).Out()
		qkv := nl.Name == "self_attn.q_proj" || nl.Name == "self_attn.k_proj" || nl.Name == "self_attn.v_proj"
		bias, err := llm.ReadBias(part, name, out, cfg.QKVBias && qkv)
		if err != nil {
			return err
		}
		g, quantized := d.opt.Plan.For(name, d.m.Grid())
		if !quantized {
			w, err := part.Float32(name+".weight", out, in)
			if err != nil {
				return err
			}
			*nl.L = llm.NewDense(w, bias, in, out)
			continue
		}
		var lin *pack.Linear
		if d.opt.Format == "awq" {
			lin, err = pack.ReadAWQ(part, name, in, out, g)
		} else {
			lin, err = pack.ReadGPTQ(part, name, in, out, g, d.w.Format)
		}
		if err != nil {
			return err
		}
		*nl.L = llm.NewDense(lin.Dequantize(), bias, in, out)
	}
	return nil
}
