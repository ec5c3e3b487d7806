// Package server is an OpenAI-compatible HTTP API over an engine.Engine:
//
//	POST /v1/chat/completions   chat, streaming (server-sent events) or not
//	POST /v1/completions        plain-text completion, likewise
//	GET  /v1/models             the one model served
//	GET  /health                liveness and queue depth
//
// Requests follow the OpenAI schema (model, messages or prompt,
// max_tokens / max_completion_tokens, temperature, top_p, stop, seed,
// stream, stream_options.include_usage) and answers carry usage counts.
// Errors use OpenAI's {"error": {...}} body: 400 for malformed JSON and
// invalid parameters (a prompt longer than the context, max_tokens past
// it), 404 for an unknown model, 413 for a body over the limit, 503 with
// Retry-After when the engine's queue is full. A client that disconnects
// cancels its generation.
package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/chat"
)

// Options configure a Server.
type Options struct {
	Model        string // the model's name in requests and /v1/models
	MaxBodyBytes int64  // request body limit (default 1 MiB)
}

// Server serves one engine.
type Server struct {
	e       *engine.Engine
	opt     Options
	created int64
	ids     atomic.Int64
	mux     *http.ServeMux
}

// New makes the HTTP handler of an engine.
func New(e *engine.Engine, opt Options) *Server {
	if opt.MaxBodyBytes <= 0 {
		opt.MaxBodyBytes = 1 << 20
	}
	s := &Server{e: e, opt: opt, created: time.Now().Unix(), mux: http.NewServeMux()}
	s.mux.HandleFunc("POST /v1/chat/completions", s.chatCompletions)
	s.mux.HandleFunc("POST /v1/completions", s.completions)
	s.mux.HandleFunc("GET /v1/models", s.models)
	s.mux.HandleFunc("GET /health", s.health)
	return s
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// Serve runs the server on ln until ctx is cancelled, then shuts down
// gracefully: it stops accepting connections and lets in-flight requests
// (streams included) finish for up to grace, after which their
// connections are closed, which cancels their generations.
func Serve(ctx context.Context, ln net.Listener, h http.Handler, grace time.Duration) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	err := srv.Shutdown(sctx)
	if errors.Is(err, context.DeadlineExceeded) {
		srv.Close()
		err = fmt.Errorf("shutdown: requests still running after %v were cut off", grace)
	}
	<-errc
	return err
}

// apiError is an error with its HTTP status and OpenAI error fields.
type apiError struct {
	Status  int    `json:"-"`
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   string `json:"param,omitempty"`
	Code    string `json:"code,omitempty"`
}

func (e *apiError) Error() string { return e.Message }

func invalid(param, format string, args ...any) *apiError {
	return &apiError{Status: http.StatusBadRequest, Message: fmt.Sprintf(format, args...), Type: "invalid_request_error", Param: param}
}

func writeError(w http.ResponseWriter, err error) {
	var ae *apiError
	switch {
	case errors.As(err, &ae):
	case errors.Is(err, engine.ErrInvalid):
		ae = invalid("", "%s", err.Error())
	case errors.Is(err, engine.ErrBusy):
		w.Header().Set("Retry-After", "1")
		ae = &apiError{Status: http.StatusServiceUnavailable, Message: "the server is busy: too many requests waiting; retry later", Type: "server_error", Code: "overloaded"}
	case errors.Is(err, engine.ErrClosed):
		ae = &apiError{Status: http.StatusServiceUnavailable, Message: "the server is shutting down", Type: "server_error"}
	default:
		ae = &apiError{Status: http.StatusInternalServerError, Message: err.Error(), Type: "server_error"}
	}
	writeJSON(w, ae.Status, map[string]any{"error": ae})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
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
}

// decode reads a JSON body within the size limit.
func (s *Server) decode(w http.ResponseWriter, r *http.Request, v any) error {
	body := http.MaxBytesReader(w, r.Body, s.opt.MaxBodyBytes)
	if err := json.NewDecoder(body).Decode(v); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return &apiError{Status: http.StatusRequestEntityTooLarge, Type: "invalid_request_error",
				Message: fmt.Sprintf("request body larger than %d bytes", s.opt.MaxBodyBytes)}
		}
		return invalid("", "malformed JSON body: %v", err)
	}
	return nil
}

// request turns params and a prompt into an engine request, with OpenAI's
// defaults: temperature 1, top_p 1, max_tokens up to the context's end.
func (s *Server) request(p *params, prompt []int) (engine.Request, error) {
	req := engine.Request{Prompt: prompt, Sample: llm.SampleOptions{Temperature: 1, TopP: 1}}
	if p.Model != s.opt.Model {
		if p.Model == "" {
			return req, invalid("model", "model is required (this server has %q)", s.opt.Model)
		}
		return req, &apiError{Status: http.StatusNotFound, Type: "invalid_request_error", Param: "model", Code: "model_not_found",
			Message: fmt.Sprintf("the model %q does not exist; this server has %q", p.Model, s.opt.Model)}
	}
	if p.N != nil && *p.N != 1 {
		return req, invalid("n", "n must be 1, got %d", *p.N)
	}
	ctxLen := s.e.Backend.Config().MaxPositions
	switch {
	case p.MaxCompletionTokens != nil:
		req.MaxTokens = *p.MaxCompletionTokens
	case p.MaxTokens != nil:
		req.MaxTokens = *p.MaxTokens
	default:
		req.MaxTokens = max(ctxLen-len(prompt), 1)
	}
	if p.Temperature != nil {
		if *p.Temperature < 0 || *p.Temperature > 2 {
			return req, invalid("temperature", "temperature must be in [0, 2], got %v", *p.Temperature)
		}
		req.Sample.Temperature = *p.Temperature
	}
	if p.TopP != nil {
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
	if err := s.e.Validate(req); err != nil {
		return req, invalid("", "%s", err.Error())
	}
	return req, nil
}

// stopStrings reads "stop": null, a string, or a list of up to 4 strings.
func stopStrings(raw json.RawMessage) ([]string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var one string
	if json.Unmarshal(raw, &one) == nil {
		return []string{one}, nil
	}
	var list []string
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, invalid("stop", "stop must be a string or a list of strings")
	}
	if len(list) > 4 {
		return nil, invalid("stop", "at most 4 stop strings, got %d", len(list))
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
		return fmt.Errorf("content must be a string or a list of text parts")
	}
	for _, p := range parts {
		if p.Type != "text" {
			return fmt.Errorf("content part of type %q: only text is supported", p.Type)
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
	} `json:"messages"`
}

type completionRequest struct {
	params
	Prompt json.RawMessage `json:"prompt"`
}

func (s *Server) chatCompletions(w http.ResponseWriter, r *http.Request) {
	var cr chatRequest
	if err := s.decode(w, r, &cr); err != nil {
		writeError(w, err)
		return
	}
	if len(cr.Messages) == 0 {
		writeError(w, invalid("messages", "messages must hold at least one message"))
		return
	}
	msgs := make([]chat.Message, len(cr.Messages))
	for i, m := range cr.Messages {
		msgs[i] = chat.Message{Role: m.Role, Content: string(m.Content)}
	}
	prompt, err := s.e.EncodeChat(msgs)
	if err != nil {
		writeError(w, err)
		return
	}
	s.run(w, r, &cr.params, prompt, true)
}

func (s *Server) completions(w http.ResponseWriter, r *http.Request) {
	var cr completionRequest
	if err := s.decode(w, r, &cr); err != nil {
		writeError(w, err)
		return
	}
	var text string
	if err := json.Unmarshal(cr.Prompt, &text); err != nil {
		var list []string
		if json.Unmarshal(cr.Prompt, &list) != nil || len(list) != 1 {
			writeError(w, invalid("prompt", "prompt must be a string (or a list of exactly one string)"))
			return
		}
		text = list[0]
	}
	s.run(w, r, &cr.params, s.e.Encode(text), false)
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
func (s *Server) run(w http.ResponseWriter, r *http.Request, p *params, prompt []int, isChat bool) {
	req, err := s.request(p, prompt)
	if err != nil {
		writeError(w, err)
		return
	}
	id := fmt.Sprintf("%s-%d", map[bool]string{true: "chatcmpl", false: "cmpl"}[isChat], s.ids.Add(1))
	object := map[bool]string{true: "chat.completion", false: "text_completion"}[isChat]
	head := map[string]any{"id": id, "object": object, "created": time.Now().Unix(), "model": s.opt.Model}
	choice := func(text string, finish any, first bool) map[string]any {
		c := map[string]any{"index": 0, "finish_reason": finish}
		switch {
		case !isChat:
			c["text"] = text
			c["logprobs"] = nil
		case p.Stream && first:
			c["delta"] = map[string]any{"role": "assistant", "content": text}
		case p.Stream:
			c["delta"] = map[string]any{"content": text}
		default:
			c["message"] = map[string]any{"role": "assistant", "content": text}
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

	if !p.Stream {
		res, err := s.e.Generate(r.Context(), req, nil)
		if err != nil {
			writeError(w, err)
			return
		}
		writeJSON(w, http.StatusOK, with(map[string]any{"choices": []any{choice(res.Text, res.FinishReason, false)}, "usage": usageOf(res)}))
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
	first := true // the first chunk also carries the assistant's role
	res, err := s.e.Generate(r.Context(), req, func(text string) error {
		err := event(with(map[string]any{"choices": []any{choice(text, nil, first)}}))
		first = false
		return err
	})
	if err != nil {
		if !started {
			writeError(w, err)
			return
		}
		if r.Context().Err() == nil { // report a failure mid-stream in-band
			event(map[string]any{"error": &apiError{Message: err.Error(), Type: "server_error"}})
		}
		return
	}
	if err := event(with(map[string]any{"choices": []any{choice("", res.FinishReason, first)}})); err != nil {
		return
	}
	if p.StreamOptions != nil && p.StreamOptions.IncludeUsage {
		if err := event(with(map[string]any{"choices": []any{}, "usage": usageOf(res)})); err != nil {
			return
		}
	}
	event([]byte("[DONE]"))
}

func (s *Server) models(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []any{
		map[string]any{"id": s.opt.Model, "object": "model", "created": s.created, "owned_by": "llmq"},
	}})
}

func (s *Server) health(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "model": s.opt.Model, "device": s.e.Backend.Name(),
		"context": s.e.Backend.Config().MaxPositions, "stats": s.e.Stats()})
}
