package server_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"

	"github.com/llmq/llmq/backend"
	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/server"
)

// An OpenAI-compatible endpoint in a few lines: open a model, start an
// engine on it, wrap the engine in the handler, and serve it (server.Serve
// adds graceful shutdown).
func Example() {
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
	ts := httptest.NewServer(server.New(e, server.Options{Model: "llama-tiny"}))
	defer ts.Close()

	resp, err := http.Post(ts.URL+"/v1/completions", "application/json",
		strings.NewReader(`{"model": "llama-tiny", "prompt": "The history of the", "max_tokens": 6, "temperature": 0}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer resp.Body.Close()
	var out struct {
		Choices []struct {
			Text         string `json:"text"`
			FinishReason string `json:"finish_reason"`
		}
		Usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
		}
	}
	json.NewDecoder(resp.Body).Decode(&out)
	fmt.Printf("%q %s %d+%d\n", out.Choices[0].Text, out.Choices[0].FinishReason, out.Usage.PromptTokens, out.Usage.CompletionTokens)
	// Output: " history of the history of the" length 5+6
}
