// Package tokenizer reads Hugging Face tokenizer.json files and encodes and
// decodes text exactly as the Rust `tokenizers` library does, for the BPE
// tokenizers of the Llama family:
//
//   - byte-level BPE (GPT-2, Llama-3, Qwen2): text is split by a regex
//     pre-tokenizer (the GPT-2 pattern, or a Split with the Llama-3/Qwen2
//     pattern, which needs lookahead: Go's regexp lacks it, so we use
//     dlclark/regexp2), each piece's UTF-8 bytes are mapped to printable
//     characters (the GPT-2 byte↔unicode table), then merged by BPE;
//   - SentencePiece-style BPE (Llama-2, Mistral): spaces become "▁" (by a
//     Metaspace pre-tokenizer or Prepend/Replace normalizers), BPE runs over
//     characters, and characters missing from the vocabulary fall back to
//     <0xXX> byte tokens (byte_fallback).
//
// Encoding follows the library's pipeline: added tokens are split out first,
// the rest is normalized, pre-tokenized into pieces and each piece is merged
// by BPE (lowest merge rank first, leftmost on ties); the post-processor
// then adds special tokens such as BOS.
package tokenizer

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"unicode/utf8"
)

// Tokenizer encodes text to token ids and back.
type Tokenizer struct {
	bpe        *bpe
	normalizer normalizer
	pre        preTokenizer
	decoder    decoder
	added      []addedToken // longest content first, for splitting
	addedFirst [256]bool    // first bytes of added tokens
	addedByID  map[int]addedToken
	prefix     []int // ids the post-processor puts before a single sequence
	suffix     []int // ... and after it
}

type addedToken struct {
	ID      int    `json:"id"`
	Content string `json:"content"`
	Special bool   `json:"special"`
}

type fileJSON struct {
	AddedTokens   []addedToken    `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         json.RawMessage `json:"model"`
}

// Load reads a tokenizer.json file.
func Load(path string) (*Tokenizer, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading tokenizer: %w", err)
	}
	t, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

// Parse builds a tokenizer from the bytes of a tokenizer.json.
func Parse(data []byte) (*Tokenizer, error) {
	var f fileJSON
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("invalid JSON: %w", err)
	}
	if len(f.Model) == 0 {
		return nil, fmt.Errorf("no \"model\" section")
	}
	m, err := parseBPE(f.Model)
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	t := &Tokenizer{bpe: m, addedByID: map[int]addedToken{}}
	if t.normalizer, err = parseNormalizer(f.Normalizer); err != nil {
		return nil, fmt.Errorf("normalizer: %w", err)
	}
	if t.pre, err = parsePreTokenizer(f.PreTokenizer); err != nil {
		return nil, fmt.Errorf("pre_tokenizer: %w", err)
	}
	if t.decoder, err = parseDecoder(f.Decoder); err != nil {
		return nil, fmt.Errorf("decoder: %w", err)
	}
	for _, a := range f.AddedTokens {
		if a.Content == "" {
			return nil, fmt.Errorf("added token %d has empty content", a.ID)
		}
		if err := checkID("added token", a.Content, a.ID, len(m.vocab)+len(f.AddedTokens)); err != nil {
			return nil, err
		}
		t.added = append(t.added, a)
		t.addedFirst[a.Content[0]] = true
		t.addedByID[a.ID] = a
		m.addToken(a.Content, a.ID)
	}
	sort.SliceStable(t.added, func(i, j int) bool { return len(t.added[i].Content) > len(t.added[j].Content) })
	if err := t.parsePostProcessor(f.PostProcessor); err != nil {
		return nil, fmt.Errorf("post_processor: %w", err)
	}
	return t, nil
}

// VocabSize is one past the largest token id.
func (t *Tokenizer) VocabSize() int { return t.bpe.size() }

// MaxTokenBytes bounds the text one token stands for: the longest token
// string in bytes (a token's string is never shorter than the text it
// encodes: byte-level and "▁" spellings only lengthen it), and at least
// utf8.UTFMax (an unknown character is one token). A text of n bytes
// therefore needs at least n/MaxTokenBytes tokens, barring a normalizer
// that shortens it.
func (t *Tokenizer) MaxTokenBytes() int {
	n := utf8.UTFMax
	for _, tok := range t.bpe.tokens {
		n = max(n, len(tok))
	}
	return n
}

// TokenID returns the id of a token string (e.g. "<|eot_id|>").
func (t *Tokenizer) TokenID(tok string) (int, bool) {
	id, ok := t.bpe.vocab[tok]
	return id, ok
}

// Token returns the string of a token id ("" when out of range).
func (t *Tokenizer) Token(id int) string {
	if id < 0 || id >= len(t.bpe.tokens) {
		return ""
	}
	return t.bpe.tokens[id]
}

// IsSpecial reports whether id is an added special token.
func (t *Tokenizer) IsSpecial(id int) bool { return t.addedByID[id].Special }

// Encode tokenizes text. With addSpecial the post-processor's tokens (BOS
// for Llama) are added, as `tokenizer(text)` does in transformers.
func (t *Tokenizer) Encode(text string, addSpecial bool) []int {
	var ids []int
	if addSpecial {
		ids = append(ids, t.prefix...)
	}
	for _, seg := range t.splitAdded(text) {
		if seg.id >= 0 {
			ids = append(ids, seg.id)
			continue
		}
		s := seg.text
		if t.normalizer != nil {
			s = t.normalizer.normalize(s)
		}
		pieces := []string{s}
		if t.pre != nil {
			pieces = t.pre.split(pieces)
		}
		for _, p := range pieces {
			if p != "" {
				ids = t.bpe.encodeWord(ids, p)
			}
		}
	}
	if addSpecial {
		ids = append(ids, t.suffix...)
	}
	return ids
}

type segment struct {
	text string
	id   int // ≥ 0 for an added token
}

// splitAdded cuts out added tokens, longest match first at each position.
func (t *Tokenizer) splitAdded(text string) []segment {
	var out []segment
	start := 0
	for i := 0; i < len(text); {
		a, ok := t.addedAt(text[i:])
		if !ok {
			_, w := utf8.DecodeRuneInString(text[i:])
			i += w
			continue
		}
		if start < i {
			out = append(out, segment{text[start:i], -1})
		}
		out = append(out, segment{a.Content, a.ID})
		i += len(a.Content)
		start = i
	}
	if start < len(text) {
		out = append(out, segment{text[start:], -1})
	}
	return out
}

// addedAt returns the longest added token that s starts with.
func (t *Tokenizer) addedAt(s string) (addedToken, bool) {
	if !t.addedFirst[s[0]] {
		return addedToken{}, false
	}
	for _, a := range t.added {
		if strings.HasPrefix(s, a.Content) {
			return a, true
		}
	}
	return addedToken{}, false
}

// Decode turns ids back into text; with skipSpecial, special tokens are
// dropped (as transformers' skip_special_tokens=True).
func (t *Tokenizer) Decode(ids []int, skipSpecial bool) string {
	toks := make([]string, 0, len(ids))
	var b strings.Builder
	flush := func() {
		if len(toks) == 0 {
			return
		}
		if t.decoder != nil {
			toks = t.decoder.decode(toks)
		}
		for _, s := range toks {
			b.WriteString(s)
		}
		toks = toks[:0]
	}
	for _, id := range ids {
		if a, ok := t.addedByID[id]; ok {
			if skipSpecial && a.Special {
				continue
			}
			flush()
			b.WriteString(a.Content)
			continue
		}
		toks = append(toks, t.Token(id))
	}
	flush()
	return b.String()
}

func (t *Tokenizer) parsePostProcessor(raw json.RawMessage) error {
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	var p struct {
		Type       string            `json:"type"`
		Processors []json.RawMessage `json:"processors"`
		Single     []struct {
			SpecialToken *struct {
				ID string `json:"id"`
			} `json:"SpecialToken"`
			Sequence *struct {
				ID string `json:"id"`
			} `json:"Sequence"`
		} `json:"single"`
		SpecialTokens map[string]struct {
			IDs []int `json:"ids"`
		} `json:"special_tokens"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return err
	}
	switch p.Type {
	case "Sequence":
		for _, sub := range p.Processors {
			if err := t.parsePostProcessor(sub); err != nil {
				return err
			}
		}
	case "ByteLevel":
		// Only adjusts offsets; ids are unchanged.
	case "TemplateProcessing":
		seen := false
		for _, piece := range p.Single {
			switch {
			case piece.Sequence != nil:
				seen = true
			case piece.SpecialToken != nil:
				st, ok := p.SpecialTokens[piece.SpecialToken.ID]
				if !ok {
					return fmt.Errorf("template names special token %q that special_tokens lacks", piece.SpecialToken.ID)
				}
				if seen {
					t.suffix = append(t.suffix, st.IDs...)
				} else {
					t.prefix = append(t.prefix, st.IDs...)
				}
			}
		}
	default:
		return fmt.Errorf("unsupported post-processor type %q", p.Type)
	}
	return nil
}
