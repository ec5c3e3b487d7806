//go:build !cgo

// Package cuda runs llmq's CUDA kernels from Go; this build has no cgo, so
// the GPU is unavailable and Open says so.
package cuda

import (
	"errors"

	"github.com/llmq/llmq/llm/checkpoint"
)

var errNoCgo = errors.New("GPU unavailable: llmq was built without cgo (CGO_ENABLED=0); rebuild with cgo to load the CUDA library")

// Lib is unavailable without cgo.
type Lib struct{}

// Open always fails without cgo.
func Open(path string) (*Lib, error) {
	return nil, errNoCgo
}

// OpenModel always fails without cgo.
func OpenModel(ck *checkpoint.Checkpoint) (Backend, error) { return nil, errNoCgo }
