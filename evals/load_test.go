package evals

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// TestRunLoadTimesTokensWithoutText: a stream whose tokens carry no text
// (a tokenizer that cannot spell them) has no time to first token unless
// the load test asks for logprobs, whose events then time it; the
// request carries the flag.
func TestRunLoadTimesTokensWithoutText(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Logprobs bool }
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, `data: {"choices":[{"delta":{"role":"assistant"}}]}`+"\n\n")
		for i := 0; i < 3; i++ {
			time.Sleep(2 * time.Millisecond)
			if req.Logprobs { // the server streams a token's event only with something in it
				fmt.Fprint(w, `data: {"choices":[{"delta":{"content":""},"logprobs":{"content":[{"token":"","logprob":-1}]}}]}`+"\n\n")
			}
		}
		fmt.Fprint(w, `data: {"choices":[],"usage":{"completion_tokens":3}}`+"\n\ndata: [DONE]\n\n")
	}))
	defer srv.Close()
	for _, lp := range []bool{false, true} {
		res, err := RunLoad(context.Background(), LoadOptions{URL: srv.URL, Model: "m", Clients: 2, Requests: 4, MaxTokens: 3, Logprobs: lp})
		if err != nil {
			t.Fatal(err)
		}
		if res.Succeeded != 4 || res.CompletionTokens != 12 || res.Total == nil {
			t.Fatalf("logprobs %v: %+v", lp, res)
		}
		if timed := res.TTFT != nil && res.ITL != nil; timed != lp {
			t.Errorf("logprobs %v: TTFT %v, ITL %v; want them timed only with logprobs", lp, res.TTFT, res.ITL)
		}
		if lp && !(res.TTFT["p50"] > 0 && res.TTFT["p50"] < res.Total["p50"]) {
			t.Errorf("TTFT p50 %v ms, latency p50 %v ms", res.TTFT["p50"], res.Total["p50"])
		}
	}
}
