package quantize

import (
	"time"

	"github.com/llmq/llmq/llm"
)

// Reading a block's weights (from disk, bf16 → float32) overlaps with
// quantizing the one before it: loadBlock hands out block l, read in the
// background while block l−1 was quantized, and starts reading block l+1.
// Two blocks' weights are in memory at once.

type loadedBlock struct {
	b   *llm.Block
	err error
}

// loadBlock returns block l's weights; Timing["load"] counts the time
// spent waiting for them.
func (d *driver) loadBlock(l int) (*llm.Block, error) {
	t0 := time.Now()
	var r loadedBlock
	if d.pre != nil && d.preBlock == l {
		r = <-d.pre
	} else {
		d.waitPrefetch()
		r.b, r.err = llm.LoadBlock(d.ck, l, llm.DenseLoader)
	}
	d.pre = nil
	d.addTime("load", time.Since(t0).Seconds())
	if r.err == nil && l+1 < d.ck.Config.Layers {
		ch := make(chan loadedBlock, 1)
		d.pre, d.preBlock = ch, l+1
		go func() {
			b, err := llm.LoadBlock(d.ck, l+1, llm.DenseLoader)
			ch <- loadedBlock{b, err}
		}()
	}
	return r.b, r.err
}

// waitPrefetch waits for a background read to finish (before the
// checkpoint's files are unmapped) and drops it.
func (d *driver) waitPrefetch() {
	if d.pre != nil {
		<-d.pre
		d.pre = nil
	}
}
