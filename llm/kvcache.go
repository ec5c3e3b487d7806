package llm

import (
	"fmt"
	"runtime/debug"
)

// KVCache is the CPU backend's cache, paged (BlockTable): per layer, a
// table of blocks from the model's BlockPool, each block's keys and values
// stored [kv_heads][B][head_dim] in memory allocated when the pool hands
// the block out and dropped when it comes back.
//
// Attention gathers a layer's keys and values from the blocks into one
// contiguous matrix per kv head, in position order: the products it runs
// are those of a contiguous cache, to the bit.
type KVCache struct {
	*BlockTable[*kvBlock]
	kvh, hd int
}

// kvBlock is one block's memory: keys and values [kv_heads][B][head_dim].
type kvBlock struct{ k, v []float32 }

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
func (m *Model) SetKVCacheBytes(bytes int64) error { return m.KVPool().ResizeBytes(bytes) }

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
	return newKVCache(m.KVPool(), m.KVPool().Windows(), capacity, c.KVHeads, c.HeadDim), nil
}

func newKVCache(pool *BlockPool, windows []int, capacity, kvh, hd int) *KVCache {
	size := kvh * pool.BlockTokens() * hd
	return &KVCache{BlockTable: NewBlockTable(pool, windows, capacity, func(int) (*kvBlock, error) {
		kv := make([]float32, 2*size)
		return &kvBlock{k: kv[:size:size], v: kv[size:]}, nil
	}), kvh: kvh, hd: hd}
}

// store writes the rows of n new tokens' keys and values
// ([n][kv_heads×hd]) that layer l keeps into its blocks (reserved).
func (c *KVCache) store(l int, k, v []float32, n int) {
	lo, hi := c.Stored(l, n)
	bl, bt, hd := c.layers[l].blocks, c.bt, c.hd
	for p := lo; p < hi; p++ {
		b, off, t := bl[p/bt].mem, p%bt, p-c.n
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
		b, off := bl[p/bt].mem, p%bt
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
