package main

import (
	"fmt"
	"path/filepath"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/tokenizer"
	"github.com/llmq/llmq/pack"
)

// loaded is a model ready to run, with its tokenizer.
type loaded struct {
	ck      *checkpoint.Checkpoint
	backend llm.Backend
	tok     *tokenizer.Tokenizer
}

func (l *loaded) Close() { l.ck.Close() }

// openModel loads dir's checkpoint and tokenizer for the CPU backend.
func openModel(dir string) (*loaded, error) {
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return nil, err
	}
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		ck.Close()
		return nil, err
	}
	load, err := pack.Loader(ck.Config)
	if err != nil {
		ck.Close()
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	m, err := llm.Load(ck, load)
	if err != nil {
		ck.Close()
		return nil, fmt.Errorf("loading %s: %w", dir, err)
	}
	return &loaded{ck: ck, backend: m, tok: tok}, nil
}
