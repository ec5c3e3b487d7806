// Package assets locates the project's read-only reference assets (models,
// data and reference outputs in ../shared beside the repository). It is
// what the llmq binary needs of them (synth's default tokenizer); the test
// helpers built on it are in internal/shared.
package assets

import (
	"os"
	"path/filepath"
)

// Root returns the shared directory: $LLMQ_SHARED, or ../shared relative to
// the module root (the nearest directory above the working directory that
// holds a go.mod), or ../shared relative to the working directory when
// there is no module root above it.
func Root() string {
	if d := os.Getenv("LLMQ_SHARED"); d != "" {
		return d
	}
	dir, err := os.Getwd()
	if err != nil {
		return "../shared"
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return filepath.Join(dir, "..", "shared")
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "../shared"
		}
		dir = parent
	}
}
