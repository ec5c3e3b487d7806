package server

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// ttftBuckets are the upper bounds, in seconds, of the time-to-first-token
// histogram: from a short prompt on a GPU to a long prefill on a CPU.
var ttftBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// metrics are the server's counters, exposed on GET /metrics in
// Prometheus' text format (version 0.0.4), written by hand.
type metrics struct {
	mu       sync.Mutex
	requests map[requestKey]int64 // by route and status
	ttft     []int64              // per bucket (not cumulative), +Inf last
	ttftSum  float64
	ttftN    int64

	promptTokens     atomic.Int64
	completionTokens atomic.Int64
	inFlight         atomic.Int64 // generation requests being handled
}

type requestKey struct {
	route  string
	status int
}

func newMetrics() *metrics {
	return &metrics{requests: map[requestKey]int64{}, ttft: make([]int64, len(ttftBuckets)+1)}
}

func (m *metrics) request(route string, status int) {
	m.mu.Lock()
	m.requests[requestKey{route, status}]++
	m.mu.Unlock()
}

func (m *metrics) observeTTFT(d time.Duration) {
	sec := d.Seconds()
	i, _ := slices.BinarySearch(ttftBuckets, sec) // first bound ≥ sec
	m.mu.Lock()
	m.ttft[i]++
	m.ttftSum += sec
	m.ttftN++
	m.mu.Unlock()
}

// write renders every metric. e holds the engine's gauges (nil while the
// model loads).
func (m *metrics) write(w io.Writer, s *Server) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	head := func(name, typ, help string) {
		p("# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
	}
	m.mu.Lock()
	keys := make([]requestKey, 0, len(m.requests))
	for k := range m.requests {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b requestKey) int {
		if a.route != b.route {
			return cmpString(a.route, b.route)
		}
		return a.status - b.status
	})
	head("llmq_http_requests_total", "counter", "HTTP requests answered, by route and status code.")
	for _, k := range keys {
		p("llmq_http_requests_total{route=%s,status=\"%d\"} %d\n", strconv.Quote(k.route), k.status, m.requests[k])
	}
	head("llmq_time_to_first_token_seconds", "histogram", "Time from a generation request's arrival to its first token.")
	var cum int64
	for i, le := range ttftBuckets {
		cum += m.ttft[i]
		p("llmq_time_to_first_token_seconds_bucket{le=\"%s\"} %d\n", strconv.FormatFloat(le, 'g', -1, 64), cum)
	}
	cum += m.ttft[len(ttftBuckets)]
	p("llmq_time_to_first_token_seconds_bucket{le=\"+Inf\"} %d\n", cum)
	p("llmq_time_to_first_token_seconds_sum %s\n", strconv.FormatFloat(m.ttftSum, 'g', -1, 64))
	p("llmq_time_to_first_token_seconds_count %d\n", m.ttftN)
	m.mu.Unlock()

	head("llmq_prompt_tokens_total", "counter", "Prompt tokens of the generation requests run.")
	p("llmq_prompt_tokens_total %d\n", m.promptTokens.Load())
	head("llmq_completion_tokens_total", "counter", "Tokens generated for clients.")
	p("llmq_completion_tokens_total %d\n", m.completionTokens.Load())
	head("llmq_requests_in_flight", "gauge", "Generation requests being handled (tokenizing, queued or running).")
	p("llmq_requests_in_flight %d\n", m.inFlight.Load())

	e := s.engine()
	loaded := 0
	if e != nil {
		loaded = 1
	}
	head("llmq_model_loaded", "gauge", "1 once the model is loaded and requests are served, 0 while it loads.")
	p("llmq_model_loaded %d\n", loaded)
	if e == nil {
		return
	}
	st := e.Stats()
	head("llmq_queue_depth", "gauge", "Requests waiting for a batch slot.")
	p("llmq_queue_depth %d\n", st.Queued)
	head("llmq_active_sequences", "gauge", "Sequences in the running batch.")
	p("llmq_active_sequences %d\n", st.Active)
	head("llmq_kv_cache_tokens", "gauge", "Tokens held in the KV caches of the active sequences.")
	p("llmq_kv_cache_tokens %d\n", st.KVTokens)
	if st.KVBytesKnown {
		head("llmq_kv_cache_bytes", "gauge", "Memory the KV caches hold (on the CPU: the blocks in use).")
		p("llmq_kv_cache_bytes %d\n", st.KVBytes)
	}
	if st.KVPaged {
		head("llmq_kv_cache_blocks_used", "gauge", "KV cache blocks the sequences hold.")
		p("llmq_kv_cache_blocks_used %d\n", st.KVBlocksUsed)
		if st.KVBlocksTotal > 0 {
			head("llmq_kv_cache_blocks_total", "gauge", "KV cache blocks in the pool (its bound).")
			p("llmq_kv_cache_blocks_total %d\n", st.KVBlocksTotal)
		}
		head("llmq_preemptions_total", "counter", "Sequences preempted for want of KV cache blocks (prefilled again later).")
		p("llmq_preemptions_total %d\n", st.Preemptions)
	}
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (s *Server) metricsPage(w http.ResponseWriter, r *http.Request, rs *reqState) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	s.m.write(w, s)
}
