package tokenizer

import (
	"container/list"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"unicode/utf8"
)

// bpe is the byte-pair-encoding model: a vocabulary and ranked merges.
type bpe struct {
	vocab        map[string]int
	tokens       []string // id → token
	ranks        map[[2]string]int
	byteFallback bool
	ignoreMerges bool // a piece that is itself in the vocabulary skips merging (Llama-3)
	unk          int  // -1 when there is no unknown token
	cache        *lru // pieces already merged
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
	b := &bpe{vocab: m.Vocab, ranks: map[[2]string]int{}, byteFallback: m.ByteFallback, ignoreMerges: m.IgnoreMerges, unk: -1, cache: newLRU(cacheEntries)}
	for tok, id := range m.Vocab {
		if err := checkID("token", tok, id, len(m.Vocab)); err != nil {
			return nil, err
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

// maxIDGap is how far past the count of a file's tokens their ids may
// reach. The table of tokens by id is dense, so an id bounds its size: a
// few bytes of JSON must not ask for gigabytes. Published vocabularies
// are dense or nearly (Qwen2's added tokens follow its 151,643 directly).
const maxIDGap = 1 << 16

// checkID refuses an id below 0 or at count + maxIDGap or past it (count:
// the tokens the file defines so far).
func checkID(what, tok string, id, count int) error {
	if id < 0 || id >= count+maxIDGap {
		return fmt.Errorf("%s %q has id %d; want 0 ≤ id < %d (the %d tokens defined, plus %d)", what, tok, id,
			count+maxIDGap, count, maxIDGap)
	}
	return nil
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

// encodeWord appends the ids of one pre-tokenized piece. Short pieces
// (most words) are remembered in a bounded LRU cache; long ones are rare
// and would only crowd it.
func (b *bpe) encodeWord(ids []int, word string) []int {
	if len(word) > cacheMaxWordBytes {
		return append(ids, b.merge(word)...)
	}
	if cached, ok := b.cache.get(word); ok {
		return append(ids, cached...)
	}
	out := b.merge(word)
	b.cache.put(word, out)
	return append(ids, out...)
}

// merge runs BPE on one piece: start from its characters and repeatedly
// merge the adjacent pair of lowest rank (leftmost on ties).
//
// It takes O(n log n) for n characters, as the fast tokenizers do: the
// symbols are a linked list over the piece's bytes (a symbol is always a
// contiguous substring, word[start:end], so merging allocates nothing),
// and the mergeable adjacent pairs wait in a min-heap keyed by (rank,
// position of the left symbol). A merge changes only the pairs on either
// side of it, which are pushed anew; entries made stale by earlier merges
// are dropped when popped (pairRank no longer holds their rank: a rank
// names one pair of strings, so a pair at the same position with the same
// rank is the same pair). Popping the least (rank, position) among the
// live pairs is exactly the naive rule "lowest rank, leftmost on ties", so
// the output is the same.
func (b *bpe) merge(word string) []int {
	if b.ignoreMerges {
		if id, ok := b.vocab[word]; ok {
			return []int{id}
		}
	}
	if !utf8.ValidString(word) {
		// Each invalid byte is its own character U+FFFD, as ranging over
		// the string yields it.
		word = string([]rune(word))
	}
	n := int32(len(word))
	// For the symbol starting at byte s: end[s] is its end (-1 when no
	// symbol starts there), prev[s] the start of the symbol before it, and
	// pairRank[s] the merge rank of it and the next symbol (-1: none).
	end := make([]int32, 3*n)
	prev, pairRank := end[n:2*n], end[2*n:]
	for i := range end[:n] {
		end[i] = -1
	}
	last := int32(-1)
	for i, r := range word {
		end[i] = int32(i + utf8.RuneLen(r))
		prev[i] = last
		last = int32(i)
	}
	h := make(pairHeap, 0, n)
	push := func(left int32) {
		pairRank[left] = -1
		mid := end[left]
		if mid >= n {
			return
		}
		if r, ok := b.ranks[[2]string{word[left:mid], word[mid:end[mid]]}]; ok {
			pairRank[left] = int32(r)
			h.push(uint64(r)<<32 | uint64(left))
		}
	}
	for i := int32(0); i < n; i = end[i] {
		push(i)
	}
	for len(h) > 0 {
		key := h.pop()
		left, rank := int32(uint32(key)), int32(key>>32)
		if end[left] < 0 || pairRank[left] != rank {
			continue // stale: a side of this pair was merged since
		}
		mid := end[left]
		right := end[mid]
		end[left], end[mid] = right, -1
		if right < n {
			prev[right] = left
		}
		if q := prev[left]; q >= 0 {
			push(q)
		}
		push(left)
	}
	out := make([]int, 0, 8)
	for i := int32(0); i < n; i = end[i] {
		s := word[i:end[i]]
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

// pairHeap is a 4-ary min-heap of pairs, each keyed rank<<32 | position
// (ranks and positions are below 2³¹), so that one comparison orders by
// rank, then position.
type pairHeap []uint64

func (h *pairHeap) push(k uint64) {
	s := append(*h, k)
	i := len(s) - 1
	for i > 0 {
		p := (i - 1) / 4
		if s[p] <= k {
			break
		}
		s[i] = s[p]
		i = p
	}
	s[i] = k
	*h = s
}

func (h *pairHeap) pop() uint64 {
	s := *h
	top := s[0]
	k := s[len(s)-1]
	s = s[:len(s)-1]
	*h = s
	if len(s) == 0 {
		return top
	}
	i := 0
	for {
		c := 4*i + 1
		if c >= len(s) {
			break
		}
		m := c
		for j := c + 1; j < c+4 && j < len(s); j++ {
			if s[j] < s[m] {
				m = j
			}
		}
		if s[m] >= k {
			break
		}
		s[i] = s[m]
		i = m
	}
	s[i] = k
	return top
}

// cacheMaxWordBytes: longer pieces are not cached. cacheEntries bounds
// the cache: at most this many pieces of at most that many bytes.
const (
	cacheMaxWordBytes = 64
	cacheEntries      = 1 << 14
)

// lru is a fixed-size least-recently-used cache of pieces' ids, safe for
// concurrent use.
type lru struct {
	mu      sync.Mutex
	entries map[string]*list.Element
	order   list.List // front: most recently used
	max     int
}

type lruEntry struct {
	word string
	ids  []int
}

func newLRU(max int) *lru { return &lru{entries: map[string]*list.Element{}, max: max} }

func (c *lru) get(word string) ([]int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.entries[word]
	if !ok {
		return nil, false
	}
	c.order.MoveToFront(el)
	return el.Value.(*lruEntry).ids, true
}

func (c *lru) put(word string, ids []int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.entries[word]; ok {
		c.order.MoveToFront(el)
		return
	}
	if c.order.Len() >= c.max {
		old := c.order.Back()
		c.order.Remove(old)
		delete(c.entries, old.Value.(*lruEntry).word)
	}
	word = strings.Clone(word) // not a slice of a caller's (maybe large) text
	c.entries[word] = c.order.PushFront(&lruEntry{word: word, ids: ids})
}

func (c *lru) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.order.Len()
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
