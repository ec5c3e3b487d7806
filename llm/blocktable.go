package llm

import "fmt"

// BlockTable is one sequence's paged key/value bookkeeping, whatever holds
// the keys and values (Kwon et al. 2023, "vLLM"): per layer, the blocks
// from a BlockPool that hold its positions, block i holding positions
// i·B … i·B+B−1 (B = the pool's BlockTokens). A block is taken from the
// pool when the first of its positions is about to be written (Reserve)
// and handed back when the table is truncated before it or closed, so a
// sequence's memory follows the tokens it holds, not its capacity. A
// sliding-window layer (window W) keeps only the blocks of its last W
// positions, since no query will look further back; the blocks before
// them go back to the pool as the sequence moves on (Advance).
//
// What a block holds is the backend's: M is its handle to the block's
// memory (the CPU's KVCache: the block's floats; the GPU's: a device
// address), made by newBlock when the pool hands the block out.
//
// A forward pass of n new tokens calls Need(n) (to check the pool),
// Reserve(n), writes and reads the blocks (Stored, Block), then Advance(n);
// on failure Rollback gives back what Reserve took.
type BlockTable[M any] struct {
	pool     *BlockPool
	newBlock func(id int) (M, error)
	layers   []tableLayer[M]
	n, cap   int
	bt       int // positions per block
	held     int // blocks held, over all layers
	// written is the number of positions whose keys the sliding layers
	// saw since they were last known whole: Truncate can go back only as
	// far as they still hold the window before the new end.
	written int
	closed  bool
}

// tableLayer is one layer's blocks.
type tableLayer[M any] struct {
	window int              // the sliding window, or 0 when the layer sees every position
	blocks []*tableBlock[M] // nil where a block was handed back (before a sliding layer's window)
}

type tableBlock[M any] struct {
	id  int
	mem M
}

// NewBlockTable is an empty table of len(windows) layers (windows[l]: layer
// l's sliding window, or 0) for up to capacity tokens, its blocks from
// pool, each block's memory made by newBlock.
func NewBlockTable[M any](pool *BlockPool, windows []int, capacity int, newBlock func(id int) (M, error)) *BlockTable[M] {
	t := &BlockTable[M]{pool: pool, newBlock: newBlock, cap: capacity, bt: pool.BlockTokens()}
	for _, w := range windows {
		t.layers = append(t.layers, tableLayer[M]{window: w})
	}
	return t
}

// Close hands every block back to the pool; closing twice is harmless.
func (t *BlockTable[M]) Close() error {
	if t.closed {
		return nil
	}
	t.releaseFrom(0)
	t.closed, t.n, t.cap = true, 0, 0
	return nil
}

// Closed reports whether Close was called.
func (t *BlockTable[M]) Closed() bool { return t.closed }

// Pool is the pool the table's blocks come from.
func (t *BlockTable[M]) Pool() *BlockPool { return t.pool }

func (t *BlockTable[M]) Len() int { return t.n }
func (t *BlockTable[M]) Cap() int { return t.cap }

// Blocks is how many blocks the table holds, over all layers.
func (t *BlockTable[M]) Blocks() int { return t.held }

// Bytes is the memory of the blocks the table holds.
func (t *BlockTable[M]) Bytes() int64 { return int64(t.held) * t.pool.BlockBytes() }

// Truncate forgets everything after the first n tokens, and hands back
// the blocks past them. A sliding layer has handed back what lay a
// window before the tokens it forgets, so the next pass fails if more
// than one token was dropped past the window (RingsLost says so); full
// layers can go back anywhere.
func (t *BlockTable[M]) Truncate(n int) {
	if n >= 0 && n < t.n {
		t.n = n
		t.releaseFrom(n)
	}
}

// RingsLost reports whether a sliding layer no longer holds the window
// before position Len (Truncate went back too far).
func (t *BlockTable[M]) RingsLost() error {
	for l, L := range t.layers {
		if w := L.window; w > 0 && w < t.cap && t.written > max(w, t.n+1) {
			return fmt.Errorf("layer %d keeps only the last %d positions (its sliding window) and the cache was truncated from %d to %d tokens: start a new cache", l, w, t.written, t.n)
		}
	}
	return nil
}

// Window is layer l's sliding window, or 0.
func (t *BlockTable[M]) Window(l int) int { return t.layers[l].window }

// Stored is the positions [lo, hi) of n new tokens that layer l stores:
// all of them, or a sliding layer's last window of them.
func (t *BlockTable[M]) Stored(l, n int) (lo, hi int) {
	lo, hi = t.n, t.n+n
	if w := t.layers[l].window; w > 0 {
		lo = max(lo, hi-w)
	}
	return lo, hi
}

// Block is the memory of layer l's block b (positions b·B …), and whether
// the table holds it.
func (t *BlockTable[M]) Block(l, b int) (M, bool) {
	if bl := t.layers[l].blocks; b >= 0 && b < len(bl) && bl[b] != nil {
		return bl[b].mem, true
	}
	var zero M
	return zero, false
}

// missing calls f with each block index that storing n new tokens in
// layer l writes to and the layer does not hold yet.
func (t *BlockTable[M]) missing(l, n int, f func(b int)) {
	lo, hi := t.Stored(l, n)
	if lo >= hi {
		return
	}
	bl := t.layers[l].blocks
	for b := lo / t.bt; b <= (hi-1)/t.bt; b++ {
		if b >= len(bl) || bl[b] == nil {
			f(b)
		}
	}
}

// Need is how many blocks beyond those it holds appending n tokens takes
// from the pool.
func (t *BlockTable[M]) Need(n int) int {
	k := 0
	for l := range t.layers {
		t.missing(l, n, func(int) { k++ })
	}
	return k
}

// Reserve takes from the pool the blocks that appending n tokens writes
// to, all or none (newBlock failing gives back what it took).
func (t *BlockTable[M]) Reserve(n int) error {
	ids, err := t.pool.Alloc(t.Need(n))
	if err != nil {
		return err
	}
	for l := range t.layers {
		L := &t.layers[l]
		t.missing(l, n, func(b int) {
			if err != nil {
				return
			}
			var mem M
			if mem, err = t.newBlock(ids[0]); err != nil {
				return
			}
			for len(L.blocks) <= b {
				L.blocks = append(L.blocks, nil)
			}
			L.blocks[b] = &tableBlock[M]{id: ids[0], mem: mem}
			ids = ids[1:]
			t.held++
		})
	}
	if err != nil {
		t.pool.Release(ids...)
		t.Rollback()
	}
	return err
}

// ReserveAll is a forward pass's reservation: for each table i the blocks
// appending ns[i] tokens writes to, for every table or none. A pool
// without room for all of them is refused before any block is taken.
func ReserveAll[M any](pool *BlockPool, tables []*BlockTable[M], ns []int) error {
	need := 0
	for i, t := range tables {
		need += t.Need(ns[i])
	}
	if need > pool.Free() {
		return fmt.Errorf("KV cache pool exhausted: this step needs %d more blocks, %d of %d are free", need, pool.Free(), pool.Blocks())
	}
	for i, t := range tables {
		if err := t.Reserve(ns[i]); err != nil {
			for _, u := range tables[:i+1] {
				u.Rollback()
			}
			return err
		}
	}
	return nil
}

// Rollback hands back the blocks Reserve took past the tokens stored (a
// pass that failed or was cancelled).
func (t *BlockTable[M]) Rollback() { t.releaseFrom(t.n) }

// Advance records n new tokens as stored, and hands back the sliding
// layers' blocks that fell wholly before their window.
func (t *BlockTable[M]) Advance(n int) {
	t.n += n
	t.written = t.n
	t.trim()
}

// releaseFrom hands back every block whose first position is n or later.
func (t *BlockTable[M]) releaseFrom(n int) {
	first := (n + t.bt - 1) / t.bt
	var ids []int
	for l := range t.layers {
		L := &t.layers[l]
		if first >= len(L.blocks) {
			continue
		}
		for _, b := range L.blocks[first:] {
			if b != nil {
				ids = append(ids, b.id)
			}
		}
		clear(L.blocks[first:])
		L.blocks = L.blocks[:first]
	}
	t.held -= len(ids)
	t.pool.Release(ids...)
}

// trim hands back the blocks of the sliding layers that lie wholly before
// their window: positions before Len − W.
func (t *BlockTable[M]) trim() {
	var ids []int
	for l := range t.layers {
		L := &t.layers[l]
		if L.window <= 0 {
			continue
		}
		for b := 0; b < len(L.blocks) && (b+1)*t.bt <= t.n-L.window; b++ {
			if L.blocks[b] != nil {
				ids = append(ids, L.blocks[b].id)
				L.blocks[b] = nil
			}
		}
	}
	t.held -= len(ids)
	t.pool.Release(ids...)
}
