package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
)

// TestExportGGUF: llmq export gguf writes the file and says what it did;
// an existing file needs --force; a missing -o, a directory and a model
// without a tokenizer are errors that say so.
func TestExportGGUF(t *testing.T) {
	model := shared.Path(t, "models/llama-tiny")
	dir := t.TempDir()
	out := filepath.Join(dir, "tiny.gguf")
	got := mustLLMQ(t, "export", "gguf", model, "-o", out)
	if !strings.Contains(got, "wrote "+out) || !strings.Contains(got, "F16×30") {
		t.Errorf("output: %q", got)
	}
	if _, err := llmq(t, "export", "gguf", model, "-o", out); err == nil || !strings.Contains(err.Error(), "--force") {
		t.Errorf("existing output without --force: %v", err)
	}
	mustLLMQ(t, "export", "gguf", model, "-o", out, "--force")
	if _, err := llmq(t, "export", "gguf", model); err == nil || !strings.Contains(err.Error(), "-o") {
		t.Errorf("no -o: %v", err)
	}
	if _, err := llmq(t, "export", "gguf", model, "-o", dir); err == nil || !strings.Contains(err.Error(), "directory") {
		t.Errorf("-o a directory: %v", err)
	}
	bare := filepath.Join(dir, "bare")
	os.Mkdir(bare, 0o755)
	for _, f := range []string{"config.json", "model.safetensors"} {
		if err := os.Symlink(filepath.Join(model, f), filepath.Join(bare, f)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := llmq(t, "export", "gguf", bare, "-o", filepath.Join(dir, "bare.gguf")); err == nil || !strings.Contains(err.Error(), "tokenizer") {
		t.Errorf("no tokenizer.json: %v", err)
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".") {
			t.Errorf("temporary file left behind: %s", e.Name())
		}
	}
}
