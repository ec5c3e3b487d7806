package engine

import (
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/llmq/llmq/cuda"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/chat"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/tokenizer"
	"github.com/llmq/llmq/pack"
)

// Model is a checkpoint opened on a device, with its tokenizer and chat
// template.
type Model struct {
	Dir       string
	Config    *checkpoint.Config
	Backend   llm.Backend
	Tokenizer *tokenizer.Tokenizer
	Template  *chat.Template // nil without a chat_template
	LoadTime  time.Duration
	// Fallback says why device "auto" runs on the CPU (empty otherwise).
	Fallback string
	close    func() error
}

// Close releases the model (its mapped files, its GPU memory).
func (m *Model) Close() error { return m.close() }

// Load opens a model directory — packed by llmq quantize or unquantized —
// on device "cpu" (float32, dequantized), "cuda" (the GPU backend: packed
// layers stay 4-bit, the rest fp16), or "auto": the GPU when its library
// and a device are there and the model fits, else the CPU, with the reason
// in Model.Fallback.
func Load(dir, device string) (*Model, error) {
	if device == "auto" {
		m, err := Load(dir, "cuda")
		if err == nil {
			return m, nil
		}
		m, cerr := Load(dir, "cpu")
		if cerr != nil { // not a GPU problem (a bad checkpoint, say)
			return nil, cerr
		}
		m.Fallback = err.Error() + "; running on the CPU"
		return m, nil
	}
	start := time.Now()
	tmpl, err := chat.Load(dir)
	if err != nil && !errors.Is(err, chat.ErrNoTemplate) {
		return nil, err
	}
	switch device {
	case "", "cpu":
		m, err := pack.OpenModel(dir)
		if err != nil {
			return nil, err
		}
		return &Model{Dir: dir, Config: m.Checkpoint.Config, Backend: m.Model, Tokenizer: m.Tokenizer, Template: tmpl,
			LoadTime: time.Since(start), close: m.Close}, nil
	case "cuda":
		ck, err := checkpoint.Open(dir)
		if err != nil {
			return nil, err
		}
		defer ck.Close() // the weights are copied to the GPU
		tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
		if err != nil {
			return nil, err
		}
		b, err := cuda.OpenModel(ck)
		if err != nil {
			return nil, err
		}
		return &Model{Dir: dir, Config: ck.Config, Backend: b, Tokenizer: tok, Template: tmpl,
			LoadTime: time.Since(start), close: b.Close}, nil
	}
	return nil, fmt.Errorf("--device %q: want auto, cpu or cuda", device)
}
