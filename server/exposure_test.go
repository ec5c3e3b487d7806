package server

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

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

// TestSlowBodyHoldsNoSlot: a client that sends its headers and then
// withholds its body (slowloris on the body: up to the read timeout, 60 s
// by default, and again on a new connection) holds none of the
// MaxConcurrent slots meanwhile. It used to take its slot before reading
// the body, so MaxConcurrent such connections — 256 by default — turned
// every other client away with 429.
func TestSlowBodyHoldsNoSlot(t *testing.T) {
	ts, _, _ := serveWith(t, Options{MaxConcurrent: 1}, engine.Options{}, nil)
	c, err := net.Dial("tcp", ts.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\""); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // the handler is reading the body
	if _, err := complete(ts.URL, "Once upon a time", 1, false); err != nil {
		t.Errorf("a request beside a withheld body: %v", err)
	}
}
