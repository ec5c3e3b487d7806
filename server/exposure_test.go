package server

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/llmq/llmq/engine"
)

// TestHugeMaxTokens: a max_tokens near the integer limit is a 400
// naming max_tokens, never a panic. prompt + max_tokens used to wrap
// around past the context check, and the engine then panicked making the
// sequence's token buffer: in the handler (the connection dropped), or,
// for a batch of prompts, in one of runMany's goroutines, which took the
// whole server down.
func TestHugeMaxTokens(t *testing.T) {
	ts, _, _ := serveWith(t, Options{}, engine.Options{}, nil)
	for _, c := range []struct{ path, body string }{
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "Hi", "max_tokens": 9223372036854775807}`},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "Hi", "max_tokens": 9223372036854775807, "stream": true}`},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": ["Hi", "Ho"], "max_tokens": 9223372036854775807}`},
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 9223372036854775806}`},
	} {
		resp, body := do(t, http.MethodPost, ts.URL+c.path, c.body)
		e := checkErrorShape(t, fmt.Sprintf("%s %s", c.path, c.body), resp, body, http.StatusBadRequest, "too large")
		if e["param"] != "max_tokens" || e["code"] != "context_length_exceeded" {
			t.Errorf("%s: param %v, code %v; want max_tokens, context_length_exceeded", c.body, e["param"], e["code"])
		}
	}
}
