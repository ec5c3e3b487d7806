package engine

import (
	"context"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
)

// The prompt's logprobs (max_tokens 0) and the first generated token's
// equal log-softmax of transformers' fp32 logits for the same ids, within
// 1e-4, and the top alternatives are the reference's most likely tokens.
//
// Also with the prompt prefilled in chunks of 5 positions (MaxScoreLogits
// 5×vocab): the KV cache carries each chunk into the next.
func TestPromptLogprobsMatchReference(t *testing.T) {
	m := openTiny(t)
	V := m.Backend.Config().Vocab
	for _, opt := range []Options{{}, {MaxScoreLogits: 5 * V}} {
		t.Run(fmt.Sprintf("chunk %d", max(1, opt.withDefaults().MaxScoreLogits/V)), func(t *testing.T) {
			promptLogprobsMatchReference(t, start(t, m, opt))
		})
	}
}

func promptLogprobsMatchReference(t *testing.T, e *Engine) {
	ids := shared.Int32s(t, "reference/llama-tiny.logits.input.i32")
	ref := shared.Float32s(t, "reference/llama-tiny.logits.f32")
	V := e.Backend.Config().Vocab
	if len(ref) != len(ids)*V {
		t.Fatalf("reference holds %d logits, want %d×%d", len(ref), len(ids), V)
	}
	res, err := e.Generate(context.Background(), Request{Prompt: ids, MaxTokens: 0, PromptLogprobs: true, TopLogprobs: 3}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.PromptLogprobs) != len(ids)-1 || len(res.Tokens) != 0 || res.CompletionTokens != 0 {
		t.Fatalf("%d prompt logprobs, %d tokens; want %d and 0", len(res.PromptLogprobs), len(res.Tokens), len(ids)-1)
	}
	worst := 0.0
	for i, lp := range res.PromptLogprobs {
		want := shared.LogSoftmax(ref[i*V : (i+1)*V])
		if lp.ID != ids[i+1] {
			t.Fatalf("entry %d is token %d, want %d", i, lp.ID, ids[i+1])
		}
		worst = math.Max(worst, math.Abs(lp.Logprob-want[ids[i+1]]))
		if len(lp.Top) != 3 {
			t.Fatalf("entry %d has %d alternatives, want 3", i, len(lp.Top))
		}
		for _, a := range lp.Top {
			worst = math.Max(worst, math.Abs(a.Logprob-want[a.ID]))
		}
		// The reference's most likely token, unless two are within the
		// tolerance of each other.
		best := 0
		for j, v := range want {
			if v > want[best] {
				best = j
			}
		}
		if lp.Top[0].ID != best && want[best]-want[lp.Top[0].ID] > 1e-4 {
			t.Errorf("position %d: most likely %d, reference %d", i, lp.Top[0].ID, best)
		}
	}
	t.Logf("largest |logprob − reference| over %d prompt tokens and their alternatives: %.2e", len(ids)-1, worst)
	if worst > 1e-4 {
		t.Errorf("logprobs differ from the reference by %.2e > 1e-4", worst)
	}

	// One greedy token with its logprob: the last reference row.
	res, err = e.Generate(context.Background(), Request{Prompt: ids, MaxTokens: 1, Logprobs: true, TopLogprobs: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Logprobs) != 1 {
		t.Fatalf("%d logprobs for one token", len(res.Logprobs))
	}
	last := shared.LogSoftmax(ref[(len(ids)-1)*V:])
	lp := res.Logprobs[0]
	if d := math.Abs(lp.Logprob - last[lp.ID]); d > 1e-4 || lp.Top[0].ID != lp.ID {
		t.Errorf("generated token %d: logprob %v (reference %v), top %v", lp.ID, lp.Logprob, last[lp.ID], lp.Top)
	}
}

// Scored and plain requests in one batch: the plain ones' tokens are what
// they are alone, and streamed chunks carry every token's logprob once.
func TestLogprobsInABatch(t *testing.T) {
	ref := shared.GreedyRefs(t, "llama-tiny")
	e := tiny(t, Options{MaxBatch: 8})
	var wg sync.WaitGroup
	for prompt, r := range ref {
		wg.Add(2)
		go func() {
			defer wg.Done()
			res, err := e.Generate(context.Background(), Request{Prompt: r.PromptIDs, MaxTokens: len(r.GreedyIDs)}, nil)
			if err != nil || !equal(res.Tokens, r.GreedyIDs) {
				t.Errorf("%q: plain request: %v, %v", prompt, err, res)
			}
		}()
		go func() {
			defer wg.Done()
			var streamed []TokenLogprob
			res, err := e.GenerateChunks(context.Background(), Request{Prompt: r.PromptIDs, MaxTokens: len(r.GreedyIDs),
				Logprobs: true, TopLogprobs: 2, PromptLogprobs: true}, func(c Chunk) error {
				streamed = append(streamed, c.Logprobs...)
				return nil
			})
			if err != nil {
				t.Errorf("%q: %v", prompt, err)
				return
			}
			if !equal(res.Tokens, r.GreedyIDs) {
				t.Errorf("%q: scored request: tokens %v, want %v", prompt, res.Tokens, r.GreedyIDs)
			}
			if len(res.PromptLogprobs) != len(r.PromptIDs)-1 || len(res.Logprobs) != len(res.Tokens) || len(streamed) != len(res.Logprobs) {
				t.Errorf("%q: %d prompt logprobs, %d logprobs, %d streamed for %d+%d tokens", prompt,
					len(res.PromptLogprobs), len(res.Logprobs), len(streamed), len(r.PromptIDs), len(res.Tokens))
				return
			}
			for i, lp := range res.Logprobs {
				if lp.ID != res.Tokens[i] || streamed[i].ID != lp.ID || lp.Top[0].ID != lp.ID || lp.Logprob > 0 {
					t.Errorf("%q: token %d: %+v (streamed %+v)", prompt, i, lp, streamed[i])
				}
			}
		}()
	}
	wg.Wait()
}

func TestValidateLogprobs(t *testing.T) {
	e := tiny(t, Options{})
	for _, req := range []Request{
		{Prompt: []int{0, 5}, MaxTokens: 0},
		{Prompt: []int{0, 5}, MaxTokens: -1, PromptLogprobs: true},
		{Prompt: []int{0, 5}, MaxTokens: 1, Logprobs: true, TopLogprobs: MaxTopLogprobs + 1},
		{Prompt: []int{0, 5}, MaxTokens: 1, Logprobs: true, TopLogprobs: -1},
	} {
		if err := e.Validate(req); err == nil {
			t.Errorf("%+v accepted", req)
		}
	}
	// A one-token prompt scored: nothing to score, nothing generated.
	res, err := e.Generate(context.Background(), Request{Prompt: []int{0}, PromptLogprobs: true}, nil)
	if err != nil || len(res.PromptLogprobs) != 0 || len(res.Tokens) != 0 {
		t.Errorf("one-token prompt: %v, %+v", err, res)
	}
}

// favour makes one token the most likely everywhere (its logit 100).
type favour struct {
	llm.Backend
	id int
}

func (b favour) Forward(ctx context.Context, steps []llm.Step) error {
	if err := b.Backend.Forward(ctx, steps); err != nil {
		return err
	}
	V := b.Config().Vocab
	for _, s := range steps {
		for r := 0; r < len(s.Logits)/V; r++ {
			s.Logits[r*V+b.id] = 100
		}
	}
	return nil
}

// A generation ended by the end-of-sequence token lists that token in
// Logprobs (not in Tokens): a client that drops the last entry of
// prompt+1 tokens, as lm-evaluation-harness does, still drops the right
// one. Streamed, it comes in the last chunk.
func TestEOSInLogprobs(t *testing.T) {
	m := openTiny(t)
	eos := m.Backend.Config().EOS[0]
	e := start(t, NewModel(favour{m.Backend, eos}, m.Tokenizer, m.Template), Options{})
	var chunks []Chunk
	res, err := e.GenerateChunks(context.Background(), Request{Prompt: []int{0, 791, 3925}, MaxTokens: 1, Logprobs: true, TopLogprobs: 1, PromptLogprobs: true},
		func(c Chunk) error { chunks = append(chunks, c); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Tokens) != 0 || res.FinishReason != "stop" || len(res.Logprobs) != 1 || res.Logprobs[0].ID != eos || res.Logprobs[0].Top[0].ID != eos || len(res.PromptLogprobs) != 2 {
		t.Fatalf("tokens %v, finish %q, logprobs %+v, %d prompt logprobs", res.Tokens, res.FinishReason, res.Logprobs, len(res.PromptLogprobs))
	}
	if len(chunks) != 1 || chunks[0].Text != "" || len(chunks[0].Logprobs) != 1 || len(chunks[0].PromptLogprobs) != 2 {
		t.Errorf("chunks %+v", chunks)
	}
	// Without Logprobs nothing is sent for it.
	res, err = e.Generate(context.Background(), Request{Prompt: []int{0, 791}, MaxTokens: 3}, nil)
	if err != nil || len(res.Tokens) != 0 || res.Logprobs != nil || res.FinishReason != "stop" {
		t.Errorf("%v, %+v", err, res)
	}
}

// Tokens without text stream their logprobs one chunk a token (what a
// client timing each token sees), stop strings set or not.
func TestLogprobsOfTokensWithoutText(t *testing.T) {
	m := openTiny(t)
	// The beginning-of-sequence token: a special token, with no text.
	e := start(t, NewModel(favour{m.Backend, m.Backend.Config().BOS}, m.Tokenizer, m.Template), Options{})
	for _, c := range []struct {
		stop   []string
		chunks []int // logprobs in each chunk
	}{{nil, []int{1, 1, 1, 1}}, {[]string{"never"}, []int{1, 1, 1, 1}}} {
		var got []int
		res, err := e.GenerateChunks(context.Background(), Request{Prompt: []int{0, 791}, MaxTokens: 4, Logprobs: true, Stop: c.stop},
			func(ch Chunk) error {
				if ch.Text != "" {
					t.Errorf("stop %q: chunk text %q from a special token", c.stop, ch.Text)
				}
				got = append(got, len(ch.Logprobs))
				return nil
			})
		if err != nil || len(res.Tokens) != 4 || res.Tokens[0] != m.Backend.Config().BOS {
			t.Fatalf("stop %q: %v, %+v", c.stop, err, res)
		}
		if !equal(got, c.chunks) {
			t.Errorf("stop %q: logprobs a chunk %v, want %v", c.stop, got, c.chunks)
		}
	}
}

// pickedOnDevice answers Greedy and Draw steps the way a GPU backend may:
// it sets Argmax — for Greedy not the real one but the step's last token +
// 1000, so a greedy request that took it is recognisable; for Draw the
// draw's pick — and leaves NaN in the logits, so one that read them would
// not get it. draws counts the Draw steps it answered.
type pickedOnDevice struct {
	llm.Backend
	draws *atomic.Int64
}

func (b pickedOnDevice) AnswersGreedy() {}
func (b pickedOnDevice) AnswersDraw()   {}

func (b pickedOnDevice) Forward(ctx context.Context, steps []llm.Step) error {
	if err := b.Backend.Forward(ctx, steps); err != nil {
		return err
	}
	for i, s := range steps {
		switch {
		case s.Greedy:
			steps[i].Argmax = s.Tokens[len(s.Tokens)-1] + 1000
		case s.Draw != nil:
			steps[i].Argmax = s.Draw.Pick(s.Logits)
			b.draws.Add(1)
		default:
			continue
		}
		for j := range s.Logits {
			s.Logits[j] = float32(math.NaN())
		}
	}
	return nil
}

// In one batch, a greedy request without logprobs takes the backend's own
// pick (Step.Greedy) at every step and a sampled one its pick from the
// request's draws (Step.Draw, one a token: the same tokens as the host's
// sampling), while a greedy and a sampled one with logprobs, beside them,
// get their tokens and logprobs from the plain backend's logits (no
// draws).
func TestGreedyStepsTakeTheBackendsPick(t *testing.T) {
	m := openTiny(t)
	plain := start(t, m, Options{})
	draws := new(atomic.Int64)
	e := start(t, NewModel(pickedOnDevice{m.Backend, draws}, m.Tokenizer, m.Template), Options{MaxBatch: 4})
	prompt := []int{0, 791}
	reqs := []Request{
		{Prompt: prompt, MaxTokens: 4},
		{Prompt: prompt, MaxTokens: 4, Logprobs: true},
		{Prompt: prompt, MaxTokens: 4, Sample: llm.SampleOptions{Temperature: 0.8, Seed: 7}},
		{Prompt: prompt, MaxTokens: 4, Sample: llm.SampleOptions{Temperature: 0.8, Seed: 7}, Logprobs: true},
	}
	got := generateAll(t, e, reqs)
	if t.Failed() {
		return
	}
	if want := []int{791 + 1000, 1791 + 1000, 2791 + 1000, 3791 + 1000}; !equal(got[0].Tokens, want) {
		t.Errorf("greedy: %v, want the backend's picks %v", got[0].Tokens, want)
	}
	for i, r := range reqs[1:] {
		want, err := plain.Generate(context.Background(), r, nil)
		if err != nil || !equal(got[i+1].Tokens, want.Tokens) || len(got[i+1].Logprobs) != len(want.Logprobs) {
			t.Errorf("request %d: %v %v, want %v %v from the logits (%v)", i+1, got[i+1].Tokens, got[i+1].Logprobs, want.Tokens, want.Logprobs, err)
			continue
		}
		for j, lp := range want.Logprobs { // batched beside others, alone: the same up to float rounding
			if g := got[i+1].Logprobs[j]; g.ID != lp.ID || math.Abs(g.Logprob-lp.Logprob) > 1e-4 {
				t.Errorf("request %d, token %d: logprob %+v, want %+v", i+1, j, g, lp)
			}
		}
	}
	if n := draws.Load(); n != int64(reqs[2].MaxTokens) {
		t.Errorf("the backend answered %d draws, want %d: one a token of the sampled request without logprobs", n, reqs[2].MaxTokens)
	}
}
