package main

import (
	"fmt"
	"os"

	"github.com/llmq/llmq/llm/engine"
)

// openModel loads dir's checkpoint (packed or not) and tokenizer on a
// device: auto, cpu or cuda; it says when auto falls back to the CPU.
func openModel(dir, device string) (*engine.Model, error) {
	switch device {
	case "auto", "cpu", "cuda":
	default:
		return nil, fmt.Errorf("--device %q: want auto, cpu or cuda", device)
	}
	m, err := engine.Load(dir, device)
	if err != nil {
		return nil, err
	}
	if m.Fallback != "" {
		fmt.Fprintln(os.Stderr, "llmq:", m.Fallback)
	}
	if device != "cpu" {
		fmt.Fprintf(os.Stderr, "llmq: %s loaded on %s in %.1f s\n", dir, m.Backend.Name(), m.LoadTime.Seconds())
	}
	return m, nil
}
