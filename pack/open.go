package pack

import (
	"fmt"
	"path/filepath"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/tokenizer"
)

// Model is a checkpoint loaded for the CPU backend with its tokenizer.
type Model struct {
	Checkpoint *checkpoint.Checkpoint
	*llm.Model
	Tokenizer *tokenizer.Tokenizer
}

// OpenModel loads a model directory — unquantized, or packed in the GPTQ
// or AWQ layout (dequantized to float32) — and its tokenizer.json.
func OpenModel(dir string) (*Model, error) {
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return nil, err
	}
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		ck.Close()
		return nil, err
	}
	load, err := Loader(ck.Config)
	if err != nil {
		ck.Close()
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	m, err := llm.Load(ck, load)
	if err != nil {
		ck.Close()
		return nil, fmt.Errorf("loading %s: %w", dir, err)
	}
	return &Model{Checkpoint: ck, Model: m, Tokenizer: tok}, nil
}

// Close releases the checkpoint's mappings.
func (m *Model) Close() error { return m.Checkpoint.Close() }
