package server

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/llm"
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

// smallSendBuffers gives each accepted connection a small kernel send
// buffer, so that a client that stops reading blocks the server's writes
// after kilobytes rather than megabytes.
type smallSendBuffers struct{ net.Listener }

func (l smallSendBuffers) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetWriteBuffer(4 << 10)
	}
	return c, err
}

// TestStalledReaderIsCutOff: a client that asks for a long stream and
// never reads it blocks the server's writes once the socket buffers are
// full. The handler used to wait in that write forever — no write
// deadline, and RequestTimeout does not interrupt a write — holding its
// concurrency slot (and its goroutine and connection) for good, so
// MaxConcurrent such clients shut the server for everyone. Each write
// now has WriteTimeout to finish: past it the connection is closed, the
// generation stops and the slot is free.
func TestStalledReaderIsCutOff(t *testing.T) {
	e := tinyEngine(t, engine.Options{}, nil)
	ts := httptest.NewUnstartedServer(New(e, Options{Model: "llama-tiny", MaxConcurrent: 1, WriteTimeout: 300 * time.Millisecond}))
	ts.Listener = smallSendBuffers{ts.Listener}
	ts.Start()
	defer ts.Close()

	c, err := net.Dial("tcp", ts.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.(*net.TCPConn).SetReadBuffer(4 << 10)
	// 1000 tokens with 20 alternatives each: megabytes of events.
	body := `{"model": "llama-tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 1000, "stream": true, "logprobs": true, "top_logprobs": 20}`
	if _, err := fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body); err != nil {
		t.Fatal(err)
	}
	// The client reads nothing from here on.
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, err := complete(ts.URL, "Once upon a time", 1, false)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("20 s after a client stopped reading its stream, its slot is still held: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if st := e.Stats(); st.Active != 0 || st.KVBlocksUsed != 0 {
		t.Errorf("after the stalled stream was cut off: %d sequences active, %d KV blocks held", st.Active, st.KVBlocksUsed)
	}
}

// TestWriteTimeoutIsPerWrite: WriteTimeout bounds each write, not the
// answer: a stream and a whole answer that take well past it, read by
// their client, are not cut.
func TestWriteTimeoutIsPerWrite(t *testing.T) {
	ts, _, _ := serveWith(t, Options{WriteTimeout: 200 * time.Millisecond}, engine.Options{},
		func(b llm.Backend) llm.Backend { return slowBackend{b, 40 * time.Millisecond} })
	for _, stream := range []bool{true, false} {
		start := time.Now()
		a, err := complete(ts.URL, "Once upon a time", 15, stream)
		if err != nil {
			t.Fatalf("stream %v: %v", stream, err)
		}
		if a.Usage.CompletionTokens != 15 {
			t.Errorf("stream %v: %d tokens", stream, a.Usage.CompletionTokens)
		}
		if d := time.Since(start); d < 400*time.Millisecond {
			t.Errorf("stream %v took %v, not past the write timeout: the test proves nothing", stream, d)
		}
	}
}

// TestErrorsEchoBoundedInput: an error that quotes what the client sent
// (an unknown model, a content part's type) quotes its start only, as 404
// messages quote at most 200 bytes of a path: a 100 kB model name used to
// come back whole, and go whole into the request's log line.
func TestErrorsEchoBoundedInput(t *testing.T) {
	ts, _, _ := serveWith(t, Options{}, engine.Options{}, nil)
	long := strings.Repeat("x", 100<<10)
	for _, c := range []struct {
		path, body, want string
		status           int
	}{
		{"/v1/completions", `{"model": "` + long + `", "prompt": "Hi"}`, `the model "xxx`, http.StatusNotFound},
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": [{"type": "` + long + `"}]}]}`, `content part of type "xxx`, http.StatusBadRequest},
	} {
		resp, body := do(t, http.MethodPost, ts.URL+c.path, c.body)
		checkErrorShape(t, c.path, resp, body, c.status, c.want)
		if len(body) > 1000 {
			t.Errorf("%s: a %d-byte error answer to a %d-byte value", c.path, len(body), len(long))
		}
	}
}

// TestCrossSiteRequestsRefused: a web page the server's user visits can
// POST to it from the browser — a "simple" request (text/plain body, no
// preflight), which the server read as JSON all the same — and so run
// generations on a server bound to localhost without an API key (the
// default), blind but at will. Browsers mark such requests (Sec-Fetch-Site,
// Origin); they now get 403 in OpenAI's shape, while same-origin browser
// requests and clients that are not browsers (no such headers) are served.
func TestCrossSiteRequestsRefused(t *testing.T) {
	ts, _, _ := serveWith(t, Options{}, engine.Options{}, nil)
	body := `{"model": "llama-tiny", "prompt": "Once", "max_tokens": 2}`
	resp, b := do(t, http.MethodPost, ts.URL+"/v1/completions", body,
		"Content-Type", "text/plain", "Origin", "https://evil.example", "Sec-Fetch-Site", "cross-site", "Sec-Fetch-Mode", "no-cors")
	e := checkErrorShape(t, "cross-site POST", resp, b, http.StatusForbidden, "cross-origin")
	if e["code"] != "cross_origin_request" {
		t.Errorf("code %v", e["code"])
	}
	resp, b = do(t, http.MethodPost, ts.URL+"/v1/completions", body,
		"Content-Type", "text/plain", "Origin", "http://evil.example") // an older browser: Origin alone
	checkErrorShape(t, "cross-origin POST", resp, b, http.StatusForbidden, "cross-origin")
	for _, h := range [][]string{
		{"Sec-Fetch-Site", "same-origin", "Origin", ts.URL},
		{"Content-Type", "application/json"},
	} {
		if resp, b := do(t, http.MethodPost, ts.URL+"/v1/completions", body, h...); resp.StatusCode != http.StatusOK {
			t.Errorf("POST with %v: %d %s", h, resp.StatusCode, b)
		}
	}
}

// TestInvalidValuesNameTheField: a value out of range is a 400 whose
// param and message name the JSON field. top_p, an empty stop string and
// a token id outside the vocabulary were caught by the engine alone,
// answered with param null and the engine's words ("top-p").
func TestInvalidValuesNameTheField(t *testing.T) {
	ts, _, _ := serveWith(t, Options{}, engine.Options{}, nil)
	for _, c := range []struct{ body, param, want string }{
		{`{"model": "llama-tiny", "prompt": "Hi", "max_tokens": 1, "top_p": 1.5}`, "top_p", "top_p must be in [0, 1], got 1.5"},
		{`{"model": "llama-tiny", "prompt": "Hi", "max_tokens": 1, "top_p": -1}`, "top_p", "top_p must be in [0, 1], got -1"},
		{`{"model": "llama-tiny", "prompt": "Hi", "max_tokens": 1, "stop": ["\n", ""]}`, "stop", "stop strings must not be empty"},
		{`{"model": "llama-tiny", "prompt": "Hi", "max_tokens": 1, "stop": ""}`, "stop", "stop strings must not be empty"},
		{`{"model": "llama-tiny", "prompt": [5, 99999], "max_tokens": 1}`, "prompt", "token id 99999 is outside the vocabulary of 8192"},
		{`{"model": "llama-tiny", "prompt": [[5], [-1]], "max_tokens": 1}`, "prompt", "token id -1 is outside the vocabulary of 8192"},
	} {
		resp, body := do(t, http.MethodPost, ts.URL+"/v1/completions", c.body)
		if e := checkErrorShape(t, c.body, resp, body, http.StatusBadRequest, c.want); e["param"] != c.param {
			t.Errorf("%s: param %v, want %s", c.body, e["param"], c.param)
		}
	}
}

// TestClientGoneIsNoServerError: a client that hangs up before its
// answer is not the server's failure. Its request used to be answered
// (to no one) with 500 "context canceled", logged at ERROR and counted as
// a 500 in /metrics, so any client could raise the server's error rate
// at will; it is now 499 (nginx's "client closed request"), logged at
// INFO as other client-side outcomes are.
func TestClientGoneIsNoServerError(t *testing.T) {
	var logs syncBuffer
	ts, _, _ := serveWith(t, Options{Logger: slog.New(slog.NewJSONHandler(&logs, nil))}, engine.Options{},
		func(b llm.Backend) llm.Backend { return slowBackend{b, 20 * time.Millisecond} })
	for i, body := range []string{
		`{"model": "llama-tiny", "prompt": "Once", "max_tokens": 500}`,
		`{"model": "llama-tiny", "prompt": ["Once", "Twice"], "max_tokens": 500}`,
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, ts.URL+"/v1/completions", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if resp, err := http.DefaultClient.Do(req); err == nil {
			t.Fatalf("%s: answered (%d) before the client hung up", body, resp.StatusCode)
		}
		cancel()
		deadline := time.Now().Add(10 * time.Second)
		for strings.Count(logs.String(), `"path":"/v1/completions"`) <= i && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
	}
	m := scrape(t, ts.URL)
	if m[`llmq_http_requests_total{route="/v1/completions",status="500"}`] != 0 || m[`llmq_http_requests_total{route="/v1/completions",status="499"}`] != 2 {
		t.Errorf("two clients that hung up: %v 500s, %v 499s in /metrics", m[`llmq_http_requests_total{route="/v1/completions",status="500"}`], m[`llmq_http_requests_total{route="/v1/completions",status="499"}`])
	}
	if strings.Contains(logs.String(), `"level":"ERROR"`) {
		t.Errorf("a client that hung up logged as an error:\n%s", logs.String())
	}
}
