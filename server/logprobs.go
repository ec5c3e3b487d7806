package server

import (
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/tokenizer"
)

// logprobWriter turns the engine's token logprobs into the API's shapes,
// chunk after chunk of one choice:
//
// The legacy completions API (choices[i].logprobs):
//
//	{"tokens": ["Once", " upon"], "token_logprobs": [null, -3.1],
//	 "top_logprobs": [null, {" upon": -3.1, " a": -2.2}], "text_offset": [0, 4]}
//
// one entry per token, the prompt's first (with echo; the first prompt
// token has nothing before it: null), then the generated ones and the
// end-of-sequence token if one ended the generation; top_logprobs maps
// the most likely tokens' text, and the chosen token's, to their
// logprobs; text_offset is each token's offset in characters in the
// prompt followed by the completion (without echo the first generated
// token's offset is the prompt's length, as OpenAI counts).
//
// The chat API (choices[i].logprobs):
//
//	{"content": [{"token": " upon", "logprob": -3.1, "bytes": [32, …],
//	  "top_logprobs": [{"token": …, "logprob": …, "bytes": […]}]}], "refusal": null}
//
// for the generated tokens (the end-of-turn token has no text and is left
// out).
type logprobWriter struct {
	tok    *tokenizer.Tokenizer
	stop   []int
	chat   bool
	prompt []int
	echo   bool
	stream *tokenizer.Stream // the text so far, for offsets
	offset int               // characters so far
}

func newLogprobWriter(e *engine.Engine, pr prompt, echo, chat bool) *logprobWriter {
	w := &logprobWriter{tok: e.Tokenizer, stop: e.Stop, chat: chat, prompt: pr.ids, echo: echo}
	if !chat {
		w.stream = e.Tokenizer.NewStream()
		if !echo { // offsets count the prompt all the same
			for _, id := range pr.ids {
				w.advance(id)
			}
		}
	}
	return w
}

// advance adds a token to the text and returns its offset.
func (w *logprobWriter) advance(id int) int {
	at := w.offset
	w.offset += utf8.RuneCountInString(w.stream.Add(id))
	return at
}

// completionToken is a token's text as the legacy API shows it: its
// bytes when they are valid UTF-8, else "bytes:" and \xNN escapes (a
// byte-level token can hold part of a character).
func (w *logprobWriter) completionToken(id int) string {
	s := w.tok.Decode([]int{id}, false)
	if utf8.ValidString(s) {
		return s
	}
	var b strings.Builder
	b.WriteString("bytes:")
	for i := 0; i < len(s); i++ {
		fmt.Fprintf(&b, "\\x%02x", s[i])
	}
	return b.String()
}

// chatToken is a token as the chat API shows it: its text (invalid bytes
// replaced) and its exact bytes.
func (w *logprobWriter) chatToken(id int, lp float64) map[string]any {
	s := w.tok.Decode([]int{id}, false)
	bytes := make([]int, len(s)) // a list of integers, not base64
	for i := range len(s) {
		bytes[i] = int(s[i])
	}
	return map[string]any{"token": strings.ToValidUTF8(s, "\uFFFD"), "logprob": lp, "bytes": bytes}
}

// add returns the logprobs object of the next chunk: the prompt's tokens
// (when prompt is not nil, with echo) and then the generated tokens.
func (w *logprobWriter) add(prompt, generated []engine.TokenLogprob) map[string]any {
	if w.chat {
		content := []any{}
		for _, t := range generated {
			if slices.Contains(w.stop, t.ID) {
				continue
			}
			c := w.chatToken(t.ID, t.Logprob)
			top := make([]any, len(t.Top))
			for i, a := range t.Top {
				top[i] = w.chatToken(a.ID, a.Logprob)
			}
			c["top_logprobs"] = top
			content = append(content, c)
		}
		return map[string]any{"content": content, "refusal": nil}
	}
	tokens, lps, tops, offsets := []string{}, []any{}, []any{}, []int{}
	entry := func(id int, lp any, top any) {
		tokens = append(tokens, w.completionToken(id))
		lps = append(lps, lp)
		tops = append(tops, top)
		offsets = append(offsets, w.advance(id))
	}
	topMap := func(t engine.TokenLogprob) map[string]float64 {
		m := map[string]float64{}
		for _, a := range append([]llm.Logprob{{ID: t.ID, Logprob: t.Logprob}}, t.Top...) {
			k := w.completionToken(a.ID)
			if v, ok := m[k]; !ok || a.Logprob > v { // two ids can share a text
				m[k] = a.Logprob
			}
		}
		return m
	}
	if w.echo && prompt != nil {
		for i, id := range w.prompt {
			if i == 0 {
				entry(id, nil, nil)
				continue
			}
			t := prompt[i-1]
			entry(id, t.Logprob, topMap(t))
		}
	}
	for _, t := range generated {
		entry(t.ID, t.Logprob, topMap(t))
	}
	return map[string]any{"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
}
