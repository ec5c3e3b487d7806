package server

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/backend"
	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/chat"
	openai "github.com/sashabaranov/go-openai"
)

// splitCases are answers and how they split, by how the prompt left them.
var splitCases = []struct {
	think              splitState
	answer             string
	reasoning, content string
}{
	// Qwen3 by default: the model opens the think block, or not.
	{atStart, "<think>\nThe user greets me.\n</think>\n\nHello there!", "The user greets me.", "Hello there!"},
	{atStart, "  <think>\n\n</think>\n\nHi", "", "Hi"},
	{atStart, "<think>\nStill thinking about", "Still thinking about", ""}, // max_tokens while thinking
	{atStart, "<think>", "", ""},
	{atStart, "\n\nNo tags, <b>as generated</b> \n", "", "\n\nNo tags, <b>as generated</b> \n"},
	{atStart, "<thi", "", "<thi"}, // too short to have opened the block
	{atStart, "", "", ""},
	{atStart, "<think>a < b </thinking> <\n</think>c </think> d", "a < b </thinking> <", "c </think> d"},
	{atStart, "<think>\u00a0Überlegung…\u3000</think>\u3000答え ", "Überlegung…", "答え "},
	// QwQ, DeepSeek-R1: the prompt opened the block.
	{inReasoning, "Because 2+2=4.\n</think>\n\n4", "Because 2+2=4.", "4"},
	{inReasoning, "</think>\n\nJust the answer", "", "Just the answer"},
	{inReasoning, "\nCut off mid-thou", "Cut off mid-thou", ""},
	{inReasoning, "Cut off at the tag </th", "Cut off at the tag </th", ""},
}

// The splitter returns each answer's reasoning and content, whole and
// streamed in every split of it into up to three chunks (at character
// boundaries, as the engine streams): tags split across chunks, the
// reasoning closed or not, answers without tags. Streamed, the reasoning
// comes before the content and nothing is returned twice.
func TestReasoningSplitter(t *testing.T) {
	for _, c := range splitCases {
		r, content := newReasoningSplitter(c.think).whole(c.answer)
		if r != c.reasoning || content != c.content {
			t.Errorf("%q whole: reasoning %q, content %q; want %q, %q", c.answer, r, content, c.reasoning, c.content)
		}
		var cuts []int // character boundaries
		for i := range c.answer {
			cuts = append(cuts, i)
		}
		cuts = append(cuts, len(c.answer))
		for _, i := range cuts {
			for _, j := range cuts {
				if j < i {
					continue
				}
				chunks := []string{c.answer[:i], c.answer[i:j], c.answer[j:]}
				s := newReasoningSplitter(c.think)
				var r, content strings.Builder
				for _, chunk := range chunks {
					dr, dc := s.add(chunk)
					if dr != "" && content.Len() > 0 {
						t.Errorf("%q in %q: reasoning %q after content %q", c.answer, chunks, dr, content.String())
					}
					r.WriteString(dr)
					content.WriteString(dc)
				}
				dr, dc := s.flush()
				r.WriteString(dr)
				content.WriteString(dc)
				if r.String() != c.reasoning || content.String() != c.content {
					t.Errorf("%q in %q: reasoning %q, content %q; want %q, %q", c.answer, chunks, r.String(), content.String(), c.reasoning, c.content)
				}
			}
		}
	}
	if newReasoningSplitter(noSplit) != nil {
		t.Error("an answer that does not think has a splitter")
	}
}

// thinkingOf reads whether the model thinks from its template, and how
// the answer begins from the end of the prompt.
func TestThinkingOf(t *testing.T) {
	qwen3, plain := qwen3Template(t, "qwen3"), qwen3Template(t, "qwen2")
	const head = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
	for _, c := range []struct {
		tmpl   *chat.Template
		prompt string
		want   splitState
	}{
		{qwen3, head, atStart},
		{qwen3, head + "<think>\n\n</think>\n\n", noSplit}, // enable_thinking false
		{qwen3, head + "<think>\n", inReasoning},
		{qwen3, "<|im_start|>user\nWhat is </think>?<|im_end|>\n<|im_start|>assistant\n", atStart},
		{plain, head + "<think>\n", noSplit}, // the template never thinks
	} {
		if got := thinkingOf(c.tmpl, c.prompt); got != c.want {
			t.Errorf("%q: %d, want %d", c.prompt, got, c.want)
		}
	}
}

// qwen3Template reads a chat template of package chat's testdata
// (qwen3.jinja is Qwen3's published template, qwen2.jinja Qwen2's, which
// has no think blocks): the zoo checkpoints have no tokenizer_config.json.
func qwen3Template(t *testing.T, name string) *chat.Template {
	t.Helper()
	src, err := os.ReadFile(filepath.Join("..", "llm", "chat", "testdata", name+".jinja"))
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := chat.New(strings.TrimSuffix(string(src), "\n"), "", "<|im_end|>")
	if err != nil {
		t.Fatal(err)
	}
	return tmpl
}

// scripted answers a script whatever the weights say: after each forward
// pass, a sequence's next token is the script's next one (then EOS), by
// far the likeliest.
type scripted struct {
	llm.Backend
	script []int
	next   map[llm.Cache]int // a sequence's script tokens answered so far
}

func (s *scripted) Forward(ctx context.Context, steps []llm.Step) error {
	for _, st := range steps {
		if st.Cache.Len() == 0 { // a new sequence
			s.next[st.Cache] = 0
		}
	}
	if err := s.Backend.Forward(ctx, steps); err != nil {
		return err
	}
	V := s.Config().Vocab
	for _, st := range steps {
		tok := s.Config().EOS[0]
		if i := s.next[st.Cache]; i < len(s.script) {
			tok = s.script[i]
		}
		s.next[st.Cache]++
		last := st.Logits[len(st.Logits)-V:]
		clear(last)
		last[tok] = 100
	}
	return nil
}

// serveQwen3 serves the Qwen3 zoo checkpoint (random weights, a byte-level
// tokenizer without Qwen's special tokens) on the CPU with a template of
// package chat's testdata, every answer scripted to be answer.
func serveQwen3(t *testing.T, template, answer string) (*httptest.Server, *engine.Engine) {
	t.Helper()
	m, err := backend.Open(shared.Path(t, "models/archzoo/qwen3-rand"), "cpu")
	if err != nil {
		t.Fatal(err)
	}
	script := m.Tokenizer.Encode(answer, false)
	if got := m.Tokenizer.Decode(script, true); got != answer {
		m.Close()
		t.Fatalf("the script %q decodes to %q", answer, got)
	}
	b := &scripted{Backend: m.Backend, script: script, next: map[llm.Cache]int{}}
	e, err := engine.New(engine.NewModel(b, m.Tokenizer, qwen3Template(t, template)), engine.Options{})
	if err != nil {
		m.Close()
		t.Fatal(err)
	}
	ts := httptest.NewServer(New(e, Options{Model: "qwen3"}))
	t.Cleanup(func() { ts.Close(); e.Close(); m.Close() })
	return ts, e
}

// streamChat reads a streamed chat answer through go-openai: its deltas'
// reasoning and content in order, and the finish reason. No reasoning may
// follow content.
func streamChat(t *testing.T, client *openai.Client, req openai.ChatCompletionRequest) (reasoning, content []string, finish string) {
	t.Helper()
	req.Stream = true
	stream, err := client.CreateChatCompletionStream(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	for {
		c, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return reasoning, content, finish
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, ch := range c.Choices {
			if ch.Delta.ReasoningContent != "" {
				if len(content) > 0 {
					t.Errorf("reasoning %q streamed after content %q", ch.Delta.ReasoningContent, content)
				}
				reasoning = append(reasoning, ch.Delta.ReasoningContent)
			}
			if ch.Delta.Content != "" {
				content = append(content, ch.Delta.Content)
			}
			if ch.FinishReason != "" {
				finish = string(ch.FinishReason)
			}
		}
	}
}

// A Qwen3 answer (scripted: the weights are random) comes back as
// reasoning_content and content, through the go-openai client, whole and
// streamed: the tags in neither, "</think>" reaching the stream split
// across tokens, the reasoning streamed before the content. Cut off by
// max_tokens while thinking, the answer is all reasoning. A template that
// never thinks (Qwen2's) leaves the same answer whole in content.
func TestChatReasoningContent(t *testing.T) {
	const answer = "<think>\nThe user greets me.\n</think>\n\nHello there!"
	ts, e := serveQwen3(t, "qwen3", answer)
	for _, id := range e.Tokenizer.Encode(answer, false) {
		if tok := e.Tokenizer.Decode([]int{id}, true); strings.Contains(tok, thinkClose) {
			t.Fatalf("the token %q holds all of %s: the stream would not split it", tok, thinkClose)
		}
	}
	client := clientFor(ts.URL, "none")
	req := openai.ChatCompletionRequest{Model: "qwen3", Messages: []openai.ChatCompletionMessage{{Role: "user", Content: "Hi"}}, MaxTokens: 64}
	check := func(what string, maxTokens int, wantReasoning, wantContent, wantFinish string) {
		t.Helper()
		req.MaxTokens = maxTokens
		whole, err := client.CreateChatCompletion(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		msg := whole.Choices[0].Message
		if msg.ReasoningContent != wantReasoning || msg.Content != wantContent || string(whole.Choices[0].FinishReason) != wantFinish {
			t.Errorf("%s: reasoning %q, content %q, finish %q; want %q, %q, %q", what, msg.ReasoningContent, msg.Content,
				whole.Choices[0].FinishReason, wantReasoning, wantContent, wantFinish)
		}
		reasoning, content, finish := streamChat(t, client, req)
		if r, c := strings.Join(reasoning, ""), strings.Join(content, ""); r != wantReasoning || c != wantContent || finish != wantFinish {
			t.Errorf("%s, streamed: reasoning %q, content %q, finish %q; want %q, %q, %q", what, reasoning, content, finish,
				wantReasoning, wantContent, wantFinish)
		}
		if wantReasoning != "" && len(reasoning) < 2 {
			t.Errorf("%s, streamed: the reasoning came in %d deltas %q: it was not streamed", what, len(reasoning), reasoning)
		}
	}
	check("whole answer", 64, "The user greets me.", "Hello there!", "stop")
	// Cut off in "</think>", 14 tokens: "<" "th" "ink" ">" "\n" "The" " user"
	// " g" "re" "ets" " me" "." "\n" "<", the last two held back until the
	// end.
	check("max_tokens while thinking", 14, "The user greets me.\n<", "", "length")

	// Raw, the deltas hold what they carry and no more: no delta of
	// reasoning has a content field, none is empty (text held back sends
	// nothing) but the last, which has the finish reason.
	body := `{"model": "qwen3", "messages": [{"role": "user", "content": "Hi"}], "stream": true}`
	resp, b := do(t, http.MethodPost, ts.URL+"/v1/chat/completions", body, "Content-Type", "application/json")
	deltas := 0
	for _, line := range strings.Split(string(b), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var c struct {
			Choices []struct {
				Delta        map[string]any `json:"delta"`
				FinishReason *string        `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil || len(c.Choices) != 1 {
			t.Fatalf("event %s: %v", data, err)
		}
		d := c.Choices[0].Delta
		_, hasContent := d["content"]
		switch {
		case d["reasoning_content"] != nil && hasContent:
			t.Errorf("delta %v: reasoning with a content field", d)
		case d["reasoning_content"] == nil && d["content"] == "" && d["role"] == nil && c.Choices[0].FinishReason == nil:
			t.Errorf("delta %v: empty", d)
		}
		deltas++
	}
	if resp.StatusCode != 200 || deltas < 2 {
		t.Errorf("stream: status %d, %d deltas:\n%s", resp.StatusCode, deltas, b)
	}

	ts, _ = serveQwen3(t, "qwen2", answer)
	client = clientFor(ts.URL, "none")
	check("a template without think blocks", 64, "", answer, "stop")
	status, out := post(t, ts.URL+"/v1/chat/completions", map[string]any{"model": "qwen3", "messages": req.Messages})
	if msg := out["choices"].([]any)[0].(map[string]any)["message"].(map[string]any); status != 200 || msg["reasoning_content"] != nil {
		t.Errorf("a template without think blocks: %d, message %v has reasoning_content", status, msg)
	}
}

// chat_template_kwargs reach the template: Qwen3's enable_thinking false
// renders the empty think block (the prompt is the one the library
// renders, and longer), and the answer, which then has no think block of
// its own, is all content and has no reasoning_content. An assistant
// turn's reasoning_content is rendered too. Keywords that are not an
// object, or that would replace what the server renders with, are 400s
// naming the field.
func TestChatTemplateKwargs(t *testing.T) {
	ts, e := serveQwen3(t, "qwen3", "Hello")
	url := ts.URL + "/v1/chat/completions"
	promptTokens := func(msgs []chat.Message, vars map[string]any) int {
		t.Helper()
		ids, text, err := e.EncodeChatWith(msgs, vars)
		if err != nil {
			t.Fatal(err)
		}
		if vars != nil && !strings.HasSuffix(text, "<think>\n\n</think>\n\n") {
			t.Fatalf("%v renders %q", vars, text)
		}
		return len(ids)
	}
	// ask returns the message and the prompt's tokens.
	ask := func(body map[string]any) (map[string]any, int) {
		t.Helper()
		body["model"] = "qwen3"
		status, out := post(t, url, body)
		if status != 200 {
			t.Fatalf("%v: %d %v", body, status, out)
		}
		usage := out["usage"].(map[string]any)
		return out["choices"].([]any)[0].(map[string]any)["message"].(map[string]any), int(usage["prompt_tokens"].(float64))
	}

	hi := []chat.Message{{Role: "user", Content: "Hi"}}
	msg, n := ask(map[string]any{"messages": hi})
	if want := promptTokens(hi, nil); n != want || msg["reasoning_content"] != nil || msg["content"] != "Hello" {
		t.Errorf("by default: %d prompt tokens (want %d), message %v", n, want, msg)
	}
	noThink := map[string]any{"enable_thinking": false}
	msg, n = ask(map[string]any{"messages": hi, "chat_template_kwargs": noThink})
	if want := promptTokens(hi, noThink); n != want || n <= promptTokens(hi, nil) {
		t.Errorf("enable_thinking false: %d prompt tokens, want %d (and more than without)", n, want)
	}
	if _, has := msg["reasoning_content"]; has || msg["content"] != "Hello" {
		t.Errorf("enable_thinking false: message %v, want content alone", msg)
	}

	turns := []chat.Message{{Role: "user", Content: "2+2?"}, {Role: "assistant", Content: "4", ReasoningContent: "Add them."}}
	_, n = ask(map[string]any{"messages": turns})
	if want := promptTokens(turns, nil); n != want || n <= promptTokens([]chat.Message{turns[0], {Role: "assistant", Content: "4"}}, nil) {
		t.Errorf("reasoning_content of a turn: %d prompt tokens, want %d (and more than without it)", n, want)
	}

	for _, c := range []struct{ body, param, want string }{
		{`"chat_template_kwargs": "enable_thinking=false"`, "chat_template_kwargs", `"chat_template_kwargs" must be an object, got a string`},
		{`"chat_template_kwargs": [{"enable_thinking": false}]`, "chat_template_kwargs", `"chat_template_kwargs" must be an object, got an array`},
		{`"chat_template_kwargs": {"enable_thinking": false, "messages": []}`, "chat_template_kwargs", `chat_template_kwargs cannot set "messages"`},
		{`"chat_template_kwargs": {"add_generation_prompt": false}`, "chat_template_kwargs", `chat_template_kwargs cannot set "add_generation_prompt"`},
		{`"chat_template_kwargs": {"bos_token": "<s>", "eos_token": "</s>"}`, "chat_template_kwargs", `chat_template_kwargs cannot set "bos_token"`},
		{`"chat_template_kwargs": {"namespace": 3}`, "", "chat template: namespace is not callable"}, // the template fails: still the client's error
		{`"messages": [{"role": "assistant", "content": "4", "reasoning_content": 5}]`, "messages.reasoning_content", `"messages.reasoning_content" must be a string, got a number`},
	} {
		body := `{"model": "qwen3", "messages": [{"role": "user", "content": "Hi"}], ` + c.body + `}`
		if strings.HasPrefix(c.body, `"messages"`) {
			body = `{"model": "qwen3", ` + c.body + `}`
		}
		resp, b := do(t, http.MethodPost, url, body, "Content-Type", "application/json")
		e := checkErrorShape(t, c.body, resp, b, http.StatusBadRequest, c.want)
		if param, _ := e["param"].(string); param != c.param {
			t.Errorf("%s: param %q, want %q", c.body, param, c.param)
		}
	}
}
