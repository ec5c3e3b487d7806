package calib

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm/tokenizer"
)

// TestWindows: the first n non-overlapping windows, and errors that say
// what the data holds and what was asked for (in the library's words: the
// command line names its flags).
func TestWindows(t *testing.T) {
	ids := make([]int, 300)
	for i := range ids {
		ids[i] = i
	}
	w, err := Windows(ids, 2, 128)
	if err != nil {
		t.Fatal(err)
	}
	if len(w) != 2 || !reflect.DeepEqual(w[0], ids[:128]) || !reflect.DeepEqual(w[1], ids[128:256]) {
		t.Errorf("windows %v", w)
	}
	_, err = Windows(ids, 4, 128)
	var short *ShortError
	if !errors.As(err, &short) || *short != (ShortError{Tokens: 300, N: 4, SeqLen: 128}) ||
		err.Error() != "calibration data has 300 tokens, 2 windows of 128; 4 windows need 512 tokens" {
		t.Errorf("too few tokens: %v", err)
	}
	if _, err := Windows(ids, 0, 128); err == nil || err.Error() != "0 calibration windows of 128 tokens: want a positive number of windows and tokens" {
		t.Errorf("no windows: %v", err)
	}
}

func TestReadTokensErrors(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.i32")
	if err := os.WriteFile(bad, make([]byte, 10), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadTokens(bad, "", nil); err == nil || err.Error() != bad+": 10 bytes is not a whole number of int32 ids" {
		t.Errorf("10-byte .i32: %v", err)
	}
	good := filepath.Join(dir, "good.i32")
	if err := os.WriteFile(good, []byte{1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}, 0o644); err != nil {
		t.Fatal(err)
	}
	if ids, err := ReadTokens(good, "", nil); err != nil || !reflect.DeepEqual(ids, []int{1, -1}) {
		t.Errorf("ids %v, %v; want [1 -1]", ids, err)
	}
	if _, err := ReadTokens(filepath.Join(dir, "missing.txt"), "", nil); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}

// TestReadTokensFormats: ids are read from .i32 names or --format ids
// whatever the name; a binary file is refused as text (it would tokenize
// into nonsense: a perplexity of 1.5e8 on an .i32 file read as text); text
// split mid-character at the 64 KiB sniffing boundary is still text.
func TestReadTokensFormats(t *testing.T) {
	dir := t.TempDir()
	ids := filepath.Join(dir, "tokens.bin")
	if err := os.WriteFile(ids, []byte{7, 0, 0, 0, 2, 1, 0, 0}, 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := ReadTokens(ids, FormatIDs, nil); err != nil || !reflect.DeepEqual(got, []int{7, 258}) {
		t.Errorf("--format ids: %v, %v; want [7 258]", got, err)
	}
	if _, err := ReadTokens(ids, FormatAuto, nil); !errors.Is(err, ErrNotText) || !strings.Contains(err.Error(), ids) {
		t.Errorf("binary file as text: %v", err)
	}
	if _, err := ReadTokens(ids, "csv", nil); err == nil || !strings.Contains(err.Error(), `"csv"`) {
		t.Errorf("unknown format: %v", err)
	}
	// "é" is two bytes; put its first byte last in the sniffed prefix.
	text := filepath.Join(dir, "text.txt")
	data := append(bytes.Repeat([]byte("a"), 64<<10-1), "éa"...)
	if err := os.WriteFile(text, data, 0o644); err != nil {
		t.Fatal(err)
	}
	tok := testTokenizer(t)
	if got, err := ReadTokens(text, FormatAuto, tok); err != nil || len(got) == 0 {
		t.Errorf("text cut mid-character at 64 KiB: %d ids, %v", len(got), err)
	}
}

func testTokenizer(t *testing.T) *tokenizer.Tokenizer {
	t.Helper()
	tok, err := tokenizer.Load(shared.Path(t, "models/llama-tiny/tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// TestJSONLAndSampling: JSON Lines calibration files give their "text"
// fields joined by blank lines (a line without one is an error naming the
// line); seeded sampling is reproducible, differs between seeds, stays in
// the text, and seed 0 is the first non-overlapping windows.
func TestJSONLAndSampling(t *testing.T) {
	tok := testTokenizer(t)
	dir := t.TempDir()
	good := filepath.Join(dir, "c.jsonl")
	os.WriteFile(good, []byte("{\"text\": \"The cat sat.\", \"id\": 1}\n\n{\"text\": \"A dog ran.\"}\n"), 0o644)
	got, err := ReadTokens(good, FormatAuto, tok)
	if err != nil || !slices.Equal(got, tok.Encode("The cat sat.\n\nA dog ran.", false)) {
		t.Errorf("jsonl: %v, %v", got, err)
	}
	bad := filepath.Join(dir, "bad.jsonl")
	os.WriteFile(bad, []byte("{\"text\": \"ok\"}\n{\"content\": \"no text\"}\n"), 0o644)
	if _, err := ReadTokens(bad, FormatAuto, tok); err == nil || !strings.Contains(err.Error(), "line 2") {
		t.Errorf("a line without text: %v", err)
	}
	ids := make([]int, 1000)
	for i := range ids {
		ids[i] = i
	}
	a, _ := Sample(ids, 8, 100, 7)
	b, _ := Sample(ids, 8, 100, 7)
	c, _ := Sample(ids, 8, 100, 8)
	if !reflect.DeepEqual(a, b) || reflect.DeepEqual(a, c) {
		t.Errorf("seed 7 twice: equal %v; seeds 7 and 8: equal %v", reflect.DeepEqual(a, b), reflect.DeepEqual(a, c))
	}
	for _, w := range a {
		if len(w) != 100 || w[99]-w[0] != 99 || w[99] >= 1000 {
			t.Errorf("window %v… is not 100 consecutive tokens of the text", w[:3])
		}
	}
	first, _ := Sample(ids, 3, 100, 0)
	if want, _ := Windows(ids, 3, 100); !reflect.DeepEqual(first, want) {
		t.Error("seed 0 is not the first windows")
	}
}
