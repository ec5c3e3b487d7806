// Package calib prepares calibration data for the quantizers, shared by
// GPTQ and AWQ: the text is tokenized without BOS and the first n
// non-overlapping windows of seqlen tokens are taken — deterministic, so a
// quantization run is reproducible — and embedded for the first block.
package calib

import (
	"encoding/binary"
	"fmt"
	"os"
	"strings"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/tokenizer"
)

// ReadTokens reads calibration tokens: a file ending in .i32 holds
// little-endian int32 ids; anything else is text, encoded with tok.
func ReadTokens(path string, tok *tokenizer.Tokenizer) ([]int, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("calibration data: %w", err)
	}
	if strings.HasSuffix(path, ".i32") {
		if len(data)%4 != 0 {
			return nil, fmt.Errorf("calibration data %s: %d bytes is not a whole number of int32 ids", path, len(data))
		}
		ids := make([]int, len(data)/4)
		for i := range ids {
			ids[i] = int(int32(binary.LittleEndian.Uint32(data[4*i:])))
		}
		return ids, nil
	}
	return tok.Encode(string(data), false), nil
}

// Windows returns the first n non-overlapping windows of seqlen tokens.
func Windows(ids []int, n, seqlen int) ([][]int, error) {
	if n <= 0 || seqlen <= 0 {
		return nil, fmt.Errorf("%d calibration windows of %d tokens: want a positive number of windows and tokens", n, seqlen)
	}
	have := len(ids) / seqlen
	if have < n {
		return nil, fmt.Errorf("calibration data has %d tokens, %d windows of %d; %d windows need %d tokens", len(ids), have, seqlen, n, n*seqlen)
	}
	out := make([][]int, n)
	for i := range out {
		out[i] = ids[i*seqlen : (i+1)*seqlen]
	}
	return out, nil
}

// Embed looks up each window's token embeddings: [n][seqlen·hidden].
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
				return nil, fmt.Errorf("calibration token %d outside the vocabulary [0, %d)", id, c.Vocab)
			}
			copy(x[i*c.Hidden:], E[id*c.Hidden:(id+1)*c.Hidden])
		}
		out[w] = x
	}
	return out, nil
}
