package server

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmq/llmq/engine"
)

// TestKVCacheLimits: on a KV cache of 40 blocks (10 of 16 positions per
// layer of llama-tiny: 160 tokens), a request whose prompt + max_tokens
// could never fit gets 400 context_length_exceeded naming the KV cache,
// as one past the model's context does naming the context; a request
// without max_tokens gets what fits (the default 1024 bounded by the
// 160 tokens); /metrics shows the pool.
func TestKVCacheLimits(t *testing.T) {
	ts, e, _ := serveWith(t, Options{}, engine.Options{KVCacheBytes: 40 * 2 * 2 * 16 * 64 * 4}, nil)
	if got := e.MaxSequence(); got != 160 {
		t.Fatalf("MaxSequence %d, want 160", got)
	}
	for _, c := range []struct {
		body, param string
		want        []string
	}{
		{`{"model": "llama-tiny", "prompt": "The history of the", "max_tokens": 200}`, "max_tokens",
			[]string{"5 prompt tokens + max_tokens 200 = 205 tokens need", "blocks of KV cache", "at most 160 tokens fit"}},
		{`{"model": "llama-tiny", "prompt": "` + strings.Repeat("history ", 200) + `", "max_tokens": 1}`, "prompt",
			[]string{"203 prompt tokens + max_tokens 1", "at most 160 tokens fit"}},
		{`{"model": "llama-tiny", "prompt": "The history of the", "max_tokens": 2044}`, "max_tokens",
			[]string{"max_tokens 2044 too large: 5 prompt tokens + 2044 exceed the model's context of 2048"}},
	} {
		resp, body := do(t, "POST", ts.URL+"/v1/completions", c.body)
		var out struct {
			Error struct {
				Message, Code, Param string
			}
		}
		json.Unmarshal(body, &out)
		ok := resp.StatusCode == 400 && out.Error.Code == "context_length_exceeded" && out.Error.Param == c.param
		for _, w := range c.want {
			ok = ok && strings.Contains(out.Error.Message, w)
		}
		if !ok {
			t.Errorf("%.70s: %d %s; want 400 context_length_exceeded, param %s, with %q", c.body, resp.StatusCode, body, c.param, c.want)
		}
	}
	resp, body := do(t, "POST", ts.URL+"/v1/completions", `{"model": "llama-tiny", "prompt": "The history of the", "temperature": 0}`)
	var out struct {
		Usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
		}
	}
	if err := json.Unmarshal(body, &out); err != nil || resp.StatusCode != 200 {
		t.Fatalf("no max_tokens: %d %s", resp.StatusCode, body)
	}
	if n := out.Usage.PromptTokens + out.Usage.CompletionTokens; n > 160 || out.Usage.CompletionTokens < 100 {
		t.Errorf("no max_tokens: %d + %d tokens; want at most 160 together, and most of them", out.Usage.PromptTokens, out.Usage.CompletionTokens)
	}
	// The engine frees a finished sequence's blocks after its last event
	// reaches the handler, so the response can come first: wait (at most
	// 5 s) for the pool to empty.
	m := scrape(t, ts.URL)
	for deadline := time.Now().Add(5 * time.Second); (m["llmq_kv_cache_blocks_used"] != 0 || m["llmq_kv_cache_bytes"] != 0) &&
		time.Now().Before(deadline); m = scrape(t, ts.URL) {
		time.Sleep(5 * time.Millisecond)
	}
	if m["llmq_kv_cache_blocks_total"] != 40 || m["llmq_kv_cache_blocks_used"] != 0 || m["llmq_kv_cache_bytes"] != 0 {
		t.Errorf("metrics after the requests: blocks %v of %v, %v bytes", m["llmq_kv_cache_blocks_used"], m["llmq_kv_cache_blocks_total"], m["llmq_kv_cache_bytes"])
	}
}

// TestNothingLostUnderLoad (issue 16, item 6, over HTTP): 64 concurrent
// streaming completions on a KV cache of 120 blocks (480 tokens of
// llama-tiny), a fifth of the clients disconnecting after three events,
// some requests of 200 tokens (13 blocks a layer, more than the others
// leave free): every completed stream is the text the same request gets
// alone, sequences are preempted rather than failed, and afterwards the
// server is up, idle, and holds no KV cache memory.
func TestNothingLostUnderLoad(t *testing.T) {
	ts, e, _ := serveWith(t, Options{}, engine.Options{MaxBatch: 16, KVCacheBytes: 120 * 2 * 2 * 16 * 64 * 4}, nil)
	prompts := []string{"The history of the", "Once upon a time", "In the beginning", "The main function of",
		"Python is a", "The president said", "A dictionary is", "Git stores"}
	maxTokens := func(k int) int { return []int{30, 200, 45, 60, 200, 25, 90, 50}[k] }
	want := make([]string, len(prompts))
	for k, p := range prompts {
		a, err := complete(ts.URL, p, maxTokens(k), true)
		if err != nil {
			t.Fatal(err)
		}
		want[k] = a.Text
	}
	var wg sync.WaitGroup
	var completed, dropped atomic.Int64
	for i := range 64 {
		k := i % len(prompts)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i%5 == 4 { // a client that goes away after three events
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				body := fmt.Sprintf(`{"model": "llama-tiny", "prompt": %q, "max_tokens": %d, "temperature": 0, "stream": true}`, prompts[k], maxTokens(k))
				req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL+"/v1/completions", strings.NewReader(body))
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				defer resp.Body.Close()
				sc := bufio.NewScanner(resp.Body)
				for n := 0; n < 3 && sc.Scan(); {
					if strings.HasPrefix(sc.Text(), "data: ") {
						n++
					}
				}
				dropped.Add(1)
				return
			}
			a, err := complete(ts.URL, prompts[k], maxTokens(k), true)
			if err != nil {
				t.Errorf("request %d: %v", i, err)
				return
			}
			completed.Add(1)
			if a.Text != want[k] {
				t.Errorf("request %d (%q): %q\nalone: %q", i, prompts[k], a.Text, want[k])
			}
		}()
	}
	wg.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st := e.Stats()
		if st.Active == 0 && st.Queued == 0 && st.KVBlocksUsed == 0 {
			t.Logf("%d completed, %d dropped by their clients; %d preemptions, peak %d of %d blocks", completed.Load(), dropped.Load(), st.Preemptions, st.KVBlocksPeak, st.KVBlocksTotal)
			if st.Preemptions == 0 || st.KVBlocksPeak > 120 {
				t.Errorf("%d preemptions, peak %d blocks of 120", st.Preemptions, st.KVBlocksPeak)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not idle after the load: %+v", st)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if mem, _ := e.Backend.Memory(); mem.Caches != 0 {
		t.Errorf("%d bytes of KV cache held when idle", mem.Caches)
	}
	if resp, _ := do(t, "GET", ts.URL+"/health", ""); resp.StatusCode != 200 {
		t.Errorf("health after the load: %d", resp.StatusCode)
	}
}
