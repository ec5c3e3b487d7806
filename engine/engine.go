// Package engine is the API a Go chat server imports: it runs many
// generation requests at once on one model — an llm.Backend with its
// tokenizer and chat template — and renders chat prompts.
//
// The engine does not load models: it runs whatever satisfies Model.
// Package backend opens a model directory on the CPU or the GPU and
// returns one, so the engine depends on package llm's interfaces alone,
// never on the packages that implement them (pack, cuda):
//
//	m, err := backend.Open(dir, "auto")
//	defer m.Close()
//	e, err := engine.New(m, engine.Options{MaxBatch: 16})
//	defer e.Close()
//
// Requests are batched continuously (Yu et al. 2022, "Orca"): one
// scheduler goroutine owns the backend, and every iteration it admits
// waiting requests up to MaxBatch, runs one Forward over all active
// sequences together — a new request's whole prompt (prefill) next to the
// others' single decode tokens — samples one token for each, and retires
// the ones that finished. A request therefore never waits for another to
// end, and batch-1 decoding turns into batch-N matrix products.
//
// On a backend that pages its key/value caches (llm.Paged: the CPU and the GPU) the
// batch is bounded by memory too: a waiting request is admitted only when
// the block pool has what its prefill takes, and when the running
// sequences run out of blocks the one that arrived last is preempted —
// its blocks freed, and everything it held prefilled again when there is
// room (recomputation, as vLLM does) — so requests wait rather than fail,
// and their output does not change.
//
// Callers see requests as a blocking Generate call that streams text
// through a callback; cancelling its context (a client that went away)
// removes the sequence at the next iteration. Text is decoded and stop
// strings are matched in the caller's goroutine, so a slow consumer never
// stalls the batch.
package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/chat"
	"github.com/llmq/llmq/llm/tokenizer"
)

// Model is what an Engine runs. *backend.Model is one; NewModel makes one
// from parts a caller already holds (a backend it wrapped, say).
type Model interface {
	// Parts returns the backend that runs the forward passes, the
	// checkpoint's tokenizer, and its chat template (nil when it has none).
	// The backend's Config().EOS ids end a generation.
	Parts() (llm.Backend, *tokenizer.Tokenizer, *chat.Template)
}

// NewModel makes a Model of its parts; tmpl may be nil.
func NewModel(b llm.Backend, tok *tokenizer.Tokenizer, tmpl *chat.Template) Model {
	return parts{b, tok, tmpl}
}

type parts struct {
	b    llm.Backend
	tok  *tokenizer.Tokenizer
	tmpl *chat.Template
}

func (p parts) Parts() (llm.Backend, *tokenizer.Tokenizer, *chat.Template) { return p.b, p.tok, p.tmpl }

// Options configure an Engine.
type Options struct {
	// MaxBatch is the most sequences in one forward pass (default 16).
	MaxBatch int
	// MaxQueue is the most requests waiting for a batch slot; beyond it
	// Generate fails at once with ErrBusy (default 64).
	MaxQueue int
	// MaxScoreLogits bounds the logits a scored prompt (PromptLogprobs)
	// keeps at once, in positions × vocabulary values (default 1<<26:
	// 256 MiB of float32). A longer prompt is prefilled in chunks of
	// MaxScoreLogits/vocab positions over successive iterations, so a
	// long prompt on a large vocabulary cannot exhaust memory.
	MaxScoreLogits int
	// KVCacheBytes bounds the key/value cache memory of a backend that
	// pages it (llm.Paged: the CPU, the GPU), in bytes; 0 leaves the
	// backend's pool as it is (unbounded until bounded). With a bound,
	// a waiting request joins the batch only when the pool has the blocks
	// its next step takes; when decoding sequences run out of blocks the
	// one that arrived last is preempted — its blocks freed, its prompt and
	// the tokens generated so far prefilled again once blocks are free —
	// and a request that could not fit the pool even alone is refused
	// (ErrInvalid). Backends that reserve each cache's capacity up front
	// ignore it.
	KVCacheBytes int64
	// Chain is how many greedy decode steps a Chainer backend (the GPU)
	// runs back to back, with no round trip to the host between them,
	// when every sequence in the batch decodes greedily one token a step
	// and no request has arrived since the scheduler last looked (≤ 0:
	// llm.DefaultChain; 1: a step at a time). Requests the scheduler left
	// waiting (the batch full, or the pool short) do not stop a chain: a
	// chain runs at most Chain steps, as many as the pool has room for,
	// and never past a sequence's MaxTokens, so they wait longer only
	// where a sequence stops early inside it. A chain runs whole: a
	// request that arrives meanwhile waits for its end, as do a
	// cancellation and Close, and a sequence that stops inside a chain
	// drops the tokens decoded past its stop.
	Chain int
}

func (o Options) withDefaults() Options {
	if o.MaxBatch <= 0 {
		o.MaxBatch = 16
	}
	if o.MaxQueue <= 0 {
		o.MaxQueue = 64
	}
	if o.MaxScoreLogits <= 0 {
		o.MaxScoreLogits = 1 << 26
	}
	if o.Chain <= 0 {
		o.Chain = llm.DefaultChain
	}
	return o
}

// Errors a server maps to status codes.
var (
	// ErrBusy: the queue is full; retry later (HTTP 503).
	ErrBusy = errors.New("engine: too many requests waiting")
	// ErrClosed: the engine was closed.
	ErrClosed = errors.New("engine: closed")
	// ErrInvalid wraps a request the model cannot serve (HTTP 400).
	ErrInvalid = errors.New("invalid request")
)

// Engine runs generation requests on one backend. Its methods are safe for
// concurrent use.
type Engine struct {
	Backend   llm.Backend
	Tokenizer *tokenizer.Tokenizer
	Template  *chat.Template // nil when the model has no chat template
	// Stop holds the token ids that end a generation (the model's EOS ids
	// and the chat template's end-of-turn token).
	Stop []int

	opt     Options
	queue   chan *sequence
	quit    chan struct{}
	done    chan struct{}
	closing sync.Once

	mu     sync.Mutex // orders submissions before Close
	closed bool

	pool        *llm.BlockPool // the backend's KV blocks, when it pages its caches
	arrivals    int64          // sequences submitted (under mu): their order
	preemptions atomic.Int64

	active       atomic.Int64 // sequences in the batch
	queued       atomic.Int64 // sequences submitted, neither in the batch nor dropped yet
	generated    atomic.Int64 // tokens generated since the start
	kvTokens     atomic.Int64 // tokens held by the active sequences' caches
	kvBytes      atomic.Int64 // memory those caches reserve, when they report it
	kvBytesKnown atomic.Bool
}

// New starts an engine on a model. The engine uses the model but does not
// own it: whoever opened the model closes it, after closing the engine.
func New(m Model, opt Options) (*Engine, error) {
	if m == nil {
		return nil, errors.New("engine: no model")
	}
	b, tok, tmpl := m.Parts()
	switch {
	case b == nil:
		return nil, errors.New("engine: the model has no backend")
	case b.Config() == nil:
		return nil, fmt.Errorf("engine: the %s backend has no config", b.Name())
	case tok == nil:
		return nil, errors.New("engine: the model has no tokenizer")
	}
	opt = opt.withDefaults()
	e := &Engine{Backend: b, Tokenizer: tok, Template: tmpl, opt: opt,
		queue: make(chan *sequence, opt.MaxQueue), quit: make(chan struct{}), done: make(chan struct{})}
	if p, ok := b.(llm.Paged); ok {
		if opt.KVCacheBytes > 0 {
			if err := p.SetKVCacheBytes(opt.KVCacheBytes); err != nil {
				return nil, fmt.Errorf("engine: %w", err)
			}
		}
		e.pool = p.KVPool()
	}
	e.Stop = slices.Clone(b.Config().EOS)
	if tmpl != nil {
		if id, ok := tok.TokenID(tmpl.EOSToken); ok && !slices.Contains(e.Stop, id) {
			e.Stop = append(e.Stop, id)
		}
	}
	go e.run()
	return e, nil
}

// Close stops the engine: requests still running end with ErrClosed.
// Callers that want in-flight requests to finish wait for them first (an
// http.Server's Shutdown does). It leaves the model open.
func (e *Engine) Close() error {
	e.closing.Do(func() {
		e.mu.Lock()
		e.closed = true
		e.mu.Unlock()
		close(e.quit)
		<-e.done
	})
	return nil
}

// Stats are an engine's counters.
type Stats struct {
	Queued    int   `json:"queued"`           // requests waiting for a batch slot
	Active    int   `json:"active"`           // sequences in the running batch
	Generated int64 `json:"generated_tokens"` // tokens generated since the engine started
	// KVTokens is the tokens the active sequences' KV caches hold, as of
	// the last iteration of the scheduler.
	KVTokens int64 `json:"kv_cache_tokens"`
	// KVBytes is the memory of the backend's caches (Memory().Caches: on
	// a paged backend the blocks held now; on the GPU, the segments of
	// blocks allocated, idle ones included until Trim, and the caches'
	// block tables).
	KVBytes int64 `json:"kv_cache_bytes,omitempty"`
	// KVBytesKnown: the backend's caches report their size (seen once a
	// request ran); KVBytes means nothing otherwise.
	KVBytesKnown bool `json:"-"`
	// KVPaged: the backend pages its caches (llm.Paged), and then the
	// blocks the caches hold, the pool's size (0 when it has no bound),
	// the most held at once, and how many times a sequence was preempted
	// (its blocks freed to let others on; it is prefilled again later).
	KVPaged       bool  `json:"kv_paged"`
	KVBlocksUsed  int   `json:"kv_blocks_used"`
	KVBlocksTotal int   `json:"kv_blocks_total,omitempty"`
	KVBlocksPeak  int   `json:"kv_blocks_peak"`
	Preemptions   int64 `json:"preemptions"`
}

// Stats reads the counters.
func (e *Engine) Stats() Stats {
	st := Stats{Queued: int(e.queued.Load()), Active: int(e.active.Load()), Generated: e.generated.Load(),
		KVTokens: e.kvTokens.Load(), KVBytes: e.kvBytes.Load(), KVBytesKnown: e.kvBytesKnown.Load(), Preemptions: e.preemptions.Load()}
	if e.pool != nil {
		st.KVPaged, st.KVBlocksUsed, st.KVBlocksPeak = true, e.pool.Used(), e.pool.Peak()
		if n := e.pool.Blocks(); n < llm.Unbounded {
			st.KVBlocksTotal = n
		}
	}
	return st
}

// KVPoolBytes is the memory a bounded key/value pool may hold (0 when the
// backend does not page its caches or the pool has no bound).
func (e *Engine) KVPoolBytes() int64 {
	if e.pool == nil || e.pool.Blocks() == llm.Unbounded {
		return 0
	}
	return int64(e.pool.Blocks()) * e.pool.BlockBytes()
}

// MaxSequence is the most tokens, prompt and generation together, one
// request may take: the model's context, or less when a bounded KV cache
// pool cannot hold that many.
func (e *Engine) MaxSequence() int {
	ctxLen := e.Backend.Config().MaxPositions
	if e.pool == nil {
		return ctxLen
	}
	return e.pool.MaxTokens(ctxLen)
}

// kvUsage is the tokens the active sequences' caches hold, and the bytes
// of key/value cache the backend accounts for (Backend.Memory).
func (e *Engine) kvUsage(active []*sequence) (tokens, bytes int64, known bool) {
	for _, s := range active {
		if s.cache != nil {
			tokens += int64(s.cache.Len())
		}
	}
	mem, err := e.Backend.Memory()
	return tokens, mem.Caches, err == nil
}

// Request is one generation.
type Request struct {
	Prompt []int // token ids (see Encode, EncodeChat and EncodeChatWith)
	// MaxTokens is the most new tokens (> 0; 0 is allowed with
	// PromptLogprobs: the prompt is scored and nothing generated).
	MaxTokens int
	Sample    llm.SampleOptions
	Stop      []string // text that ends the generation (not returned)

	// Logprobs asks for each generated token's log-probability under the
	// model (before temperature and top-p), in Result.Logprobs and, when
	// streaming, in each Chunk. It costs one pass over the vocabulary per
	// token, in the scheduler; requests without it pay nothing.
	Logprobs bool
	// TopLogprobs is how many of the most likely tokens to report at each
	// position with Logprobs or PromptLogprobs (0 to MaxTopLogprobs).
	TopLogprobs int
	// PromptLogprobs asks for the log-probability of every prompt token
	// after the first, given the tokens before it (Result.PromptLogprobs):
	// what loglikelihood evaluations score. The prefill then keeps the
	// logits of every prompt position, in chunks of at most
	// Options.MaxScoreLogits values, and the log-softmax is computed in
	// the caller's goroutine, not the scheduler's.
	PromptLogprobs bool
}

// MaxTopLogprobs bounds Request.TopLogprobs.
const MaxTopLogprobs = 20

// TokenLogprob is one token with its log-probability and, when asked
// for, the most likely tokens at its position (most likely first; the
// token itself may or may not be among them).
type TokenLogprob struct {
	ID      int
	Logprob float64
	Top     []llm.Logprob
}

// Result is a finished generation.
type Result struct {
	Text             string
	Tokens           []int
	PromptTokens     int
	CompletionTokens int
	// FinishReason is "stop" (an EOS token or a stop string) or "length"
	// (MaxTokens or the model's context).
	FinishReason string
	// Logprobs (with Request.Logprobs) has one entry per token of Tokens,
	// followed by the end-of-sequence token when one ended the generation
	// (it is not in Tokens: it has no text), as OpenAI-compatible servers
	// report it.
	Logprobs []TokenLogprob
	// PromptLogprobs (with Request.PromptLogprobs) has len(Prompt)−1
	// entries: entry i is Prompt[i+1] given Prompt[:i+1]. The first
	// prompt token has no log-probability: nothing comes before it.
	PromptLogprobs []TokenLogprob
}

// Chunk is a piece of a streamed generation: new text, and (with
// Request.Logprobs) the tokens taken since the previous chunk. Every
// token with logprobs is streamed at once, in a chunk without text when
// its text is held back (an incomplete character, the start of a possible
// stop string) or empty (a special token). As in Result.Logprobs, the
// tokens of a stop string that ended the generation are listed too.
//
// With Request.PromptLogprobs, the first chunk also carries
// PromptLogprobs (as Result.PromptLogprobs), even when it has no text.
type Chunk struct {
	Text           string
	Logprobs       []TokenLogprob
	PromptLogprobs []TokenLogprob
}

// Encode tokenizes a plain-text prompt, adding the tokenizer's special
// tokens (BOS).
func (e *Engine) Encode(text string) []int { return e.Tokenizer.Encode(text, true) }

// EncodeChat renders a conversation with the model's chat template,
// ready for the assistant's turn, and tokenizes it (the template writes
// its own special tokens).
func (e *Engine) EncodeChat(messages []chat.Message) ([]int, error) {
	ids, _, err := e.EncodeChatWith(messages, nil)
	return ids, err
}

// EncodeChatWith is EncodeChat with further template variables (see
// chat.Template.RenderWith; e.g. Qwen3's {"enable_thinking": false}),
// and returns the rendered text too.
func (e *Engine) EncodeChatWith(messages []chat.Message, vars map[string]any) (ids []int, text string, err error) {
	if text, err = e.RenderChat(messages, vars); err != nil {
		return nil, "", err
	}
	return e.Tokenizer.Encode(text, false), text, nil
}

// RenderChat is EncodeChatWith's first half: the conversation rendered
// with the chat template, ready for the assistant's turn, not tokenized
// (so that a caller can bound the text before paying for its tokens).
func (e *Engine) RenderChat(messages []chat.Message, vars map[string]any) (string, error) {
	if e.Template == nil {
		return "", fmt.Errorf("%w: the model has no chat template (tokenizer_config.json chat_template); use a plain completion", ErrInvalid)
	}
	text, err := e.Template.RenderWith(messages, true, vars)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	return text, nil
}

// Validate checks a request against the model before it is queued.
func (e *Engine) Validate(req Request) error {
	ctxLen := e.Backend.Config().MaxPositions
	switch {
	case len(req.Prompt) == 0:
		return fmt.Errorf("%w: empty prompt", ErrInvalid)
	case req.MaxTokens < 0 || (req.MaxTokens == 0 && !req.PromptLogprobs):
		return fmt.Errorf("%w: max_tokens must be positive, got %d (0 only when scoring the prompt)", ErrInvalid, req.MaxTokens)
	case req.TopLogprobs < 0 || req.TopLogprobs > MaxTopLogprobs:
		return fmt.Errorf("%w: top logprobs must be in [0, %d], got %d", ErrInvalid, MaxTopLogprobs, req.TopLogprobs)
	case len(req.Prompt) >= ctxLen:
		return fmt.Errorf("%w: the prompt has %d tokens, the model's context is %d", ErrInvalid, len(req.Prompt), ctxLen)
	case req.MaxTokens > ctxLen-len(req.Prompt): // not prompt + MaxTokens: a huge MaxTokens would wrap around
		return fmt.Errorf("%w: max_tokens %d too large: %d prompt tokens + %d exceed the model's context of %d (at most %d fit after this prompt)",
			ErrInvalid, req.MaxTokens, len(req.Prompt), req.MaxTokens, ctxLen, ctxLen-len(req.Prompt))
	}
	if e.pool != nil {
		n := len(req.Prompt) + req.MaxTokens
		if need, total := e.pool.BlocksFor(n), e.pool.Blocks(); need > total {
			return fmt.Errorf("%w: %d prompt tokens + max_tokens %d = %d tokens need %d blocks of KV cache (%d positions of one layer each; %s), more than the whole pool of %d blocks (%s) holds: at most %d tokens fit in it; lower max_tokens or give the server more KV cache memory",
				ErrInvalid, len(req.Prompt), req.MaxTokens, n, need, e.pool.BlockTokens(), mib(int64(need)*e.pool.BlockBytes()), total, mib(int64(total)*e.pool.BlockBytes()), e.pool.MaxTokens(ctxLen))
		}
	}
	for _, id := range req.Prompt {
		if id < 0 || id >= e.Backend.Config().Vocab {
			return fmt.Errorf("%w: token id %d outside the vocabulary of %d", ErrInvalid, id, e.Backend.Config().Vocab)
		}
	}
	for _, s := range req.Stop {
		if s == "" {
			return fmt.Errorf("%w: empty stop string", ErrInvalid)
		}
	}
	if err := req.Sample.Validate(); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	return nil
}

// mib writes a byte count in MiB.
func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// Generate runs a request, calling emit (when not nil) with each piece of
// new text as soon as it is final. It blocks until the generation ends,
// ctx is cancelled, or emit returns an error. It fails at once with
// ErrBusy when MaxQueue requests are already waiting.
func (e *Engine) Generate(ctx context.Context, req Request, emit func(text string) error) (*Result, error) {
	var f func(Chunk) error
	if emit != nil {
		f = func(c Chunk) error {
			if c.Text == "" {
				return nil
			}
			return emit(c.Text)
		}
	}
	return e.GenerateChunks(ctx, req, f)
}

// GenerateChunks is Generate with the tokens' log-probabilities streamed
// alongside the text (see Chunk), for requests with Logprobs.
func (e *Engine) GenerateChunks(ctx context.Context, req Request, emit func(Chunk) error) (*Result, error) {
	if err := e.Validate(req); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // tells the scheduler to drop the sequence if it runs on
	capacity := req.MaxTokens + 1
	if req.PromptLogprobs { // one more for each chunk of prompt logits
		chunk := e.scoreChunk()
		capacity += (len(req.Prompt) + chunk - 1) / chunk
	}
	s := &sequence{ctx: ctx, req: req, tokens: make(chan token, capacity), sampler: llm.NewSampler(req.Sample), next: req.Prompt}
	if req.PromptLogprobs {
		s.scoring = true
		s.next = req.Prompt[:min(e.scoreChunk(), len(req.Prompt))]
	}
	if err := e.submit(s); err != nil {
		return nil, err
	}

	res := &Result{PromptTokens: len(req.Prompt), FinishReason: "length"}
	if req.PromptLogprobs {
		res.PromptLogprobs = make([]TokenLogprob, 0, len(req.Prompt)-1)
	}
	var all strings.Builder
	defer func() { res.Text = all.String() }()
	text := newStopText(e.Tokenizer.NewStream(), req.Stop)
	var pending []TokenLogprob // logprobs not yet sent with a chunk
	promptSent := !req.PromptLogprobs
	// A token's logprobs go out at once, in a chunk without text when its
	// text is held back (an incomplete UTF-8 sequence, a possible stop
	// string) or empty (a special token).
	send := func(piece string) error {
		if piece == "" && promptSent && len(pending) == 0 {
			return nil
		}
		all.WriteString(piece)
		c := Chunk{Text: piece, Logprobs: pending}
		if !promptSent {
			c.PromptLogprobs, promptSent = res.PromptLogprobs, true
		}
		pending = nil
		if emit != nil {
			return emit(c)
		}
		return nil
	}
tokens:
	for {
		var t token
		var ok bool
		select {
		case t, ok = <-s.tokens:
		case <-ctx.Done():
			// Cancelled or past its deadline, perhaps still queued behind
			// a full batch: answer now; the scheduler drops the sequence
			// when it next looks at it.
			res.CompletionTokens = len(res.Tokens)
			return res, ctx.Err()
		}
		if !ok {
			break
		}
		if t.logits != nil { // a chunk of the prompt's logits: score it
			res.PromptLogprobs = appendPromptLogprobs(res.PromptLogprobs, t.logits, t.from, req.Prompt, e.Backend.Config().Vocab, req.TopLogprobs)
			continue
		}
		if t.lp != nil {
			res.Logprobs = append(res.Logprobs, *t.lp)
			pending = append(pending, *t.lp)
		}
		if t.eos { // only sent with logprobs: no text
			continue
		}
		res.Tokens = append(res.Tokens, t.id)
		piece, stopped := text.add(t.id)
		if err := send(piece); err != nil {
			return res, err
		}
		if stopped {
			res.FinishReason = "stop"
			break tokens
		}
	}
	if res.FinishReason != "stop" {
		if err := s.err; err != nil {
			res.CompletionTokens = len(res.Tokens)
			return res, err
		}
		piece, stopped := text.flush()
		if s.eos || stopped {
			res.FinishReason = "stop"
		}
		if err := send(piece); err != nil {
			return res, err
		}
	}
	res.CompletionTokens = len(res.Tokens)
	return res, nil
}

// appendPromptLogprobs scores the prompt tokens that a chunk of the
// prefill's logits predicts: its rows are positions from, from+1, …, and
// the row of position j gives the log-probability of prompt[j+1].
func appendPromptLogprobs(out []TokenLogprob, logits []float32, from int, prompt []int, vocab, top int) []TokenLogprob {
	for r := 0; r < len(logits)/vocab; r++ {
		j := from + r
		if j+1 >= len(prompt) {
			break
		}
		id := prompt[j+1]
		lp, alts := llm.Logprobs(logits[r*vocab:(r+1)*vocab], id, top)
		out = append(out, TokenLogprob{ID: id, Logprob: lp, Top: alts})
	}
	return out
}

// scoreChunk is how many prompt positions a scored prefill runs at once.
func (e *Engine) scoreChunk() int { return max(1, e.opt.MaxScoreLogits/e.Backend.Config().Vocab) }

// submit queues a sequence unless the engine is closed or MaxQueue
// sequences are waiting already.
func (e *Engine) submit(s *sequence) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrClosed
	}
	if e.queued.Load() >= int64(e.opt.MaxQueue) {
		return ErrBusy
	}
	e.arrivals++
	s.arrival = e.arrivals
	// Counted before the send: the scheduler may take the sequence off
	// the channel, and uncount it, before this goroutine runs again; were
	// the count added after, it would dip below zero in between and a
	// full queue would take one more than MaxQueue. The channel holds at
	// most the queued sequences, fewer than MaxQueue, its capacity: the
	// send does not block.
	e.queued.Add(1)
	select {
	case e.queue <- s:
		return nil
	default:
		e.queued.Add(-1)
		return ErrBusy
	}
}

// sequence is a request inside the scheduler. The scheduler sends each
// new token on tokens and closes it at the end, after setting err (a
// failure or cancellation) or eos; the channel holds MaxTokens+1 tokens
// (the last can be the end-of-sequence token, sent with logprobs), so
// sending never blocks. With PromptLogprobs the prompt is prefilled in
// chunks (scoreChunk positions), and each chunk's logits are sent before
// any token, one more slot each.
type sequence struct {
	ctx    context.Context
	req    Request
	tokens chan token

	arrival int64 // its place in the order of submission

	cache llm.Cache
	// fed is the tokens in the cache. A preempted sequence loses its
	// cache: refill is then what it held, prefilled again (together with
	// next, or alone while the prompt is being scored) when it is back in
	// the batch; refilling marks a step that only restores the cache.
	fed, refill []int
	refilling   bool
	step        []int // the tokens of this iteration's step
	sampler     *llm.Sampler
	logits      []float32
	scoring     bool // the prefill of a PromptLogprobs request is running
	scored      int  // prompt positions prefilled so far, when scoring
	// picked: the last step asked the backend for its token (the argmax,
	// llm.Step.Greedy, or a draw's pick, llm.Step.Draw), which is pickedID;
	// logits then holds nothing new.
	picked   bool
	pickedID int
	next     []int
	n        int
	eos      bool
	err      error
}

// token is one sampled token as the scheduler hands it over; lp is set
// with Request.Logprobs, and eos marks the end-of-sequence token (sent
// only then, for its logprob). With logits set it is no token but a
// chunk of a scored prompt's logits, rows for positions from, from+1, …:
// the caller's from then on.
type token struct {
	id     int
	lp     *TokenLogprob
	eos    bool
	logits []float32
	from   int
}

func (s *sequence) finish(err error) {
	if s.cache != nil { // a GPU cache holds device memory
		s.cache.Close()
	}
	s.err = err
	close(s.tokens)
}

// run is the scheduler loop.
func (e *Engine) run() {
	defer close(e.done)
	// waiting holds the submitted sequences not yet in the batch, taken
	// off the channel every iteration so that those whose context ended
	// (a client gone, a deadline passed) leave the queue at once, not when
	// a batch slot frees.
	var active, waiting []*sequence
	defer func() {
		for _, s := range active {
			s.finish(ErrClosed)
		}
		for _, s := range waiting {
			s.finish(ErrClosed)
		}
		for {
			select {
			case s := <-e.queue:
				s.finish(ErrClosed)
			default:
				return
			}
		}
	}()
	cfg := e.Backend.Config()
	var steps []llm.Step
	worked := false // a forward pass ran since the engine was last idle
	for {
		e.active.Store(int64(len(active)))
		kvt, kvb, known := e.kvUsage(active)
		e.kvTokens.Store(kvt)
		e.kvBytes.Store(kvb)
		if known {
			e.kvBytesKnown.Store(true)
		}
		if len(active) == 0 && len(waiting) == 0 { // idle: wait for work
			var trim <-chan time.Time
			var timer *time.Timer
			if worked && e.pool != nil {
				// Idle for a while after work: the backend returns the
				// memory of the blocks handed back to the system.
				timer = time.NewTimer(idleTrim)
				trim = timer.C
			}
			select {
			case s := <-e.queue:
				waiting = append(waiting, s)
				if timer != nil {
					timer.Stop()
				}
			case <-trim:
				e.Backend.(llm.Paged).Trim()
				worked = false
				continue
			case <-e.quit:
				return
			}
		}
	drain:
		for {
			select {
			case s := <-e.queue:
				waiting = append(waiting, s)
			default:
				break drain
			}
		}
		kept := waiting[:0]
		for _, s := range waiting {
			if err := s.ctx.Err(); err != nil {
				s.finish(err)
				e.queued.Add(-1)
				continue
			}
			kept = append(kept, s)
		}
		clear(waiting[len(kept):])
		waiting = kept
		select {
		case <-e.quit:
			return
		default:
		}

		// Drop cancelled sequences (their blocks go back to the pool),
		// then admit waiting ones.
		live := active[:0]
		for _, s := range active {
			if err := s.ctx.Err(); err != nil {
				s.finish(err)
				continue
			}
			live = append(live, s)
		}
		clear(active[len(live):])
		active = live
		if e.pool == nil {
			n := min(e.opt.MaxBatch-len(active), len(waiting))
			active = append(active, waiting[:n]...)
			waiting = append(waiting[:0], waiting[n:]...)
			clear(waiting[len(waiting):cap(waiting)])
			e.queued.Add(-int64(n))
		} else {
			active, waiting = e.schedule(active, waiting)
		}

		// Start new sequences and build the steps.
		steps = steps[:0]
		live = active[:0]
		for _, s := range active {
			if s.cache == nil {
				c, err := e.Backend.NewCache(len(s.req.Prompt) + s.req.MaxTokens)
				if err != nil {
					s.finish(err)
					continue
				}
				s.cache = c
			}
			if s.logits == nil {
				s.logits = make([]float32, cfg.Vocab)
			}
			s.setStep()
			live = append(live, s)
			switch {
			case s.refilling: // only restores the cache: the logits are not used
				steps = append(steps, llm.Step{Cache: s.cache, Tokens: s.step, Logits: make([]float32, cfg.Vocab), LastOnly: true})
			case s.scoring: // every position's logits, in a buffer the caller will own
				s.logits = make([]float32, len(s.step)*cfg.Vocab)
				steps = append(steps, llm.Step{Cache: s.cache, Tokens: s.step, Logits: s.logits})
			default: // a request without logprobs asks the backend for its token only: the argmax or a draw's pick
				step := llm.Step{Cache: s.cache, Tokens: s.step, Logits: s.logits, LastOnly: true}
				if !s.req.Logprobs {
					s.sampler.AskBackend(e.Backend, &step)
				}
				steps = append(steps, step)
			}
		}
		active = live
		if len(active) == 0 {
			continue
		}
		worked = true
		if n := e.chainLength(active, steps, len(waiting)); n > 1 {
			active = e.runChain(active, steps, n)
			continue
		}
		if err := e.forward(steps); err != nil {
			for _, s := range active {
				s.finish(err)
			}
			active = active[:0]
			continue
		}
		for i, s := range active { // steps[i] is s's
			if s.refill != nil {
				s.fed, s.refill = s.step, nil
			} else {
				s.fed = append(s.fed, s.step...)
			}
			s.picked, s.pickedID = steps[i].Greedy || steps[i].Draw != nil, steps[i].Argmax
		}

		// One new token for each sequence: the rows that decode are sampled
		// in parallel first (a pass over the vocabulary each: 0.19–0.21 ms
		// at 128k logits on a 2-core machine, llm's BenchmarkArgmax, so
		// several ms a step at batch 32 one after another).
		picks := pickAll(active)
		live = active[:0]
		for i, s := range active {
			if s.refilling { // the cache is back; scoring goes on next time
				s.refilling = false
				live = append(live, s)
				continue
			}
			row := s.logits
			if s.scoring { // a chunk of a scored prefill: hand its logits over
				s.tokens <- token{logits: row, from: s.scored}
				s.scored += len(s.next)
				if p := s.req.Prompt; s.scored < len(p) {
					s.next = p[s.scored:min(s.scored+e.scoreChunk(), len(p))]
					live = append(live, s)
					continue
				}
				s.scoring = false
				row = row[len(row)-cfg.Vocab:] // read-only from here on, on both sides
				s.logits = make([]float32, cfg.Vocab)
				if s.req.MaxTokens == 0 {
					s.finish(nil)
					continue
				}
			}
			pk := picks[i]
			if !pk.ok { // the first token after a scored prompt
				pk = s.pick(row, 1)
			}
			if e.deliver(s, pk.id, pk.lp) {
				live = append(live, s)
			}
		}
		active = live
	}
}

// deliver hands a sequence's new token over: a stop token or the last of
// its MaxTokens finishes it (a stop token is sent only for its logprob);
// otherwise the token is its next step's, and deliver reports true.
func (e *Engine) deliver(s *sequence, id int, lp *TokenLogprob) bool {
	if slices.Contains(e.Stop, id) {
		if lp != nil {
			s.tokens <- token{id: id, lp: lp, eos: true}
		}
		s.eos = true
		s.finish(nil)
		return false
	}
	s.tokens <- token{id: id, lp: lp}
	s.n++
	e.generated.Add(1)
	if s.n >= s.req.MaxTokens {
		s.finish(nil)
		return false
	}
	s.next = []int{id}
	return true
}

// chainLength is how many greedy steps this iteration's steps may run as
// one chain (llm.Chainer; 1: a single step): up to Options.Chain when the
// backend chains, no request has arrived that the scheduler has not seen
// (queued counts the channel beside the `waiting` it left: those the batch
// or the pool could not take), every step decodes one token and asks the
// backend for its argmax, no sequence would pass its MaxTokens, and the
// KV pool has the blocks the chain's tokens take (the chain is shortened
// until it does).
func (e *Engine) chainLength(active []*sequence, steps []llm.Step, waiting int) int {
	if _, ok := e.Backend.(llm.Chainer); !ok || e.opt.Chain < 2 || e.queued.Load() > int64(waiting) {
		return 1
	}
	n := e.opt.Chain
	for i, s := range active {
		// (A refill or a scored prompt's chunk asks for no argmax.)
		if st := steps[i]; !st.Greedy || len(st.Tokens) != 1 {
			return 1
		}
		n = min(n, s.req.MaxTokens-s.n)
	}
	for ; n > 1 && e.pool != nil; n-- {
		need := 0
		for _, s := range active {
			if pc, ok := s.cache.(llm.PagedCache); ok {
				need += pc.Need(n)
			}
		}
		if need <= e.pool.Free() {
			break
		}
	}
	return max(n, 1)
}

// runChain runs n greedy steps of the batch on the backend's device and
// delivers each sequence's n tokens in order; it returns the sequences
// that go on.
func (e *Engine) runChain(active []*sequence, steps []llm.Step, n int) []*sequence {
	picks, err := e.decodeGreedy(steps, n)
	if err != nil {
		for _, s := range active {
			s.finish(err)
		}
		return active[:0]
	}
	live := active[:0]
	for i, s := range active {
		// The cache took the step's token and the first n-1 picks.
		s.fed = append(append(s.fed, s.step...), picks[i][:n-1]...)
		goesOn := true
		for _, id := range picks[i] {
			if goesOn = e.deliver(s, id, nil); !goesOn {
				break
			}
		}
		if goesOn {
			live = append(live, s)
		}
	}
	clear(active[len(live):])
	return live
}

// pick is a sequence's next token, with its logprob when asked.
type pick struct {
	id int
	lp *TokenLogprob
	ok bool
}

// pick samples the next token from a row of logits, its logprobs (when
// asked) over `parts` goroutines (llm.LogprobsIn).
func (s *sequence) pick(row []float32, parts int) pick {
	p := pick{id: s.sampler.Sample(row), ok: true}
	if s.req.Logprobs {
		v, top := llm.LogprobsIn(row, p.id, s.req.TopLogprobs, parts)
		p.lp = &TokenLogprob{ID: p.id, Logprob: v, Top: top}
	}
	return p
}

// pickAll samples, in parallel, the next token of every sequence in the
// batch that decodes (not refilling its cache, not scoring its prompt),
// or takes the backend's pick where a step asked for it (the argmax, or a
// draw's pick); the others' picks are left unset. Each sequence has its
// own sampler. When fewer rows pick on the host than there are cores,
// each row that wants logprobs cuts its log-softmax across the spare ones.
func pickAll(batch []*sequence) []pick {
	picks := make([]pick, len(batch))
	var wg sync.WaitGroup
	var host []int // rows sampled here, each a goroutine
	for i, s := range batch {
		switch {
		case s.refilling || s.scoring:
		case s.picked: // the backend did: its argmax or its draw's pick
			picks[i] = pick{id: s.pickedID, ok: true}
		default:
			host = append(host, i)
		}
	}
	cores := runtime.GOMAXPROCS(0)
	sem := make(chan struct{}, cores)
	parts := max(1, cores/max(len(host), 1))
	for _, i := range host {
		s := batch[i]
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			picks[i] = s.pick(s.logits, parts)
			<-sem
		}()
	}
	wg.Wait()
	return picks
}

// setStep sets the tokens of the sequence's next step: next, after what
// the cache held before a preemption when it has to be refilled, or (while
// the prompt is scored) the refill alone.
func (s *sequence) setStep() {
	s.refilling = false
	switch {
	case s.refill == nil:
		s.step = s.next
	case s.scoring:
		s.step, s.refilling = s.refill, true
	default:
		s.step = append(slices.Clip(s.refill), s.next...)
	}
}

// schedule is admission by KV cache blocks. It first preempts active
// sequences, the latest arrival first, until the pool has the blocks that
// this iteration's steps of the others take; then it admits waiting
// sequences, in order of arrival, while the blocks their first step takes
// (a preempted scored prompt's: its refill and its next chunk) are left
// over and the batch has room. A preempted sequence gives its
// blocks back and waits (first in line, by its arrival) to be prefilled
// again with everything it held. waiting is in order of arrival, and so
// is what schedule returns.
func (e *Engine) schedule(active, waiting []*sequence) ([]*sequence, []*sequence) {
	need := func(s *sequence) int {
		s.setStep()
		if pc, ok := s.cache.(llm.PagedCache); ok {
			return pc.Need(len(s.step))
		}
		return e.pool.BlocksFor(len(s.step)) // a new cache takes at most this
	}
	sum := 0
	for _, s := range active {
		sum += need(s)
	}
	for sum > e.pool.Free() && len(active) > 0 {
		vi := 0
		for i, s := range active {
			if s.arrival > active[vi].arrival {
				vi = i
			}
		}
		v := active[vi]
		sum -= need(v)
		active = slices.Delete(active, vi, vi+1)
		e.preempt(v)
		i, _ := slices.BinarySearchFunc(waiting, v.arrival, func(s *sequence, a int64) int { return cmp.Compare(s.arrival, a) })
		waiting = slices.Insert(waiting, i, v)
		e.queued.Add(1)
	}
	budget := e.pool.Free() - sum
	n := 0
	for n < len(waiting) && len(active) < e.opt.MaxBatch {
		s := waiting[n]
		k := need(s)
		if s.refilling {
			// Restoring a scored prompt's cache is no progress by itself:
			// admitted with room for the refill alone, the sequence would
			// be preempted again at its next chunk, and refilled again,
			// every step while the pool stays short.
			k = e.pool.BlocksFor(len(s.refill) + len(s.next))
		}
		if k > budget {
			if len(active) > 0 {
				break
			}
			// Nothing runs that could free blocks: the pool is held by
			// caches outside the engine.
			s.finish(fmt.Errorf("the KV cache pool has %d blocks free, the request needs %d", budget, k))
		} else {
			budget -= k
			active = append(active, s)
		}
		n++
		e.queued.Add(-1)
	}
	waiting = append(waiting[:0], waiting[n:]...)
	clear(waiting[len(waiting):cap(waiting)])
	return active, waiting
}

// preempt takes a sequence's cache away: its blocks go back to the pool,
// and what the cache held is to be prefilled again.
func (e *Engine) preempt(s *sequence) {
	s.cache.Close()
	s.cache = nil
	if s.refill == nil {
		s.refill = s.fed
	}
	s.fed, s.refilling = nil, false
	e.preemptions.Add(1)
}

// idleTrim is how long the engine waits, idle, before the backend gives
// freed cache memory back to the system.
const idleTrim = time.Second

// forward runs one batched step.
func (e *Engine) forward(steps []llm.Step) error {
	return e.guard("forward pass", func() error { return e.Backend.Forward(context.Background(), steps) })
}

// guard runs a call into the backend, turning a panic in it into an error
// naming the call, so that one bad request cannot take the server down.
func (e *Engine) guard(call string, f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%s %s: %v", e.Backend.Name(), call, r)
		}
	}()
	return f()
}

// decodeGreedy runs a chain of n greedy steps (llm.Chainer), a panic
// (guard) or picks of the wrong shape turned into an error.
func (e *Engine) decodeGreedy(steps []llm.Step, n int) ([][]int, error) {
	var picks [][]int
	err := e.guard("greedy chain", func() (err error) {
		picks, err = e.Backend.(llm.Chainer).DecodeGreedy(context.Background(), steps, n)
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(picks) != len(steps) {
		return nil, fmt.Errorf("%s greedy chain: %d sequences' picks for %d sequences", e.Backend.Name(), len(picks), len(steps))
	}
	for i, p := range picks {
		if len(p) != n {
			return nil, fmt.Errorf("%s greedy chain: sequence %d has %d picks for a chain of %d", e.Backend.Name(), i, len(p), n)
		}
	}
	return picks, nil
}

// stopText decodes tokens to text and ends it at the first stop string,
// holding back any tail that could still become one.
type stopText struct {
	stream  *tokenizer.Stream
	stops   []string
	pending string // decoded, not yet emitted
}

func newStopText(s *tokenizer.Stream, stops []string) *stopText {
	return &stopText{stream: s, stops: stops}
}

// add decodes one token; it returns the text now safe to emit and
// whether a stop string was found (the text before it is returned).
func (t *stopText) add(id int) (string, bool) {
	t.pending += t.stream.Add(id)
	for _, s := range t.stops {
		if i := strings.Index(t.pending, s); i >= 0 {
			out := t.pending[:i]
			t.pending = ""
			return out, true
		}
	}
	keep := 0 // longest tail of pending that starts a stop string
	for _, s := range t.stops {
		for k := min(len(s)-1, len(t.pending)); k > keep; k-- {
			if strings.HasPrefix(s, t.pending[len(t.pending)-k:]) {
				keep = k
				break
			}
		}
	}
	out := t.pending[:len(t.pending)-keep]
	t.pending = t.pending[len(t.pending)-keep:]
	return out, false
}

// flush returns the held-back text at the end of a generation, cut at a
// stop string if the last characters completed one.
func (t *stopText) flush() (string, bool) {
	out := t.pending + t.stream.Flush()
	t.pending = ""
	stopped := false
	for _, s := range t.stops {
		if i := strings.Index(out, s); i >= 0 {
			out, stopped = out[:i], true
		}
	}
	return out, stopped
}
