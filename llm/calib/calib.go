// Package calib prepares calibration data for the quantizers, shared by
// GPTQ and AWQ: the text (a plain file, or JSON Lines with a "text" field
// per line, the way calibration sets are shipped) is tokenized without
// BOS, and n windows of seqlen tokens are taken — the first n
// non-overlapping ones, or with a seed n at random offsets as the GPTQ
// reference samples them; both reproducible — and embedded for the first
// block.
package calib

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"unicode/utf8"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/tokenizer"
)

// Formats of a token file (ReadTokens).
const (
	FormatAuto  = "auto"  // by the name: .i32 ids, .jsonl JSON Lines, else text
	FormatText  = "text"  // UTF-8 text, encoded with the tokenizer
	FormatIDs   = "ids"   // little-endian int32 token ids
	FormatJSONL = "jsonl" // one JSON object a line; their "text" fields, joined by blank lines
)

// ReadTokens reads a file of tokens in a format (FormatAuto when empty):
// text is encoded with tok, without BOS. A file that does not look like
// text (a NUL byte, or invalid UTF-8 in its first 64 KiB) is refused as
// text rather than tokenized into nonsense. Ids are returned as read: the
// caller checks them against its model's vocabulary.
func ReadTokens(path, format string, tok *tokenizer.Tokenizer) ([]int, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	switch format {
	case "", FormatAuto:
		format = FormatText
		switch {
		case strings.HasSuffix(path, ".i32"):
			format = FormatIDs
		case strings.HasSuffix(path, ".jsonl"):
			format = FormatJSONL
		}
	case FormatText, FormatIDs, FormatJSONL:
	default:
		return nil, fmt.Errorf("token file format %q: want %s, %s, %s or %s", format, FormatAuto, FormatText, FormatIDs, FormatJSONL)
	}
	if format == FormatJSONL {
		text, err := jsonlText(path, data)
		if err != nil {
			return nil, err
		}
		return tok.Encode(text, false), nil
	}
	if format == FormatText {
		head := data[:min(len(data), 64<<10)]
		if i := bytes.IndexByte(head, 0); i >= 0 || !utf8.Valid(trimPartialRune(head)) {
			return nil, fmt.Errorf("%s does not look like text (a NUL byte or invalid UTF-8 near the start): %w", path, ErrNotText)
		}
		return tok.Encode(string(data), false), nil
	}
	if len(data)%4 != 0 {
		return nil, fmt.Errorf("%s: %d bytes is not a whole number of int32 ids", path, len(data))
	}
	ids := make([]int, len(data)/4)
	for i := range ids {
		ids[i] = int(int32(binary.LittleEndian.Uint32(data[4*i:])))
	}
	return ids, nil
}

// jsonlText joins the "text" fields of a JSON Lines file with blank lines.
func jsonlText(path string, data []byte) (string, error) {
	var b strings.Builder
	for i, line := range bytes.Split(data, []byte("\n")) {
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var rec struct {
			Text *string `json:"text"`
		}
		if err := json.Unmarshal(line, &rec); err != nil {
			return "", fmt.Errorf("%s line %d: %w", path, i+1, err)
		}
		if rec.Text == nil {
			return "", fmt.Errorf("%s line %d: no \"text\" field", path, i+1)
		}
		if b.Len() > 0 {
			b.WriteString("\n\n")
		}
		b.WriteString(*rec.Text)
	}
	if b.Len() == 0 {
		return "", fmt.Errorf("%s: no lines with text", path)
	}
	return b.String(), nil
}

// ErrNotText is ReadTokens' error for a binary file read as text.
var ErrNotText = errors.New("not a text file")

// trimPartialRune drops a UTF-8 sequence cut off at the end of b.
func trimPartialRune(b []byte) []byte {
	for i := 1; i <= 3 && i <= len(b); i++ {
		if utf8.RuneStart(b[len(b)-i]) {
			if !utf8.FullRune(b[len(b)-i:]) {
				return b[:len(b)-i]
			}
			break
		}
	}
	return b
}

// ShortError is Windows' error for too few tokens: it knows the windows
// that fit, so a caller can suggest settings that work.
type ShortError struct {
	Tokens, N, SeqLen int
}

func (e *ShortError) Error() string {
	return fmt.Sprintf("calibration data has %d tokens, %d windows of %d; %d windows need %d tokens",
		e.Tokens, e.Tokens/e.SeqLen, e.SeqLen, e.N, e.N*e.SeqLen)
}

// Sample returns n windows of seqlen tokens: with seed 0 the first n
// non-overlapping ones (Windows), else n windows at offsets drawn
// uniformly from the whole text with a PCG generator seeded by seed, as
// the GPTQ reference draws its calibration samples (they may overlap).
func Sample(ids []int, n, seqlen int, seed uint64) ([][]int, error) {
	if seed == 0 {
		return Windows(ids, n, seqlen)
	}
	if n <= 0 || seqlen <= 0 {
		return nil, fmt.Errorf("%d calibration windows of %d tokens: want a positive number of windows and tokens", n, seqlen)
	}
	if len(ids) < seqlen {
		return nil, &ShortError{Tokens: len(ids), N: n, SeqLen: seqlen}
	}
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	out := make([][]int, n)
	for i := range out {
		at := r.IntN(len(ids) - seqlen + 1)
		out[i] = ids[at : at+seqlen]
	}
	return out, nil
}

// Windows returns the first n non-overlapping windows of seqlen tokens.
func Windows(ids []int, n, seqlen int) ([][]int, error) {
	if n <= 0 || seqlen <= 0 {
		return nil, fmt.Errorf("%d calibration windows of %d tokens: want a positive number of windows and tokens", n, seqlen)
	}
	if len(ids)/seqlen < n {
		return nil, &ShortError{Tokens: len(ids), N: n, SeqLen: seqlen}
	}
	out := make([][]int, n)
	for i := range out {
		out[i] = ids[i*seqlen : (i+1)*seqlen]
	}
	return out, nil
}

// Embed looks up each window's token embeddings, [n][seqlen·hidden],
// scaled as the forward pass scales them (Gemma 3: by √hidden).
func Embed(ck *checkpoint.Checkpoint, windows [][]int) ([][]float32, error) {
	c := ck.Config
	E, err := ck.Float32("model.embed_tokens.weight", c.Vocab, c.Hidden)
	if err != nil {
		return nil, err
	}
	out := make([][]float32, len(windows))
	for w, ids := range windows {
		x := make([]float32, len(ids)*c.Hidden)
		for i, id := range ids {
			if id < 0 || id >= c.Vocab {
				return nil, fmt.Errorf("token id %d (window %d, position %d) is outside the vocabulary [0, %d)", id, w, i, c.Vocab)
			}
			copy(x[i*c.Hidden:], E[id*c.Hidden:(id+1)*c.Hidden])
		}
		if scale := float32(c.EmbedScale); scale != 0 { // Gemma: √hidden, as the forward pass scales
			for i := range x {
				x[i] *= scale
			}
		}
		out[w] = x
	}
	return out, nil
}
