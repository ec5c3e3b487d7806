package evals

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"
)

// LoadOptions describe a closed-loop load test of an OpenAI-compatible
// server: Clients goroutines each send streaming chat requests one after
// another until Requests have been sent in all.
type LoadOptions struct {
	URL       string // base URL, e.g. http://127.0.0.1:8080
	Model     string
	Clients   int
	Requests  int
	MaxTokens int
	Prompt    string // the user message; request i appends " (i)"
	// Logprobs asks for each token's log-probability, so that every token
	// streams an event even when its text is empty (a tokenizer that
	// cannot spell the model's tokens, as a synthetic model's): the first
	// token is then timed by its event, not by the first visible text.
	Logprobs bool
}

// LoadResult summarises a load test. Latencies are per request: TTFT to
// the first streamed text (or logprobs), Total to the end of the stream,
// ITL the mean time between its tokens after the first, (Total −
// TTFT)/(tokens − 1) (requests of one token have none; neither has a
// request whose stream carried no text and no logprobs).
type LoadResult struct {
	Requests         int                `json:"requests"`
	Succeeded        int                `json:"succeeded"`
	Errors           []string           `json:"errors,omitempty"`
	CompletionTokens int                `json:"completion_tokens"`
	WallSeconds      float64            `json:"wall_s"`
	TokensPerSecond  float64            `json:"tokens_per_s"`
	TTFT             map[string]float64 `json:"ttft_ms"`
	Total            map[string]float64 `json:"latency_ms"`
	ITL              map[string]float64 `json:"itl_ms,omitempty"`
}

// RunLoad runs the load test.
func RunLoad(ctx context.Context, opt LoadOptions) (*LoadResult, error) {
	if opt.Clients <= 0 || opt.Requests <= 0 || opt.MaxTokens <= 0 {
		return nil, fmt.Errorf("load test: clients, requests and max tokens must be positive")
	}
	res := &LoadResult{Requests: opt.Requests}
	var mu sync.Mutex
	var ttft, total, itl []float64
	next := make(chan int)
	go func() {
		defer close(next)
		for i := 0; i < opt.Requests; i++ {
			select {
			case next <- i:
			case <-ctx.Done():
				return
			}
		}
	}()
	client := &http.Client{}
	start := time.Now()
	var wg sync.WaitGroup
	for c := 0; c < opt.Clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				first, all, tokens, err := streamChat(ctx, client, opt, fmt.Sprintf("%s (%d)", opt.Prompt, i))
				mu.Lock()
				if err != nil {
					res.Errors = append(res.Errors, fmt.Sprintf("request %d: %v", i, err))
				} else {
					res.Succeeded++
					res.CompletionTokens += tokens
					total = append(total, ms(all))
					if first > 0 { // no text and no logprobs: nothing timed the first token
						ttft = append(ttft, ms(first))
						if tokens > 1 {
							itl = append(itl, ms(all-first)/float64(tokens-1))
						}
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	res.WallSeconds = time.Since(start).Seconds()
	res.TokensPerSecond = float64(res.CompletionTokens) / res.WallSeconds
	res.TTFT, res.Total, res.ITL = percentiles(ttft), percentiles(total), percentiles(itl)
	return res, ctx.Err()
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func percentiles(xs []float64) map[string]float64 {
	if len(xs) == 0 {
		return nil
	}
	sort.Float64s(xs)
	return map[string]float64{"p50": quantile(xs, 0.50), "p90": quantile(xs, 0.90), "p99": quantile(xs, 0.99), "max": xs[len(xs)-1]}
}

// quantile is the p-quantile of sorted values (nearest rank, rounding down).
func quantile(sorted []float64, p float64) float64 {
	return sorted[min(len(sorted)-1, int(p*float64(len(sorted))))]
}

// Median sorts xs in place and returns its middle value (the upper one of
// an even count), the statistic every llmq timing reports.
func Median(xs []float64) float64 {
	sort.Float64s(xs)
	return quantile(xs, 0.5)
}

// streamChat sends one streaming chat request and reads its events to
// [DONE]. It returns the time to the first text, to the end, and the
// completion tokens of the usage event.
func streamChat(ctx context.Context, client *http.Client, opt LoadOptions, prompt string) (first, all time.Duration, tokens int, err error) {
	body, _ := json.Marshal(map[string]any{
		"model": opt.Model, "stream": true, "max_tokens": opt.MaxTokens, "temperature": 0,
		"stream_options": map[string]any{"include_usage": true}, "logprobs": opt.Logprobs,
		"messages": []any{map[string]any{"role": "user", "content": prompt}},
	})
	req, err := http.NewRequestWithContext(ctx, "POST", strings.TrimSuffix(opt.URL, "/")+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return 0, 0, 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	t0 := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return 0, 0, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, 0, 0, fmt.Errorf("status %s", resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	done := false
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			done = true
			break
		}
		var ev struct {
			Choices []struct {
				Delta    struct{ Content string }
				Logprobs *struct {
					Content []json.RawMessage `json:"content"`
				} `json:"logprobs"`
			}
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			}
			Error *struct{ Message string }
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return 0, 0, 0, fmt.Errorf("bad event %q: %w", data, err)
		}
		if ev.Error != nil {
			return 0, 0, 0, fmt.Errorf("server error in stream: %s", ev.Error.Message)
		}
		if len(ev.Choices) > 0 && first == 0 {
			c := ev.Choices[0]
			if c.Delta.Content != "" || (c.Logprobs != nil && len(c.Logprobs.Content) > 0) {
				first = time.Since(t0)
			}
		}
		if ev.Usage != nil {
			tokens = ev.Usage.CompletionTokens
		}
	}
	if err := sc.Err(); err != nil {
		return 0, 0, 0, err
	}
	if !done {
		return 0, 0, 0, fmt.Errorf("stream ended without [DONE]")
	}
	return first, time.Since(t0), tokens, nil
}
