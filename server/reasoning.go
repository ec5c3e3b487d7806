package server

import (
	"strings"
	"unicode"

	"github.com/llmq/llmq/llm/chat"
)

// Thinking models (Qwen3, QwQ, DeepSeek-R1) write their reasoning in a
// think block before the answer proper:
//
//	<think>
//	The user greets me.
//	</think>
//
//	Hello!
//
// As vLLM's reasoning parsers do, the chat route returns the block's text
// as the message's reasoning_content and what follows as its content
// ("The user greets me." and "Hello!"), whole or streamed.

// The tags around a think block.
const (
	thinkOpen  = "<think>"
	thinkClose = "</think>"
)

// splitState is where a chat answer stands in its split into
// reasoning_content and content; thinkingOf gives where it starts.
type splitState int

const (
	// noSplit: the answer is content, as generated. The model's chat
	// template writes no think blocks (it never mentions </think>), or
	// its generation prompt closed one already: Qwen3's template with
	// chat_template_kwargs {"enable_thinking": false} ends the prompt in
	// an empty "<think>\n\n</think>\n\n", and the model answers without
	// tags.
	noSplit splitState = iota
	// atStart: the generation prompt leaves thinking to the model
	// (Qwen3's template by default). An answer that opens with <think> is
	// split; one that does not is all content.
	atStart
	// inReasoning: in the think block, until </think> — from the start
	// when the generation prompt opened it (it ends in "<think>\n", as
	// QwQ's and DeepSeek-R1's templates do).
	inReasoning
	// inContent: after the think block, or in an answer without one.
	inContent
)

// thinkingOf reads how a chat's answer will be split from the model's
// chat template and the prompt it rendered: from whether the template
// writes think blocks at all, and how the prompt ends.
func thinkingOf(tmpl *chat.Template, prompt string) splitState {
	end := strings.TrimRightFunc(prompt, unicode.IsSpace)
	switch {
	case !strings.Contains(tmpl.Source, thinkClose), strings.HasSuffix(end, thinkClose):
		return noSplit
	case strings.HasSuffix(end, thinkOpen):
		return inReasoning
	}
	return atStart
}

// reasoningSplitter splits an answer, chunk by chunk as it streams, into
// reasoning (the think block's text, without its tags and the whitespace
// around it) and content (what follows </think>, its leading whitespace
// dropped). The tags are never returned: text that may be the start of
// one (a tag can arrive split across chunks), and whitespace that may end
// the reasoning, is held until later text or the answer's end decides. An
// answer whose think block never closes (max_tokens reached while
// thinking) is all reasoning.
type reasoningSplitter struct {
	state splitState
	held  string // text received and not yet returned
	begun bool   // the current part has returned text: its whitespace is no longer leading
}

// newReasoningSplitter returns the splitter of an answer that starts in
// state start, or nil when the answer is not to be split (noSplit).
func newReasoningSplitter(start splitState) *reasoningSplitter {
	if start == noSplit {
		return nil
	}
	return &reasoningSplitter{state: start}
}

// add takes the answer's next text and returns what is now known to be
// reasoning and content, of it and of the text held before it.
func (s *reasoningSplitter) add(text string) (reasoning, content string) {
	s.held += text
	if s.state == atStart {
		rest := strings.TrimLeftFunc(s.held, unicode.IsSpace)
		if len(rest) < len(thinkOpen) && strings.HasPrefix(thinkOpen, rest) {
			return "", "" // nothing yet, or "<", "<th"…: the tag may be arriving
		}
		if after, ok := strings.CutPrefix(rest, thinkOpen); ok {
			s.state, s.held = inReasoning, after
		} else { // no think block: all content, as generated
			s.state, s.begun = inContent, true
		}
	}
	if s.state == inReasoning {
		before, after, closed := strings.Cut(s.held, thinkClose)
		if !closed {
			return s.take(settled(s.held)), ""
		}
		s.held = strings.TrimRightFunc(before, unicode.IsSpace)
		reasoning = s.take(len(s.held))
		s.state, s.held, s.begun = inContent, after, false
	}
	return reasoning, s.take(len(s.held))
}

// flush returns what is still held when the answer ends: the rest of a
// think block that never closed is reasoning; an answer too short to
// tell whether it opened one (atStart: "", "<th") is content.
func (s *reasoningSplitter) flush() (reasoning, content string) {
	switch s.state {
	case inReasoning:
		s.held = strings.TrimRightFunc(s.held, unicode.IsSpace)
		return s.take(len(s.held)), ""
	case atStart:
		s.state, s.begun = inContent, true
	}
	return "", s.take(len(s.held))
}

// whole splits a whole answer: what the chunks of the same answer,
// streamed through add and flush, add up to.
func (s *reasoningSplitter) whole(text string) (reasoning, content string) {
	r, c := s.add(text)
	fr, fc := s.flush()
	return r + fr, c + fc
}

// take returns the first n bytes held, less leading whitespace while the
// current part has returned nothing, and holds on to the rest.
func (s *reasoningSplitter) take(n int) string {
	out := s.held[:n]
	s.held = s.held[n:]
	if !s.begun {
		out = strings.TrimLeftFunc(out, unicode.IsSpace)
		s.begun = out != ""
	}
	return out
}

// settled is how much of the reasoning held can be returned before
// </think> is seen: all but an end that may be the tag's start, and the
// whitespace before that end (dropped should the tag follow).
func settled(held string) int {
	n := len(held)
	for k := min(len(thinkClose)-1, n); k > 0; k-- {
		if strings.HasSuffix(held, thinkClose[:k]) {
			n -= k
			break
		}
	}
	return len(strings.TrimRightFunc(held[:n], unicode.IsSpace))
}
