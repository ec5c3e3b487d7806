package llm_test

import (
	"context"
	"math"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
)

// pagedScenario runs two sequences batched — a prefill with every
// position's logits, then greedy decoding, the second sequence taking two
// tokens at a time and sitting out every third step — and returns every
// logit computed.
func pagedScenario(t *testing.T, m *llm.Model, n0, steps int) []float32 {
	t.Helper()
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	V := m.Cfg.Vocab
	a, b := ids[:n0], ids[500:500+n0/2]
	ca, _ := m.NewCache(n0 + steps + 1)
	cb, _ := m.NewCache(n0 + 2*steps + 1)
	defer ca.Close()
	defer cb.Close()
	la, lb := make([]float32, len(a)*V), make([]float32, V)
	ctx := context.Background()
	if err := m.Forward(ctx, []llm.Step{{Cache: ca, Tokens: a, Logits: la}, {Cache: cb, Tokens: b, Logits: lb, LastOnly: true}}); err != nil {
		t.Fatal(err)
	}
	out := append(append([]float32(nil), la...), lb...)
	ta, tb := llm.Argmax(la[len(la)-V:]), llm.Argmax(lb)
	for i := 0; i < steps; i++ {
		sa, sb := make([]float32, V), make([]float32, V)
		st := []llm.Step{{Cache: ca, Tokens: []int{ta}, Logits: sa}}
		if i%3 != 2 {
			st = append(st, llm.Step{Cache: cb, Tokens: []int{tb, (tb + 7) % V}, Logits: sb, LastOnly: true})
		}
		if err := m.Forward(ctx, st); err != nil {
			t.Fatal(err)
		}
		out, ta = append(out, sa...), llm.Argmax(sa)
		if i%3 != 2 {
			out, tb = append(out, sb...), llm.Argmax(sb)
		}
	}
	return out
}

// TestPagedEqualsContiguous: the logits do not depend on how the cache is
// cut into blocks — one position per block, the default 16, or one block
// for the whole sequence (the contiguous layout of the cache before
// paging) — to the bit, on llama-tiny and on the sliding-window layers of
// Gemma 3 and Mistral, decoding well past the window. (Against the
// contiguous cache this replaced, the same scenario measured 0 differing
// floats of 745,472 / 1,294,336 / 1,294,336.)
func TestPagedEqualsContiguous(t *testing.T) {
	for _, tc := range []struct {
		rel       string
		n0, steps int
	}{{"models/llama-tiny", 40, 30}, {"models/archzoo/gemma3-rand", 90, 40}, {"models/archzoo/mistral-swa-rand", 90, 40}} {
		m := loadModel(t, tc.rel)
		llm.SetBlockTokens(m, 4096)
		want := pagedScenario(t, m, tc.n0, tc.steps)
		for _, bt := range []int{1, 16} {
			llm.SetBlockTokens(m, bt)
			got := pagedScenario(t, m, tc.n0, tc.steps)
			diff := 0
			for i := range got {
				if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
					diff++
				}
			}
			if diff > 0 || len(got) != len(want) {
				t.Errorf("%s: blocks of %d: %d of %d logits differ from one block's", tc.rel, bt, diff, len(got))
			}
			if u := m.KVPool().Used(); u != 0 {
				t.Errorf("%s: blocks of %d: %d blocks held after every cache closed", tc.rel, bt, u)
			}
		}
	}
}

// TestCacheMemoryFollowsTokens: a cache of capacity 2048 holds no memory
// until tokens arrive, then one block per 16 positions per layer; Truncate
// and Close hand blocks back; Memory counts what is held.
func TestCacheMemoryFollowsTokens(t *testing.T) {
	m := loadModel(t, "models/llama-tiny")
	c := m.Cfg
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	block := int64(2*c.KVHeads*llm.DefaultBlockTokens*c.HeadDim) * 4
	cache, _ := m.NewCache(2048)
	kc := cache.(*llm.KVCache)
	check := func(tokens int) {
		t.Helper()
		want := int64(c.Layers*((tokens+15)/16)) * block
		mem, _ := m.Memory()
		if kc.Bytes() != want || mem.Caches != want {
			t.Errorf("%d tokens in a cache of 2048: %d bytes held, Memory %d; want %d", tokens, kc.Bytes(), mem.Caches, want)
		}
	}
	check(0)
	V := c.Vocab
	logits := make([]float32, V)
	n := 0
	for _, k := range []int{1, 15, 1, 83} { // 1, 16, 17, 100 tokens
		if got := kc.Need(k); got != c.Layers*((n+k+15)/16-(n+15)/16) {
			t.Errorf("Need(%d) after %d tokens = %d", k, n, got)
		}
		if err := m.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids[n : n+k], Logits: logits, LastOnly: true}}); err != nil {
			t.Fatal(err)
		}
		n += k
		check(n)
	}
	cache.Truncate(33)
	check(33)
	cache.Close()
	check(0)
	// Capacity 2048 before paging: 2048/100 = 20× the memory of 100 tokens.
}

// TestSlidingCacheHoldsAWindow: after 200 tokens a sliding layer holds
// the blocks of its last window (64 positions: blocks 8 … 12, positions
// 128 … 207), a full layer all 13 blocks.
func TestSlidingCacheHoldsAWindow(t *testing.T) {
	for _, tc := range []struct {
		name   string
		blocks int // summed over layers
	}{{"gemma3-rand", 5 + 13}, {"mistral-swa-rand", 5 + 5}, {"qwen3-rand", 13 + 13}} {
		m := loadModel(t, "models/archzoo/"+tc.name)
		c := m.Cfg
		ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")[:200]
		cache, _ := m.NewCache(200)
		if err := m.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids, Logits: make([]float32, c.Vocab), LastOnly: true}}); err != nil {
			t.Fatal(err)
		}
		want := int64(tc.blocks) * int64(2*c.KVHeads*c.HeadDim*16) * 4
		if got := cache.(*llm.KVCache).Bytes(); got != want {
			t.Errorf("%s: 200 tokens hold %d bytes, want %d", tc.name, got, want)
		}
		if mem, _ := m.Memory(); mem.Caches != want {
			t.Errorf("%s: Memory counts %d cache bytes, want %d", tc.name, mem.Caches, want)
		}
		if b := m.KVPool().BlocksFor(200); b < tc.blocks {
			t.Errorf("%s: BlocksFor(200) = %d, less than the %d held", tc.name, b, tc.blocks)
		}
		cache.Close()
		if mem, _ := m.Memory(); mem.Caches != 0 {
			t.Errorf("%s: %d cache bytes counted after Close", tc.name, mem.Caches)
		}
	}
}

// TestBoundedPool: with the pool bounded, a step that needs more blocks
// than are free fails without touching any cache of the batch, and goes
// through once another cache hands its blocks back.
func TestBoundedPool(t *testing.T) {
	m := loadModel(t, "models/llama-tiny")
	c := m.Cfg
	p := m.KVPool()
	if err := m.SetKVCacheBytes(10 * p.BlockBytes()); err != nil { // 10 blocks: 2 per layer and 2 spare
		t.Fatal(err)
	}
	defer m.SetKVCacheBytes(0)
	if err := m.SetKVCacheBytes(p.BlockBytes() - 1); err == nil {
		t.Error("a pool smaller than a block was accepted")
	}
	if got := p.MaxTokens(2048); got != 32 {
		t.Errorf("MaxTokens = %d, want 32 (2 blocks of 16 in each of 4 layers)", got)
	}
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	V := c.Vocab
	a, _ := m.NewCache(64)
	b, _ := m.NewCache(64)
	ctx := context.Background()
	if err := m.Forward(ctx, []llm.Step{{Cache: a, Tokens: ids[:20], Logits: make([]float32, V), LastOnly: true}}); err != nil {
		t.Fatal(err) // 8 blocks
	}
	err := m.Forward(ctx, []llm.Step{{Cache: a, Tokens: ids[20:21], Logits: make([]float32, V)}, {Cache: b, Tokens: ids[:3], Logits: make([]float32, V), LastOnly: true}})
	if err == nil || !strings.Contains(err.Error(), "exhausted") {
		t.Fatalf("a step needing 4 blocks with 2 free: %v", err)
	}
	if a.Len() != 20 || b.Len() != 0 || p.Used() != 8 {
		t.Errorf("after the refused step: lengths %d, %d, %d blocks used; want 20, 0, 8", a.Len(), b.Len(), p.Used())
	}
	if err := m.SetKVCacheBytes(7 * p.BlockBytes()); err == nil {
		t.Error("shrinking the pool below the blocks in use was accepted")
	}
	a.Close()
	if err := m.Forward(ctx, []llm.Step{{Cache: b, Tokens: ids[:3], Logits: make([]float32, V), LastOnly: true}}); err != nil {
		t.Fatal(err)
	}
	b.Close()
	if p.Used() != 0 || p.Peak() != 8 {
		t.Errorf("%d blocks used at the end (peak %d), want 0 (peak 8)", p.Used(), p.Peak())
	}
}
