package cuda

import "github.com/llmq/llmq/llm"

// Backend is a model resident on the GPU (Model, in builds with cgo).
type Backend interface {
	llm.Backend
	// WeightBytes is the GPU memory the weights take.
	WeightBytes() int64
	// Close frees the model's GPU memory.
	Close() error
}
