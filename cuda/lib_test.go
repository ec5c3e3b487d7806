//go:build cgo

package cuda

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm/checkpoint"
)

// TestOpenSaysWhereItLooked: without a library, the error is one short
// line naming every absolute path tried and how to build the library.
func TestOpenSaysWhereItLooked(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("LLMQ_CUDA_LIB", filepath.Join(dir, "nowhere", "libllmqcuda.so"))
	if DefaultPath() != "" {
		t.Skip("a CUDA library is installed here")
	}
	_, err := Open("")
	if err == nil {
		t.Fatal("Open found a library that is not there")
	}
	msg := err.Error()
	for _, p := range Candidates() {
		if !filepath.IsAbs(p) || !strings.Contains(msg, p) {
			t.Errorf("error %q does not name the absolute path %s", msg, p)
		}
	}
	if !strings.Contains(msg, "make cuda") || strings.Contains(msg, "\n") || len(msg) > 400 {
		t.Errorf("error is not one short line saying how to build the library: %q", msg)
	}
}

// TestSupportsRefusesSlidingWindow: a Mistral sliding-window config is
// refused by name rather than run with full attention.
func TestSupportsRefusesSlidingWindow(t *testing.T) {
	swa, err := checkpoint.LoadConfig(shared.Path(t, "models/archzoo/mistral-swa-rand"))
	if err != nil {
		t.Fatal(err)
	}
	if err := Supports(swa); err == nil || !strings.Contains(err.Error(), "sliding_window 64") {
		t.Errorf("sliding window: %v", err)
	}
	full, err := checkpoint.LoadConfig(shared.Path(t, "models/archzoo/mistral-rand"))
	if err != nil {
		t.Fatal(err)
	}
	if err := Supports(full); err != nil {
		t.Errorf("full attention refused: %v", err)
	}
}
