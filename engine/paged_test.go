package engine

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmq/llmq/internal/hostchain"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
)

// pagedRequests are greedy requests of different lengths: prompts of 5 to
// 26 tokens of WikiText, 24 to 66 new tokens.
func pagedRequests(t *testing.T, n int) []Request {
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	reqs := make([]Request, n)
	for i := range reqs {
		p := append([]int{0}, ids[i*37:i*37+4+i%8*3]...)
		reqs[i] = Request{Prompt: p, MaxTokens: 24 + i%8*6}
	}
	return reqs
}

// alone runs each request by itself on an engine with an unbounded pool,
// asking for the two most likely tokens at each step (sameAsAlone's
// near-ties).
func alone(t *testing.T, e *Engine, reqs []Request) []*Result {
	t.Helper()
	out := make([]*Result, len(reqs))
	for i, r := range reqs {
		r.Logprobs, r.TopLogprobs = true, 2
		res, err := e.Generate(context.Background(), r, nil)
		if err != nil {
			t.Fatal(err)
		}
		out[i] = res
	}
	return out
}

// nearTie is the largest gap, in log-probability, between the two most
// likely tokens at which the GPU may pick either: its activations are
// fp16 and its kernels depend on the batch (the W4A16 GEMV or the MMA
// kernel by the number of rows, cuBLAS's choice for the lm_head, split-K
// sums in the order CTAs finish, a preempted sequence's tokens prefilled
// again), so a row's logits move by about 1e-2 with what it is batched
// with (TestModelLogits: 0.0104 against the CPU).
const nearTie = 0.05

// sameAsAlone reports whether tokens are what the request generated
// alone: equal on the CPU, whose rows do not depend on the batch; on
// another device equal up to the first position where the two most
// likely tokens alone were within nearTie, if tokens took the other one
// there (after which the texts may part).
func sameAsAlone(tokens []int, alone *Result) bool {
	if equal(tokens, alone.Tokens) {
		return true
	}
	if testDevice() == "cpu" {
		return false
	}
	for i := range min(len(tokens), len(alone.Tokens)) {
		if tokens[i] == alone.Tokens[i] {
			continue
		}
		top := alone.Logprobs[i].Top
		return len(top) == 2 && top[1].ID == tokens[i] && top[0].Logprob-top[1].Logprob < nearTie
	}
	return false
}

// bounded is an engine on a fresh llama-tiny whose KV pool holds blocks
// blocks (of 16 positions of one layer).
func bounded(t *testing.T, blocks int, opt Options) (*Engine, *llm.BlockPool) {
	t.Helper()
	m := openTiny(t)
	p := m.Backend.(llm.Paged).KVPool()
	opt.KVCacheBytes = int64(blocks) * p.BlockBytes()
	return start(t, m, opt), p
}

// TestPreemption: twelve requests at once on a pool of 48 blocks (the
// longest request alone takes 24: 6 per layer): they cannot all hold
// their caches together, so some are admitted later and some preempted
// and prefilled again; every one still gets the tokens it gets alone,
// and at the end every block is back in the pool.
func TestPreemption(t *testing.T) {
	reqs := pagedRequests(t, 12)
	want := alone(t, tiny(t, Options{}), reqs)
	e, p := bounded(t, 48, Options{MaxBatch: 12})
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := e.Generate(context.Background(), r, nil)
			if err != nil {
				t.Errorf("request %d: %v", i, err)
				return
			}
			if !sameAsAlone(res.Tokens, want[i]) {
				t.Errorf("request %d:\n got %v\nwant %v (alone)", i, res.Tokens, want[i].Tokens)
			}
		}()
	}
	wg.Wait()
	st := e.Stats()
	t.Logf("preemptions %d, peak %d of %d blocks", st.Preemptions, st.KVBlocksPeak, st.KVBlocksTotal)
	if st.Preemptions == 0 {
		t.Error("no sequence was preempted: the test does not exercise preemption")
	}
	if st.KVBlocksPeak > 48 || st.KVBlocksTotal != 48 {
		t.Errorf("peak %d blocks of a pool of %d, want ≤ 48 of 48", st.KVBlocksPeak, st.KVBlocksTotal)
	}
	waitIdle(t, e, p)
}

// waitIdle waits for the engine to retire every sequence, the pool to get
// every block back and the backend's cache memory to return to 0.
func waitIdle(t *testing.T, e *Engine, p *llm.BlockPool) {
	t.Helper()
	// The GPU keeps its freed blocks' memory until the engine, idle for
	// idleTrim, trims it; the CPU frees it as blocks come back.
	deadline := time.Now().Add(10 * time.Second)
	for {
		st := e.Stats()
		mem, _ := e.Backend.Memory()
		if st.Active == 0 && st.Queued == 0 && p.Used() == 0 && mem.Caches == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not idle: %+v, %d blocks held, Memory counts %d cache bytes", st, p.Used(), mem.Caches)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestPreemptScoredPrompt: a request scoring a 60-token prompt
// (PromptLogprobs, prefilled 4 positions a step) joins a long generation
// on a pool of 10 blocks a layer; midway through its prompt the two no
// longer fit, so it (the later arrival) is preempted, and it scores the
// rest of its prompt once the other is done: its prompt logprobs and
// tokens are those it gets alone. It joins after the long one's 1st,
// 9th, 17th or 25th token, and is preempted once each time: a refill
// that would be preempted again at its next chunk is not admitted (the
// first version re-admitted it every step, 4 to 12 times).
func TestPreemptScoredPrompt(t *testing.T) {
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	long := Request{Prompt: ids[1000:1100], MaxTokens: 40}
	scored := Request{Prompt: ids[2000:2060], MaxTokens: 5, Logprobs: true, TopLogprobs: 2, PromptLogprobs: true}
	opt := Options{MaxScoreLogits: 4 * 8192}
	ref, err := tiny(t, opt).Generate(context.Background(), scored, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The CPU scores a prompt the same in any batch; the GPU (nearTie)
	// within a few thousandths.
	tol := 1e-4
	if testDevice() != "cpu" {
		tol = 1e-2
	}
	for _, after := range []int{1, 9, 17, 25} {
		t.Run(fmt.Sprintf("after %d tokens", after), func(t *testing.T) {
			e, p := bounded(t, 40, opt)
			started := make(chan struct{})
			longDone := make(chan error, 1)
			go func() {
				n := 0
				_, err := e.Generate(context.Background(), long, func(string) error {
					if n++; n == after {
						close(started)
					}
					return nil
				})
				longDone <- err
			}()
			<-started
			res, err := e.Generate(context.Background(), scored, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := <-longDone; err != nil {
				t.Fatal(err)
			}
			if !sameAsAlone(res.Tokens, ref) || len(res.PromptLogprobs) != len(ref.PromptLogprobs) {
				t.Fatalf("scored request: tokens %v, %d prompt logprobs; alone %v, %d", res.Tokens, len(res.PromptLogprobs), ref.Tokens, len(ref.PromptLogprobs))
			}
			for j := range ref.PromptLogprobs {
				if d := res.PromptLogprobs[j].Logprob - ref.PromptLogprobs[j].Logprob; math.Abs(d) > tol || res.PromptLogprobs[j].ID != ref.PromptLogprobs[j].ID {
					t.Errorf("prompt logprob %d: %+v, alone %+v", j, res.PromptLogprobs[j], ref.PromptLogprobs[j])
				}
			}
			if st := e.Stats(); st.Preemptions != 1 {
				t.Errorf("%d preemptions, want 1 (the scored request, midway through its prompt)", st.Preemptions)
			}
			waitIdle(t, e, p)
		})
	}
}

// TestNothingLostUnderLoad (issue 16, item 6): 64 concurrent streaming
// requests on a pool that holds a fraction of them, some cancelled
// midway (a client that disconnects), some longer than the blocks free
// while the others run: every completed one streams exactly its tokens
// alone, the cancelled ones give their blocks back, and the engine ends
// idle with an empty pool.
func TestNothingLostUnderLoad(t *testing.T) {
	reqs := pagedRequests(t, 64)
	for i := 5; i < len(reqs); i += 8 { // long ones: 200 new tokens, 13+ blocks a layer
		reqs[i].MaxTokens = 200
	}
	want := alone(t, tiny(t, Options{}), reqs)
	e, p := bounded(t, 120, Options{MaxBatch: 16})
	var wg sync.WaitGroup
	var mu sync.Mutex
	completed, cancelled, parted := 0, 0, 0
	for i, r := range reqs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			cancelAt := -1
			if i%4 == 3 {
				cancelAt = 3 + i%5
			}
			chunks := 0
			var streamed strings.Builder
			res, err := e.Generate(ctx, r, func(s string) error {
				streamed.WriteString(s)
				if chunks++; chunks == cancelAt {
					cancel()
				}
				return nil
			})
			mu.Lock()
			defer mu.Unlock()
			if cancelAt >= 0 && errors.Is(err, context.Canceled) {
				cancelled++
				return
			}
			if err != nil {
				t.Errorf("request %d: %v", i, err)
				return
			}
			completed++
			if !equal(res.Tokens, want[i].Tokens) {
				parted++ // at a near-tie (sameAsAlone, below)
			}
			if !sameAsAlone(res.Tokens, want[i]) || streamed.String() != res.Text {
				t.Errorf("request %d:\n got %v\nwant %v (alone); streamed %q of %q", i, res.Tokens, want[i].Tokens, streamed.String(), res.Text)
			}
		}()
	}
	wg.Wait()
	st := e.Stats()
	t.Logf("%d completed (%d parting from their text alone at a near-tie), %d cancelled, %d preemptions, peak %d of %d blocks",
		completed, parted, cancelled, st.Preemptions, st.KVBlocksPeak, st.KVBlocksTotal)
	if cancelled == 0 || st.Preemptions == 0 {
		t.Errorf("%d cancelled, %d preemptions: the test exercises neither", cancelled, st.Preemptions)
	}
	waitIdle(t, e, p)
}

// TestCancelFreesBlocks: a streaming request cancelled midway gives its
// blocks back at once, while another keeps running.
func TestCancelFreesBlocks(t *testing.T) {
	e, p := bounded(t, 400, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	held := make(chan int, 1)
	done := make(chan error, 1)
	go func() {
		n := 0
		_, err := e.Generate(ctx, Request{Prompt: []int{0, 791, 3925}, MaxTokens: 1000}, func(string) error {
			if n++; n == 40 {
				held <- p.Used()
				cancel()
			}
			return nil
		})
		done <- err
	}()
	if h := <-held; h < 4*3 { // 40+ tokens: 3 blocks a layer
		t.Errorf("%d blocks held after 40 tokens", h)
	}
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled request: %v", err)
	}
	waitIdle(t, e, p)
}

// TestValidatePool: a request that could not fit the pool even alone is
// refused with ErrInvalid saying how much fits; MaxSequence says it too.
func TestValidatePool(t *testing.T) {
	e, _ := bounded(t, 40, Options{}) // 10 blocks a layer: 160 tokens
	if got := e.MaxSequence(); got != 160 {
		t.Errorf("MaxSequence %d, want 160", got)
	}
	if err := e.Validate(Request{Prompt: make([]int, 10), MaxTokens: 150}); err != nil {
		t.Errorf("160 tokens refused: %v", err)
	}
	_, err := e.Generate(context.Background(), Request{Prompt: make([]int, 10), MaxTokens: 151}, nil)
	want := fmt.Sprintf("10 prompt tokens + max_tokens 151 = 161 tokens need 44 blocks of KV cache")
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "at most 160 tokens fit") {
		t.Errorf("got %v, want ErrInvalid containing %q", err, want)
	}
}

// trimCounter counts the calls of Trim on the CPU backend.
type trimCounter struct {
	*llm.Model
	n atomic.Int32
}

func (b *trimCounter) Trim() { b.n.Add(1); b.Model.Trim() }

// TestIdleTrim: a second after its last request the engine has the
// backend give freed cache memory back, once, and not again while idle.
func TestIdleTrim(t *testing.T) {
	m := openTiny(t)
	b := &trimCounter{Model: m.Backend.(*llm.Model)}
	e := start(t, NewModel(b, m.Tokenizer, m.Template), Options{})
	if _, err := e.Generate(context.Background(), Request{Prompt: []int{0, 791}, MaxTokens: 20}, nil); err != nil {
		t.Fatal(err)
	}
	if n := b.n.Load(); n != 0 {
		t.Errorf("Trim called %d times right after the request", n)
	}
	time.Sleep(idleTrim + idleTrim/2)
	if n := b.n.Load(); n != 1 {
		t.Errorf("Trim called %d times %v after the request, want 1", n, idleTrim+idleTrim/2)
	}
	time.Sleep(idleTrim + idleTrim/2)
	if n := b.n.Load(); n != 1 {
		t.Errorf("Trim called %d times after a longer idle, want 1", n)
	}
}

// TestChainsMatchSingleSteps: greedy requests on a Chainer (the backend's
// own on the GPU, else one on the host) run in chains while no request
// has arrived that the scheduler has not seen, and get the tokens they get
// alone — with an unbounded pool, and with a pool small enough that
// sequences are preempted and chains are shortened to what the pool
// holds.
// Requests that want logprobs or sample run single steps; Chain 1 turns
// chains off.
func TestChainsMatchSingleSteps(t *testing.T) {
	reqs := pagedRequests(t, 8)
	want := alone(t, tiny(t, Options{}), reqs)
	for _, c := range []struct {
		name   string
		blocks int // the pool's bound (0: none)
		chain  int
	}{{"unbounded", 0, 0}, {"pool of 48 blocks", 48, 0}, {"chain 1", 0, 1}} {
		t.Run(c.name, func(t *testing.T) {
			m := openTiny(t)
			p, ok := m.Backend.(llm.Paged)
			if !ok {
				t.Skipf("%s does not page its caches", m.Backend.Name())
			}
			hc := hostchain.NewPaged(p)
			opt := Options{MaxBatch: 8, Chain: c.chain}
			if c.blocks > 0 {
				opt.KVCacheBytes = int64(c.blocks) * p.KVPool().BlockBytes()
			}
			e := start(t, NewModel(hc, m.Tokenizer, m.Template), opt)
			got := generateAll(t, e, reqs)
			if t.Failed() {
				return
			}
			for i := range reqs {
				if !sameAsAlone(got[i].Tokens, want[i]) {
					t.Errorf("request %d:\n got %v\nwant %v (alone)", i, got[i].Tokens, want[i].Tokens)
				}
			}
			chains := hc.Chains()
			st := e.Stats()
			t.Logf("%d chains (%v), %d preemptions", len(chains), chains, st.Preemptions)
			switch {
			case c.chain == 1 && len(chains) > 0:
				t.Errorf("chains %v with Chain 1", chains)
			case c.chain == 0 && len(chains) == 0:
				t.Error("no chain ran")
			case c.blocks > 0 && st.Preemptions == 0:
				t.Error("no sequence was preempted: the bounded case does not exercise the pool")
			}
			for _, n := range chains {
				if n < 2 || n > 8 {
					t.Errorf("a chain of %d steps (want 2 to 8)", n)
				}
			}
			// A request that wants logprobs, or samples, runs single steps.
			before := len(hc.Chains())
			generateAll(t, e, []Request{
				{Prompt: reqs[0].Prompt, MaxTokens: 20, Logprobs: true},
				{Prompt: reqs[0].Prompt, MaxTokens: 20, Sample: llm.SampleOptions{Temperature: 0.8, Seed: 1}}})
			if n := len(hc.Chains()) - before; n > 0 {
				t.Errorf("%d chains ran for requests with logprobs or sampling", n)
			}
		})
	}
}

// TestChainsWhileRequestsWait: a request the batch cannot take does not
// stop the sequence in it from chaining. With a batch of one, the second
// request is submitted once the first has streamed its first token and
// waits for the whole of the first; both decode in chains, so the chains'
// steps reach both requests' decode steps (each request's first token
// comes from its prefill) but for one: the second request, arriving
// between the scheduler's look at the queue and its chain check, costs a
// single step. Had a waiting request stopped chains, they would cover
// only the first request's chains before the second came and the
// second request's steps. Both get the tokens they get alone.
func TestChainsWhileRequestsWait(t *testing.T) {
	reqs := pagedRequests(t, 2)
	want := alone(t, tiny(t, Options{}), reqs)
	m := openTiny(t)
	p, ok := m.Backend.(llm.Paged)
	if !ok {
		t.Skipf("%s does not page its caches", m.Backend.Name())
	}
	hc := hostchain.NewPaged(p)
	e := start(t, NewModel(hc, m.Tokenizer, m.Template), Options{MaxBatch: 1})
	got := make([]*Result, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	wg.Add(1)
	submitted := false
	got[0], errs[0] = e.GenerateChunks(context.Background(), reqs[0], func(Chunk) error {
		if !submitted { // the first request runs: the second waits behind it
			submitted = true
			go func() {
				defer wg.Done()
				got[1], errs[1] = e.Generate(context.Background(), reqs[1], nil)
			}()
			for deadline := time.Now().Add(10 * time.Second); e.Stats().Queued < 1; runtime.Gosched() {
				if time.Now().After(deadline) {
					return errors.New("the second request was not queued within 10 s")
				}
			}
		}
		return nil
	})
	if !submitted {
		wg.Done()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	decode := 0 // the decode steps: every token but the first
	for i := range reqs {
		if !sameAsAlone(got[i].Tokens, want[i]) {
			t.Errorf("request %d:\n got %v\nwant %v (alone)", i, got[i].Tokens, want[i].Tokens)
		}
		if len(got[i].Tokens) < 2 {
			t.Fatalf("request %d generated %d tokens: no decode step to chain", i, len(got[i].Tokens))
		}
		decode += len(got[i].Tokens) - 1
	}
	steps := 0
	for _, n := range hc.Chains() {
		steps += n
	}
	t.Logf("chains %v: %d steps of the requests' %d decode steps", hc.Chains(), steps, decode)
	if steps < decode-1 {
		t.Errorf("chains ran %d steps of %d: a request waiting stopped them", steps, decode)
	}
}

// generateAll runs reqs on e at once, each from its own goroutine, and
// returns their results (nil where one failed: the test is marked failed).
func generateAll(t *testing.T, e *Engine, reqs []Request) []*Result {
	got := make([]*Result, len(reqs))
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if got[i], err = e.Generate(context.Background(), r, nil); err != nil {
				t.Errorf("request %d: %v", i, err)
			}
		}()
	}
	wg.Wait()
	return got
}

// TestChainShortenedToThePool: a chain is shortened until the KV pool
// holds its blocks. A cache 14 tokens long takes a block a layer more
// from its third token on (position 16), so with one block fewer free
// than layers the chain stops at 2 steps, and with as many it runs 8.
func TestChainShortenedToThePool(t *testing.T) {
	m := openTiny(t)
	p, ok := m.Backend.(llm.Paged)
	if !ok {
		t.Skipf("%s does not page its caches", m.Backend.Name())
	}
	cfg := m.Backend.Config()
	L := cfg.Layers
	for _, c := range []struct{ spare, want int }{{L - 1, 2}, {L, 8}} {
		// The pool: the cache's blocks (one a layer) and spare more.
		e := start(t, NewModel(hostchain.NewPaged(p), m.Tokenizer, m.Template), Options{KVCacheBytes: int64(L+c.spare) * p.KVPool().BlockBytes()})
		cache, err := m.Backend.NewCache(64)
		if err != nil {
			t.Fatal(err)
		}
		prompt := make([]int, 14)
		if err := m.Backend.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: prompt, Logits: make([]float32, cfg.Vocab), LastOnly: true}}); err != nil {
			t.Fatal(err)
		}
		if free := e.pool.Free(); free != c.spare {
			t.Fatalf("%d blocks free after the prefill, want %d", free, c.spare)
		}
		s := &sequence{req: Request{MaxTokens: 100}, n: 1, cache: cache}
		steps := []llm.Step{{Cache: cache, Tokens: []int{1}, Greedy: true, LastOnly: true}}
		if n := e.chainLength([]*sequence{s}, steps, 0); n != c.want {
			t.Errorf("%d blocks free for %d layers: a chain of %d, want %d", c.spare, L, n, c.want)
		}
		cache.Close()
	}
}

// panicky panics once, in Forward or in DecodeGreedy (in), and otherwise
// answers as the Chainer it wraps.
type panicky struct {
	*hostchain.Chainer
	in       string // "forward" or "chain"
	panicked atomic.Bool
}

func (p *panicky) Forward(ctx context.Context, steps []llm.Step) error {
	if p.in == "forward" && p.panicked.CompareAndSwap(false, true) {
		panic("a bad kernel")
	}
	return p.Chainer.Forward(ctx, steps)
}

func (p *panicky) DecodeGreedy(ctx context.Context, steps []llm.Step, n int) ([][]int, error) {
	if p.in == "chain" && p.panicked.CompareAndSwap(false, true) {
		panic("a bad kernel")
	}
	return p.Chainer.DecodeGreedy(ctx, steps, n)
}

// TestBackendPanicIsAnError: a panic in the backend, in a forward pass or
// in a greedy chain, fails the requests of that step with an error naming
// the call, and the engine goes on: the next request gets the tokens it
// gets alone.
func TestBackendPanicIsAnError(t *testing.T) {
	reqs := pagedRequests(t, 1)
	want := alone(t, tiny(t, Options{}), reqs)
	for _, c := range []struct{ in, call string }{{"forward", "forward pass"}, {"chain", "greedy chain"}} {
		t.Run(c.in, func(t *testing.T) {
			m := openTiny(t)
			e := start(t, NewModel(&panicky{Chainer: hostchain.New(m.Backend), in: c.in}, m.Tokenizer, m.Template), Options{})
			_, err := e.Generate(context.Background(), reqs[0], nil)
			if err == nil || !strings.Contains(err.Error(), c.call+": a bad kernel") {
				t.Fatalf("a panic in the %s: %v; want an error naming %q", c.call, err, c.call)
			}
			res, err := e.Generate(context.Background(), reqs[0], nil)
			if err != nil {
				t.Fatalf("the request after the panic: %v", err)
			}
			if !sameAsAlone(res.Tokens, want[0]) {
				t.Errorf("the request after the panic:\n got %v\nwant %v (alone)", res.Tokens, want[0].Tokens)
			}
		})
	}
}
