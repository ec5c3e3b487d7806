package cuda

import "github.com/llmq/llmq/llm"

// Backend is a model resident on the GPU (Model, in builds with cgo): an
// llm.Backend whose Close frees its GPU memory and whose Memory accounts
// for every byte of it.
type Backend interface {
	llm.Backend
	// WeightBytes is the GPU memory the weights take (Memory().Weights).
	WeightBytes() int64
}
