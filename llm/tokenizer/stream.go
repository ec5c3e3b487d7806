package tokenizer

import (
	"strings"
	"unicode/utf8"
)

// Stream turns generated ids into text incrementally. A token can end in
// the middle of a UTF-8 character (byte-level BPE splits characters), so
// Stream holds back an incomplete trailing character until the tokens that
// complete it arrive.
type Stream struct {
	t       *Tokenizer
	ids     []int
	printed int // bytes of the decoded text already returned
}

// NewStream starts an empty stream.
func (t *Tokenizer) NewStream() *Stream { return &Stream{t: t} }

// Add appends a token and returns the text that is now complete.
func (s *Stream) Add(id int) string {
	s.ids = append(s.ids, id)
	text := s.t.Decode(s.ids, true)
	end := len(text)
	// hold back an incomplete final character
	for i := 1; i <= utf8.UTFMax && i <= end-s.printed; i++ {
		if utf8.RuneStart(text[end-i]) {
			if !utf8.FullRuneInString(text[end-i:]) {
				end -= i
			}
			break
		}
	}
	if end <= s.printed {
		return ""
	}
	out := text[s.printed:end]
	s.printed = end
	return out
}

// Flush returns whatever is held back, with invalid bytes replaced.
func (s *Stream) Flush() string {
	text := s.t.Decode(s.ids, true)
	if s.printed >= len(text) {
		return ""
	}
	out := strings.ToValidUTF8(text[s.printed:], "\uFFFD")
	s.printed = len(text)
	return out
}
