package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/llmq/llmq/backend"
)

// loadModel opens dir's checkpoint (packed or not), tokenizer and chat
// template on a device: auto, cpu or cuda (the --device flag).
func loadModel(dir, device string) (*backend.Model, error) {
	return loadModelWith(dir, device, backend.Options{})
}

// loadModelWith is loadModel with backend options.
func loadModelWith(dir, device string, opt backend.Options) (*backend.Model, error) {
	m, err := backend.OpenWith(dir, device, opt)
	if errors.Is(err, backend.ErrUnknownDevice) {
		return nil, fmt.Errorf("--device %q: want auto, cpu or cuda", device)
	}
	return m, err
}

// openModel is loadModel that also says when auto falls back to the CPU
// and, on the GPU, how long loading took.
func openModel(dir, device string) (*backend.Model, error) {
	return openModelWith(dir, device, backend.Options{})
}

// openModelWith is openModel with backend options.
func openModelWith(dir, device string, opt backend.Options) (*backend.Model, error) {
	m, err := loadModelWith(dir, device, opt)
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

// modelName is the directory's base name: the model's name in the API
// llmq serve answers.
func modelName(dir string) string { return filepath.Base(filepath.Clean(dir)) }
