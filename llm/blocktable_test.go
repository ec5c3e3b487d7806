package llm

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/llmq/llmq/llm/checkpoint"
)

// TestBlockTableBookkeeping walks a two-layer table (one full layer, one
// with a sliding window of 20) through the calls a paged backend makes,
// with a handle that only records the block's id, and checks by hand what
// it holds after each: blocks taken per 16 positions, a window's blocks
// handed back as the sequence moves past them, Rollback of a failed pass,
// Truncate, and Close returning everything to the pool.
func TestBlockTableBookkeeping(t *testing.T) {
	pool := NewBlockPool(&checkpoint.Config{Layers: 2}, 16, 0, 1)
	made := map[int]int{} // handle → times made
	fail := -1            // newBlock fails after this many more blocks (−1: never)
	tb := NewBlockTable(pool, []int{0, 20}, 100, func(id int) (int, error) {
		if fail == 0 {
			return 0, errors.New("no memory")
		}
		if fail > 0 {
			fail--
		}
		made[id]++
		return id, nil
	})
	held := func(l int) (bs []int) {
		for b := 0; b < 8; b++ {
			if _, ok := tb.Block(l, b); ok {
				bs = append(bs, b)
			}
		}
		return bs
	}
	check := func(step string, full, sliding []int, used int) {
		t.Helper()
		if g := held(0); !slices.Equal(g, full) {
			t.Errorf("%s: full layer holds blocks %v, want %v", step, g, full)
		}
		if g := held(1); !slices.Equal(g, sliding) {
			t.Errorf("%s: sliding layer holds blocks %v, want %v", step, g, sliding)
		}
		if pool.Used() != used || tb.Blocks() != used {
			t.Errorf("%s: pool has %d in use, the table %d; want %d", step, pool.Used(), tb.Blocks(), used)
		}
	}

	// 40 tokens: positions 0–39, blocks 0–2 in the full layer; the sliding
	// layer stores only its last 20 (20–39: blocks 1, 2).
	if n := tb.Need(40); n != 5 {
		t.Fatalf("Need(40) = %d, want 3 + 2", n)
	}
	if err := tb.Reserve(40); err != nil {
		t.Fatal(err)
	}
	tb.Advance(40)
	check("40 tokens", []int{0, 1, 2}, []int{1, 2}, 5)
	if lo, hi := tb.Stored(1, 8); lo != 40 || hi != 48 {
		t.Errorf("Stored(sliding, 8) = [%d, %d), want [40, 48)", lo, hi)
	}
	// 10 more (40–49): block 3 in both; the window (30–49) still reaches
	// block 1 (16–31), so nothing goes back yet.
	if err := tb.Reserve(10); err != nil {
		t.Fatal(err)
	}
	tb.Advance(10)
	check("50 tokens", []int{0, 1, 2, 3}, []int{1, 2, 3}, 7)
	// 3 more (50–52): the window is 33–52, block 1 (16–31) goes back.
	if err := tb.Reserve(3); err != nil {
		t.Fatal(err)
	}
	tb.Advance(3)
	check("53 tokens", []int{0, 1, 2, 3}, []int{2, 3}, 6)
	// A pass of 20 that fails after Reserve: its blocks (4 in both
	// layers) come back, the length stays.
	if err := tb.Reserve(20); err != nil {
		t.Fatal(err)
	}
	check("reserved 20", []int{0, 1, 2, 3, 4}, []int{2, 3, 4}, 8)
	tb.Rollback()
	check("rolled back", []int{0, 1, 2, 3}, []int{2, 3}, 6)
	if tb.Len() != 53 {
		t.Errorf("Len after Rollback = %d, want 53", tb.Len())
	}
	// A pass whose memory cannot be had, at once or after one of its two
	// blocks (the full layer's): nothing is taken.
	for _, after := range []int{0, 1} {
		fail = after
		if err := tb.Reserve(20); err == nil {
			t.Errorf("Reserve with memory failing after %d blocks: no error", after)
		}
		fail = -1
		check(fmt.Sprintf("memory refused after %d", after), []int{0, 1, 2, 3}, []int{2, 3}, 6)
	}
	// Truncating into block 3 keeps it; to 48, block 3 (48–63) goes.
	tb.Truncate(50)
	check("truncated to 50", []int{0, 1, 2, 3}, []int{2, 3}, 6)
	tb.Truncate(48)
	check("truncated to 48", []int{0, 1, 2}, []int{2}, 4)
	if err := tb.RingsLost(); err == nil {
		t.Error("RingsLost: nil after going back 5 positions past a window of 20 that was trimmed")
	}
	if id, ok := tb.Block(0, 0); !ok || made[id] != 1 {
		t.Errorf("block 0's handle %d made %d times, want once", id, made[id])
	}
	if err := tb.Close(); err != nil || pool.Used() != 0 || tb.Blocks() != 0 || !tb.Closed() {
		t.Errorf("Close: %v, pool %d in use, table %d held, closed %v", err, pool.Used(), tb.Blocks(), tb.Closed())
	}
}
