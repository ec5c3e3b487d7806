package tokenizer

import (
	"strings"
	"unicode/utf8"
)

// Stream turns generated ids into text incrementally. A token can end in
// the middle of a UTF-8 character (byte-level BPE splits characters), so
// Stream holds back an incomplete trailing character until the tokens that
// complete it arrive.
//
// Each step decodes only a short window: the tokens since the last emitted
// text (ids[read:]) together with the ones emitted just before them
// (ids[prefix:read]), whose text is known; the new text is the difference.
// Decoding the window rather than one token keeps decoders that depend on
// their neighbours (SentencePiece's leading-space rule, byte fallback) right,
// and keeps a long generation linear in its length.
type Stream struct {
	t            *Tokenizer
	ids          []int
	prefix, read int
}

// NewStream starts an empty stream.
func (t *Tokenizer) NewStream() *Stream { return &Stream{t: t} }

// pending returns the text of ids[read:], given the window's known prefix.
func (s *Stream) pending() string {
	known := s.t.Decode(s.ids[s.prefix:s.read], true)
	text := s.t.Decode(s.ids[s.prefix:], true)
	if len(text) < len(known) || !strings.HasPrefix(text, known) {
		return ""
	}
	return text[len(known):]
}

// Add appends a token and returns the text that is now complete.
func (s *Stream) Add(id int) string {
	s.ids = append(s.ids, id)
	out := s.pending()
	if out == "" || incompleteTail(out) {
		return ""
	}
	s.prefix, s.read = s.read, len(s.ids)
	return out
}

// incompleteTail reports whether s ends inside a multi-byte character.
func incompleteTail(s string) bool {
	for i := 1; i <= utf8.UTFMax && i <= len(s); i++ {
		if utf8.RuneStart(s[len(s)-i]) {
			return !utf8.FullRuneInString(s[len(s)-i:])
		}
	}
	return false
}

// Flush returns whatever is held back, with invalid bytes replaced.
func (s *Stream) Flush() string {
	out := strings.ToValidUTF8(s.pending(), "\uFFFD")
	s.prefix, s.read = s.read, len(s.ids)
	return out
}
