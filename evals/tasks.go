package evals

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"strings"
	"time"
	"unicode"

	"github.com/llmq/llmq/llm"
)

// Multiple-choice task evaluation, scored the way lm-evaluation-harness
// scores its loglikelihood tasks (ARC, HellaSwag, PIQA …): each choice is
// a continuation of the item's context, and the model's answer is the
// choice it gives the highest log-likelihood,
//
//	ll(choice) = Σ_{t ∈ continuation} log p(t | context, the continuation before t);
//
// acc counts answers by ll, acc_norm by ll / len(choice in bytes)
// (lm-eval's acc_norm divides by the length in characters: the same for
// ASCII), which removes the bias toward short choices.
//
// The continuation's tokens are found as lm-eval finds them: whitespace
// at the end of the context moves to the front of the continuation, then
// the context and context+continuation are encoded and the continuation
// is the tokens the whole string has beyond the context's count (so a
// token spanning the boundary belongs to the continuation). The model
// reads the context's own encoding followed by those tokens. Both
// encodings start with the tokenizer's special prefix (BOS), as llmq's
// prompts do.

// TaskItem is one multiple-choice item: a line of a tasks file.
type TaskItem struct {
	Context string   `json:"context"`
	Choices []string `json:"choices"`
	Answer  int      `json:"answer"`
}

// ReadTasks reads a JSON Lines file of TaskItems (blank lines skipped),
// checking each: at least two non-empty choices, the answer one of them.
func ReadTasks(path string) ([]TaskItem, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var items []TaskItem
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		dec := json.NewDecoder(strings.NewReader(line))
		dec.DisallowUnknownFields()
		var it TaskItem
		if err := dec.Decode(&it); err != nil {
			return nil, fmt.Errorf("%s:%d: not a task item {\"context\", \"choices\", \"answer\"}: %w", path, n, err)
		}
		if err := it.check(); err != nil {
			return nil, fmt.Errorf("%s:%d: %w", path, n, err)
		}
		items = append(items, it)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(items) == 0 {
		return nil, fmt.Errorf("%s: no task items", path)
	}
	return items, nil
}

func (it TaskItem) check() error {
	if len(it.Choices) < 2 {
		return fmt.Errorf("%d choices: an item needs at least two", len(it.Choices))
	}
	for i, c := range it.Choices {
		if c == "" {
			return fmt.Errorf("choice %d is empty", i)
		}
	}
	if it.Answer < 0 || it.Answer >= len(it.Choices) {
		return fmt.Errorf("answer %d is not one of the %d choices (0-based)", it.Answer, len(it.Choices))
	}
	return nil
}

// Encoder turns text into token ids, with the special prefix (BOS) when
// addSpecial; *tokenizer.Tokenizer is one.
type Encoder interface {
	Encode(text string, addSpecial bool) []int
}

// TaskOptions configure ScoreTasks.
type TaskOptions struct {
	// Progress, if set, is called after each item.
	Progress func(done, total int)
}

// ItemScore is how the model answered one item.
type ItemScore struct {
	Answer int `json:"answer"`
	// Loglik is each choice's summed continuation log-probability, Tokens
	// its continuation's token count, Greedy whether every continuation
	// token was the model's most likely.
	Loglik   []float64 `json:"loglik"`
	Tokens   []int     `json:"tokens"`
	Greedy   []bool    `json:"greedy"`
	Pred     int       `json:"pred"`      // argmax of Loglik
	PredNorm int       `json:"pred_norm"` // argmax of Loglik / len(choice) bytes
}

// TaskResult sums up a task run. The standard errors are those of a
// mean of 0/1 outcomes: √(s²/n), s² the sample variance.
type TaskResult struct {
	Items         int         `json:"items"`
	Acc           float64     `json:"acc"`
	AccStderr     float64     `json:"acc_stderr"`
	AccNorm       float64     `json:"acc_norm"`
	AccNormStderr float64     `json:"acc_norm_stderr"`
	Choices       int         `json:"choices"` // continuations scored
	Tokens        int         `json:"tokens"`  // tokens run through the model
	Seconds       float64     `json:"seconds"`
	PerItem       []ItemScore `json:"per_item"`
}

// ScoreTasks scores the items on b: one Forward per item, its choices
// as a batch of independent sequences.
func ScoreTasks(ctx context.Context, b llm.Backend, tok Encoder, items []TaskItem, opt TaskOptions) (TaskResult, error) {
	if len(items) == 0 {
		return TaskResult{}, errors.New("no task items")
	}
	start := time.Now()
	res := TaskResult{Items: len(items), PerItem: make([]ItemScore, len(items))}
	acc, accNorm := make([]float64, len(items)), make([]float64, len(items))
	for i, it := range items {
		if err := it.check(); err != nil {
			return TaskResult{}, fmt.Errorf("item %d: %w", i, err)
		}
		sc, tokens, err := scoreItem(ctx, b, tok, it)
		if err != nil {
			return TaskResult{}, fmt.Errorf("item %d: %w", i, err)
		}
		res.PerItem[i] = sc
		res.Choices += len(it.Choices)
		res.Tokens += tokens
		if sc.Pred == it.Answer {
			acc[i] = 1
		}
		if sc.PredNorm == it.Answer {
			accNorm[i] = 1
		}
		if opt.Progress != nil {
			opt.Progress(i+1, len(items))
		}
	}
	res.Acc, res.AccStderr = meanStderr(acc)
	res.AccNorm, res.AccNormStderr = meanStderr(accNorm)
	res.Seconds = time.Since(start).Seconds()
	return res, nil
}

// continuation splits an item's choice into the context's tokens and the
// continuation's, as lm-eval does (see the package comment).
func continuation(tok Encoder, context, choice string) (ctxIDs, cont []int) {
	trimmed := strings.TrimRightFunc(context, unicode.IsSpace)
	choice = context[len(trimmed):] + choice
	context = trimmed
	whole := tok.Encode(context+choice, true)
	ctxIDs = tok.Encode(context, true)
	if len(whole) <= len(ctxIDs) {
		return ctxIDs, nil
	}
	return ctxIDs, whole[len(ctxIDs):]
}

// scoreItem runs an item's choices together and scores them; it returns
// the tokens run.
func scoreItem(ctx context.Context, b llm.Backend, tok Encoder, it TaskItem) (ItemScore, int, error) {
	cfg := b.Config()
	V := cfg.Vocab
	sc := ItemScore{Answer: it.Answer, Loglik: make([]float64, len(it.Choices)),
		Tokens: make([]int, len(it.Choices)), Greedy: make([]bool, len(it.Choices))}
	steps := make([]llm.Step, len(it.Choices))
	conts := make([][]int, len(it.Choices))
	ctxLens := make([]int, len(it.Choices))
	run := 0
	for c, choice := range it.Choices {
		ctxIDs, cont := continuation(tok, it.Context, choice)
		if len(ctxIDs) == 0 {
			return sc, 0, errors.New("the context encodes to no tokens and the tokenizer adds no BOS: nothing to condition the first token on")
		}
		if len(cont) == 0 {
			return sc, 0, fmt.Errorf("choice %d (%q) adds no tokens to the context's encoding", c, choice)
		}
		// The model reads everything but the last token: the logits at
		// position j predict token j+1.
		in := append(append([]int{}, ctxIDs...), cont...)
		in = in[:len(in)-1]
		if len(in)+1 > cfg.MaxPositions {
			return sc, 0, fmt.Errorf("choice %d: %d tokens exceed the model's context of %d", c, len(in)+1, cfg.MaxPositions)
		}
		for _, id := range in {
			if id < 0 || id >= V {
				return sc, 0, fmt.Errorf("choice %d: token id %d outside the model's vocabulary of %d", c, id, V)
			}
		}
		cache, err := b.NewCache(len(in))
		if err != nil {
			return sc, 0, fmt.Errorf("choice %d: %w", c, err)
		}
		defer cache.Close() // a GPU cache holds device memory
		steps[c] = llm.Step{Cache: cache, Tokens: in, Logits: make([]float32, len(in)*V)}
		conts[c], ctxLens[c] = cont, len(ctxIDs)
		run += len(in)
	}
	if err := b.Forward(ctx, steps); err != nil {
		return sc, 0, err
	}
	for c, cont := range conts {
		sc.Tokens[c] = len(cont)
		sc.Greedy[c] = true
		for k, id := range cont {
			row := steps[c].Logits[(ctxLens[c]-1+k)*V : (ctxLens[c]+k)*V]
			sc.Loglik[c] -= llm.NLL(row, id) // float64 throughout, as perplexity (Logprobs trades 1e-7 for speed)
			if llm.Argmax(row) != id {
				sc.Greedy[c] = false
			}
		}
		if sc.Loglik[c] > sc.Loglik[sc.Pred] {
			sc.Pred = c
		}
		if sc.Loglik[c]/float64(len(it.Choices[c])) > sc.Loglik[sc.PredNorm]/float64(len(it.Choices[sc.PredNorm])) {
			sc.PredNorm = c
		}
	}
	return sc, run, nil
}

// meanStderr is the mean of x and its standard error √(s²/n), s² the
// sample variance (0 for one value).
func meanStderr(x []float64) (mean, stderr float64) {
	for _, v := range x {
		mean += v
	}
	mean /= float64(len(x))
	if len(x) < 2 {
		return mean, 0
	}
	var ss float64
	for _, v := range x {
		ss += (v - mean) * (v - mean)
	}
	return mean, math.Sqrt(ss / float64(len(x)-1) / float64(len(x)))
}
