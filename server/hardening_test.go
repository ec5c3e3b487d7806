package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmq/llmq/backend"
	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	openai "github.com/sashabaranov/go-openai"
)

// tinyEngine is an engine over llama-tiny on the CPU, its backend
// wrapped by wrap when not nil; both are closed when the test ends.
func tinyEngine(t testing.TB, eopt engine.Options, wrap func(llm.Backend) llm.Backend) *engine.Engine {
	t.Helper()
	m, err := backend.Open(shared.Path(t, "models/llama-tiny"), "cpu")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	b := m.Backend
	if wrap != nil {
		b = wrap(b)
	}
	e, err := engine.New(engine.NewModel(b, m.Tokenizer, m.Template), eopt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// serveWith starts a server with opt (Model defaults to llama-tiny) for
// llama-tiny on the CPU, its backend wrapped by wrap when not nil.
func serveWith(t testing.TB, opt Options, eopt engine.Options, wrap func(llm.Backend) llm.Backend) (*httptest.Server, *engine.Engine, *Server) {
	t.Helper()
	e := tinyEngine(t, eopt, wrap)
	if opt.Model == "" {
		opt.Model = "llama-tiny"
	}
	s := New(e, opt)
	ts := httptest.NewServer(s)
	t.Cleanup(ts.Close) // before the engine's and the model's (cleanups run last first)
	return ts, e, s
}

func clientFor(url, key string) *openai.Client {
	cfg := openai.DefaultConfig(key)
	cfg.BaseURL = url + "/v1"
	return openai.NewClientWithConfig(cfg)
}

// do sends one request and returns the response and its body.
func do(t *testing.T, method, url, body string, header ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

// goNames are traces of Go in an error message: type and struct names
// that encoding/json's own messages carry.
var goNames = regexp.MustCompile(`Go |struct|server\.|engine\.|\bu?int(8|16|32|64)?\b|float(32|64)|\[\]|\*[a-z]|json: `)

// checkErrorShape: the body is exactly OpenAI's error object — "error"
// holding message, type, param and code, nothing else — in JSON, its
// message free of Go names and containing want.
func checkErrorShape(t *testing.T, what string, resp *http.Response, body []byte, status int, want string) map[string]any {
	t.Helper()
	if resp.StatusCode != status {
		t.Errorf("%s: status %d, want %d (%s)", what, resp.StatusCode, status, body)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("%s: Content-Type %q", what, ct)
	}
	var outer map[string]json.RawMessage
	if err := json.Unmarshal(body, &outer); err != nil || len(outer) != 1 || outer["error"] == nil {
		t.Fatalf("%s: body %s is not {\"error\": …}", what, body)
	}
	var e map[string]any
	if err := json.Unmarshal(outer["error"], &e); err != nil {
		t.Fatalf("%s: error %s is not an object", what, outer["error"])
	}
	if len(e) != 4 {
		t.Errorf("%s: error has keys %v, want message, type, param, code", what, e)
	}
	msg, _ := e["message"].(string)
	typ, _ := e["type"].(string)
	_, hasParam := e["param"]
	_, hasCode := e["code"]
	if msg == "" || typ == "" || !hasParam || !hasCode {
		t.Errorf("%s: error %v lacks a field", what, e)
	}
	if !strings.Contains(msg, want) {
		t.Errorf("%s: message %q does not say %q", what, msg, want)
	}
	if m := goNames.FindString(msg); m != "" {
		t.Errorf("%s: message %q leaks Go (%q)", what, msg, m)
	}
	return e
}

// TestEveryErrorIsOpenAIShaped (issue 18, point 10): unknown routes (404),
// wrong methods (405 with Allow), malformed and mistyped JSON, and the
// limits all answer in OpenAI's error shape, without Go type names.
func TestEveryErrorIsOpenAIShaped(t *testing.T) {
	ts, _, _ := serveWith(t, Options{MaxBodyBytes: 64 << 10, MaxPromptBytes: 1000}, engine.Options{}, nil)
	for _, c := range []struct {
		method, path, body string
		status             int
		want, param, code  string
	}{
		{"GET", "/v2/everything", "", 404, "no route GET /v2/everything", "", "not_found"},
		{"POST", "/", "{}", 404, "no route POST /", "", "not_found"},
		{"GET", "/v1/chat/completions", "", 405, "use POST", "", "method_not_allowed"},
		{"DELETE", "/v1/models", "", 405, "use GET or HEAD", "", "method_not_allowed"},
		{"POST", "/health", "", 405, "use GET or HEAD", "", "method_not_allowed"},
		{"POST", "/v1/chat/completions", `{"model": "llama-tiny", "messages": "hi"}`, 400, `"messages" must be an array, got a string`, "messages", ""},
		{"POST", "/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": 7}]}`, 400, "content must be a string or a list of text parts", "messages", ""},
		{"POST", "/v1/completions", `{"model": "llama-tiny", "prompt": "x", "max_tokens": "5"}`, 400, `"max_tokens" must be an integer, got a string`, "max_tokens", ""},
		{"POST", "/v1/completions", `{"model": "llama-tiny", "prompt": "x", "max_tokens": 1.5}`, 400, `"max_tokens" must be an integer, got a number`, "max_tokens", ""},
		{"POST", "/v1/completions", `{"model": "llama-tiny", "prompt": "x", "temperature": true}`, 400, `"temperature" must be a number, got a boolean`, "temperature", ""},
		{"POST", "/v1/completions", `{"model": "llama-tiny", "prompt": "x", "stream": "yes"}`, 400, `"stream" must be a boolean, got a string`, "stream", ""},
		{"POST", "/v1/completions", `{"model": 3}`, 400, `"model" must be a string, got a number`, "model", ""},
		{"POST", "/v1/completions", `[1, 2]`, 400, "must be a JSON object, got an array", "", ""},
		{"POST", "/v1/completions", `{"model": "llama-tiny",`, 400, "malformed JSON body", "", ""},
		{"POST", "/v1/completions", `{"model" "llama-tiny"}`, 400, "malformed JSON body at byte 10", "", ""},
		{"POST", "/v1/completions", ``, 400, "the body is empty", "", ""},
		{"POST", "/v1/completions", `{"model": "llama-tiny", "prompt": "` + strings.Repeat("y", 70000) + `"}`, 413, "limit of 65536 bytes", "", "request_too_large"},
		{"POST", "/v1/completions", `{"model": "llama-tiny", "prompt": "` + strings.Repeat("y", 1001) + `"}`, 400, "the prompt has 1001 bytes of text, more than the 1000", "prompt", "context_length_exceeded"},
		{"POST", "/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"doc": "` + strings.Repeat("y", 1000) + `"}}`, 400, "the prompt has 1016 bytes of text, more than the 1000", "messages", "context_length_exceeded"},
		// 900 messages of a one-letter role and no content pass the check of roles and contents, and
		// the template's markup makes them far longer than the limit: that
		// is refused before the text is tokenized.
		{"POST", "/v1/chat/completions", `{"model": "llama-tiny", "messages": [` + strings.Repeat(`{"role": "a", "content": ""},`, 899) + `{"role": "a", "content": ""}]}`,
			400, "the chat template renders the 900 messages into", "messages", "context_length_exceeded"},
		{"POST", "/v1/completions", `{"model": "gpt-5", "prompt": "x"}`, 404, `the model "gpt-5" does not exist`, "model", "model_not_found"},
	} {
		what := c.method + " " + c.path + " " + c.body
		if len(what) > 90 {
			what = what[:90]
		}
		resp, body := do(t, c.method, ts.URL+c.path, c.body, "Content-Type", "application/json")
		e := checkErrorShape(t, what, resp, body, c.status, c.want)
		if p, _ := e["param"].(string); p != c.param {
			t.Errorf("%s: param %v, want %q", what, e["param"], c.param)
		}
		if code, _ := e["code"].(string); code != c.code {
			t.Errorf("%s: code %v, want %q", what, e["code"], c.code)
		}
		if c.status == 405 && resp.Header.Get("Allow") == "" {
			t.Errorf("%s: 405 without Allow", what)
		}
	}
	// go-openai reads the shape: its APIError carries code and status.
	_, err := clientFor(ts.URL, "none").CreateCompletion(context.Background(), openai.CompletionRequest{Model: "no-such-model", Prompt: "x"})
	var apiErr *openai.APIError
	if !errors.As(err, &apiErr) || apiErr.HTTPStatusCode != 404 || apiErr.Code != "model_not_found" || apiErr.Type != "invalid_request_error" {
		t.Errorf("go-openai on an unknown model: %#v", err)
	}
}

// snakeKeys fails on any object key of v that is not snake_case.
func snakeKeys(t *testing.T, where string, v any) {
	t.Helper()
	switch v := v.(type) {
	case map[string]any:
		for k, sub := range v {
			if !regexp.MustCompile(`^[a-z][a-z0-9_]*$`).MatchString(k) {
				t.Errorf("%s: key %q is not snake_case", where, k)
			}
			snakeKeys(t, where+"."+k, sub)
		}
	case []any:
		for _, sub := range v {
			snakeKeys(t, where, sub)
		}
	}
}

// TestHealthLoadingThenReady (point 10): a server made before its engine
// answers /health 503 "loading" and the API 503 model_loading with
// Retry-After, then 200 "ok" once SetEngine hands it the engine; all
// /health keys are snake_case.
func TestHealthLoadingThenReady(t *testing.T) {
	s := New(nil, Options{Model: "llama-tiny"})
	ts := httptest.NewServer(s)
	defer ts.Close()
	resp, body := do(t, "GET", ts.URL+"/health", "")
	var h map[string]any
	json.Unmarshal(body, &h)
	if resp.StatusCode != 503 || h["status"] != "loading" {
		t.Errorf("health while loading: %d %s", resp.StatusCode, body)
	}
	resp, body = do(t, "POST", ts.URL+"/v1/completions", `{"model": "llama-tiny", "prompt": "x"}`)
	if e := checkErrorShape(t, "completion while loading", resp, body, 503, "still loading"); e["code"] != "model_loading" || resp.Header.Get("Retry-After") == "" {
		t.Errorf("completion while loading: %v, Retry-After %q", e, resp.Header.Get("Retry-After"))
	}

	e := tinyEngine(t, engine.Options{}, nil)
	s.SetEngine(e)
	resp, body = do(t, "GET", ts.URL+"/health", "")
	h = nil
	json.Unmarshal(body, &h)
	if resp.StatusCode != 200 || h["status"] != "ok" || !strings.HasPrefix(fmt.Sprint(h["device"]), "cpu") || h["context"] != 2048.0 {
		t.Errorf("health when ready: %d %s", resp.StatusCode, body)
	}
	stats, _ := h["stats"].(map[string]any)
	for _, k := range []string{"queued", "active", "generated_tokens", "kv_cache_tokens"} {
		if _, ok := stats[k]; !ok {
			t.Errorf("health stats %v lack %q", stats, k)
		}
	}
	snakeKeys(t, "health", h)
	if a, err := complete(ts.URL, "Once upon a time", 3, false); err != nil || a.Usage.CompletionTokens != 3 {
		t.Errorf("completion once ready: %+v %v", a, err)
	}
}

// TestAPIKey (point 11): with a key, a missing or wrong bearer token gets
// 401 in OpenAI's shape (go-openai sees invalid_api_key), the right one
// is served, /health stays open and /metrics needs the key.
func TestAPIKey(t *testing.T) {
	const key = "sk-llmq-0123456789"
	ts, _, _ := serveWith(t, Options{APIKey: key}, engine.Options{}, nil)
	req := openai.CompletionRequest{Model: "llama-tiny", Prompt: "Once upon a time", MaxTokens: 2}
	for _, bad := range []string{"", "sk-llmq-0123456788", "sk-llmq-012345678", key + "0"} {
		_, err := clientFor(ts.URL, bad).CreateCompletion(context.Background(), req)
		var apiErr *openai.APIError
		if !errors.As(err, &apiErr) || apiErr.HTTPStatusCode != 401 || apiErr.Code != "invalid_api_key" {
			t.Errorf("key %q: %v", bad, err)
		}
	}
	resp, body := do(t, "GET", ts.URL+"/v1/models", "")
	checkErrorShape(t, "no Authorization", resp, body, 401, "missing API key")
	if resp.Header.Get("WWW-Authenticate") == "" {
		t.Error("401 without WWW-Authenticate")
	}
	resp, body = do(t, "GET", ts.URL+"/v1/models", "", "Authorization", "Basic "+key)
	checkErrorShape(t, "Basic scheme", resp, body, 401, "incorrect API key")
	if _, err := clientFor(ts.URL, key).CreateCompletion(context.Background(), req); err != nil {
		t.Errorf("the right key: %v", err)
	}
	if resp, body := do(t, "GET", ts.URL+"/v1/models", "", "Authorization", "bearer "+key); resp.StatusCode != 200 {
		t.Errorf("lower-case scheme: %d %s", resp.StatusCode, body)
	}
	if resp, _ := do(t, "GET", ts.URL+"/health", ""); resp.StatusCode != 200 {
		t.Errorf("/health without a key: %d", resp.StatusCode)
	}
	if resp, _ := do(t, "GET", ts.URL+"/metrics", ""); resp.StatusCode != 401 {
		t.Errorf("/metrics without a key: %d", resp.StatusCode)
	}
}

// stepGate holds each forward pass until the test lets one through (a
// send on release) or all (closing release).
type stepGate struct {
	llm.Backend
	entered chan struct{}
	release chan struct{}
}

func newStepGate() *stepGate {
	return &stepGate{entered: make(chan struct{}, 100), release: make(chan struct{})}
}

func (g *stepGate) Forward(ctx context.Context, steps []llm.Step) error {
	g.entered <- struct{}{}
	<-g.release
	return g.Backend.Forward(ctx, steps)
}

func (g *stepGate) wrap(b llm.Backend) llm.Backend { g.Backend = b; return g }

// TestConcurrencyLimit (point 11): past MaxConcurrent requests in flight,
// the next one gets 429 with Retry-After, in OpenAI's shape, before its
// body is even read; once the first ends, requests are served again.
func TestConcurrencyLimit(t *testing.T) {
	g := newStepGate()
	ts, _, _ := serveWith(t, Options{MaxConcurrent: 1}, engine.Options{}, g.wrap)
	done := make(chan error, 1)
	go func() { _, err := complete(ts.URL, "Once upon a time", 2, false); done <- err }()
	<-g.entered
	resp, body := do(t, "POST", ts.URL+"/v1/completions", `{"model": "llama-tiny", "prompt": "x", "max_tokens": 1}`)
	checkErrorShape(t, "second request", resp, body, 429, "handles 1 at once")
	if resp.Header.Get("Retry-After") == "" {
		t.Error("429 without Retry-After")
	}
	close(g.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := complete(ts.URL, "Once upon a time", 1, false); err != nil {
		t.Errorf("after the first ended: %v", err)
	}
}

// TestRateLimit (point 11): at 0.5 requests a second with bursts of 2,
// the third request in a row gets 429 and a Retry-After of 1–2 s.
func TestRateLimit(t *testing.T) {
	ts, _, _ := serveWith(t, Options{RateLimit: 0.5, RateBurst: 2}, engine.Options{}, nil)
	for i := range 2 {
		if _, err := complete(ts.URL, "Once upon a time", 1, false); err != nil {
			t.Fatalf("request %d within the burst: %v", i, err)
		}
	}
	resp, body := do(t, "POST", ts.URL+"/v1/completions", `{"model": "llama-tiny", "prompt": "x", "max_tokens": 1}`)
	e := checkErrorShape(t, "third request", resp, body, 429, "rate limit reached")
	ra, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	if err != nil || ra < 1 || ra > 2 || e["code"] != "rate_limit_exceeded" {
		t.Errorf("Retry-After %q, code %v", resp.Header.Get("Retry-After"), e["code"])
	}
	// Other routes are not limited.
	if resp, _ := do(t, "GET", ts.URL+"/v1/models", ""); resp.StatusCode != 200 {
		t.Errorf("/v1/models under the rate limit: %d", resp.StatusCode)
	}
}

// TestRequestTimeout (point 11): a generation that outlives
// RequestTimeout ends with 504 in OpenAI's shape, and its sequence leaves
// the engine.
func TestRequestTimeout(t *testing.T) {
	g := newStepGate()
	ts, e, _ := serveWith(t, Options{RequestTimeout: 300 * time.Millisecond}, engine.Options{}, g.wrap)
	go func() {
		<-g.entered // hold the first forward pass past the deadline
		time.Sleep(600 * time.Millisecond)
		close(g.release)
		for range g.entered {
		}
	}()
	resp, body := do(t, "POST", ts.URL+"/v1/completions", `{"model": "llama-tiny", "prompt": "Once upon a time", "max_tokens": 50}`)
	checkErrorShape(t, "slow generation", resp, body, 504, "request timeout of 300ms")
	deadline := time.Now().Add(5 * time.Second)
	for e.Stats().Active > 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if st := e.Stats(); st.Active != 0 {
		t.Errorf("the timed-out sequence still runs: %+v", st)
	}
}

// slowBackend makes every forward pass take at least d.
type slowBackend struct {
	llm.Backend
	d time.Duration
}

func (s slowBackend) Forward(ctx context.Context, steps []llm.Step) error {
	time.Sleep(s.d)
	return s.Backend.Forward(ctx, steps)
}

// TestServerTimeouts (point 11): Serve's read-header and read timeouts
// close connections that dribble their headers or body (slowloris), while
// a stream that runs well past the read timeout is not cut.
func TestServerTimeouts(t *testing.T) {
	e := tinyEngine(t, engine.Options{}, func(b llm.Backend) llm.Backend { return slowBackend{b, 30 * time.Millisecond} })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() {
		served <- Serve(ctx, ln, New(e, Options{Model: "llama-tiny"}),
			ServeOptions{ReadHeaderTimeout: 200 * time.Millisecond, ReadTimeout: 400 * time.Millisecond, IdleTimeout: time.Second})
	}()
	defer func() { stop(); <-served }()
	url := "http://" + ln.Addr().String()

	// closedWithin: the server hangs up on a client that sent only part
	// of its request.
	closedWithin := func(what, partial string, limit time.Duration) {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		start := time.Now()
		if _, err := c.Write([]byte(partial)); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		io.Copy(io.Discard, c) // until the server closes the connection
		if d := time.Since(start); d > limit {
			t.Errorf("%s: connection held for %v", what, d)
		}
	}
	closedWithin("headers never finished", "POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 2*time.Second)
	closedWithin("body never finished", "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\"", 2*time.Second)

	// 40 tokens at ≥ 30 ms each: well past the 400 ms read timeout.
	start := time.Now()
	a, err := complete(url, "Once upon a time", 40, true)
	if err != nil {
		t.Fatalf("long stream: %v", err)
	}
	if a.Finish != "length" || a.Usage.CompletionTokens != 40 {
		t.Errorf("long stream ended %q after %d tokens", a.Finish, a.Usage.CompletionTokens)
	}
	if d := time.Since(start); d < 400*time.Millisecond {
		t.Errorf("the stream took %v, not past the read timeout: the test proves nothing", d)
	}
}

// syncBuffer is a bytes.Buffer safe for the logger and the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestRequestIDAndLogs (point 11): each request gets its own id in
// X-Request-Id, and its one JSON log line carries that id, the route,
// the status and the token counts.
func TestRequestIDAndLogs(t *testing.T) {
	var logs syncBuffer
	ts, _, _ := serveWith(t, Options{Logger: slog.New(slog.NewJSONHandler(&logs, nil))}, engine.Options{}, nil)
	body := `{"model": "llama-tiny", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}`
	r1, _ := do(t, "POST", ts.URL+"/v1/completions", body)
	r2, _ := do(t, "GET", ts.URL+"/nowhere", "")
	id1, id2 := r1.Header.Get("X-Request-Id"), r2.Header.Get("X-Request-Id")
	idPattern := regexp.MustCompile(`^req-[0-9a-f]{16}$`)
	if !idPattern.MatchString(id1) || !idPattern.MatchString(id2) || id1 == id2 {
		t.Fatalf("request ids %q and %q", id1, id2)
	}
	lines := map[string]map[string]any{}
	sc := bufio.NewScanner(strings.NewReader(logs.String()))
	for sc.Scan() {
		var l map[string]any
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("log line %q is not JSON: %v", sc.Text(), err)
		}
		id, _ := l["request_id"].(string)
		lines[id] = l
	}
	l1, l2 := lines[id1], lines[id2]
	if l1 == nil || l1["msg"] != "request" || l1["path"] != "/v1/completions" || l1["status"] != 200.0 ||
		l1["prompt_tokens"] != 5.0 || l1["completion_tokens"] != 3.0 || l1["level"] != "INFO" {
		t.Errorf("log of the completion: %v", l1)
	}
	if l2 == nil || l2["status"] != 404.0 || !strings.Contains(fmt.Sprint(l2["error"]), "no route") {
		t.Errorf("log of the 404: %v", l2)
	}
}

// metricLine is one sample of the text exposition format.
var metricLine = regexp.MustCompile(`^([a-z_]+)(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? (-?[0-9.e+]+|\+Inf)$`)

// scrape reads /metrics, checks every line against the text format
// (HELP and TYPE before each family's samples, samples well formed) and
// returns the samples by name with labels.
func scrape(t *testing.T, url string) map[string]float64 {
	t.Helper()
	resp, body := do(t, "GET", url+"/metrics", "")
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain; version=0.0.4") {
		t.Fatalf("/metrics: %d %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	out := map[string]float64{}
	typed := map[string]string{}
	for _, line := range strings.Split(strings.TrimSuffix(string(body), "\n"), "\n") {
		if f := strings.Fields(line); len(f) >= 4 && f[0] == "#" && f[1] == "TYPE" {
			typed[f[2]] = f[3]
			continue
		}
		if strings.HasPrefix(line, "# HELP ") {
			continue
		}
		m := metricLine.FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("/metrics line %q is not in the text format", line)
		}
		family := m[1]
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			if base, ok := strings.CutSuffix(family, suf); ok && typed[base] == "histogram" {
				family = base
			}
		}
		if typed[family] == "" {
			t.Errorf("/metrics: %s has no TYPE line before it", m[1])
		}
		v, err := strconv.ParseFloat(strings.Replace(m[4], "+Inf", "Inf", 1), 64)
		if err != nil {
			t.Fatalf("/metrics line %q: %v", line, err)
		}
		out[m[1]+m[2]] = v
	}
	return out
}

// llamaTinyConfig reads the fields the KV cache's size depends on from
// config.json.
func llamaTinyConfig(t *testing.T) (layers, kvHeads, headDim int) {
	raw, err := os.ReadFile(shared.Path(t, "models/llama-tiny/config.json"))
	if err != nil {
		t.Fatal(err)
	}
	var c struct {
		Layers  int `json:"num_hidden_layers"`
		Heads   int `json:"num_attention_heads"`
		KVHeads int `json:"num_key_value_heads"`
		Hidden  int `json:"hidden_size"`
		HeadDim int `json:"head_dim"`
	}
	if err := json.Unmarshal(raw, &c); err != nil {
		t.Fatal(err)
	}
	if c.HeadDim == 0 {
		c.HeadDim = c.Hidden / c.Heads
	}
	return c.Layers, c.KVHeads, c.HeadDim
}

// TestMetrics (point 11): /metrics, in Prometheus' text format, counts
// requests by route and status, tokens (five prompt tokens per "Once upon
// a time", counted by hand in TestCompletionsMatchReference), the
// time-to-first-token histogram (cumulative buckets ending at the count),
// and during a generation the queue, the active sequences and the KV
// cache: its tokens and bytes (2 × layers × kv heads × 16 positions (a
// block) × head dim × 4 bytes, from config.json).
func TestMetrics(t *testing.T) {
	g := newStepGate()
	ts, _, _ := serveWith(t, Options{}, engine.Options{MaxBatch: 1}, g.wrap)
	done := make(chan error, 2)
	go func() { _, err := complete(ts.URL, "Once upon a time", 4, false); done <- err }()
	<-g.entered
	g.release <- struct{}{} // the prefill
	<-g.entered             // the first decode step: the cache holds the prompt
	go func() { _, err := complete(ts.URL, "Once upon a time", 4, false); done <- err }()
	var during map[string]float64
	for range 200 {
		if during = scrape(t, ts.URL); during["llmq_queue_depth"] == 1 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	layers, kvh, hd := llamaTinyConfig(t)
	wantBytes := float64(2 * layers * kvh * 16 * hd * 4) // a block of 16 positions a layer
	for name, want := range map[string]float64{"llmq_queue_depth": 1, "llmq_active_sequences": 1, "llmq_requests_in_flight": 2,
		"llmq_kv_cache_tokens": 5, "llmq_kv_cache_bytes": wantBytes, "llmq_model_loaded": 1} {
		if got, ok := during[name]; !ok || got != want {
			t.Errorf("during the generation %s = %v, want %v", name, got, want)
		}
	}
	close(g.release)
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	do(t, "POST", ts.URL+"/v1/completions", `{"model": "gpt-5", "prompt": "x"}`)
	do(t, "GET", ts.URL+"/nowhere", "")
	do(t, "GET", ts.URL+"/v1/completions", "")

	after := scrape(t, ts.URL)
	for name, want := range map[string]float64{
		`llmq_http_requests_total{route="/v1/completions",status="200"}`: 2,
		`llmq_http_requests_total{route="/v1/completions",status="404"}`: 1,
		`llmq_http_requests_total{route="/v1/completions",status="405"}`: 1,
		`llmq_http_requests_total{route="other",status="404"}`:           1,
		`llmq_prompt_tokens_total`:                                       10,
		`llmq_completion_tokens_total`:                                   8,
		`llmq_time_to_first_token_seconds_count`:                         2,
		`llmq_time_to_first_token_seconds_bucket{le="+Inf"}`:             2,
		`llmq_queue_depth`:        0,
		`llmq_active_sequences`:   0,
		`llmq_requests_in_flight`: 0,
	} {
		if got, ok := after[name]; !ok || got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	if after[`llmq_http_requests_total{route="/metrics",status="200"}`] < 1 {
		t.Error("the scrapes are not counted")
	}
	prev := 0.0
	for _, le := range ttftBuckets {
		v := after[fmt.Sprintf(`llmq_time_to_first_token_seconds_bucket{le="%s"}`, strconv.FormatFloat(le, 'g', -1, 64))]
		if v < prev {
			t.Errorf("histogram bucket le=%v: %v below the previous %v", le, v, prev)
		}
		prev = v
	}
	if sum := after["llmq_time_to_first_token_seconds_sum"]; sum <= 0 {
		t.Errorf("time to first token sum %v", sum)
	}
}

// TestPromptBytesLimitDefault (point 9): by default a prompt is refused
// before tokenizing when it has more bytes than the context could hold:
// 2048 tokens × the longest token of tokenizer.json (found here from the
// file itself).
func TestPromptBytesLimitDefault(t *testing.T) {
	raw, err := os.ReadFile(shared.Path(t, "models/llama-tiny/tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	var tj struct {
		Model struct {
			Vocab map[string]int `json:"vocab"`
		} `json:"model"`
		Added []struct {
			Content string `json:"content"`
		} `json:"added_tokens"`
	}
	if err := json.Unmarshal(raw, &tj); err != nil {
		t.Fatal(err)
	}
	longest := 4
	for tok := range tj.Model.Vocab {
		longest = max(longest, len(tok))
	}
	for _, a := range tj.Added {
		longest = max(longest, len(a.Content))
	}
	limit := 2048 * longest
	ts, _, _ := serveWith(t, Options{}, engine.Options{}, nil)
	over := strings.Repeat("ab ", limit/3+1)
	resp, body := do(t, "POST", ts.URL+"/v1/completions", `{"model": "llama-tiny", "max_tokens": 1, "prompt": "`+over+`"}`)
	checkErrorShape(t, "prompt over the default", resp, body, 400, fmt.Sprintf("more than the %d this server takes (the model's context of 2048 tokens × %d bytes", limit, longest))
	chat := `{"model": "llama-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "` + over[:limit/2] + `"}, {"role": "user", "content": "` + over[:limit/2+1] + `"}]}`
	resp, body = do(t, "POST", ts.URL+"/v1/chat/completions", chat)
	// The text counted: both contents and both roles ("user").
	e := checkErrorShape(t, "chat over the default", resp, body, 400, fmt.Sprintf("the prompt has %d bytes", limit/2+limit/2+1+2*len("user")))
	if e["param"] != "messages" {
		t.Errorf("param %v", e["param"])
	}
}

// TestBodyLimitWithoutLength (point 9): a chunked body (no Content-Length
// to refuse it by) is cut at the limit while it is read: 413 all the same.
func TestBodyLimitWithoutLength(t *testing.T) {
	ts, _, _ := serveWith(t, Options{MaxBodyBytes: 1000}, engine.Options{}, nil)
	body := io.MultiReader(strings.NewReader(`{"model": "llama-tiny", "prompt": "`), strings.NewReader(strings.Repeat("z", 5000)+`"}`))
	req, err := http.NewRequest("POST", ts.URL+"/v1/completions", body)
	if err != nil {
		t.Fatal(err)
	}
	if req.ContentLength != 0 {
		t.Fatalf("the request has a Content-Length (%d): the test would not read the body", req.ContentLength)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	checkErrorShape(t, "chunked body over the limit", resp, b, 413, "limit of 1000 bytes")
}

// TestRequestTimeoutWhileQueued (point 11): a request still waiting for a
// batch slot when its deadline passes is answered 504 then, not when the
// batch ahead of it frees a slot.
func TestRequestTimeoutWhileQueued(t *testing.T) {
	g := newStepGate()
	ts, e, _ := serveWith(t, Options{RequestTimeout: 300 * time.Millisecond}, engine.Options{MaxBatch: 1}, g.wrap)
	first := make(chan int, 1)
	go func() {
		resp, _ := do(t, "POST", ts.URL+"/v1/completions", `{"model": "llama-tiny", "prompt": "Once upon a time", "max_tokens": 2}`)
		first <- resp.StatusCode
	}()
	<-g.entered // the first request holds the only slot
	type answer struct {
		resp *http.Response
		body []byte
	}
	second := make(chan answer, 1)
	go func() {
		resp, body := do(t, "POST", ts.URL+"/v1/completions", `{"model": "llama-tiny", "prompt": "The history of", "max_tokens": 2}`)
		second <- answer{resp, body}
	}()
	select {
	case a := <-second:
		checkErrorShape(t, "queued request", a.resp, a.body, 504, "request timeout of 300ms")
		close(g.release)
	case <-time.After(5 * time.Second):
		close(g.release)
		t.Fatal("the queued request was not answered within 5 s of its 300 ms deadline")
	}
	if s := <-first; s != 504 { // it was held past its own deadline
		t.Errorf("the first request: %d", s)
	}
	deadline := time.Now().Add(5 * time.Second)
	for (e.Stats().Active > 0 || e.Stats().Queued > 0) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if st := e.Stats(); st.Active != 0 || st.Queued != 0 {
		t.Errorf("sequences left behind: %+v", st)
	}
}

// TestDefaultMaxTokens: a request that names no max_tokens generates at
// most the server's default (here 5), not to the end of the context.
func TestDefaultMaxTokens(t *testing.T) {
	ts, _, _ := serveWith(t, Options{DefaultMaxTokens: 5}, engine.Options{}, nil)
	resp, body := do(t, "POST", ts.URL+"/v1/completions", `{"model": "llama-tiny", "prompt": "The history of the", "temperature": 0}`)
	var out struct {
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		}
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		}
	}
	if err := json.Unmarshal(body, &out); err != nil || resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if out.Usage.CompletionTokens != 5 || out.Choices[0].FinishReason != "length" {
		t.Errorf("%d tokens, finish %q; want 5 and length", out.Usage.CompletionTokens, out.Choices[0].FinishReason)
	}
}
