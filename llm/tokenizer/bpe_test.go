package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/llmq/llmq/internal/shared"
)

// naiveMerge is the textbook BPE loop, kept as the reference the heap
// version is checked against: scan all adjacent pairs, merge the one of
// lowest rank (leftmost on ties), repeat. O(n²) per piece.
func naiveMerge(b *bpe, word string) []string {
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
	return syms
}

// naiveIDs maps the naive symbols to ids the way merge does.
func naiveIDs(b *bpe, word string) []int {
	var out []int
	for _, s := range naiveMerge(b, word) {
		if id, ok := b.vocab[s]; ok {
			out = append(out, id)
		} else if ids, ok := b.byteTokens(s); b.byteFallback && ok {
			out = append(out, ids...)
		} else if b.unk >= 0 {
			out = append(out, b.unk)
		}
	}
	return out
}

// TestMergeMatchesNaive: the heap merge gives the naive loop's ids on
// every WikiText piece, on long single pieces (where stale heap entries
// and ties between equal pairs abound), on random strings over the
// alphabet of the merges, and on invalid UTF-8.
func TestMergeMatchesNaive(t *testing.T) {
	tk := load(t, "models/llama-tiny/tokenizer.json")
	b := tk.bpe
	text, err := os.ReadFile(shared.Path(t, "data/wikitext2/wiki.test.raw"))
	if err != nil {
		t.Fatal(err)
	}
	var words []string
	seen := map[string]bool{}
	for _, p := range tk.pre.split([]string{string(text[:300000])}) {
		if !seen[p] {
			seen[p] = true
			words = append(words, p)
		}
	}
	letters := strings.Map(func(r rune) rune {
		if unicode.IsLetter(r) {
			return r
		}
		return -1
	}, string(text[:4000]))
	words = append(words, tk.pre.split([]string{letters})...)
	words = append(words, strings.Repeat("a", 1001), strings.Repeat("ab", 700), strings.Repeat("Ġthe", 300), "\xff\xfeab\xc3", "é\x80é")
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []rune("ĠtheanoisrlTHdc.,")
	for range 2000 {
		w := make([]rune, 1+rng.IntN(40))
		for i := range w {
			w[i] = alphabet[rng.IntN(len(alphabet))]
		}
		words = append(words, string(w))
	}
	for _, w := range words {
		if got, want := b.merge(w), naiveIDs(b, w); !reflect.DeepEqual(got, want) {
			t.Fatalf("%.60q: heap merge %v, naive %v", w, got, want)
		}
	}
	// SentencePiece-style, with byte fallback and unknown characters.
	sp, err := Parse([]byte(spTokenizer))
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"▁hi▁te▁é", strings.Repeat("▁h", 50) + "i", "xyz▁hi"} {
		if got, want := sp.bpe.merge(w), naiveIDs(sp.bpe, w); !reflect.DeepEqual(got, want) {
			t.Fatalf("%q: heap merge %v, naive %v", w, got, want)
		}
	}
}

// TestLongPieceIsFast: one 200,000-character piece (no pre-tokenizer
// split) encodes in well under a second on one core; the quadratic loop
// took 59 s for 32,000 characters. The bound is loose (20 s) so that a
// loaded machine cannot fail it, yet quadratic time would take hours.
func TestLongPieceIsFast(t *testing.T) {
	tk := load(t, "models/llama-tiny/tokenizer.json")
	word := longWord(t, 200_000)
	start := time.Now()
	ids := tk.Encode(word, false)
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("a %d-character piece took %v to encode", len(word), d)
	}
	if got := tk.Decode(ids, false); got != word {
		t.Fatal("decode(encode(word)) differs from the word")
	}
}

// TestCacheIsBounded: encoding many distinct pieces leaves at most
// cacheEntries of them in the cache, and long pieces are never cached.
func TestCacheIsBounded(t *testing.T) {
	tk := load(t, "models/llama-tiny/tokenizer.json")
	var sb strings.Builder
	for i := range cacheEntries + 5000 {
		fmt.Fprintf(&sb, " w%x", i)
	}
	tk.Encode(sb.String(), false)
	if n := tk.bpe.cache.len(); n > cacheEntries {
		t.Errorf("cache holds %d pieces, bound %d", n, cacheEntries)
	}
	before := tk.bpe.cache.len()
	tk.Encode(" "+strings.Repeat("z", 500), false)
	if _, ok := tk.bpe.cache.get(strings.Repeat("z", 500)); ok {
		t.Error("a 500-byte piece was cached")
	}
	if n := tk.bpe.cache.len(); n != before {
		t.Errorf("cache grew from %d to %d on a long piece", before, n)
	}
	// Entries still hit: the same words give the same ids.
	a, b := tk.Encode("hello world", false), tk.Encode("hello world", false)
	if !reflect.DeepEqual(a, b) {
		t.Errorf("cached encode differs: %v vs %v", a, b)
	}
}

// longWord is n characters of WikiText's letters with everything else
// removed: one piece for the byte-level pre-tokenizer (` ?\p{L}+`) that
// still exercises many different merges.
func longWord(t testing.TB, n int) string {
	text, err := os.ReadFile(shared.Path(t, "data/wikitext2/wiki.test.raw"))
	if err != nil {
		t.Fatal(err)
	}
	letters := []rune(strings.Map(func(r rune) rune {
		if r < 128 && unicode.IsLetter(r) {
			return r
		}
		return -1
	}, string(text)))
	out := make([]rune, n)
	for i := range out {
		out[i] = letters[i%len(letters)]
	}
	return string(out)
}

// prose is n bytes of WikiText (repeated if needed).
func prose(t testing.TB, n int) string {
	text, err := os.ReadFile(shared.Path(t, "data/wikitext2/wiki.test.raw"))
	if err != nil {
		t.Fatal(err)
	}
	for len(text) < n {
		text = append(text, text...)
	}
	return strings.ToValidUTF8(string(text[:n]), "")
}

// BenchmarkEncode shows linear scaling from 1k to 1M characters: the time
// per character stays flat (cpu-ns/char is the CPU time the process
// spent, the steadier figure on a machine that others share). "prose" is WikiText (cache cleared each iteration, so every
// piece is merged); "one-word" is a single piece with no pre-tokenizer
// split, the input that made the old quadratic loop take 59 s for 32k
// characters.
//
//	go test -tags openblas -run XX -bench Encode -benchtime 3x ./llm/tokenizer
func BenchmarkEncode(b *testing.B) {
	tk := load(b, "models/llama-tiny/tokenizer.json")
	for _, kind := range []string{"prose", "one-word"} {
		for _, n := range []int{1_000, 10_000, 100_000, 1_000_000} {
			var text string
			if kind == "prose" {
				text = prose(b, n)
			} else {
				text = longWord(b, n)
			}
			b.Run(fmt.Sprintf("%s/%d", kind, n), func(b *testing.B) {
				b.SetBytes(int64(len(text)))
				var cpu time.Duration
				for b.Loop() {
					b.StopTimer()
					tk.bpe.cache = newLRU(cacheEntries)
					c0, _ := cpuTime()
					b.StartTimer()
					tk.Encode(text, false)
					b.StopTimer()
					c1, _ := cpuTime()
					cpu += c1 - c0
					b.StartTimer()
				}
				perChar := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / float64(b.N) / float64(len(text)) }
				b.ReportMetric(perChar(b.Elapsed()), "ns/char")
				if _, ok := cpuTime(); ok {
					b.ReportMetric(perChar(cpu), "cpu-ns/char")
				}
			})
		}
	}
}
