// Package server is an OpenAI-compatible HTTP API over an engine.Engine:
//
//	POST /v1/chat/completions   chat, streaming (server-sent events) or not
//	POST /v1/completions        plain-text completion, likewise
//	GET  /v1/models             the one model served
//	GET  /health                "loading" (503) until the model is ready, then "ok"
//	GET  /metrics               Prometheus text format
//
// Requests follow the OpenAI schema (model, messages or prompt,
// max_tokens / max_completion_tokens, temperature, top_p, stop, seed,
// stream, stream_options.include_usage) and answers carry usage counts.
// Log-probabilities come in each API's shape: on /v1/completions,
// logprobs (0–5) and echo in the legacy form {tokens, token_logprobs,
// top_logprobs, text_offset}, echo with max_tokens 0 scoring the prompt
// alone, and prompts as text, token ids or a list of either (one choice
// each) — what evaluation harnesses send; on /v1/chat/completions,
// logprobs true with top_logprobs (0–20). Streamed chunks carry their
// tokens' log-probabilities.
//
// Chat requests may carry chat_template_kwargs, further variables for the
// model's chat template as vLLM takes them (Qwen3's {"enable_thinking":
// false}), but not those the server renders with (messages,
// add_generation_prompt, bos_token, eos_token); assistant messages may
// carry reasoning_content, for templates that render it. A thinking
// model's answer — its chat template writes think blocks: it mentions
// </think> — comes back as vLLM's reasoning parsers return it: the think
// block's text, without its tags and the whitespace around them, as
// message.reasoning_content, and what follows as content; streamed, the
// deltas carry reasoning_content until </think> and content after it
// (the delta that crosses the tag may carry both), never a tag (text that
// may begin one waits for the next token); reasoning_content is left out
// where there is no reasoning. An
// answer that does not open a think block is all content, as is the
// answer to a prompt that closed one itself (Qwen3 with enable_thinking
// false); a prompt that opens one (ends in <think>) makes the answer
// start as reasoning; a think block that never closes (max_tokens
// reached while thinking) makes it all reasoning. See reasoning.go.
//
// Every error, whatever the route, is answered in OpenAI's shape
// {"error": {"message", "type", "param", "code"}}: 400 for malformed JSON
// and invalid parameters (a prompt longer than the context, max_tokens
// past it), 401 for a missing or wrong API key, 403 for a POST that a
// browser marks as cross-origin (CSRF), 404 for an unknown model or
// route, 405 for a wrong method, 413 for a body over the limit, 429
// with Retry-After past the rate or concurrency limit, 503 with
// Retry-After while the model loads or when the engine's queue is full,
// 504 when a generation outlives the request timeout. A client that
// disconnects cancels its generation (its request is logged and counted
// with nginx's 499, not as a server error).
//
// A server can start before its model is loaded (New with a nil engine,
// then SetEngine), so that a listener is bound at once and clients see
// 503 "loading" rather than a refused connection. Each request gets an id,
// returned as X-Request-Id and carried by its structured log line.
package server

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/chat"
)

// Options configure a Server. The zero value serves without limits other
// than a 1 MiB body and the model's context.
type Options struct {
	Model        string // the model's name in requests and /v1/models
	MaxBodyBytes int64  // request body limit (default 1 MiB): 413 beyond it
	// DefaultMaxTokens bounds a request that names no max_tokens
	// (DefaultMaxTokensValue when 0), and the room left in the context
	// (or in a bounded KV cache, engine.MaxSequence) bounds it again:
	// without it, a request would generate to the end of the context
	// (131,072 tokens for Llama-3.1). A request that names max_tokens
	// gets 400 (context_length_exceeded) when prompt + max_tokens exceed
	// the context, or a KV cache that could not hold it even alone.
	DefaultMaxTokens int
	// MaxPromptBytes limits a prompt's text (a completion's prompt, or the
	// sum of a chat's message roles and contents) before it is tokenized: 400
	// beyond it. By default it is the longest prompt that could fit the
	// context: the context's tokens × the longest token's bytes.
	MaxPromptBytes int
	// APIKey, when set, is required on every route but /health as
	// "Authorization: Bearer APIKey"; requests without it get 401.
	APIKey string
	// MaxConcurrent is the most generation requests handled at once
	// (tokenizing, queued or running); beyond it they get 429. 0: no limit.
	MaxConcurrent int
	// RateLimit is the generation requests admitted per second, in bursts
	// of up to RateBurst (default: RateLimit rounded up); beyond it they
	// get 429 with Retry-After. 0: no limit.
	RateLimit float64
	RateBurst int
	// RequestTimeout bounds a generation (queueing included): past it a
	// request ends with 504 (an error event when streaming). 0: no limit.
	RequestTimeout time.Duration
	// WriteTimeout bounds each write of an answer (default 30 s): a
	// client that stops reading fills the socket's buffers and blocks the
	// write, which no context interrupts; past WriteTimeout its
	// connection is closed, which ends its generation and frees its
	// concurrency slot. A stream that the client reads is never cut.
	WriteTimeout time.Duration
	// Logger receives one line per request (nil: no logs).
	Logger *slog.Logger
}

// Server serves one engine.
type Server struct {
	eng     atomic.Pointer[engine.Engine]
	opt     Options
	created int64
	ids     atomic.Int64
	routes  map[string]map[string]handler
	keyHash [sha256.Size]byte
	slots   chan struct{} // nil: no concurrency limit
	bucket  *tokenBucket  // nil: no rate limit
	m       *metrics
	log     *slog.Logger
	// csrf refuses POSTs that browsers mark as cross-origin: a page the
	// user visits could otherwise run generations on a server without an
	// API key (on localhost, say) with a "simple" request, no preflight.
	csrf http.CrossOriginProtection
}

// handler is a route's handler; rs carries what the request's log line
// and metrics need.
type handler func(w http.ResponseWriter, r *http.Request, rs *reqState)

// reqState is what a request leaves for its log line.
type reqState struct {
	id                             string
	promptTokens, completionTokens int
	err                            string
}

// New makes the HTTP handler of an engine. e may be nil: the server then
// answers 503 "loading" until SetEngine hands it the engine.
func New(e *engine.Engine, opt Options) *Server {
	if opt.MaxBodyBytes <= 0 {
		opt.MaxBodyBytes = 1 << 20
	}
	if opt.WriteTimeout <= 0 {
		opt.WriteTimeout = DefaultWriteTimeout
	}
	s := &Server{opt: opt, created: time.Now().Unix(), m: newMetrics(), log: opt.Logger}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if opt.APIKey != "" {
		s.keyHash = sha256.Sum256([]byte(opt.APIKey))
	}
	if opt.MaxConcurrent > 0 {
		s.slots = make(chan struct{}, opt.MaxConcurrent)
	}
	if opt.RateLimit > 0 {
		burst := opt.RateBurst
		if burst <= 0 {
			burst = int(opt.RateLimit + 0.999)
		}
		s.bucket = newTokenBucket(opt.RateLimit, burst)
	}
	s.routes = map[string]map[string]handler{
		"/v1/chat/completions": {http.MethodPost: s.chatCompletions},
		"/v1/completions":      {http.MethodPost: s.completions},
		"/v1/models":           {http.MethodGet: s.models, http.MethodHead: s.models},
		"/health":              {http.MethodGet: s.health, http.MethodHead: s.health},
		"/metrics":             {http.MethodGet: s.metricsPage, http.MethodHead: s.metricsPage},
	}
	if e != nil {
		s.SetEngine(e)
	}
	return s
}

// SetEngine hands the server its engine once the model is loaded: from
// then on requests are served and /health answers "ok".
func (s *Server) SetEngine(e *engine.Engine) { s.eng.Store(e) }

func (s *Server) engine() *engine.Engine { return s.eng.Load() }

var errLoading = &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "model_loading", RetryAfter: 1,
	Message: "the model is still loading; retry shortly (GET /health answers 200 once it is ready)"}

// DefaultWriteTimeout is Options.WriteTimeout when it is 0.
const DefaultWriteTimeout = 30 * time.Second

// statusWriter records the status code and whether a body began, and
// gives each write (and flush) writeTimeout to reach the client.
type statusWriter struct {
	http.ResponseWriter
	status       int
	rc           *http.ResponseController
	writeTimeout time.Duration
}

// deadline moves the connection's write deadline to writeTimeout from
// now. (A ResponseWriter without deadlines, a test's recorder, has none.)
func (w *statusWriter) deadline() {
	w.rc.SetWriteDeadline(time.Now().Add(w.writeTimeout))
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	w.deadline()
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Flush() {
	w.deadline()
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the connection.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func newRequestID() string {
	var b [8]byte
	rand.Read(b[:]) // never fails (crypto/rand panics rather)
	return "req-" + hex.EncodeToString(b[:])
}

// ServeHTTP routes a request: an id, the route (404 and 405 in OpenAI's
// shape), the cross-origin check, the API key, the handler; then its
// metrics and log line.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	rs := &reqState{id: newRequestID()}
	sw := &statusWriter{ResponseWriter: w, rc: http.NewResponseController(w), writeTimeout: s.opt.WriteTimeout}
	sw.Header().Set("X-Request-Id", rs.id)
	route := "other" // unknown paths share one label: bounded cardinality
	methods, known := s.routes[r.URL.Path]
	switch {
	case !known:
		writeError(sw, rs, &apiError{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "not_found",
			Message: fmt.Sprintf("no route %.20s %.200s: this server answers POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health and GET /metrics", r.Method, r.URL.Path)})
	case methods[r.Method] == nil:
		route = r.URL.Path
		allowed := slices.Sorted(maps.Keys(methods))
		sw.Header().Set("Allow", strings.Join(allowed, ", "))
		writeError(sw, rs, &apiError{Status: http.StatusMethodNotAllowed, Type: "invalid_request_error", Code: "method_not_allowed",
			Message: fmt.Sprintf("%s does not answer %.20s; use %s", r.URL.Path, r.Method, strings.Join(allowed, " or "))})
	case s.csrf.Check(r) != nil:
		route = r.URL.Path
		writeError(sw, rs, &apiError{Status: http.StatusForbidden, Type: "invalid_request_error", Code: "cross_origin_request",
			Message: "cross-origin browser requests are refused: call this server from a program, or from a page of its own origin"})
	case r.URL.Path != "/health" && !s.authorized(r):
		route = r.URL.Path
		sw.Header().Set("WWW-Authenticate", `Bearer realm="llmq"`)
		writeError(sw, rs, unauthorized(r))
	default:
		route = r.URL.Path
		methods[r.Method](sw, r, rs)
	}
	status := sw.status
	if status == 0 {
		status = http.StatusOK
	}
	s.m.request(route, status)
	level := slog.LevelInfo // client errors too: they are the client's
	switch {
	case status == http.StatusServiceUnavailable:
		level = slog.LevelWarn // loading, a full queue, shutting down
	case status >= 500:
		level = slog.LevelError
	}
	attrs := []slog.Attr{
		slog.String("request_id", rs.id), slog.String("method", r.Method), slog.String("path", r.URL.Path),
		slog.Int("status", status), slog.Duration("duration", time.Since(start)), slog.String("remote", r.RemoteAddr),
	}
	if rs.promptTokens > 0 {
		attrs = append(attrs, slog.Int("prompt_tokens", rs.promptTokens), slog.Int("completion_tokens", rs.completionTokens))
	}
	if rs.err != "" {
		attrs = append(attrs, slog.String("error", rs.err))
	}
	s.log.LogAttrs(r.Context(), level, "request", attrs...)
}

// ServeOptions configure Serve: the HTTP server's timeouts and shutdown.
type ServeOptions struct {
	// Grace is how long in-flight requests may run on after shutdown
	// begins (default 30 s).
	Grace time.Duration
	// ReadHeaderTimeout bounds reading a request's headers (default 10 s),
	// ReadTimeout the whole request, body included (default 60 s; it does
	// not bound the answer: a long generation streams on), IdleTimeout a
	// kept-alive connection's wait for its next request (default 120 s).
	// There is no overall write timeout, which would cut long streams:
	// Options.RequestTimeout bounds generations, and Options.WriteTimeout
	// each write to a client that stopped reading.
	ReadHeaderTimeout, ReadTimeout, IdleTimeout time.Duration
	// Logger receives the HTTP server's own errors (nil: discarded).
	Logger *slog.Logger
}

func (o ServeOptions) withDefaults() ServeOptions {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&o.Grace, 30*time.Second)
	def(&o.ReadHeaderTimeout, 10*time.Second)
	def(&o.ReadTimeout, 60*time.Second)
	def(&o.IdleTimeout, 120*time.Second)
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// Serve runs h on ln until ctx is cancelled, then shuts down gracefully:
// it stops accepting connections and lets in-flight requests (streams
// included) finish for up to opt.Grace, after which their connections
// are closed, which cancels their generations.
func Serve(ctx context.Context, ln net.Listener, h http.Handler, opt ServeOptions) error {
	opt = opt.withDefaults()
	srv := &http.Server{Handler: h, ReadHeaderTimeout: opt.ReadHeaderTimeout, ReadTimeout: opt.ReadTimeout,
		IdleTimeout: opt.IdleTimeout, ErrorLog: slog.NewLogLogger(opt.Logger.Handler(), slog.LevelWarn)}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), opt.Grace)
	defer cancel()
	err := srv.Shutdown(sctx)
	if errors.Is(err, context.DeadlineExceeded) {
		srv.Close()
		err = fmt.Errorf("shutdown: requests still running after %v were cut off", opt.Grace)
	}
	<-errc
	return err
}

// params are the generation fields both endpoints share.
type params struct {
	Model               string          `json:"model"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Temperature         *float64        `json:"temperature"`
	TopP                *float64        `json:"top_p"`
	Stop                json.RawMessage `json:"stop"`
	Seed                *int64          `json:"seed"`
	N                   *int            `json:"n"`
	Stream              bool            `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	// Logprobs is an integer (0–5) on /v1/completions, a boolean on
	// /v1/chat/completions (with TopLogprobs, 0–20): read per route.
	Logprobs    json.RawMessage `json:"logprobs"`
	TopLogprobs *int            `json:"top_logprobs"`
}

// maxCompletionLogprobs is the legacy completions API's limit on
// logprobs (the alternatives reported at each position).
const maxCompletionLogprobs = 5

// logprobOptions are what a request asks for: per-token logprobs with
// top alternatives, the prompt's too (echo), or neither.
type logprobOptions struct {
	want bool // logprobs were asked for
	top  int  // alternatives at each position
	echo bool // completions: return the prompt (and its logprobs) too
}

// completionLogprobs reads a completion's "logprobs": null or an integer
// from 0 to 5.
func completionLogprobs(raw json.RawMessage) (logprobOptions, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return logprobOptions{}, nil
	}
	var n int
	if err := json.Unmarshal(raw, &n); err != nil {
		return logprobOptions{}, invalid("logprobs", "logprobs must be an integer from 0 to %d (the alternatives reported at each token) or null on /v1/completions", maxCompletionLogprobs)
	}
	if n < 0 || n > maxCompletionLogprobs {
		return logprobOptions{}, invalid("logprobs", "logprobs must be from 0 to %d, got %d", maxCompletionLogprobs, n)
	}
	return logprobOptions{want: true, top: n}, nil
}

// chatLogprobs reads a chat's "logprobs" (a boolean) and "top_logprobs"
// (0–20, only with logprobs true), as OpenAI's chat API has them.
func chatLogprobs(raw json.RawMessage, top *int) (logprobOptions, error) {
	var want bool
	if len(raw) != 0 && string(raw) != "null" {
		if err := json.Unmarshal(raw, &want); err != nil {
			return logprobOptions{}, invalid("logprobs", "logprobs must be a boolean on /v1/chat/completions (ask for alternatives with top_logprobs, 0 to %d); the integer form is the legacy /v1/completions API's", engine.MaxTopLogprobs)
		}
	}
	if top == nil {
		return logprobOptions{want: want}, nil
	}
	switch {
	case *top < 0 || *top > engine.MaxTopLogprobs:
		return logprobOptions{}, invalid("top_logprobs", "top_logprobs must be from 0 to %d, got %d", engine.MaxTopLogprobs, *top)
	case !want && *top > 0:
		return logprobOptions{}, invalid("top_logprobs", "top_logprobs needs logprobs: true")
	}
	return logprobOptions{want: want, top: *top}, nil
}

// decode reads a JSON body within the size limit.
// A body whose Content-Length is over the limit is refused unread.
func (s *Server) decode(w http.ResponseWriter, r *http.Request, v any) error {
	tooLarge := &apiError{Status: http.StatusRequestEntityTooLarge, Type: "invalid_request_error", Code: "request_too_large",
		Message: fmt.Sprintf("request body larger than this server's limit of %d bytes", s.opt.MaxBodyBytes)}
	if r.ContentLength > s.opt.MaxBodyBytes {
		return tooLarge
	}
	body := http.MaxBytesReader(w, r.Body, s.opt.MaxBodyBytes)
	if err := json.NewDecoder(body).Decode(v); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return tooLarge
		}
		return jsonError(err)
	}
	return nil
}

// maxPromptBytes is the prompt text limit (Options.MaxPromptBytes).
func (s *Server) maxPromptBytes(e *engine.Engine) (limit int, why string) {
	if s.opt.MaxPromptBytes > 0 {
		return s.opt.MaxPromptBytes, "this server's limit"
	}
	ctx, tok := e.Backend.Config().MaxPositions, e.Tokenizer.MaxTokenBytes()
	return ctx * tok, fmt.Sprintf("the model's context of %d tokens × %d bytes, its longest token", ctx, tok)
}

// checkPromptBytes refuses, before tokenizing, a prompt text too long to
// be served.
func (s *Server) checkPromptBytes(e *engine.Engine, param string, n int) error {
	if limit, why := s.maxPromptBytes(e); n > limit {
		return &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: param, Code: "context_length_exceeded",
			Message: fmt.Sprintf("the prompt has %d bytes of text, more than the %d this server takes (%s)", n, limit, why)}
	}
	return nil
}

// DefaultMaxTokensValue is max_tokens for a request that sets none.
const DefaultMaxTokensValue = 1024

// request turns params and a prompt into an engine request, with OpenAI's
// defaults (temperature 1, top_p 1) and max_tokens DefaultMaxTokens, at
// most what the context (and the KV cache) has room for.
func (s *Server) request(e *engine.Engine, p *params, prompt []int, promptParam string, lo logprobOptions) (engine.Request, error) {
	req := engine.Request{Prompt: prompt, Sample: llm.SampleOptions{Temperature: 1, TopP: 1},
		Logprobs: lo.want, TopLogprobs: lo.top, PromptLogprobs: lo.echo && lo.want}
	if p.N != nil && *p.N != 1 {
		return req, invalid("n", "n must be 1, got %d", *p.N)
	}
	ctxLen := e.Backend.Config().MaxPositions
	if len(prompt) >= ctxLen {
		return req, &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: promptParam, Code: "context_length_exceeded",
			Message: fmt.Sprintf("the prompt has %d tokens, the model's context is %d (and leaves no room for an answer)", len(prompt), ctxLen)}
	}
	switch {
	case p.MaxCompletionTokens != nil:
		req.MaxTokens = *p.MaxCompletionTokens
	case p.MaxTokens != nil:
		req.MaxTokens = *p.MaxTokens
	default:
		def := s.opt.DefaultMaxTokens
		if def <= 0 {
			def = DefaultMaxTokensValue
		}
		req.MaxTokens = max(min(def, e.MaxSequence()-len(prompt)), 1)
	}
	if req.MaxTokens == 0 && lo.echo {
		// The prompt alone, as loglikelihood evaluations ask: scoring
		// it is what lets the engine run no generation step.
		req.PromptLogprobs = true
	} else if req.MaxTokens <= 0 {
		return req, invalid("max_tokens", "max_tokens must be positive, got %d (0 only with echo: the prompt scored, nothing generated)", req.MaxTokens)
	}
	if p.Temperature != nil {
		if *p.Temperature < 0 || *p.Temperature > 2 {
			return req, invalid("temperature", "temperature must be in [0, 2], got %v", *p.Temperature)
		}
		req.Sample.Temperature = *p.Temperature
	}
	if p.TopP != nil {
		if *p.TopP < 0 || *p.TopP > 1 {
			return req, invalid("top_p", "top_p must be in [0, 1], got %v", *p.TopP)
		}
		req.Sample.TopP = *p.TopP
	}
	if p.Seed != nil {
		req.Sample.Seed = uint64(*p.Seed)
	} else {
		req.Sample.Seed = uint64(time.Now().UnixNano())
	}
	stop, err := stopStrings(p.Stop)
	if err != nil {
		return req, err
	}
	req.Stop = stop
	if err := e.Validate(req); err != nil {
		// Subtracted, not added: prompt + a max_tokens near the integer
		// limit would wrap around.
		if req.MaxTokens > min(ctxLen, e.MaxSequence())-len(prompt) {
			// The context, or a KV cache too small for this request alone.
			param := "max_tokens"
			if len(prompt) >= e.MaxSequence() {
				param = promptParam
			}
			return req, &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: param, Code: "context_length_exceeded", Message: err.Error()}
		}
		return req, invalid("", "%s", err.Error())
	}
	return req, nil
}

// checkModel answers an unknown or missing model name.
func (s *Server) checkModel(p *params) error {
	if p.Model == s.opt.Model {
		return nil
	}
	if p.Model == "" {
		return invalid("model", "model is required (this server has %q)", s.opt.Model)
	}
	// The name sent is quoted up to 100 characters, as a 404 quotes a
	// path: the answer and the log line stay small whatever it is.
	return &apiError{Status: http.StatusNotFound, Type: "invalid_request_error", Param: "model", Code: "model_not_found",
		Message: fmt.Sprintf("the model %.100q does not exist; this server has %q", p.Model, s.opt.Model)}
}

// stopStrings reads "stop": null, a string, or a list of up to 4 strings,
// none empty.
func stopStrings(raw json.RawMessage) ([]string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var list []string
	var one string
	if json.Unmarshal(raw, &one) == nil {
		list = []string{one}
	} else if err := json.Unmarshal(raw, &list); err != nil {
		return nil, invalid("stop", "stop must be a string or a list of strings")
	}
	if len(list) > 4 {
		return nil, invalid("stop", "at most 4 stop strings, got %d", len(list))
	}
	if slices.Contains(list, "") {
		return nil, invalid("stop", "stop strings must not be empty")
	}
	return list, nil
}

// content reads a message's content: a string, or a list of parts of
// which only {"type": "text"} are accepted.
type content string

func (c *content) UnmarshalJSON(b []byte) error {
	var s string
	if json.Unmarshal(b, &s) == nil {
		*c = content(s)
		return nil
	}
	var parts []struct{ Type, Text string }
	if err := json.Unmarshal(b, &parts); err != nil {
		return &fieldError{"messages", "a message's content must be a string or a list of text parts"}
	}
	for _, p := range parts {
		if p.Type != "text" {
			return &fieldError{"messages", fmt.Sprintf("content part of type %.40q: only text is supported", p.Type)}
		}
		s += p.Text
	}
	*c = content(s)
	return nil
}

type chatRequest struct {
	params
	Messages []struct {
		Role    string  `json:"role"`
		Content content `json:"content"`
		// ReasoningContent is an assistant turn's thinking (as answers
		// return it), for templates that render it (Qwen3's).
		ReasoningContent string `json:"reasoning_content"`
	} `json:"messages"`
	// ChatTemplateKwargs are further variables for the chat template,
	// as vLLM takes them: Qwen3's {"enable_thinking": false}.
	ChatTemplateKwargs map[string]any `json:"chat_template_kwargs"`
}

type completionRequest struct {
	params
	Prompt json.RawMessage `json:"prompt"`
	Echo   bool            `json:"echo"`
}

// prompt is one prompt to complete: its ids, and its text (what echo
// returns: the text sent, or a prompt of token ids decoded); for a chat,
// whether and how its answer is split into reasoning and content.
type prompt struct {
	ids   []int
	text  string
	think splitState
}

// maxPrompts bounds the prompts of one completion request (a batch, as
// evaluation harnesses send), and maxParallel how many of them run at
// once.
const (
	maxPrompts  = 256
	maxParallel = 8
)

// generation runs the steps every generation request shares: the model
// must be loaded, the request within the rate and concurrency limits, its
// body within the size limit; parse then reads the prompts and what the
// request asks of logprobs. The concurrency slot is taken once the body
// is read, so that a slow body holds none.
func (s *Server) generation(w http.ResponseWriter, r *http.Request, rs *reqState, body any, p *params,
	parse func(e *engine.Engine) ([]prompt, logprobOptions, error), isChat bool) {
	e := s.engine()
	if e == nil {
		writeError(w, rs, errLoading)
		return
	}
	if aerr := s.admit(); aerr != nil {
		writeError(w, rs, aerr)
		return
	}
	if err := s.decode(w, r, body); err != nil {
		writeError(w, rs, err)
		return
	}
	release, aerr := s.acquire()
	if aerr != nil {
		writeError(w, rs, aerr)
		return
	}
	defer release()
	s.m.inFlight.Add(1)
	defer s.m.inFlight.Add(-1)
	if err := s.checkModel(p); err != nil {
		writeError(w, rs, err)
		return
	}
	prompts, lo, err := parse(e)
	if err != nil {
		writeError(w, rs, err)
		return
	}
	if len(prompts) > 1 {
		s.runMany(w, r, rs, e, p, prompts, lo)
		return
	}
	s.run(w, r, rs, e, p, prompts[0], isChat, lo)
}

func (s *Server) chatCompletions(w http.ResponseWriter, r *http.Request, rs *reqState) {
	var cr chatRequest
	s.generation(w, r, rs, &cr, &cr.params, func(e *engine.Engine) ([]prompt, logprobOptions, error) {
		lo, err := chatLogprobs(cr.Logprobs, cr.TopLogprobs)
		if err != nil {
			return nil, lo, err
		}
		if len(cr.Messages) == 0 {
			return nil, lo, invalid("messages", "messages must hold at least one message")
		}
		if err := checkTemplateKwargs(cr.ChatTemplateKwargs); err != nil {
			return nil, lo, err
		}
		n := 0
		msgs := make([]chat.Message, len(cr.Messages))
		for i, m := range cr.Messages {
			msgs[i] = chat.Message{Role: m.Role, Content: string(m.Content), ReasoningContent: m.ReasoningContent}
			n += len(m.Role) + len(m.Content) + len(m.ReasoningContent)
		}
		if len(cr.ChatTemplateKwargs) > 0 { // rendered into the prompt too
			kw, _ := json.Marshal(cr.ChatTemplateKwargs)
			n += len(kw)
		}
		if err := s.checkPromptBytes(e, "messages", n); err != nil {
			return nil, lo, err
		}
		// The template adds its markup to every message: many short ones
		// render into far more text than their roles and contents, which
		// is bounded again before it is tokenized.
		text, err := e.RenderChat(msgs, cr.ChatTemplateKwargs)
		if err != nil {
			return nil, lo, err
		}
		if limit, why := s.maxPromptBytes(e); len(text) > limit {
			return nil, lo, &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: "messages", Code: "context_length_exceeded",
				Message: fmt.Sprintf("the chat template renders the %d messages into %d bytes of text, more than the %d this server takes (%s)",
					len(msgs), len(text), limit, why)}
		}
		return []prompt{{ids: e.Tokenizer.Encode(text, false), think: thinkingOf(e.Template, text)}}, lo, nil
	}, true)
}

// checkTemplateKwargs refuses chat_template_kwargs that would replace
// the variables the server renders the template with. (A value that is
// not an object is refused while decoding.)
func checkTemplateKwargs(kwargs map[string]any) error {
	for _, k := range slices.Sorted(maps.Keys(kwargs)) {
		if slices.Contains(chat.RendererVars(), k) {
			return invalid("chat_template_kwargs", "chat_template_kwargs cannot set %q: the server sets %s itself, from the request and the model",
				k, strings.Join(chat.RendererVars(), ", "))
		}
	}
	return nil
}

func (s *Server) completions(w http.ResponseWriter, r *http.Request, rs *reqState) {
	var cr completionRequest
	s.generation(w, r, rs, &cr, &cr.params, func(e *engine.Engine) ([]prompt, logprobOptions, error) {
		lo, err := completionLogprobs(cr.Logprobs)
		if err != nil {
			return nil, lo, err
		}
		if cr.TopLogprobs != nil {
			return nil, lo, invalid("top_logprobs", "top_logprobs belongs to /v1/chat/completions; on /v1/completions logprobs (0 to %d) is the number of alternatives", maxCompletionLogprobs)
		}
		lo.echo = cr.Echo
		prompts, err := s.completionPrompts(e, cr.Prompt)
		if err == nil && len(prompts) > 1 && cr.Stream {
			err = invalid("stream", "streaming answers one prompt at a time; send %d prompts without stream", len(prompts))
		}
		return prompts, lo, err
	}, false)
}

// completionPrompts reads a completion's prompt in any of the API's
// forms: a string, a list of strings, a list of token ids, or a list of
// lists of token ids. Text gets the tokenizer's special tokens (BOS);
// token ids are taken as they are, as evaluation harnesses that
// tokenize themselves expect.
func (s *Server) completionPrompts(e *engine.Engine, raw json.RawMessage) ([]prompt, error) {
	const want = "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
	var text string
	if json.Unmarshal(raw, &text) == nil {
		if err := s.checkPromptBytes(e, "prompt", len(text)); err != nil {
			return nil, err
		}
		return []prompt{{ids: e.Encode(text), text: text}}, nil
	}
	var list []json.RawMessage
	if err := json.Unmarshal(raw, &list); err != nil || len(list) == 0 {
		return nil, invalid("prompt", "%s", want)
	}
	if len(list) > maxPrompts {
		return nil, invalid("prompt", "at most %d prompts in one request, got %d", maxPrompts, len(list))
	}
	var ids []int
	if json.Unmarshal(raw, &ids) == nil { // one prompt of token ids
		if err := checkIDs(e, ids, ""); err != nil {
			return nil, err
		}
		return []prompt{{ids: ids, text: e.Tokenizer.Decode(ids, true)}}, nil
	}
	out := make([]prompt, len(list))
	n := 0
	for i, item := range list {
		if json.Unmarshal(item, &text) == nil {
			n += len(text)
			out[i] = prompt{text: text}
			continue
		}
		var ids []int
		if json.Unmarshal(item, &ids) != nil {
			return nil, invalid("prompt", "%s (item %d is neither)", want, i)
		}
		if err := checkIDs(e, ids, fmt.Sprintf("prompt %d: ", i)); err != nil {
			return nil, err
		}
		out[i] = prompt{ids: ids, text: e.Tokenizer.Decode(ids, true)}
	}
	if err := s.checkPromptBytes(e, "prompt", n); err != nil {
		return nil, err
	}
	for i := range out {
		if out[i].ids == nil {
			out[i].ids = e.Encode(out[i].text)
		}
	}
	return out, nil
}

// checkIDs refuses a prompt's token ids outside the vocabulary, naming
// the field (the engine would refuse them too, in its own words).
func checkIDs(e *engine.Engine, ids []int, where string) error {
	vocab := e.Backend.Config().Vocab
	for _, id := range ids {
		if id < 0 || id >= vocab {
			return invalid("prompt", "%stoken id %d is outside the vocabulary of %d", where, id, vocab)
		}
	}
	return nil
}

// usage is OpenAI's token accounting.
type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

func usageOf(res *engine.Result) *usage {
	return &usage{res.PromptTokens, res.CompletionTokens, res.PromptTokens + res.CompletionTokens}
}

// run generates and answers, streamed or whole.
func (s *Server) run(w http.ResponseWriter, r *http.Request, rs *reqState, e *engine.Engine, p *params, pr prompt, isChat bool, lo logprobOptions) {
	start := time.Now()
	req, err := s.request(e, p, pr.ids, map[bool]string{true: "messages", false: "prompt"}[isChat], lo)
	if err != nil {
		writeError(w, rs, err)
		return
	}
	ctx := r.Context()
	if s.opt.RequestTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.opt.RequestTimeout)
		defer cancel()
	}
	// timedOut turns the deadline's cancellation into a 504.
	timedOut := func(err error) error {
		if errors.Is(err, context.DeadlineExceeded) && r.Context().Err() == nil {
			return &apiError{Status: http.StatusGatewayTimeout, Type: "server_error", Code: "timeout",
				Message: fmt.Sprintf("the generation did not finish within this server's request timeout of %v", s.opt.RequestTimeout)}
		}
		return err
	}
	account := func(res *engine.Result) {
		if res == nil {
			return
		}
		rs.promptTokens, rs.completionTokens = res.PromptTokens, res.CompletionTokens
		s.m.promptTokens.Add(int64(res.PromptTokens))
		s.m.completionTokens.Add(int64(res.CompletionTokens))
	}
	firstToken := true
	ttft := func() {
		if firstToken {
			firstToken = false
			s.m.observeTTFT(time.Since(start))
		}
	}

	id := fmt.Sprintf("%s-%d", map[bool]string{true: "chatcmpl", false: "cmpl"}[isChat], s.ids.Add(1))
	object := map[bool]string{true: "chat.completion", false: "text_completion"}[isChat]
	head := map[string]any{"id": id, "object": object, "created": time.Now().Unix(), "model": s.opt.Model}
	// splitter splits a thinking model's chat answer into reasoning and
	// text, its content (nil: the answer is all text).
	splitter := newReasoningSplitter(pr.think)
	// choice is a choice of the answer, or of a chunk: a completion's
	// text; a chat's message, or delta (the first with the role), whose
	// content is text, and whose reasoning_content, when the answer is
	// split, is reasoning: present only where there is some (a delta of
	// reasoning alone has no content; the delta that crosses </think>
	// carries both).
	choice := func(text, reasoning string, finish any, first bool, logprobs any) map[string]any {
		c := map[string]any{"index": 0, "finish_reason": finish, "logprobs": logprobs}
		if !isChat {
			c["text"] = text
			return c
		}
		msg := map[string]any{}
		if first || !p.Stream {
			msg["role"] = "assistant"
		}
		if splitter != nil && reasoning != "" {
			msg["reasoning_content"] = reasoning
		}
		if !p.Stream || text != "" || reasoning == "" {
			msg["content"] = text
		}
		if p.Stream {
			c["delta"] = msg
		} else {
			c["message"] = msg
		}
		return c
	}
	with := func(fields map[string]any) map[string]any {
		out := map[string]any{}
		for k, v := range head {
			out[k] = v
		}
		for k, v := range fields {
			out[k] = v
		}
		return out
	}
	echo := !isChat && lo.echo
	var lw *logprobWriter
	if lo.want {
		lw = newLogprobWriter(e, pr, echo, isChat)
	}

	if !p.Stream {
		res, err := e.Generate(ctx, req, func(string) error { ttft(); return nil })
		account(res)
		if err != nil {
			writeError(w, rs, timedOut(err))
			return
		}
		text, reasoning := res.Text, ""
		if echo {
			text = pr.text + text
		}
		if splitter != nil {
			reasoning, text = splitter.whole(text)
		}
		var logprobs any
		if lw != nil {
			logprobs = lw.add(res.PromptLogprobs, res.Logprobs)
		}
		writeJSON(w, http.StatusOK, with(map[string]any{"choices": []any{choice(text, reasoning, res.FinishReason, false, logprobs)}, "usage": usageOf(res)}))
		return
	}

	// Streaming: the headers go out with the first event, so that errors
	// found before any token (a full queue) still get their status code.
	if isChat {
		head["object"] = "chat.completion.chunk"
	}
	flusher, _ := w.(http.Flusher)
	started := false
	event := func(v any) error {
		if !started {
			w.Header().Set("Content-Type", "text/event-stream")
			w.Header().Set("Cache-Control", "no-cache")
			w.WriteHeader(http.StatusOK)
			started = true
		}
		var data []byte
		if b, ok := v.([]byte); ok {
			data = b
		} else {
			data, _ = json.Marshal(v)
		}
		if _, err := fmt.Fprintf(w, "data: %s\n\n", data); err != nil {
			return err // the client went away: Generate stops
		}
		if flusher != nil {
			flusher.Flush()
		}
		return nil
	}
	first := true // the first chunk also carries the assistant's role, or the echoed prompt
	res, err := e.GenerateChunks(ctx, req, func(c engine.Chunk) error {
		if c.Text == "" && len(c.Logprobs) == 0 && c.PromptLogprobs == nil {
			return nil
		}
		ttft()
		text, reasoning := c.Text, ""
		if echo && first {
			text = pr.text + text
		}
		if splitter != nil {
			reasoning, text = splitter.add(text)
			if text == "" && reasoning == "" && len(c.Logprobs) == 0 {
				return nil // held back: the start of a tag, or whitespace, that later text decides
			}
		}
		var logprobs any
		if lw != nil {
			logprobs = lw.add(c.PromptLogprobs, c.Logprobs)
		}
		err := event(with(map[string]any{"choices": []any{choice(text, reasoning, nil, first, logprobs)}}))
		first = false
		return err
	})
	account(res)
	if err != nil {
		err = timedOut(err)
		if !started {
			writeError(w, rs, err)
			return
		}
		if r.Context().Err() == nil { // report a failure mid-stream in-band
			ae := asAPIError(err)
			rs.err = ae.Message
			event(map[string]any{"error": ae})
		}
		return
	}
	last, reasoning := "", ""
	switch {
	case echo && first: // a completion that streamed nothing: the prompt still is the answer's start
		last = pr.text
	case splitter != nil: // a chat answer: what the splitter held back
		reasoning, last = splitter.flush()
	}
	if err := event(with(map[string]any{"choices": []any{choice(last, reasoning, res.FinishReason, first, nil)}})); err != nil {
		return
	}
	if p.StreamOptions != nil && p.StreamOptions.IncludeUsage {
		if err := event(with(map[string]any{"choices": []any{}, "usage": usageOf(res)})); err != nil {
			return
		}
	}
	event([]byte("[DONE]"))
}

// runMany answers a completion request of several prompts (not
// streamed): one choice each, index in the order sent, usage summed. The
// prompts run as concurrent engine requests, at most maxParallel at once,
// so they share forward passes with each other and with other clients.
func (s *Server) runMany(w http.ResponseWriter, r *http.Request, rs *reqState, e *engine.Engine, p *params, prompts []prompt, lo logprobOptions) {
	reqs := make([]engine.Request, len(prompts))
	for i, pr := range prompts {
		req, err := s.request(e, p, pr.ids, "prompt", lo)
		if err != nil {
			if ae, ok := err.(*apiError); ok {
				ae.Message = fmt.Sprintf("prompt %d: %s", i, ae.Message)
			}
			writeError(w, rs, err)
			return
		}
		reqs[i] = req
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	if s.opt.RequestTimeout > 0 {
		ctx, cancel = context.WithTimeout(ctx, s.opt.RequestTimeout)
		defer cancel()
	}
	results := make([]*engine.Result, len(prompts))
	errs := make([]error, len(prompts))
	sem := make(chan struct{}, maxParallel)
	var wg sync.WaitGroup
	for i := range reqs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			if ctx.Err() != nil {
				errs[i] = ctx.Err()
				return
			}
			results[i], errs[i] = e.Generate(ctx, reqs[i], nil)
			if errs[i] != nil {
				cancel()
			}
		}()
	}
	wg.Wait()
	total := &usage{}
	for _, res := range results {
		if res != nil {
			total.PromptTokens += res.PromptTokens
			total.CompletionTokens += res.CompletionTokens
		}
	}
	total.TotalTokens = total.PromptTokens + total.CompletionTokens
	rs.promptTokens, rs.completionTokens = total.PromptTokens, total.CompletionTokens
	s.m.promptTokens.Add(int64(total.PromptTokens))
	s.m.completionTokens.Add(int64(total.CompletionTokens))
	for _, err := range errs { // the first cause, not the cancellations it caused
		if err != nil && !errors.Is(err, context.Canceled) {
			if errors.Is(err, context.DeadlineExceeded) && r.Context().Err() == nil {
				err = &apiError{Status: http.StatusGatewayTimeout, Type: "server_error", Code: "timeout",
					Message: fmt.Sprintf("the generation did not finish within this server's request timeout of %v", s.opt.RequestTimeout)}
			}
			writeError(w, rs, err)
			return
		}
	}
	if err := r.Context().Err(); err != nil {
		writeError(w, rs, err)
		return
	}
	choices := make([]any, len(prompts))
	for i, res := range results {
		text := res.Text
		if lo.echo {
			text = prompts[i].text + text
		}
		var logprobs any
		if lo.want {
			logprobs = newLogprobWriter(e, prompts[i], lo.echo, false).add(res.PromptLogprobs, res.Logprobs)
		}
		choices[i] = map[string]any{"index": i, "text": text, "logprobs": logprobs, "finish_reason": res.FinishReason}
	}
	writeJSON(w, http.StatusOK, map[string]any{"id": fmt.Sprintf("cmpl-%d", s.ids.Add(1)), "object": "text_completion",
		"created": time.Now().Unix(), "model": s.opt.Model, "choices": choices, "usage": total})
}

func (s *Server) models(w http.ResponseWriter, r *http.Request, rs *reqState) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []any{
		map[string]any{"id": s.opt.Model, "object": "model", "created": s.created, "owned_by": "llmq"},
	}})
}

// health answers 503 {"status": "loading"} until the model is loaded,
// then 200 {"status": "ok"} with the engine's counters; keys are
// snake_case throughout.
func (s *Server) health(w http.ResponseWriter, r *http.Request, rs *reqState) {
	e := s.engine()
	if e == nil {
		w.Header().Set("Retry-After", "1")
		writeJSON(w, http.StatusServiceUnavailable, map[string]any{"status": "loading", "model": s.opt.Model})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "model": s.opt.Model, "device": e.Backend.Name(),
		"context": e.Backend.Config().MaxPositions, "stats": e.Stats()})
}
