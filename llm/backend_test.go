package llm_test

import (
	"context"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
)

// The CPU backend's Memory counts its float32 weights once (llama-tiny's
// parameter count × 4, the tied or separate head included once) and each
// block the open caches hold until they are closed; WindowNLL is the NLL of the window's
// logits computed by hand.
func TestCPUBackendMemoryAndWindowNLL(t *testing.T) {
	m := loadModel(t, "models/llama-tiny")
	c := m.Cfg
	var b llm.Backend = m
	mem, err := b.Memory()
	if err != nil {
		t.Fatal(err)
	}
	// Parameters of a Llama: embeddings, per layer two norms and the seven
	// projections, the final norm, and the head unless tied.
	q, kv := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	perLayer := 2*c.Hidden + c.Hidden*q + 2*c.Hidden*kv + q*c.Hidden + 3*c.Hidden*c.Intermediate
	params := c.Vocab*c.Hidden + c.Layers*perLayer + c.Hidden
	if !c.TieEmbeddings {
		params += c.Vocab * c.Hidden
	}
	if mem.Weights != int64(params)*4 || mem.Caches != 0 || mem.DeviceTotal != 0 {
		t.Errorf("memory %+v, want %d bytes of weights, no caches, no device", mem, params*4)
	}
	cache, err := b.NewCache(100)
	if err != nil {
		t.Fatal(err)
	}
	if mem, _ = b.Memory(); mem.Caches != 0 {
		t.Errorf("one empty cache of 100 tokens: %d bytes counted, want 0 (blocks come as tokens do)", mem.Caches)
	}
	if err := b.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: make([]int, 100), Logits: make([]float32, c.Vocab), LastOnly: true}}); err != nil {
		t.Fatal(err)
	}
	want := int64(2*c.Layers*kv*112) * 4 // 7 blocks of 16 per layer
	if mem, _ = b.Memory(); mem.Caches != want {
		t.Errorf("one cache holding 100 tokens: %d bytes counted, want %d", mem.Caches, want)
	}
	cache.Close()
	cache.Close() // twice is harmless
	if mem, _ = b.Memory(); mem.Caches != 0 {
		t.Errorf("after Close: %d cache bytes counted", mem.Caches)
	}
	if err := b.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: []int{1}, Logits: make([]float32, c.Vocab)}}); err == nil {
		t.Error("a closed cache was accepted")
	}

	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")[:64]
	sum, n, err := b.WindowNLL(context.Background(), ids)
	if err != nil {
		t.Fatal(err)
	}
	cache, _ = b.NewCache(len(ids))
	defer cache.Close()
	logits := make([]float32, len(ids)*c.Vocab)
	if err := b.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids, Logits: logits}}); err != nil {
		t.Fatal(err)
	}
	var ref float64
	for i := 1; i < len(ids); i++ {
		ref += llm.NLL(logits[(i-1)*c.Vocab:i*c.Vocab], ids[i])
	}
	if n != len(ids)-1 || sum != ref { // the same float32 logits, the same float64 sum
		t.Errorf("WindowNLL %v over %d tokens, by hand %v over %d", sum, n, ref, len(ids)-1)
	}
	if _, _, err := b.WindowNLL(context.Background(), ids[:1]); err == nil {
		t.Error("a one-token window was accepted")
	}
	if mem, _ = b.Memory(); mem.Caches != int64(2*c.Layers*kv*len(ids))*4 { // 64 tokens: 4 whole blocks a layer
		t.Errorf("WindowNLL left %d cache bytes open besides this test's", mem.Caches-int64(2*c.Layers*kv*len(ids))*4)
	}
}
