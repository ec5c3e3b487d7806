package engine

import (
	"cmp"
	"context"
	"errors"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmq/llmq/backend"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/chat"
)

// openTiny opens llama-tiny on the CPU, or on the device LLMQ_TEST_DEVICE
// names (cuda: device-model.sh engine runs the paged-cache tests on the
// GPU); it is closed when the test ends.
func openTiny(t *testing.T) *backend.Model {
	t.Helper()
	m, err := backend.Open(shared.Path(t, "models/llama-tiny"), testDevice())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// testDevice is the device the tests run on: LLMQ_TEST_DEVICE, or cpu.
func testDevice() string { return cmp.Or(os.Getenv("LLMQ_TEST_DEVICE"), "cpu") }

// start starts an engine on m; it is closed when the test ends (before
// the model, which t.Cleanup closes later).
func start(t *testing.T, m Model, opt Options) *Engine {
	t.Helper()
	e, err := New(m, opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// tiny is an engine on llama-tiny with its chat template.
func tiny(t *testing.T, opt Options) *Engine { return start(t, openTiny(t), opt) }

// Six prompts submitted at once to an engine that batches at most four:
// two wait in the queue and join the batch while the others decode. Every
// sequence must still get exactly the transformers reference's greedy ids.
func TestContinuousBatchingMatchesReference(t *testing.T) {
	ref := shared.GreedyRefs(t, "llama-tiny")
	m := openTiny(t)
	e := start(t, m, Options{MaxBatch: 4})
	var wg sync.WaitGroup
	for prompt, r := range ref {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := e.Generate(context.Background(), Request{Prompt: r.PromptIDs, MaxTokens: len(r.GreedyIDs)}, nil)
			if err != nil {
				t.Errorf("%q: %v", prompt, err)
				return
			}
			if !equal(res.Tokens, r.GreedyIDs) {
				t.Errorf("%q:\n got %v\nwant %v", prompt, res.Tokens, r.GreedyIDs)
			}
			if res.FinishReason != "length" || res.PromptTokens != len(r.PromptIDs) || res.CompletionTokens != len(r.GreedyIDs) {
				t.Errorf("%q: finish %q, usage %d+%d", prompt, res.FinishReason, res.PromptTokens, res.CompletionTokens)
			}
			if want := m.Tokenizer.Decode(r.GreedyIDs, true); res.Text != want {
				t.Errorf("%q: text %q, want %q", prompt, res.Text, want)
			}
		}()
	}
	wg.Wait()
}

func equal(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// Greedy llama-tiny continues "The history of the" with " history of the"
// over and over; a stop string spanning token boundaries ends it, and the
// text streamed before the stop never includes a piece of it.
func TestStopString(t *testing.T) {
	e := tiny(t, Options{})
	var streamed strings.Builder
	res, err := e.Generate(context.Background(), Request{Prompt: e.Encode("The history of the"), MaxTokens: 20, Stop: []string{"the hist"}},
		func(s string) error { streamed.WriteString(s); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if res.Text != " history of " || streamed.String() != res.Text || res.FinishReason != "stop" {
		t.Errorf("text %q, streamed %q, finish %q", res.Text, streamed.String(), res.FinishReason)
	}
	if res.CompletionTokens > 6 {
		t.Errorf("generation went on for %d tokens after the stop string", res.CompletionTokens)
	}
}

func TestChatTemplateAndEOS(t *testing.T) {
	e := tiny(t, Options{})
	ids, err := e.EncodeChat([]chat.Message{{Role: "user", Content: "Hi"}})
	if err != nil {
		t.Fatal(err)
	}
	want := e.Tokenizer.Encode("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", false)
	if !equal(ids, want) {
		t.Errorf("chat prompt %v, want %v", ids, want)
	}
	if id, _ := e.Tokenizer.TokenID("<|end_of_text|>"); !slices.Contains(e.Stop, id) {
		t.Errorf("stop ids %v lack <|end_of_text|> (%d)", e.Stop, id)
	}
}

// gated is a backend whose Forward waits until the test lets it go.
type gated struct {
	llm.Backend
	entered chan struct{}
	release chan struct{}
}

func (g *gated) Forward(ctx context.Context, steps []llm.Step) error {
	g.entered <- struct{}{}
	<-g.release
	return g.Backend.Forward(ctx, steps)
}

// With one batch slot and a queue of one, a third concurrent request is
// refused with ErrBusy; cancelling a running request ends it with the
// context's error while the queued one still completes; Close ends the rest.
func TestBusyCancelClose(t *testing.T) {
	m := openTiny(t)
	g := &gated{Backend: m.Backend, entered: make(chan struct{}), release: make(chan struct{})}
	e := start(t, NewModel(g, m.Tokenizer, nil), Options{MaxBatch: 1, MaxQueue: 1})
	prompt := m.Tokenizer.Encode("Once upon a time", true)

	ctx1, cancel1 := context.WithCancel(context.Background())
	first := make(chan error)
	go func() {
		_, err := e.Generate(ctx1, Request{Prompt: prompt, MaxTokens: 50}, nil)
		first <- err
	}()
	<-g.entered // the first request is in a forward pass
	second := make(chan *Result)
	go func() {
		res, err := e.Generate(context.Background(), Request{Prompt: prompt, MaxTokens: 3}, nil)
		if err != nil {
			t.Errorf("queued request: %v", err)
		}
		second <- res
	}()
	for len(e.queue) == 0 { // wait until the second request is queued
	}
	if _, err := e.Generate(context.Background(), Request{Prompt: prompt, MaxTokens: 3}, nil); !errors.Is(err, ErrBusy) {
		t.Errorf("third request: %v, want ErrBusy", err)
	}
	cancel1()
	close(g.release) // let every forward pass through from now on
	go func() {
		for range g.entered {
		}
	}()
	if err := <-first; !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled request: %v", err)
	}
	if res := <-second; res == nil || len(res.Tokens) != 3 {
		t.Errorf("queued request result %+v", res)
	}
	e.Close()
	if _, err := e.Generate(context.Background(), Request{Prompt: prompt, MaxTokens: 3}, nil); !errors.Is(err, ErrClosed) {
		t.Errorf("after Close: %v", err)
	}
	close(g.entered)
}

// A queued request whose context ends returns at once, and leaves the
// queue at the scheduler's next step rather than when a batch slot frees:
// with one slot and a queue of one, a request cancelled while queued does
// not keep the next one out (ErrBusy).
func TestCancelledWhileQueuedFreesTheQueue(t *testing.T) {
	m := openTiny(t)
	g := &gated{Backend: m.Backend, entered: make(chan struct{}), release: make(chan struct{})}
	e := start(t, NewModel(g, m.Tokenizer, nil), Options{MaxBatch: 1, MaxQueue: 1})
	prompt := m.Tokenizer.Encode("Once upon a time", true)

	first := make(chan error, 1)
	go func() {
		_, err := e.Generate(context.Background(), Request{Prompt: prompt, MaxTokens: 20}, nil)
		first <- err
	}()
	<-g.entered // the first request holds the only slot
	ctx2, cancel2 := context.WithCancel(context.Background())
	second := make(chan error, 1)
	go func() {
		_, err := e.Generate(ctx2, Request{Prompt: prompt, MaxTokens: 3}, nil)
		second <- err
	}()
	for e.Stats().Queued == 0 {
		time.Sleep(time.Millisecond)
	}
	cancel2()
	select {
	case err := <-second:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("cancelled queued request: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a queued request did not return when cancelled")
	}
	g.release <- struct{}{} // one step: the scheduler drops the cancelled request
	<-g.entered
	if q := e.Stats().Queued; q != 0 {
		t.Errorf("%d queued after the cancelled request left", q)
	}
	third := make(chan *Result, 1)
	go func() {
		res, err := e.Generate(context.Background(), Request{Prompt: prompt, MaxTokens: 2}, nil)
		if err != nil {
			t.Errorf("request after the cancelled one: %v", err)
		}
		third <- res
	}()
	for e.Stats().Queued == 0 && len(third) == 0 {
		time.Sleep(time.Millisecond)
	}
	close(g.release)
	go func() {
		for range g.entered {
		}
	}()
	if err := <-first; err != nil {
		t.Errorf("first request: %v", err)
	}
	if res := <-third; res == nil || len(res.Tokens) != 2 {
		t.Errorf("third request: %+v", res)
	}
	e.Close()
	close(g.entered)
}

func TestValidate(t *testing.T) {
	e := tiny(t, Options{})
	ctxLen := e.Backend.Config().MaxPositions
	long := make([]int, ctxLen)
	for _, c := range []struct {
		req  Request
		want string
	}{
		{Request{MaxTokens: 1}, "empty prompt"},
		{Request{Prompt: []int{1}}, "max_tokens must be positive"},
		{Request{Prompt: long, MaxTokens: 1}, "the prompt has 2048 tokens, the model's context is 2048"},
		{Request{Prompt: long[:2000], MaxTokens: 100}, "max_tokens 100 too large: 2000 prompt tokens + 100 exceed the model's context of 2048 (at most 48 fit after this prompt)"},
		// prompt + max_tokens must not wrap around: MaxInt plus the
		// prompt's length is negative, under any context.
		{Request{Prompt: []int{1}, MaxTokens: math.MaxInt}, "too large"},
		{Request{Prompt: []int{1, 2}, MaxTokens: math.MaxInt - 1, PromptLogprobs: true}, "too large"},
		{Request{Prompt: []int{1 << 30}, MaxTokens: 1}, "outside the vocabulary"},
		{Request{Prompt: []int{1}, MaxTokens: 1, Stop: []string{""}}, "empty stop string"},
		{Request{Prompt: []int{1}, MaxTokens: 1, Sample: llm.SampleOptions{TopP: 2}}, "top-p"},
	} {
		_, err := e.Generate(context.Background(), c.req, nil)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("got %v, want ErrInvalid containing %q", err, c.want)
		}
	}
}

func TestStopTextHoldsBackPrefixes(t *testing.T) {
	m := openTiny(t)
	ids := m.Tokenizer.Encode(" one two three four", false)
	st := newStopText(m.Tokenizer.NewStream(), []string{"three four five"})
	var out string
	for _, id := range ids {
		piece, stop := st.add(id)
		if stop {
			t.Fatal("stopped on a prefix of the stop string")
		}
		out += piece
	}
	if out != " one two " {
		t.Errorf("emitted %q before the end; the possible start of the stop string must be held", out)
	}
	rest, stopped := st.flush()
	if out += rest; out != " one two three four" || stopped {
		t.Errorf("after flush %q (stopped %v)", out, stopped)
	}
}

// New refuses a model it could not run, instead of failing later in the
// scheduler goroutine.
func TestNewRefusesIncompleteModel(t *testing.T) {
	m := openTiny(t)
	for _, c := range []struct {
		m    Model
		want string
	}{
		{nil, "no model"},
		{NewModel(nil, m.Tokenizer, nil), "no backend"},
		{NewModel(m.Backend, nil, nil), "no tokenizer"},
	} {
		if e, err := New(c.m, Options{}); err == nil || !strings.Contains(err.Error(), c.want) {
			if e != nil {
				e.Close()
			}
			t.Errorf("got %v, want an error containing %q", err, c.want)
		}
	}
}
