package llm

import (
	"fmt"
	"runtime/debug"
)

// KVCache is the CPU backend's cache, paged: per layer, a table of blocks
// from the model's BlockPool, block i holding the keys and values of
// positions i·B … i·B+B−1 (B = BlockTokens), each stored
// [kv_heads][B][head_dim]. A block is allocated when the first of its
// positions is written and handed back when the cache is truncated before
// it or closed, so the cache's memory follows the tokens it holds, not
// its capacity. A sliding-window layer (window W) keeps only the blocks
// of its last W positions, since no query will look further back; the
// blocks before them go back to the pool as the sequence moves on.
//
// Attention gathers a layer's keys and values from the blocks into one
// contiguous matrix per kv head, in position order: the products it runs
// are those of a contiguous cache, to the bit.
type KVCache struct {
	pool    *BlockPool
	layers  []kvLayer
	n, cap  int
	kvh, hd int
	bt      int // positions per block
	held    int // blocks held, over all layers
	// written is the number of positions whose keys the sliding layers
	// saw since they were last known whole: Truncate can go back only as
	// far as they still hold the window before the new end.
	written int
	closed  bool
}

// kvLayer is one layer's block table.
type kvLayer struct {
	window int        // the sliding window, or 0 when the layer sees every position
	blocks []*kvBlock // nil where a block was handed back (before a sliding layer's window)
}

// kvBlock is one block's memory: keys and values [kv_heads][B][head_dim].
type kvBlock struct {
	id   int
	k, v []float32
}

// KVPool implements Paged: the model's pool, unbounded until
// SetKVCacheBytes bounds it.
func (m *Model) KVPool() *BlockPool {
	m.kvOnce.Do(func() {
		c := m.Cfg
		bytes := int64(2*c.KVHeads*DefaultBlockTokens*c.HeadDim) * 4
		m.kv = NewBlockPool(c, DefaultBlockTokens, 0, bytes)
	})
	return m.kv
}

// SetKVCacheBytes implements Paged.
func (m *Model) SetKVCacheBytes(bytes int64) error {
	p := m.KVPool()
	if bytes <= 0 {
		return p.Resize(0)
	}
	blocks := bytes / p.BlockBytes()
	if blocks < 1 {
		return fmt.Errorf("a KV cache of %d bytes holds no block (one block is %d bytes: %d positions of one layer)", bytes, p.BlockBytes(), p.BlockTokens())
	}
	return p.Resize(int(min(blocks, Unbounded-1)))
}

// Trim implements Paged: the blocks handed back are garbage (the pool
// keeps no memory), so a collection returns them; FreeOSMemory runs one
// and gives the freed pages back to the system at once.
func (m *Model) Trim() { debug.FreeOSMemory() }

// NewCache implements Backend: an empty cache that may grow to capacity
// tokens, holding no memory until tokens are written.
func (m *Model) NewCache(capacity int) (Cache, error) {
	if capacity <= 0 {
		return nil, fmt.Errorf("cache capacity must be positive, got %d", capacity)
	}
	c := m.Cfg
	windows := make([]int, c.Layers)
	for l := range windows {
		windows[l] = c.Window(l)
	}
	return newKVCache(m.KVPool(), windows, capacity, c.KVHeads, c.HeadDim), nil
}

func newKVCache(pool *BlockPool, windows []int, capacity, kvh, hd int) *KVCache {
	kc := &KVCache{pool: pool, cap: capacity, kvh: kvh, hd: hd, bt: pool.BlockTokens()}
	for _, w := range windows {
		kc.layers = append(kc.layers, kvLayer{window: w})
	}
	return kc
}

// Close implements Cache: it hands every block back to the pool.
func (c *KVCache) Close() error {
	if c.closed {
		return nil
	}
	c.releaseFrom(0)
	c.closed, c.n, c.cap = true, 0, 0
	return nil
}

func (c *KVCache) Len() int { return c.n }
func (c *KVCache) Cap() int { return c.cap }

// Blocks implements PagedCache.
func (c *KVCache) Blocks() int { return c.held }

// Bytes is the memory of the blocks the cache holds (keys and values, all
// layers).
func (c *KVCache) Bytes() int64 { return int64(c.held) * c.pool.BlockBytes() }

// Truncate forgets everything after the first n tokens, and hands back
// the blocks past them. A sliding layer has handed back what lay a
// window before the tokens it forgets, so the next Forward fails if more
// than one token was dropped past the window (its error says so); full
// layers can go back anywhere.
func (c *KVCache) Truncate(n int) {
	if n >= 0 && n < c.n {
		c.n = n
		c.releaseFrom(n)
	}
}

// ringsLost reports whether a sliding layer no longer holds the window
// before position c.n (Truncate went back too far).
func (c *KVCache) ringsLost() error {
	for l, L := range c.layers {
		if w := L.window; w > 0 && w < c.cap && c.written > max(w, c.n+1) {
			return fmt.Errorf("layer %d keeps only the last %d positions (its sliding window) and the cache was truncated from %d to %d tokens: start a new cache", l, w, c.written, c.n)
		}
	}
	return nil
}

// stored is the positions [lo, hi) of n new tokens that layer l stores:
// all of them, or a sliding layer's last window of them.
func (c *KVCache) stored(l, n int) (lo, hi int) {
	lo, hi = c.n, c.n+n
	if w := c.layers[l].window; w > 0 {
		lo = max(lo, hi-w)
	}
	return lo, hi
}

// missing calls f with each block index that storing n new tokens in
// layer l writes to and the layer does not hold yet.
func (c *KVCache) missing(l, n int, f func(b int)) {
	lo, hi := c.stored(l, n)
	if lo >= hi {
		return
	}
	bl := c.layers[l].blocks
	for b := lo / c.bt; b <= (hi-1)/c.bt; b++ {
		if b >= len(bl) || bl[b] == nil {
			f(b)
		}
	}
}

// Need implements PagedCache.
func (c *KVCache) Need(n int) int {
	k := 0
	for l := range c.layers {
		c.missing(l, n, func(int) { k++ })
	}
	return k
}

// reserve takes from the pool the blocks that appending n tokens writes
// to, all or none.
func (c *KVCache) reserve(n int) error {
	ids, err := c.pool.Alloc(c.Need(n))
	if err != nil {
		return err
	}
	size := c.kvh * c.bt * c.hd
	for l := range c.layers {
		L := &c.layers[l]
		c.missing(l, n, func(b int) {
			for len(L.blocks) <= b {
				L.blocks = append(L.blocks, nil)
			}
			kv := make([]float32, 2*size)
			L.blocks[b] = &kvBlock{id: ids[0], k: kv[:size:size], v: kv[size:]}
			ids = ids[1:]
			c.held++
		})
	}
	return nil
}

// releaseFrom hands back every block whose first position is n or later.
func (c *KVCache) releaseFrom(n int) {
	first := (n + c.bt - 1) / c.bt
	var ids []int
	for l := range c.layers {
		L := &c.layers[l]
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
	c.held -= len(ids)
	c.pool.Release(ids...)
}

// trim hands back the blocks of the sliding layers that lie wholly before
// their window: positions before c.n − W.
func (c *KVCache) trim() {
	var ids []int
	for l := range c.layers {
		L := &c.layers[l]
		if L.window <= 0 {
			continue
		}
		for b := 0; b < len(L.blocks) && (b+1)*c.bt <= c.n-L.window; b++ {
			if L.blocks[b] != nil {
				ids = append(ids, L.blocks[b].id)
				L.blocks[b] = nil
			}
		}
	}
	c.held -= len(ids)
	c.pool.Release(ids...)
}

// store writes the rows of n new tokens' keys and values
// ([n][kv_heads×hd]) that layer l keeps into its blocks (reserved).
func (c *KVCache) store(l int, k, v []float32, n int) {
	lo, hi := c.stored(l, n)
	bl, bt, hd := c.layers[l].blocks, c.bt, c.hd
	for p := lo; p < hi; p++ {
		b, off, t := bl[p/bt], p%bt, p-c.n
		for j := 0; j < c.kvh; j++ {
			dst := (j*bt + off) * hd
			src := (t*c.kvh + j) * hd
			copy(b.k[dst:dst+hd], k[src:src+hd])
			copy(b.v[dst:dst+hd], v[src:src+hd])
		}
	}
}

// gather lays out what n new queries of layer l attend to: the keys and
// values of the cached positions base … c.n−1 (every one, or a sliding
// layer's last W−1) from the blocks, then the n new rows k and v
// ([n][kv_heads×hd]), per kv head contiguous in position order:
// [kv_heads][S][hd], S = c.n−base+n, in K and V (each at least that
// long).
func (c *KVCache) gather(l int, k, v []float32, n int, K, V []float32) (base, S int) {
	if w := c.layers[l].window; w > 0 {
		base = max(0, c.n-(w-1))
	}
	S = c.n - base + n
	bl, bt, hd, kvh := c.layers[l].blocks, c.bt, c.hd, c.kvh
	for p := base; p < c.n; {
		b, off := bl[p/bt], p%bt
		run := min(bt-off, c.n-p)
		for j := 0; j < kvh; j++ {
			src := (j*bt + off) * hd
			dst := (j*S + p - base) * hd
			copy(K[dst:dst+run*hd], b.k[src:src+run*hd])
			copy(V[dst:dst+run*hd], b.v[src:src+run*hd])
		}
		p += run
	}
	for t := 0; t < n; t++ {
		for j := 0; j < kvh; j++ {
			src := (t*kvh + j) * hd
			dst := (j*S + c.n - base + t) * hd
			copy(K[dst:dst+hd], k[src:src+hd])
			copy(V[dst:dst+hd], v[src:src+hd])
		}
	}
	return base, S
}

// kvScratch is the gathered keys and values of one layer of one sequence,
// reused across layers and sequences.
type kvScratch struct{ K, V []float32 }

func (s *kvScratch) get(n int) (K, V []float32) {
	if len(s.K) < n {
		s.K, s.V = make([]float32, n), make([]float32, n)
	}
	return s.K[:n], s.V[:n]
}
