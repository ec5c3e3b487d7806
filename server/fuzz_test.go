package server

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/llmq/llmq/backend"
	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
)

// eosBackend answers every position with the end-of-sequence token, so a
// fuzzed request that gets through validation ends after one step.
type eosBackend struct{ llm.Backend }

func (b eosBackend) Forward(ctx context.Context, steps []llm.Step) error {
	if err := b.Backend.Forward(ctx, steps); err != nil {
		return err
	}
	eos := b.Config().EOS[0]
	for _, s := range steps {
		for i := range s.Logits {
			s.Logits[i] = 0
		}
		V := b.Config().Vocab
		for r := 0; r < len(s.Logits)/V; r++ {
			s.Logits[r*V+eos] = 100
		}
	}
	return nil
}

// FuzzRequest: whatever body a client posts to the completion routes, the
// server answers 200, or a 4xx in the OpenAI error shape — never a 5xx,
// never a panic, never a Go type name.
func FuzzRequest(f *testing.F) {
	m, err := backend.Open(shared.Path(f, "models/llama-tiny"), "cpu")
	if err != nil {
		f.Fatal(err)
	}
	defer m.Close()
	e, err := engine.New(engine.NewModel(eosBackend{m.Backend}, m.Tokenizer, m.Template), engine.Options{MaxBatch: 4, MaxQueue: 64})
	if err != nil {
		f.Fatal(err)
	}
	defer e.Close()
	s := New(e, Options{Model: "llama-tiny", MaxBodyBytes: 64 << 10})
	f.Add("/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": true}`)
	f.Add("/v1/completions", `{"model": "llama-tiny", "prompt": "Once", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "stop": ["\n"], "seed": 7}`)
	f.Add("/v1/completions", `{"model": "llama-tiny", "prompt": ["a", "b"], "n": 2}`)
	f.Add("/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}`)
	f.Add("/v1/completions", `{"model": "llama-tiny", "prompt": "x", "max_tokens": -1, "temperature": 1e308}`)
	f.Add("/v1/completions", `{"model": "llama-tiny", "prompt": [[0, 5], [7]], "echo": true, "logprobs": 5, "max_tokens": 0}`)
	f.Add("/v1/completions", `{"model": "llama-tiny", "prompt": [0], "echo": true, "logprobs": 1, "max_tokens": 1, "stream": true}`)
	f.Add("/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "Hi"}], "logprobs": true, "top_logprobs": 20, "stream": true}`)
	f.Add("/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "assistant", "content": "4", "reasoning_content": "Add."}], "chat_template_kwargs": {"enable_thinking": false, "tools": [{"a": 1}]}, "stream": true}`)
	f.Add("/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "Hi", "reasoning_content": 5}], "chat_template_kwargs": {"eos_token": null}}`)
	f.Fuzz(func(t *testing.T, path, body string) {
		if path != "/v1/chat/completions" {
			path = "/v1/completions"
		}
		req := httptest.NewRequest("POST", path, strings.NewReader(body))
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, req)
		if rec.Code == http.StatusOK {
			return
		}
		if rec.Code < 400 || rec.Code >= 500 {
			t.Fatalf("POST %s %q: status %d: %s", path, body, rec.Code, rec.Body)
		}
		var out struct {
			Error *struct {
				Message string `json:"message"`
				Type    string `json:"type"`
			} `json:"error"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil || out.Error == nil || out.Error.Message == "" || out.Error.Type == "" {
			t.Fatalf("POST %s %q: %d with body %s, not an OpenAI error", path, body, rec.Code, rec.Body)
		}
		for _, leak := range []string{"json: ", "Go struct", "Go value", "main.", "server."} {
			if strings.Contains(out.Error.Message, leak) {
				t.Fatalf("POST %s %q: error message %q leaks %q", path, body, out.Error.Message, leak)
			}
		}
	})
}
