package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
)

// bpe is the byte-pair-encoding model: a vocabulary and ranked merges.
type bpe struct {
	vocab        map[string]int
	tokens       []string // id → token
	ranks        map[[2]string]int
	byteFallback bool
	ignoreMerges bool // a piece that is itself in the vocabulary skips merging (Llama-3)
	unk          int  // -1 when there is no unknown token
	cache        sync.Map
}

func parseBPE(raw json.RawMessage) (*bpe, error) {
	var m struct {
		Type         string          `json:"type"`
		Vocab        map[string]int  `json:"vocab"`
		Merges       json.RawMessage `json:"merges"`
		UnkToken     *string         `json:"unk_token"`
		ByteFallback bool            `json:"byte_fallback"`
		IgnoreMerges bool            `json:"ignore_merges"`
		ContPrefix   *string         `json:"continuing_subword_prefix"`
		EndSuffix    *string         `json:"end_of_word_suffix"`
	}
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, err
	}
	if m.Type != "BPE" && m.Type != "" {
		return nil, fmt.Errorf("unsupported tokenizer model type %q: llmq reads BPE tokenizers (Llama, Mistral, Qwen2)", m.Type)
	}
	if len(m.Vocab) == 0 {
		return nil, fmt.Errorf("empty vocab")
	}
	if (m.ContPrefix != nil && *m.ContPrefix != "") || (m.EndSuffix != nil && *m.EndSuffix != "") {
		return nil, fmt.Errorf("BPE with continuing_subword_prefix or end_of_word_suffix is not supported")
	}
	b := &bpe{vocab: m.Vocab, ranks: map[[2]string]int{}, byteFallback: m.ByteFallback, ignoreMerges: m.IgnoreMerges, unk: -1}
	for tok, id := range m.Vocab {
		if id < 0 {
			return nil, fmt.Errorf("token %q has negative id %d", tok, id)
		}
		b.setToken(tok, id)
	}
	merges, err := parseMerges(m.Merges)
	if err != nil {
		return nil, err
	}
	for i, pair := range merges {
		if _, dup := b.ranks[pair]; !dup {
			b.ranks[pair] = i
		}
	}
	if m.UnkToken != nil {
		id, ok := m.Vocab[*m.UnkToken]
		if !ok {
			return nil, fmt.Errorf("unk_token %q is not in the vocab", *m.UnkToken)
		}
		b.unk = id
	}
	return b, nil
}

// parseMerges accepts both spellings: ["a b", ...] and [["a","b"], ...].
func parseMerges(raw json.RawMessage) ([][2]string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var asStrings []string
	if err := json.Unmarshal(raw, &asStrings); err == nil {
		out := make([][2]string, len(asStrings))
		for i, s := range asStrings {
			a, b, ok := strings.Cut(s, " ")
			if !ok {
				return nil, fmt.Errorf("merge %d %q is not two space-separated tokens", i, s)
			}
			out[i] = [2]string{a, b}
		}
		return out, nil
	}
	var asPairs [][]string
	if err := json.Unmarshal(raw, &asPairs); err != nil {
		return nil, fmt.Errorf("merges: want strings or pairs: %w", err)
	}
	out := make([][2]string, len(asPairs))
	for i, p := range asPairs {
		if len(p) != 2 {
			return nil, fmt.Errorf("merge %d has %d parts, want 2", i, len(p))
		}
		out[i] = [2]string{p[0], p[1]}
	}
	return out, nil
}

func (b *bpe) setToken(tok string, id int) {
	for len(b.tokens) <= id {
		b.tokens = append(b.tokens, "")
	}
	b.tokens[id] = tok
}

func (b *bpe) addToken(tok string, id int) {
	b.vocab[tok] = id
	b.setToken(tok, id)
}

func (b *bpe) size() int { return len(b.tokens) }

// encodeWord appends the ids of one pre-tokenized piece.
func (b *bpe) encodeWord(ids []int, word string) []int {
	if cached, ok := b.cache.Load(word); ok {
		return append(ids, cached.([]int)...)
	}
	out := b.merge(word)
	b.cache.Store(word, out)
	return append(ids, out...)
}

// merge runs BPE on one piece: start from its characters and repeatedly
// merge the adjacent pair of lowest rank (leftmost on ties).
func (b *bpe) merge(word string) []int {
	if b.ignoreMerges {
		if id, ok := b.vocab[word]; ok {
			return []int{id}
		}
	}
	syms := make([]string, 0, len(word))
	for _, r := range word {
		syms = append(syms, string(r))
	}
	for len(syms) > 1 {
		best, bestRank := -1, int(^uint(0)>>1)
		for i := 0; i+1 < len(syms); i++ {
			if r, ok := b.ranks[[2]string{syms[i], syms[i+1]}]; ok && r < bestRank {
				best, bestRank = i, r
			}
		}
		if best < 0 {
			break
		}
		syms[best] += syms[best+1]
		syms = append(syms[:best+1], syms[best+2:]...)
	}
	out := make([]int, 0, len(syms))
	for _, s := range syms {
		if id, ok := b.vocab[s]; ok {
			out = append(out, id)
			continue
		}
		if b.byteFallback {
			if ids, ok := b.byteTokens(s); ok {
				out = append(out, ids...)
				continue
			}
		}
		if b.unk >= 0 {
			out = append(out, b.unk)
		}
	}
	return out
}

// byteTokens spells s as <0xXX> tokens, if the vocabulary has them all.
func (b *bpe) byteTokens(s string) ([]int, bool) {
	out := make([]int, 0, len(s))
	for i := 0; i < len(s); i++ {
		id, ok := b.vocab[fmt.Sprintf("<0x%02X>", s[i])]
		if !ok {
			return nil, false
		}
		out = append(out, id)
	}
	return out, true
}
