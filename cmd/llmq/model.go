package main

import (
	"fmt"
	"os"

	"github.com/llmq/llmq/llm/engine"
)

// openModel loads dir's checkpoint (packed or not) and tokenizer on a
// device: cpu or cuda.
func openModel(dir, device string) (*engine.Model, error) {
	m, err := engine.Load(dir, device)
	if err != nil {
		return nil, err
	}
	if device == "cuda" {
		fmt.Fprintf(os.Stderr, "llmq: %s loaded on %s in %.1f s\n", dir, m.Backend.Name(), m.LoadTime.Seconds())
	}
	return m, nil
}
