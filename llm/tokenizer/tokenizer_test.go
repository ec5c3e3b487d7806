package tokenizer

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
)

func load(t testing.TB, rel string) *Tokenizer {
	t.Helper()
	tk, err := Load(shared.Path(t, rel))
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// TestWikiTextMatchesHF: all 387,230 ids of wiki.test.raw equal those of
// HF tokenizers, and decoding gives the text back byte for byte.
func TestWikiTextMatchesHF(t *testing.T) {
	tk := load(t, "models/llama-small/tokenizer.json")
	text, err := os.ReadFile(shared.Path(t, "data/wikitext2/wiki.test.raw"))
	if err != nil {
		t.Fatal(err)
	}
	want := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	got := tk.Encode(string(text), false)
	if len(got) != len(want) {
		t.Errorf("got %d ids, want %d", len(got), len(want))
	}
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			lo := max(0, i-3)
			t.Fatalf("first difference at id %d: got %v, want %v (text %q)", i, got[lo:i+3], want[lo:i+3], tk.Decode(want[lo:i+3], false))
		}
	}
	if back := tk.Decode(got, false); back != string(text) {
		t.Error("decode(encode(text)) differs from the text")
	}
}

// TestPromptsMatchHF: the prompt ids of the greedy references (with BOS from
// the TemplateProcessing post-processor).
func TestPromptsMatchHF(t *testing.T) {
	tk := load(t, "models/llama-tiny/tokenizer.json")
	for prompt, r := range shared.GreedyRefs(t, "llama-tiny") {
		if got := tk.Encode(prompt, true); !reflect.DeepEqual(got, r.PromptIDs) {
			t.Errorf("%q: got %v, want %v", prompt, got, r.PromptIDs)
		}
	}
}

func TestSpecialTokens(t *testing.T) {
	tk := load(t, "models/llama-tiny/tokenizer.json")
	ids := tk.Encode("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", false)
	if ids[0] != 2 || ids[2] != 3 || ids[len(ids)-1] != 4 {
		t.Fatalf("special tokens not split out: %v", ids)
	}
	if got := tk.Decode(ids, true); got != "user\n\nhi" {
		t.Errorf("decode skipping specials = %q", got)
	}
	if got := tk.Decode(ids, false); got != "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>" {
		t.Errorf("decode keeping specials = %q", got)
	}
}

// TestStreamHoldsIncompleteCharacters: a multi-byte character split over
// byte-level tokens is printed only once complete.
func TestStreamHoldsIncompleteCharacters(t *testing.T) {
	tk := load(t, "models/llama-tiny/tokenizer.json")
	text := "naïve 日本語 ok"
	ids := tk.Encode(text, false)
	s := tk.NewStream()
	var b strings.Builder
	for _, id := range ids {
		piece := s.Add(id)
		if !utf8Valid(piece) {
			t.Fatalf("stream emitted invalid UTF-8 %q", piece)
		}
		b.WriteString(piece)
	}
	b.WriteString(s.Flush())
	if b.String() != text {
		t.Fatalf("streamed %q, want %q", b.String(), text)
	}
}

func utf8Valid(s string) bool { return strings.ToValidUTF8(s, "") == s }

// TestLlama3Tokenizer runs a real Llama-3 tokenizer.json (128k vocab,
// Split pre-tokenizer with lookahead, ignore_merges) against the ids its
// reference library produces. The file ships in the test data of the Go
// module github.com/daulet/tokenizers; we locate it in the module cache
// (downloading it if the proxy is reachable) and skip when absent.
func TestLlama3Tokenizer(t *testing.T) {
	path := llama3File(t)
	tk, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		text string
		want []int
	}{
		// ids from that module's tests (0x10019, 0x9bff, ...)
		{"brown fox jumps over the lazy dog", []int{65561, 39935, 35308, 927, 279, 16053, 5679}},
	}
	for _, c := range cases {
		if got := tk.Encode(c.text, false); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%q: got %v, want %v", c.text, got, c.want)
		}
		if got := tk.Encode(c.text, true); got[0] != 128000 {
			t.Errorf("BOS not prepended: %v", got)
		}
		if got := tk.Decode(tk.Encode(c.text, false), false); got != c.text {
			t.Errorf("round trip %q → %q", c.text, got)
		}
	}
	// Lookahead and digit-grouping behaviour of the Llama-3 pattern: numbers
	// in groups of at most three digits, trailing spaces before a word kept
	// apart from it.
	for _, s := range []string{"12345678", "a  b", "Hello,   world!\n\n  x", "I'm can't we'LL"} {
		if got := tk.Decode(tk.Encode(s, false), false); got != s {
			t.Errorf("round trip %q → %q", s, got)
		}
	}
	if n := len(tk.Encode("12345678", false)); n != 3 {
		t.Errorf("12345678 encoded to %d tokens, want 3 (groups of ≤3 digits)", n)
	}
}

func llama3File(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "mod", "download", "-json", "github.com/daulet/tokenizers@v1.24.0").Output()
	var info struct{ Dir string }
	if err == nil {
		err = json.Unmarshal(out, &info)
	}
	if err != nil || info.Dir == "" {
		t.Skipf("Llama-3 tokenizer.json unavailable (go mod download github.com/daulet/tokenizers@v1.24.0 failed: %v)", err)
	}
	p := filepath.Join(info.Dir, "test", "data", "Meta-Llama-3-8B-Instruct.json")
	if _, err := os.Stat(p); err != nil {
		t.Skipf("Llama-3 tokenizer.json not in the module: %v", err)
	}
	return p
}

// spTokenizer is a small SentencePiece-style BPE (the Llama-2/Mistral
// layout: Prepend+Replace normalizer, byte_fallback, Strip decoder).
const spTokenizer = `{
  "added_tokens": [{"id": 1, "content": "<s>", "special": true}],
  "normalizer": {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "▁"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
  "pre_tokenizer": null,
  "post_processor": {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
  "decoder": {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
  "model": {"type": "BPE", "byte_fallback": true, "unk_token": "<unk>",
    "vocab": {"<unk>": 0, "<s>": 1, "<0xC3>": 2, "<0xA9>": 3, "▁": 4, "h": 5, "i": 6, "▁h": 7, "▁hi": 8, "t": 9, "▁t": 10, "e": 11},
    "merges": ["▁ h", "▁h i", "▁ t"]}
}`

// TestSentencePieceStyle: "hi te é" → <s> ▁hi ▁t e ▁ <0xC3> <0xA9>: é
// (missing from the vocab) spelled by its UTF-8 bytes.
func TestSentencePieceStyle(t *testing.T) {
	tk, err := Parse([]byte(spTokenizer))
	if err != nil {
		t.Fatal(err)
	}
	got := tk.Encode("hi te é", true)
	want := []int{1, 8, 10, 11, 4, 2, 3}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if s := tk.Decode(got, true); s != "hi te é" {
		t.Fatalf("decode = %q", s)
	}
}

func TestParseErrors(t *testing.T) {
	cases := map[string]string{
		`{`: "invalid JSON",
		`{"model": {"type": "WordPiece", "vocab": {"a": 0}}}`:                                  `unsupported tokenizer model type "WordPiece"`,
		`{"model": {"type": "Unigram", "vocab": {"a": 0}}}`:                                    `unsupported tokenizer model type "Unigram"`,
		`{"model": {"type": "BPE", "vocab": {}}}`:                                              "empty vocab",
		`{"pre_tokenizer": {"type": "Whatever"}, "model": {"type": "BPE", "vocab": {"a": 0}}}`: `unsupported pre-tokenizer type "Whatever"`,
		`{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["ab"]}}`:                      "not two space-separated tokens",
		// Ids size the table of tokens: a huge one is refused, not
		// allocated (FuzzParse found a 34-byte file asking for about 9 GB),
		// and a negative added token's id is an error, not a panic.
		`{"model": {"vocab": {"": 555555550}}}`:                                           `token "" has id 555555550; want 0 ≤ id < 65537`,
		`{"model": {"vocab": {"a": -1}}}`:                                                 `token "a" has id -1`,
		`{"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": -1, "content": "x"}]}`:    `added token "x" has id -1`,
		`{"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 70000, "content": "x"}]}`: `added token "x" has id 70000; want 0 ≤ id < 65538`,
	}
	for in, want := range cases {
		_, err := Parse([]byte(in))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Parse(%s) error = %v, want it to mention %q", in, err, want)
		}
	}
	if _, err := Load("/nonexistent/tokenizer.json"); err == nil || !strings.Contains(err.Error(), "/nonexistent/tokenizer.json") {
		t.Errorf("missing file error should name it: %v", err)
	}
}

// FuzzParse: no tokenizer.json, however malformed, panics the parser, and
// a tokenizer that parses encodes and decodes any text without panicking.
func FuzzParse(f *testing.F) {
	f.Add([]byte(spTokenizer), "hi there")
	f.Add([]byte(`{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}, "pre_tokenizer": {"type": "ByteLevel"}}`), "abab a")
	f.Add([]byte(`{"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\s+(?!\\S)"}, "behavior": "Isolated"}}`), "a  a")
	f.Fuzz(func(t *testing.T, data []byte, text string) {
		tk, err := Parse(data)
		if err != nil {
			return
		}
		tk.Decode(tk.Encode(text, true), false)
	})
}

// TestStreamEqualsDecode: streaming a long text token by token gives the
// one-shot decode, for byte-level BPE and for SentencePiece-style BPE
// (whose decoder strips the first token's leading space and merges byte
// fallback runs, so the stream's decode window must respect both).
func TestStreamEqualsDecode(t *testing.T) {
	sp, err := Parse([]byte(spTokenizer))
	if err != nil {
		t.Fatal(err)
	}
	bl := load(t, "models/llama-tiny/tokenizer.json")
	text, err := os.ReadFile(shared.Path(t, "data/wikitext2/wiki.test.raw"))
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]struct {
		tk   *Tokenizer
		text string
	}{"byte-level": {bl, string(text[:20000])}, "sentencepiece": {sp, "hi te é hi  é te"}} {
		ids := c.tk.Encode(c.text, false)
		s := c.tk.NewStream()
		var b strings.Builder
		for _, id := range ids {
			b.WriteString(s.Add(id))
		}
		b.WriteString(s.Flush())
		if want := c.tk.Decode(ids, true); b.String() != want {
			t.Errorf("%s: streamed text differs from the decode (%d vs %d bytes)", name, b.Len(), len(want))
		}
	}
}
