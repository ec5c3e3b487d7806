package main

import (
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
	m       *pack.Model
}

func (l *loaded) Close() { l.m.Close() }

// openModel loads dir's checkpoint and tokenizer for the CPU backend.
func openModel(dir string) (*loaded, error) {
	m, err := pack.OpenModel(dir)
	if err != nil {
		return nil, err
	}
	return &loaded{ck: m.Checkpoint, backend: m.Model, tok: m.Tokenizer, m: m}, nil
}
