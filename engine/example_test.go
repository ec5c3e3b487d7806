package engine_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/llmq/llmq/backend"
	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm/chat"
)

// A chat server opens a model once (package backend picks the device),
// starts an engine on it, and calls Generate from each request's
// goroutine; text streams through the callback as it is produced.
func Example() {
	m, err := backend.Open(filepath.Join(shared.Root(), "models/llama-tiny"), "cpu")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Close()
	e, err := engine.New(m, engine.Options{MaxBatch: 16})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer e.Close()
	prompt, err := e.EncodeChat([]chat.Message{{Role: "user", Content: "Tell me about the history of Rome."}})
	if err != nil {
		fmt.Println(err)
		return
	}
	var streamed strings.Builder
	res, err := e.Generate(context.Background(), engine.Request{Prompt: prompt, MaxTokens: 12},
		func(text string) error { streamed.WriteString(text); return nil })
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%q\n", streamed.String())
	fmt.Println(res.PromptTokens, res.CompletionTokens, res.FinishReason)
	// Output:
	// "The history of the history of the history of the history of"
	// 22 12 length
}

// Plain completion with sampling: a fixed seed gives the same text on
// every run.
func ExampleEngine_Generate() {
	m, err := backend.Open(filepath.Join(shared.Root(), "models/llama-tiny"), "cpu")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Close()
	e, err := engine.New(m, engine.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer e.Close()
	req := engine.Request{Prompt: e.Encode("Once upon a time"), MaxTokens: 16, Stop: []string{"."}}
	req.Sample.Temperature, req.Sample.TopP, req.Sample.Seed = 0.8, 0.95, 42
	res, err := e.Generate(context.Background(), req, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%q %s\n", res.Text, res.FinishReason)
	// Output: " at a point of similitude, you must find the point for you in" length
}
