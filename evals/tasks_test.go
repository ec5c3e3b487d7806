package evals

import (
	"context"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// byteEncoder is a toy tokenizer: BOS (1) then one token per byte,
// except "ab", which is one token (200): a merge.
type byteEncoder struct{}

func (byteEncoder) Encode(text string, addSpecial bool) []int {
	var ids []int
	if addSpecial {
		ids = append(ids, 1)
	}
	for i := 0; i < len(text); i++ {
		if strings.HasPrefix(text[i:], "ab") {
			ids = append(ids, 200)
			i++
			continue
		}
		ids = append(ids, int(text[i]))
	}
	return ids
}

// nextByteBackend's logits at a position holding token t are 2 for token
// t+1 and 0 for every other: log p(t+1) = 2 − L, log p(other) = −L,
// L = log(e² + V − 1).
type nextByteBackend struct{ cfg checkpoint.Config }

type fakeCache struct{ n, cap int }

func (c *fakeCache) Len() int       { return c.n }
func (c *fakeCache) Cap() int       { return c.cap }
func (c *fakeCache) Truncate(n int) { c.n = n }
func (c *fakeCache) Close() error   { return nil }

func (b *nextByteBackend) Close() error                { return nil }
func (b *nextByteBackend) Memory() (llm.Memory, error) { return llm.Memory{}, nil }
func (b *nextByteBackend) WindowNLL(ctx context.Context, ids []int) (float64, int, error) {
	return llm.LogitsNLL(ctx, b, ids)
}

func (b *nextByteBackend) Config() *checkpoint.Config { return &b.cfg }
func (b *nextByteBackend) Name() string               { return "next-byte" }
func (b *nextByteBackend) NewCache(n int) (llm.Cache, error) {
	return &fakeCache{cap: n}, nil
}
func (b *nextByteBackend) Forward(ctx context.Context, steps []llm.Step) error {
	V := b.cfg.Vocab
	for _, s := range steps {
		for j, t := range s.Tokens {
			row := s.Logits[j*V : (j+1)*V]
			clear(row)
			row[(t+1)%V] = 2
		}
		s.Cache.(*fakeCache).n += len(s.Tokens)
	}
	return nil
}

// Scores computed by hand with L = log(e² + 300):
//
//	item 0, context "c": "d" → [d]: 2−L; "dex" → [d e x]: (2−L)+(2−L)+(−L) = 4−3L,
//	  per byte 4/3−L < 2−L; "x" → −L. acc ✓ (0), acc_norm ✓ (0).
//	item 1, context "c": "dx" → 2−2L (per byte 1−L); "q" → −L.
//	  acc ✗ (picks "q": −L > 2−2L), acc_norm ✓ (1−L > −L).
//	item 2, context "c " (trailing space): the space joins the choices,
//	  " d" → [␣ d]: −L + −L; " !" → [␣ !]: −L + (2−L) (space predicts "!").
//	  acc ✓ (1), acc_norm ✓.
//	item 3, context "c": "ab" → [ab], one merged token: −L, per byte −L/2;
//	  "d" → 2−L. acc ✓ (1), acc_norm ✗ (−L/2 > 2−L as L ≈ 5.73 > 4).
//
// acc = 3/4 with stderr √(s²/4), s² = (3·(1/4)² + (3/4)²)/3 = 1/4: 1/4;
// acc_norm likewise (items 0–2 right, 3 wrong).
func TestScoreTasksByHand(t *testing.T) {
	b := &nextByteBackend{checkpoint.Config{Vocab: 301, MaxPositions: 64}}
	L := math.Log(math.Exp(2) + 300)
	items := []TaskItem{
		{Context: "c", Choices: []string{"d", "dex", "x"}, Answer: 0},
		{Context: "c", Choices: []string{"dx", "q"}, Answer: 0},
		{Context: "c ", Choices: []string{"d", "!"}, Answer: 1},
		{Context: "c", Choices: []string{"ab", "d"}, Answer: 1},
	}
	want := [][]float64{{2 - L, 4 - 3*L, -L}, {2 - 2*L, -L}, {-2 * L, 2 - 2*L}, {-L, 2 - L}}
	wantTokens := [][]int{{1, 3, 1}, {2, 1}, {2, 2}, {1, 1}}
	wantGreedy := [][]bool{{true, false, false}, {false, false}, {false, false}, {false, true}}
	wantPred := [][2]int{{0, 0}, {1, 0}, {1, 1}, {1, 0}}
	res, err := ScoreTasks(context.Background(), b, byteEncoder{}, items, TaskOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i, sc := range res.PerItem {
		for c := range want[i] {
			if math.Abs(sc.Loglik[c]-want[i][c]) > 1e-9 || sc.Tokens[c] != wantTokens[i][c] || sc.Greedy[c] != wantGreedy[i][c] {
				t.Errorf("item %d choice %d: loglik %v (want %v), %d tokens (want %d), greedy %v (want %v)", i, c,
					sc.Loglik[c], want[i][c], sc.Tokens[c], wantTokens[i][c], sc.Greedy[c], wantGreedy[i][c])
			}
		}
		if sc.Pred != wantPred[i][0] || sc.PredNorm != wantPred[i][1] {
			t.Errorf("item %d: pred %d, pred_norm %d; want %v", i, sc.Pred, sc.PredNorm, wantPred[i])
		}
	}
	if res.Items != 4 || res.Acc != 0.75 || math.Abs(res.AccStderr-0.25) > 1e-12 || res.AccNorm != 0.75 || math.Abs(res.AccNormStderr-0.25) > 1e-12 || res.Choices != 9 {
		t.Errorf("result %+v: want acc and acc_norm 0.75 ± 0.25, 9 choices", res)
	}
	// Tokens run: each choice's context and continuation but the last.
	if want := (1 + 3 + 1) + (2 + 1) + (2 + 2) + (1 + 1) + 9*(2-1); res.Tokens != want {
		t.Errorf("%d tokens run, want %d", res.Tokens, want)
	}

	// A choice whose tokens merge into the context's: no continuation.
	if _, err := ScoreTasks(context.Background(), b, byteEncoder{}, []TaskItem{{Context: "ca", Choices: []string{"b", "d"}}}, TaskOptions{}); err == nil ||
		!strings.Contains(err.Error(), "item 0") || !strings.Contains(err.Error(), "adds no tokens") {
		t.Errorf("merged boundary: %v", err)
	}
}

func TestReadTasks(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.jsonl")
	os.WriteFile(good, []byte(`{"context": "a", "choices": ["b", "c"], "answer": 1}`+"\n\n"+`{"context": "", "choices": ["x", "y", "z"], "answer": 0}`+"\n"), 0o644)
	items, err := ReadTasks(good)
	if err != nil || len(items) != 2 || items[0].Answer != 1 || len(items[1].Choices) != 3 {
		t.Fatalf("%+v, %v", items, err)
	}
	for body, want := range map[string]string{
		`{"context": "a", "choices": ["b"], "answer": 0}`:      ":1: 1 choices",
		`{"context": "a", "choices": ["b", "c"], "answer": 2}`: ":1: answer 2 is not one of the 2",
		`{"context": "a", "choices": ["b", ""], "answer": 0}`:  ":1: choice 1 is empty",
		`{"context": "a", "choices": ["b", "c"], "label": 0}`:  ":1: not a task item",
		"\n" + `{"context": "a", "choices": "b", "answer": 0}`: ":2: not a task item",
		``: "no task items",
	} {
		p := filepath.Join(dir, "bad.jsonl")
		os.WriteFile(p, []byte(body), 0o644)
		if _, err := ReadTasks(p); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want %q", body, err, want)
		}
	}
}

// On llama-tiny and llama-small, a choice's log-likelihood is the sum of
// log-softmax of transformers' reference logits over its tokens: the
// reference input (BOS and 63 WikiText ids) cut into a context and a
// continuation at a word boundary.
func TestScoreTasksMatchesReference(t *testing.T) {
	for _, model := range []string{"llama-tiny", "llama-small"} {
		t.Run(model, func(t *testing.T) { scoreMatchesReference(t, model) })
	}
}

func scoreMatchesReference(t *testing.T, model string) {
	ids := shared.Int32s(t, "reference/"+model+".logits.input.i32")
	ref := shared.Float32s(t, "reference/"+model+".logits.f32")
	m, err := pack.OpenModel(shared.Path(t, "models/"+model))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	V := m.Model.Config().Vocab
	if got := m.Tokenizer.Encode(m.Tokenizer.Decode(ids, true), true); !slices.Equal(got, ids) {
		t.Skip("the reference ids do not round-trip through decode and encode")
	}
	for k := len(ids) / 2; k < len(ids); k++ {
		ctxText, choice := m.Tokenizer.Decode(ids[1:k], true), m.Tokenizer.Decode(ids[k:], true)
		if !strings.HasPrefix(choice, " ") || !slices.Equal(m.Tokenizer.Encode(ctxText, true), ids[:k]) {
			continue
		}
		var want float64
		for j := k; j < len(ids); j++ {
			want += shared.LogSoftmax(ref[(j-1)*V : j*V])[ids[j]]
		}
		res, err := ScoreTasks(context.Background(), m.Model, m.Tokenizer,
			[]TaskItem{{Context: ctxText, Choices: []string{choice, " the"}}}, TaskOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got := res.PerItem[0]
		t.Logf("context of %d tokens, continuation of %d: loglik %.6f, reference %.6f", k, len(ids)-k, got.Loglik[0], want)
		if got.Tokens[0] != len(ids)-k || math.Abs(got.Loglik[0]-want) > 1e-3 {
			t.Errorf("continuation of %d tokens, loglik %v; want %d tokens, %v", got.Tokens[0], got.Loglik[0], len(ids)-k, want)
		}
		return
	}
	t.Fatal("no word boundary where the context encodes to the reference's ids")
}
