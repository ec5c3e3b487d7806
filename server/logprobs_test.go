package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strings"
	"testing"

	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/internal/shared"
)

// post sends a JSON body and decodes the JSON answer.
func post(t *testing.T, url string, body any) (int, map[string]any) {
	t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatalf("%s: answer is not JSON: %v", b, err)
	}
	return resp.StatusCode, out
}

// legacyLogprobs is choices[i].logprobs of the legacy completions API,
// field by field as OpenAI documents it.
type legacyLogprobs struct {
	Tokens        []string              `json:"tokens"`
	TokenLogprobs []*float64            `json:"token_logprobs"`
	TopLogprobs   []map[string]*float64 `json:"top_logprobs"`
	TextOffset    []int                 `json:"text_offset"`
}

func decodeLogprobs(t *testing.T, choice any) legacyLogprobs {
	t.Helper()
	c, ok := choice.(map[string]any)
	if !ok {
		t.Fatalf("choice %v is not an object", choice)
	}
	lp, ok := c["logprobs"].(map[string]any)
	if !ok {
		t.Fatalf("choice %v has no logprobs object", c)
	}
	if len(lp) != 4 {
		t.Errorf("logprobs has keys %v, want tokens, token_logprobs, top_logprobs, text_offset", lp)
	}
	b, _ := json.Marshal(lp)
	var out legacyLogprobs
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("logprobs %s: %v", b, err)
	}
	return out
}

// The request lm-evaluation-harness's local-completions sends to score a
// continuation (prompt as token ids, echo, logprobs 1, max_tokens 0 and
// 1): the echoed prompt's logprobs are log-softmax of transformers'
// reference logits for the same ids (within 1e-4), the first null, and
// the answer has the documented shape, field by field.
func TestEchoLogprobsMatchReference(t *testing.T) {
	ids := shared.Int32s(t, "reference/llama-tiny.logits.input.i32")
	ref := shared.Float32s(t, "reference/llama-tiny.logits.f32")
	ts, e, _ := serve(t, engine.Options{}, nil)
	V := e.Backend.Config().Vocab
	text := e.Tokenizer.Decode(ids, true)
	for _, maxTokens := range []int{0, 1} {
		for _, form := range []string{"ids", "[ids]"} {
			var p any = ids
			if form == "[ids]" {
				p = [][]int{ids}
			}
			status, out := post(t, ts.URL+"/v1/completions", map[string]any{"model": "llama-tiny", "prompt": p,
				"echo": true, "logprobs": 1, "max_tokens": maxTokens, "temperature": 0})
			what := fmt.Sprintf("max_tokens %d, prompt %s", maxTokens, form)
			if status != 200 {
				t.Fatalf("%s: status %d: %v", what, status, out)
			}
			if out["object"] != "text_completion" {
				t.Errorf("%s: object %v", what, out["object"])
			}
			choices, _ := out["choices"].([]any)
			if len(choices) != 1 {
				t.Fatalf("%s: choices %v", what, out["choices"])
			}
			c := choices[0].(map[string]any)
			if c["index"] != 0.0 || !strings.HasPrefix(c["text"].(string), text) {
				t.Errorf("%s: index %v, text %q does not start with the prompt %q", what, c["index"], c["text"], text)
			}
			lp := decodeLogprobs(t, c)
			n := len(ids) + maxTokens
			if len(lp.Tokens) != n || len(lp.TokenLogprobs) != n || len(lp.TopLogprobs) != n || len(lp.TextOffset) != n {
				t.Fatalf("%s: %d tokens, %d token_logprobs, %d top_logprobs, %d text_offset; want %d each", what,
					len(lp.Tokens), len(lp.TokenLogprobs), len(lp.TopLogprobs), len(lp.TextOffset), n)
			}
			if lp.TokenLogprobs[0] != nil || lp.TopLogprobs[0] != nil || lp.Tokens[0] != "<|begin_of_text|>" || lp.TextOffset[0] != 0 {
				t.Errorf("%s: first token %q: logprob %v, top %v, offset %d; want BOS, null, null, 0", what,
					lp.Tokens[0], lp.TokenLogprobs[0], lp.TopLogprobs[0], lp.TextOffset[0])
			}
			worst := 0.0
			offset := 0
			for i := 1; i < n; i++ {
				want := shared.LogSoftmax(ref[(i-1)*V : i*V])
				id := 0
				if i < len(ids) {
					id = ids[i]
					if want := e.Tokenizer.Decode(ids[i:i+1], false); lp.Tokens[i] != want {
						t.Errorf("%s: token %d is %q, want %q", what, i, lp.Tokens[i], want)
					}
				} else { // the greedy token: the reference's most likely
					for j := range want {
						if want[j] > want[id] {
							id = j
						}
					}
				}
				if lp.TokenLogprobs[i] == nil {
					t.Fatalf("%s: token %d has a null logprob", what, i)
				}
				worst = math.Max(worst, math.Abs(*lp.TokenLogprobs[i]-want[id]))
				// logprobs 1: the most likely token and the chosen one.
				top := lp.TopLogprobs[i]
				if len(top) < 1 || len(top) > 2 {
					t.Errorf("%s: token %d: top_logprobs %v, want 1 or 2 entries", what, i, top)
				}
				if v, ok := top[lp.Tokens[i]]; !ok || v == nil || *v != *lp.TokenLogprobs[i] {
					t.Errorf("%s: token %d: top_logprobs %v lacks the chosen %q", what, i, top, lp.Tokens[i])
				}
				// text_offset: characters of the text before the token.
				offset += len([]rune(e.Tokenizer.Decode(ids[i-1:i], true)))
				if i < len(ids) && lp.TextOffset[i] != offset {
					t.Errorf("%s: token %d: text_offset %d, want %d", what, i, lp.TextOffset[i], offset)
				}
			}
			t.Logf("%s: largest |logprob − reference| %.2e", what, worst)
			if worst > 1e-4 {
				t.Errorf("%s: logprobs differ from the reference by %.2e", what, worst)
			}
			u := out["usage"].(map[string]any)
			if u["prompt_tokens"] != float64(len(ids)) || u["completion_tokens"] != float64(maxTokens) {
				t.Errorf("%s: usage %v", what, u)
			}
		}
	}
}

// Without echo, logprobs cover the generated tokens only, their offsets
// counting from the prompt's end; streamed chunks carry the same entries.
func TestCompletionLogprobsStreamed(t *testing.T) {
	ts, _, _ := serve(t, engine.Options{}, nil)
	body := map[string]any{"model": "llama-tiny", "prompt": "Once upon a time", "max_tokens": 8, "logprobs": 3, "temperature": 0}
	status, out := post(t, ts.URL+"/v1/completions", body)
	if status != 200 {
		t.Fatalf("status %d: %v", status, out)
	}
	c := out["choices"].([]any)[0].(map[string]any)
	whole := decodeLogprobs(t, c)
	if len(whole.Tokens) != 8 || whole.TextOffset[0] != len("Once upon a time") || strings.Join(whole.Tokens, "") != c["text"] {
		t.Errorf("tokens %q offsets %v for text %q", whole.Tokens, whole.TextOffset, c["text"])
	}
	for i, top := range whole.TopLogprobs {
		if len(top) < 3 || len(top) > 4 || whole.TokenLogprobs[i] == nil {
			t.Errorf("token %d: top %v", i, top)
		}
	}

	body["stream"] = true
	b, _ := json.Marshal(body)
	resp, err := http.Post(ts.URL+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var streamed legacyLogprobs
	var text strings.Builder
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct {
				Text     string          `json:"text"`
				Logprobs *legacyLogprobs `json:"logprobs"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatal(err)
		}
		for _, ch := range chunk.Choices {
			text.WriteString(ch.Text)
			if l := ch.Logprobs; l != nil {
				streamed.Tokens = append(streamed.Tokens, l.Tokens...)
				streamed.TokenLogprobs = append(streamed.TokenLogprobs, l.TokenLogprobs...)
				streamed.TextOffset = append(streamed.TextOffset, l.TextOffset...)
			}
		}
	}
	if text.String() != c["text"] || strings.Join(streamed.Tokens, "") != c["text"] || fmt.Sprint(streamed.TextOffset) != fmt.Sprint(whole.TextOffset) {
		t.Errorf("streamed %q, tokens %q, offsets %v; whole %q, offsets %v", text.String(), streamed.Tokens, streamed.TextOffset, c["text"], whole.TextOffset)
	}
	for i := range streamed.TokenLogprobs {
		if *streamed.TokenLogprobs[i] != *whole.TokenLogprobs[i] {
			t.Errorf("token %d: streamed logprob %v, whole %v", i, *streamed.TokenLogprobs[i], *whole.TokenLogprobs[i])
		}
	}
}

// Several prompts in one request: one choice each, in order, equal to
// the prompts asked one at a time.
func TestCompletionBatchOfPrompts(t *testing.T) {
	ts, _, _ := serve(t, engine.Options{}, nil)
	prompts := []any{"Once upon a time", []int{0, 791, 3925}, "The history of"}
	status, out := post(t, ts.URL+"/v1/completions", map[string]any{"model": "llama-tiny", "prompt": prompts,
		"max_tokens": 4, "temperature": 0, "echo": true, "logprobs": 0})
	if status != 200 {
		t.Fatalf("status %d: %v", status, out)
	}
	choices := out["choices"].([]any)
	if len(choices) != len(prompts) {
		t.Fatalf("%d choices for %d prompts", len(choices), len(prompts))
	}
	for i, p := range prompts {
		status, one := post(t, ts.URL+"/v1/completions", map[string]any{"model": "llama-tiny", "prompt": p,
			"max_tokens": 4, "temperature": 0, "echo": true, "logprobs": 0})
		if status != 200 {
			t.Fatalf("prompt %d alone: %d %v", i, status, one)
		}
		// The same text and tokens; logprobs equal up to float32
		// rounding (a batch's matrix products sum in another order).
		got, want := choices[i].(map[string]any), one["choices"].([]any)[0].(map[string]any)
		gl, wl := decodeLogprobs(t, got), decodeLogprobs(t, want)
		if got["index"] != float64(i) || got["text"] != want["text"] || got["finish_reason"] != want["finish_reason"] ||
			fmt.Sprint(gl.Tokens, gl.TextOffset) != fmt.Sprint(wl.Tokens, wl.TextOffset) || len(gl.TokenLogprobs) != len(wl.TokenLogprobs) {
			t.Errorf("prompt %d:\n batch %v\n alone %v", i, got, want)
			continue
		}
		for j := 1; j < len(gl.TokenLogprobs); j++ {
			if d := math.Abs(*gl.TokenLogprobs[j] - *wl.TokenLogprobs[j]); d > 1e-4 {
				t.Errorf("prompt %d, token %d: logprob %v in the batch, %v alone", i, j, *gl.TokenLogprobs[j], *wl.TokenLogprobs[j])
			}
		}
	}
	if u := out["usage"].(map[string]any); u["completion_tokens"] != 12.0 {
		t.Errorf("usage %v", u)
	}
}

// Chat: logprobs true with top_logprobs, in OpenAI's chat shape.
func TestChatLogprobs(t *testing.T) {
	ts, _, _ := serve(t, engine.Options{}, nil)
	status, out := post(t, ts.URL+"/v1/chat/completions", map[string]any{"model": "llama-tiny",
		"messages": []map[string]string{{"role": "user", "content": "Hi"}}, "max_tokens": 5, "temperature": 0,
		"logprobs": true, "top_logprobs": 2})
	if status != 200 {
		t.Fatalf("status %d: %v", status, out)
	}
	c := out["choices"].([]any)[0].(map[string]any)
	var lp struct {
		Content []struct {
			Token       string  `json:"token"`
			Logprob     float64 `json:"logprob"`
			Bytes       []int   `json:"bytes"`
			TopLogprobs []struct {
				Token   string  `json:"token"`
				Logprob float64 `json:"logprob"`
				Bytes   []int   `json:"bytes"`
			} `json:"top_logprobs"`
		} `json:"content"`
	}
	b, _ := json.Marshal(c["logprobs"])
	if err := json.Unmarshal(b, &lp); err != nil {
		t.Fatalf("logprobs %s: %v", b, err)
	}
	var text strings.Builder
	for i, tok := range lp.Content {
		text.WriteString(tok.Token)
		if len(tok.TopLogprobs) != 2 || tok.TopLogprobs[0].Token != tok.Token || tok.TopLogprobs[0].Logprob != tok.Logprob ||
			string(bytesOf(tok.Bytes)) != tok.Token || tok.Logprob > 0 {
			t.Errorf("token %d: %+v", i, tok)
		}
	}
	if msg := c["message"].(map[string]any)["content"]; text.String() != msg {
		t.Errorf("tokens %q, message %q", text.String(), msg)
	}
	// Without logprobs the field is null.
	_, out = post(t, ts.URL+"/v1/chat/completions", map[string]any{"model": "llama-tiny",
		"messages": []map[string]string{{"role": "user", "content": "Hi"}}, "max_tokens": 2})
	if c := out["choices"].([]any)[0].(map[string]any); c["logprobs"] != nil {
		t.Errorf("logprobs %v without asking", c["logprobs"])
	}
}

func bytesOf(b []int) []byte {
	out := make([]byte, len(b))
	for i, v := range b {
		out[i] = byte(v)
	}
	return out
}

func TestLogprobsErrors(t *testing.T) {
	ts, _, _ := serveWith(t, Options{}, engine.Options{}, nil)
	for _, c := range []struct{ path, body, param, want string }{
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "x", "logprobs": 6}`, "logprobs", "from 0 to 5, got 6"},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "x", "logprobs": -1}`, "logprobs", "from 0 to 5, got -1"},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "x", "logprobs": true}`, "logprobs", "integer from 0 to 5"},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "x", "max_tokens": 0}`, "max_tokens", "0 only with echo"},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": "x", "top_logprobs": 2}`, "top_logprobs", "belongs to /v1/chat/completions"},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": ["a", "b"], "stream": true}`, "stream", "one prompt at a time"},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": [[0, 1], {}]}`, "prompt", "item 1 is neither"},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": [0, 99999]}`, "", "outside the vocabulary"},
		{"/v1/completions", `{"model": "llama-tiny", "prompt": []}`, "prompt", "prompt must be"},
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": 1}`, "logprobs", "must be a boolean"},
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}`, "top_logprobs", "from 0 to 20"},
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}`, "top_logprobs", "needs logprobs: true"},
		{"/v1/chat/completions", `{"model": "llama-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}`, "max_tokens", "must be positive"},
	} {
		resp, body := do(t, "POST", ts.URL+c.path, c.body)
		e := checkErrorShape(t, c.body, resp, body, 400, c.want)
		if c.param != "" && e["param"] != c.param {
			t.Errorf("%s: param %v, want %q", c.body, e["param"], c.param)
		}
	}
}

// lm-evaluation-harness's loglikelihood request, parsed as its
// local-completions model parses it — per prompt, the sum of
// token_logprobs[ctxlen:-1] and whether each was the largest of its
// top_logprobs — gives what evals.ScoreTasks computes for the same
// context and choices in-process.
func TestHarnessRequestMatchesScoreTasks(t *testing.T) {
	ts, e, _ := serve(t, engine.Options{}, nil)
	item := evals.TaskItem{Context: "The sun rises in the", Choices: []string{" east", " west", " morning"}, Answer: 0}
	// And the model's own greedy continuation, whose tokens are all greedy.
	res, err := e.Generate(context.Background(), engine.Request{Prompt: e.Encode(item.Context), MaxTokens: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	item.Choices = append(item.Choices, res.Text)
	want, err := evals.ScoreTasks(context.Background(), e.Backend, e.Tokenizer, []evals.TaskItem{item}, evals.TaskOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var prompts [][]int
	var ctxlens []int
	for _, c := range item.Choices {
		ctx := e.Tokenizer.Encode(item.Context, true)
		whole := e.Tokenizer.Encode(item.Context+c, true)
		prompts = append(prompts, append(append([]int{}, ctx...), whole[len(ctx):]...))
		ctxlens = append(ctxlens, len(ctx))
	}
	status, out := post(t, ts.URL+"/v1/completions", map[string]any{"model": "llama-tiny", "prompt": prompts,
		"temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true})
	if status != 200 {
		t.Fatalf("status %d: %v", status, out)
	}
	choices := out["choices"].([]any)
	for i, c := range choices {
		lp := decodeLogprobs(t, c)
		var sum float64
		greedy := true
		for k := ctxlens[i]; k < len(lp.TokenLogprobs)-1; k++ {
			sum += *lp.TokenLogprobs[k]
			best := math.Inf(-1)
			for _, v := range lp.TopLogprobs[k] {
				best = math.Max(best, *v)
			}
			greedy = greedy && *lp.TokenLogprobs[k] == best
		}
		t.Logf("%q: server %.6f greedy %v; ScoreTasks %.6f greedy %v", item.Choices[i], sum, greedy, want.PerItem[0].Loglik[i], want.PerItem[0].Greedy[i])
		if d := math.Abs(sum - want.PerItem[0].Loglik[i]); d > 1e-4 || greedy != want.PerItem[0].Greedy[i] {
			t.Errorf("choice %q: server %v (greedy %v), ScoreTasks %v (greedy %v)", item.Choices[i], sum, greedy,
				want.PerItem[0].Loglik[i], want.PerItem[0].Greedy[i])
		}
	}
}
