package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	openai "github.com/sashabaranov/go-openai"
)

// serve starts a server for llama-tiny (on the CPU, with its chat
// template) on a loopback port; wrap wraps the backend when not nil.
func serve(t *testing.T, opt engine.Options, wrap func(llm.Backend) llm.Backend) (*httptest.Server, *engine.Engine, *openai.Client) {
	t.Helper()
	ts, e, _ := serveWith(t, Options{MaxBodyBytes: 32 << 10}, opt, wrap)
	return ts, e, clientFor(ts.URL, "none")
}

// answer is what a client reads from /v1/completions, whole or streamed.
type answer struct {
	Text   string
	Finish string
	Usage  usage
}

// complete asks /v1/completions for a greedy (temperature 0) completion
// and reads the JSON answer or, when stream, the server-sent events up to
// [DONE]. It speaks plain HTTP: go-openai cannot send temperature 0.
func complete(url, prompt string, maxTokens int, stream bool) (*answer, error) {
	body, err := json.Marshal(map[string]any{"model": "llama-tiny", "prompt": prompt, "max_tokens": maxTokens,
		"temperature": 0, "stream": stream, "stream_options": map[string]bool{"include_usage": true}})
	if err != nil {
		return nil, err
	}
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return nil, fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	type chunk struct {
		Choices []struct {
			Text         string  `json:"text"`
			FinishReason *string `json:"finish_reason"`
		} `json:"choices"`
		Usage *usage `json:"usage"`
	}
	var a answer
	add := func(c chunk) {
		for _, ch := range c.Choices {
			a.Text += ch.Text
			if ch.FinishReason != nil {
				a.Finish = *ch.FinishReason
			}
		}
		if c.Usage != nil {
			a.Usage = *c.Usage
		}
	}
	if !stream {
		var c chunk
		if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
			return nil, err
		}
		add(c)
		return &a, nil
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		return nil, fmt.Errorf("stream with Content-Type %q", ct)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		switch {
		case sc.Text() == "":
			continue
		case !ok:
			return nil, fmt.Errorf("not an event: %q", sc.Text())
		case data == "[DONE]":
			return &a, nil
		}
		var c chunk
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			return nil, fmt.Errorf("event %q: %w", data, err)
		}
		add(c)
	}
	return nil, fmt.Errorf("the stream ended without [DONE] (%v)", sc.Err())
}

// The server's greedy completions are transformers' greedy continuations
// (reference/llama-tiny.greedy.json, decoded by HF tokenizers): three
// prompts, each asked for whole and streamed, all six at once on an
// engine that batches four, so that requests join running batches.
func TestCompletionsMatchReference(t *testing.T) {
	ref := shared.GreedyRefs(t, "llama-tiny")
	ts, _, _ := serve(t, engine.Options{MaxBatch: 4}, nil)
	// Counted by hand: BOS and one token per word — "The" " history" " of"
	// " the"; "Once" " upon" " a" " time"; "def" " main" "()" ":" — and the
	// reference's 32 greedy tokens.
	want := usage{PromptTokens: 5, CompletionTokens: 32, TotalTokens: 37}
	var wg sync.WaitGroup
	for prompt, r := range ref {
		if len(r.PromptIDs) != want.PromptTokens || len(r.GreedyIDs) != want.CompletionTokens {
			t.Fatalf("%q: the reference has %d prompt and %d greedy ids", prompt, len(r.PromptIDs), len(r.GreedyIDs))
		}
		for _, stream := range []bool{false, true} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				a, err := complete(ts.URL, prompt, want.CompletionTokens, stream)
				if err != nil {
					t.Errorf("%q (stream %v): %v", prompt, stream, err)
					return
				}
				if a.Text != r.Text || a.Finish != "length" || a.Usage != want {
					t.Errorf("%q (stream %v):\n got %q, finish %q, usage %+v\nwant %q, finish \"length\", usage %+v",
						prompt, stream, a.Text, a.Finish, a.Usage, r.Text, want)
				}
			}()
		}
	}
	wg.Wait()
}

var hi = []openai.ChatCompletionMessage{{Role: "user", Content: "Tell me about the history of Rome."}}

// hiPromptTokens is the rendered chat prompt of hi, counted by hand from
// tokenizer_config.json's template and tokenizer.json's vocabulary ("Tell"
// and "assistant" are not in it; "\n\n" is two pre-tokens):
//
//	<|start_header_id|> user <|end_header_id|> \n \n   5
//	T ell ␣me ␣about ␣the ␣history ␣of ␣Rome .        9
//	<|eot_id|>                                        1
//	<|start_header_id|> ass ist ant <|end_header_id|> \n \n   7
const hiPromptTokens = 22

// The chat route renders the template, answers in OpenAI's
// chat.completion shape and counts usage. The text is llmq's greedy
// answer, recorded: a regression check of the chat route, since
// transformers' reference has no chat prompt (the generation itself is
// checked against it in TestCompletionsMatchReference).
func TestChatCompletion(t *testing.T) {
	_, _, client := serve(t, engine.Options{}, nil)
	resp, err := client.CreateChatCompletion(context.Background(), openai.ChatCompletionRequest{
		Model: "llama-tiny", Messages: hi, MaxTokens: 12, Temperature: 1e-9})
	if err != nil {
		t.Fatal(err)
	}
	const want = "The history of the history of the history of the history of"
	if len(resp.Choices) != 1 || resp.Choices[0].Message.Content != want || resp.Choices[0].Message.Role != "assistant" {
		t.Fatalf("choices %+v, want text %q", resp.Choices, want)
	}
	if resp.Choices[0].FinishReason != "length" || resp.Object != "chat.completion" || resp.Model != "llama-tiny" || !strings.HasPrefix(resp.ID, "chatcmpl-") {
		t.Errorf("response fields: %+v", resp)
	}
	if u := resp.Usage; u.PromptTokens != hiPromptTokens || u.CompletionTokens != 12 || u.TotalTokens != hiPromptTokens+12 {
		t.Errorf("usage %+v, want %d+12", u, hiPromptTokens)
	}
}

// Streaming gives the same text as the whole answer, the role in the
// first chunk, the finish reason in the last, and usage when asked.
func TestChatCompletionStream(t *testing.T) {
	_, _, client := serve(t, engine.Options{}, nil)
	req := openai.ChatCompletionRequest{Model: "llama-tiny", Messages: hi, MaxTokens: 16, Temperature: 1e-9, Seed: ptr(3)}
	whole, err := client.CreateChatCompletion(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	req.Stream, req.StreamOptions = true, &openai.StreamOptions{IncludeUsage: true}
	stream, err := client.CreateChatCompletionStream(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	var text strings.Builder
	var role, finish string
	var usage *openai.Usage
	chunks := 0
	for {
		c, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		chunks++
		if c.Usage != nil {
			usage = c.Usage
		}
		if len(c.Choices) == 0 {
			continue
		}
		if chunks == 1 {
			role = c.Choices[0].Delta.Role
		}
		text.WriteString(c.Choices[0].Delta.Content)
		if c.Choices[0].FinishReason != "" {
			finish = string(c.Choices[0].FinishReason)
		}
	}
	if text.String() != whole.Choices[0].Message.Content || role != "assistant" || finish != "length" {
		t.Errorf("streamed %q (role %q, finish %q), whole %q", text.String(), role, finish, whole.Choices[0].Message.Content)
	}
	if chunks < 5 {
		t.Errorf("only %d chunks: the text was not streamed", chunks)
	}
	if usage == nil || usage.PromptTokens != hiPromptTokens || usage.CompletionTokens != 16 || usage.TotalTokens != hiPromptTokens+16 {
		t.Errorf("usage %+v, want %d+16", usage, hiPromptTokens)
	}
}

func ptr[T any](v T) *T { return &v }

// Completions: a stop string and the same seed give the same sampled text
// streamed and whole; models lists the model.
func TestCompletionsAndModels(t *testing.T) {
	_, _, client := serve(t, engine.Options{}, nil)
	req := openai.CompletionRequest{Model: "llama-tiny", Prompt: "Once upon a time", MaxTokens: 24, Temperature: 0.8, TopP: 0.9, Seed: ptr(11), Stop: []string{"."}}
	whole, err := client.CreateCompletion(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if whole.Object != "text_completion" || len(whole.Choices) != 1 || whole.Choices[0].Text == "" || strings.Contains(whole.Choices[0].Text, ".") {
		t.Fatalf("completion %+v", whole)
	}
	req.Stream = true
	stream, err := client.CreateCompletionStream(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	var text strings.Builder
	for {
		c, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(c.Choices) > 0 {
			text.WriteString(c.Choices[0].Text)
		}
	}
	if text.String() != whole.Choices[0].Text {
		t.Errorf("streamed %q, whole %q (same seed)", text.String(), whole.Choices[0].Text)
	}
	models, err := client.ListModels(context.Background())
	if err != nil || len(models.Models) != 1 || models.Models[0].ID != "llama-tiny" {
		t.Errorf("models %+v, %v", models, err)
	}
}

// Bad requests get OpenAI-style errors with the right status codes.
func TestErrors(t *testing.T) {
	ts, _, client := serve(t, engine.Options{}, nil)
	long := strings.Repeat("history ", 2100)
	for _, c := range []struct {
		path, body string
		status     int
		want       string
	}{
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": [`, 400, "malformed JSON"},
		{"/v1/chat/completions", `{"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}`, 404, `does not exist; this server has`},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "x"}]}`, 400, "model is required"},
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": []}`, 400, "at least one message"},
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}`, 400, "max_tokens 5000 too large"},
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "x"}], "n": 2}`, 400, "n must be 1"},
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}`, 400, "only text"},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "x", "temperature": 3}`, 400, "temperature must be in [0, 2]"},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "x", "stop": 7}`, 400, "stop must be a string"},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "` + strings.Repeat("x", 40000) + `"}`, 413, "limit of 32768 bytes"},
	} {
		resp, err := http.Post(ts.URL+c.path, "application/json", strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.status || !strings.Contains(string(body), c.want) || !strings.Contains(string(body), `"error"`) {
			t.Errorf("%.60s: %d %s, want %d with %q", c.body, resp.StatusCode, body, c.status, c.want)
		}
	}
	// The prompt past the context, through the client library.
	_, err := client.CreateCompletion(context.Background(), openai.CompletionRequest{Model: "llama-tiny", Prompt: long, MaxTokens: 1})
	var apiErr *openai.APIError
	if !errors.As(err, &apiErr) || apiErr.HTTPStatusCode != 400 || !strings.Contains(apiErr.Message, "model's context is 2048") ||
		apiErr.Code != "context_length_exceeded" || apiErr.Param == nil || *apiErr.Param != "prompt" {
		t.Errorf("long prompt: %v", err)
	}
	if resp, err := http.Get(ts.URL + "/health"); err != nil || resp.StatusCode != 200 {
		t.Errorf("health: %v %v", resp, err)
	}
}

// gate holds every forward pass until the test releases it. entered
// holds one signal (make it with capacity 1): a pass that begins before
// the test waits on it must not lose its signal to the select's default.
type gate struct {
	llm.Backend
	entered chan struct{}
	release chan struct{}
}

func (g *gate) Forward(ctx context.Context, steps []llm.Step) error {
	select {
	case g.entered <- struct{}{}:
	default:
	}
	<-g.release
	return g.Backend.Forward(ctx, steps)
}

// A full queue answers 503 with Retry-After.
func TestBusy(t *testing.T) {
	g := &gate{entered: make(chan struct{}, 1), release: make(chan struct{})}
	ts, e, _ := serve(t, engine.Options{MaxBatch: 1, MaxQueue: 1}, func(b llm.Backend) llm.Backend { g.Backend = b; return g })
	body := `{"model": "llama-tiny", "prompt": "x", "max_tokens": 2}`
	done := make(chan int, 2)
	post := func() {
		resp, err := http.Post(ts.URL+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Error(err)
			done <- 0
			return
		}
		resp.Body.Close()
		done <- resp.StatusCode
	}
	// However the test ends, the forward passes go on, so that no request
	// is left waiting: were the third request queued, not refused (the
	// engine's queue count once lagged its channel), nothing else would
	// release the pass.
	var once sync.Once
	release := func() { once.Do(func() { close(g.release) }) }
	t.Cleanup(release)
	go post()
	<-g.entered // the first request is in a forward pass
	go post()
	deadline := time.Now().Add(30 * time.Second)
	for e.Stats().Queued == 0 {
		select {
		case code := <-done: // the second request ended without being queued
			t.Fatalf("the second request ended with %d before it was queued (engine stats %+v)", code, e.Stats())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second request not queued after 30 s (engine stats %+v)", e.Stats())
		}
		time.Sleep(time.Millisecond)
	}
	third := &http.Client{Timeout: 30 * time.Second}
	resp, err := third.Post(ts.URL+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("third request: %v (engine stats %+v)", err, e.Stats())
	}
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Errorf("third request: %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	release()
	if a, b := <-done, <-done; a != 200 || b != 200 {
		t.Errorf("the running and the queued requests: %d %d", a, b)
	}
}

// A client that goes away mid-stream stops its generation: the engine
// retires the sequence long before its max_tokens.
func TestDisconnectStopsGeneration(t *testing.T) {
	_, e, client := serve(t, engine.Options{}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := client.CreateChatCompletionStream(ctx, openai.ChatCompletionRequest{Model: "llama-tiny", Messages: hi, MaxTokens: 2000, Temperature: 1e-9})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if _, err := stream.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	stream.Close()
	deadline := time.Now().Add(10 * time.Second)
	for e.Stats().Active > 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if st := e.Stats(); st.Active != 0 || st.Generated >= 1000 {
		t.Errorf("after the disconnect: %+v (max_tokens was 2000)", st)
	}
}

// Shutting down lets a running stream finish, then Serve returns.
func TestGracefulShutdown(t *testing.T) {
	e := tinyEngine(t, engine.Options{}, nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() {
		served <- Serve(ctx, ln, New(e, Options{Model: "llama-tiny"}), ServeOptions{Grace: 30 * time.Second})
	}()
	cfg := openai.DefaultConfig("none")
	cfg.BaseURL = "http://" + ln.Addr().String() + "/v1"
	stream, err := openai.NewClientWithConfig(cfg).CreateChatCompletionStream(context.Background(),
		openai.ChatCompletionRequest{Model: "llama-tiny", Messages: hi, MaxTokens: 200, Temperature: 1e-9})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	stop() // SIGTERM in llmq serve
	var finish openai.FinishReason
	for {
		c, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("stream cut by the shutdown: %v", err)
		}
		if len(c.Choices) > 0 && c.Choices[0].FinishReason != "" {
			finish = c.Choices[0].FinishReason
		}
	}
	if finish != "length" {
		t.Errorf("finish reason %q: the stream did not run to its end", finish)
	}
	if err := <-served; err != nil {
		t.Errorf("Serve: %v", err)
	}
	if _, err := net.DialTimeout("tcp", ln.Addr().String(), time.Second); err == nil {
		t.Error("still accepting connections after shutdown")
	}
}
