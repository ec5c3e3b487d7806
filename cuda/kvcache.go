//go:build cgo

package cuda

import (
	"fmt"

	"github.com/llmq/llmq/llm"
)

// The GPU's key/value caches are paged as the CPU's are (llm.BlockTable,
// llm.BlockPool; Kwon et al. 2023): a block holds llm.DefaultBlockTokens
// positions of one layer's keys and values, fp16 [2][16][kv_dim], taken
// from the model's pool when a sequence is about to write its first
// position and given back when the sequence is truncated before it or
// ends, so a cache's memory follows its tokens, not its capacity, and
// the engine admits and preempts by the pool (llm.Paged).
//
// Blocks live in segments of device memory, each holding segBlocks of
// them (block id i in segment i / segBlocks), allocated when the pool
// first hands out one of their ids and freed by Trim once no block is in
// use. A cache's block table — the device addresses of its blocks,
// [block][layer], which the kernels read (cache_row in model.cu) — is a
// small device buffer of its own, sized by the cache's capacity; the
// rows a pass writes are brought up to date before it (sync).
//
// Sliding-window layers keep every position here (the pool's windows are
// 0): the cache attention kernel reads a pass's own keys from the cache,
// so a multi-token pass on a sliding layer needs more than the window
// before it; the CPU, which reads them from the pass's activations,
// keeps a window's worth.
type kvPages struct {
	pool       *llm.BlockPool
	blockBytes int64
	segBlocks  int
	segs       []Buf // Nil where not allocated
}

// kvSegmentBytes is about how much device memory one segment of blocks
// takes: large enough that a long sequence grows by few allocations.
const kvSegmentBytes = 32 << 20

func newKVPages(layers, kvDim int) kvPages {
	bytes := int64(2 * llm.DefaultBlockTokens * kvDim * 2)
	return kvPages{
		pool:       llm.NewBlockPoolFor(make([]int, layers), llm.DefaultBlockTokens, 0, bytes),
		blockBytes: bytes,
		segBlocks:  int(max(1, kvSegmentBytes/bytes)),
	}
}

// blockAddr is block id's device address, allocating its segment when
// none holds it (m.mu held).
func (m *Model) blockAddr(id int) (uint64, error) {
	if m.x == nil {
		return 0, errModelClosed
	}
	kv := &m.kv
	s := id / kv.segBlocks
	for len(kv.segs) <= s {
		kv.segs = append(kv.segs, Buf{})
	}
	if kv.segs[s].Nil() {
		bytes := int64(kv.segBlocks) * kv.blockBytes
		b, err := m.x.Alloc(int(bytes))
		if err != nil {
			return 0, fmt.Errorf("key/value blocks (%.2f GiB more, %.2f GiB held): %w", gib(bytes), gib(m.caches), err)
		}
		kv.segs[s] = b
		m.caches += bytes
	}
	return kv.segs[s].Ptr() + uint64(id%kv.segBlocks)*uint64(kv.blockBytes), nil
}

// KVPool implements llm.Paged: the pool the model's caches take their
// blocks from, unbounded until SetKVCacheBytes bounds it.
func (m *Model) KVPool() *llm.BlockPool { return m.kv.pool }

// SetKVCacheBytes implements llm.Paged.
func (m *Model) SetKVCacheBytes(bytes int64) error { return m.kv.pool.ResizeBytes(bytes) }

// Trim implements llm.Paged: once no cache holds a block, it frees every
// segment (a busy pool keeps its memory: the segments in use are not
// known to be whole).
func (m *Model) Trim() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.x == nil || m.kv.pool.Used() > 0 {
		return
	}
	for i, b := range m.kv.segs {
		if !b.Nil() && m.x.Free(b) == nil {
			m.caches -= int64(b.Bytes)
			m.kv.segs[i] = Buf{}
		}
	}
}

// Cache is a sequence's key/value cache on the GPU: an llm.BlockTable of
// device addresses (blocks; its Reserve, Advance and Rollback only under
// the model's lock, from Forward), and its copy on the device (table,
// [block][layer]; host holds what was uploaded).
type Cache struct {
	blocks *llm.BlockTable[uint64]
	m      *Model
	table  Buf
	host   []uint64
}

func (c *Cache) Len() int       { return c.blocks.Len() }
func (c *Cache) Cap() int       { return c.blocks.Cap() }
func (c *Cache) Truncate(n int) { c.blocks.Truncate(n) }

// Need implements llm.PagedCache.
func (c *Cache) Need(n int) int { return c.blocks.Need(n) }

// Blocks implements llm.PagedCache.
func (c *Cache) Blocks() int { return c.blocks.Blocks() }

// Bytes is the memory of the blocks the cache holds.
func (c *Cache) Bytes() int64 { return c.blocks.Bytes() }

// Closed reports whether the cache was closed.
func (c *Cache) Closed() bool { return c.blocks.Closed() }

// NewCache implements llm.Backend: an empty cache that may grow to
// capacity tokens, holding only its block table until tokens are written.
func (m *Model) NewCache(capacity int) (llm.Cache, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.newCache(capacity)
}

func (m *Model) newCache(capacity int) (*Cache, error) {
	if m.x == nil {
		return nil, errModelClosed
	}
	c := m.cfg
	if capacity <= 0 || capacity > c.MaxPositions {
		return nil, fmt.Errorf("cache capacity %d outside 1..%d (max_position_embeddings)", capacity, c.MaxPositions)
	}
	rows := (capacity + llm.DefaultBlockTokens - 1) / llm.DefaultBlockTokens
	t, err := m.x.Alloc(rows * c.Layers * 8)
	if err != nil {
		return nil, fmt.Errorf("the block table of a %d-token cache: %w", capacity, err)
	}
	m.caches += int64(t.Bytes)
	return &Cache{blocks: llm.NewBlockTable(m.kv.pool, m.kv.pool.Windows(), capacity, m.blockAddr),
		m: m, table: t, host: make([]uint64, rows*c.Layers)}, nil
}

// Close implements llm.Cache: it gives the cache's blocks back to the
// pool and frees its table (nothing to free when its model is closed
// already: the context freed it).
func (c *Cache) Close() error {
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	return c.close()
}

// close is Close with m.mu held.
func (c *Cache) close() error {
	if c.Closed() {
		return nil
	}
	c.blocks.Close()
	t := c.table
	c.table = Buf{}
	if c.m.x == nil {
		return nil
	}
	if err := c.m.x.Free(t); err != nil {
		return fmt.Errorf("closing a GPU cache: %w", err)
	}
	c.m.caches -= int64(t.Bytes)
	return nil
}

// sync brings the device table's rows for the n positions after Len up to
// date with the blocks the cache holds (Reserve took them), uploading the
// rows that changed (m.mu held).
func (c *Cache) sync(n int) error {
	if n <= 0 {
		return nil
	}
	L, B := c.m.cfg.Layers, llm.DefaultBlockTokens
	addr := func(i int) uint64 { a, _ := c.blocks.Block(i%L, i/L); return a } // 0 where the cache holds none
	// The changed entries [lo, hi) of the rows the pass writes; a decode
	// step mostly finds none and allocates nothing.
	lo, hi := -1, -1
	for i := c.Len() / B * L; i < ((c.Len()+n-1)/B+1)*L; i++ {
		if c.host[i] != addr(i) {
			if lo < 0 {
				lo = i
			}
			hi = i + 1
		}
	}
	if lo < 0 {
		return nil
	}
	rows := make([]uint64, hi-lo)
	for i := range rows {
		rows[i] = addr(lo + i)
	}
	// host records only what was queued for the device (an upload that
	// failed leaves it as it was).
	if err := Upload(c.m.x, c.table.Offset(lo*8), rows); err != nil {
		return err
	}
	copy(c.host[lo:hi], rows)
	return nil
}

var (
	_ llm.Paged      = (*Model)(nil)
	_ llm.PagedCache = (*Cache)(nil)
)
