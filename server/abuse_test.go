package server

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmq/llmq/engine"
)

// TestAbuseDoesNotSlowServing (issue 18, "done when"): 64 concurrent
// clients are served while others flood the server with bodies over the
// limit (413), prompts over the prompt limit (400, before tokenizing),
// malformed JSON (400), unknown routes (404) and wrong keys (401), four
// abusers each sending one request every 10 ms or so (hundreds a second,
// tens of MB of JSON a second, from the same two cores). Every
// abusive request gets its 4xx and every client its answer, and the 64
// clients' round takes less than twice as long as without the flood. The
// rounds alternate, three of each, and the fastest of each kind is
// compared, so that a burst of load from outside the test does not decide
// it.
func TestAbuseDoesNotSlowServing(t *testing.T) {
	const key = "sk-abuse-test"
	ts, _, _ := serveWith(t, Options{APIKey: key, MaxBodyBytes: 256 << 10, MaxConcurrent: 256}, engine.Options{MaxBatch: 16, MaxQueue: 64}, nil)
	post := func(path, body, auth string) (int, error) {
		req, err := http.NewRequest("POST", ts.URL+path, strings.NewReader(body))
		if err != nil {
			return 0, err
		}
		req.Header.Set("Authorization", "Bearer "+auth)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	good := `{"model": "llama-tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}`
	abuse := []struct {
		path, body, key string
		status          int
	}{
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "` + strings.Repeat("a", 300<<10) + `"}`, key, 413},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "` + strings.Repeat("long words ", 4000) + `"}`, key, 400},
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "` + strings.Repeat("x", 100000) + `"}]}`, key, 400},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": [[[[`, key, 400},
		{"/v1/nothing", `{}`, key, 404},
		{"/v1/completions", good, "sk-wrong", 401},
	}

	round := func(flood bool) time.Duration {
		stop := make(chan struct{})
		var abusers sync.WaitGroup
		var sent, wrong atomic.Int64
		var firstWrong atomic.Value
		if flood {
			for a := range 4 {
				abusers.Add(1)
				go func() {
					defer abusers.Done()
					for i := a; ; i++ {
						select {
						case <-stop:
							return
						default:
						}
						c := abuse[i%len(abuse)]
						status, err := post(c.path, c.body, c.key)
						sent.Add(1)
						if err != nil || status != c.status {
							wrong.Add(1)
							firstWrong.CompareAndSwap(nil, fmt.Sprintf("%s %.40s: %d %v (want %d)", c.path, c.body, status, err, c.status))
						}
						time.Sleep(10 * time.Millisecond)
					}
				}()
			}
			time.Sleep(50 * time.Millisecond) // the flood is on before the clients come
		}
		start := time.Now()
		var clients sync.WaitGroup
		for range 64 {
			clients.Add(1)
			go func() {
				defer clients.Done()
				if status, err := post("/v1/completions", good, key); err != nil || status != 200 {
					t.Errorf("a client got %d %v", status, err)
				}
			}()
		}
		clients.Wait()
		d := time.Since(start)
		close(stop)
		abusers.Wait()
		if wrong.Load() > 0 {
			t.Errorf("%d of %d abusive requests not answered as expected, e.g. %v", wrong.Load(), sent.Load(), firstWrong.Load())
		}
		if flood {
			t.Logf("flood round: 64 clients in %v beside %d abusive requests", d, sent.Load())
		} else {
			t.Logf("quiet round: 64 clients in %v", d)
		}
		return d
	}
	var quiet, flooded []time.Duration
	for range 3 {
		quiet = append(quiet, round(false))
		flooded = append(flooded, round(true))
	}
	q, f := slices.Min(quiet), slices.Min(flooded)
	if raceEnabled {
		t.Logf("race detector on: %v quiet, %v flooded, not compared", q, f)
		return
	}
	if f > 2*q {
		t.Errorf("the flood slowed 64 clients from %v to %v (more than 2×)", q, f)
	}
}
