package llm

import (
	"fmt"
	"math"
	"slices"
	"sync"

	"github.com/llmq/llmq/llm/checkpoint"
)

// DefaultBlockTokens is the positions a KV-cache block holds.
const DefaultBlockTokens = 16

// BlockPool is paged attention's block allocator (Kwon et al. 2023,
// "vLLM"): a fixed number of key/value blocks, each holding BlockTokens
// positions of one layer, handed out to caches as their sequences grow and
// taken back when they shrink or close. It only counts and names blocks
// (ids in [0, Blocks)); the backend maps an id to memory — the CPU
// allocates a block's floats when it is handed out and drops them when it
// comes back, a GPU would index one buffer reserved up front.
//
// A scheduler sizes its batches by it: BlocksFor says what a sequence of
// n tokens can hold at most, Free what is left, and PagedCache.Need what
// the next step of a sequence takes.
type BlockPool struct {
	mu          sync.Mutex
	blockTokens int
	blockBytes  int64
	windows     []int // per layer: the sliding window, or 0
	total       int   // blocks it may hand out
	used        int
	free        []int // ids handed back, reused first
	next        int   // ids from next on were never handed out
	peak        int
}

// Unbounded is the size of a pool with no limit (Blocks reports it).
const Unbounded = math.MaxInt32

// NewBlockPool makes a pool of blocks (≤ 0: Unbounded) for cfg's layers,
// each block blockTokens positions of one layer's keys and values taking
// blockBytes of memory.
func NewBlockPool(cfg *checkpoint.Config, blockTokens, blocks int, blockBytes int64) *BlockPool {
	windows := make([]int, cfg.Layers)
	for l := range windows {
		windows[l] = cfg.Window(l)
	}
	return NewBlockPoolFor(windows, blockTokens, blocks, blockBytes)
}

// NewBlockPoolFor is NewBlockPool for layers whose caches keep the given
// windows (0: every position), which a backend may set wider than the
// model's (the GPU keeps every position of a sliding layer).
func NewBlockPoolFor(windows []int, blockTokens, blocks int, blockBytes int64) *BlockPool {
	if blocks <= 0 {
		blocks = Unbounded
	}
	return &BlockPool{blockTokens: blockTokens, blockBytes: blockBytes, total: blocks, windows: slices.Clone(windows)}
}

// Windows is the window each layer's caches keep (0: every position).
func (p *BlockPool) Windows() []int { return slices.Clone(p.windows) }

// ResizeBytes bounds the pool to bytes of blocks (≤ 0: Unbounded), what a
// Paged backend's SetKVCacheBytes does; it fails when bytes hold no block
// or caches already hold more.
func (p *BlockPool) ResizeBytes(bytes int64) error {
	if bytes <= 0 {
		return p.Resize(0)
	}
	blocks := bytes / p.blockBytes
	if blocks < 1 {
		return fmt.Errorf("a KV cache of %d bytes holds no block (one block is %d bytes: %d positions of one layer)", bytes, p.blockBytes, p.blockTokens)
	}
	return p.Resize(int(min(blocks, Unbounded-1)))
}

// BlockTokens is the positions one block holds.
func (p *BlockPool) BlockTokens() int { return p.blockTokens }

// BlockBytes is the memory of one block.
func (p *BlockPool) BlockBytes() int64 { return p.blockBytes }

// Blocks is how many blocks the pool may hand out (Unbounded when it has
// no limit).
func (p *BlockPool) Blocks() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.total
}

// Free is how many blocks are left to hand out.
func (p *BlockPool) Free() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.total - p.used
}

// Used is how many blocks caches hold now.
func (p *BlockPool) Used() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.used
}

// Peak is the most blocks held at once since the pool was made.
func (p *BlockPool) Peak() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.peak
}

// Resize sets the number of blocks (≤ 0: Unbounded); it fails when caches
// already hold more.
func (p *BlockPool) Resize(blocks int) error {
	if blocks <= 0 {
		blocks = Unbounded
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.used > blocks {
		return fmt.Errorf("KV cache pool: %d blocks are in use, more than the %d asked for", p.used, blocks)
	}
	p.total = blocks
	return nil
}

// Alloc hands out n blocks, all or none.
func (p *BlockPool) Alloc(n int) ([]int, error) {
	if n <= 0 {
		return nil, nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.used+n > p.total {
		return nil, fmt.Errorf("KV cache pool exhausted: %d blocks wanted, %d of %d free", n, p.total-p.used, p.total)
	}
	ids := make([]int, n)
	for i := range ids {
		if k := len(p.free); k > 0 {
			ids[i], p.free = p.free[k-1], p.free[:k-1]
		} else {
			ids[i] = p.next
			p.next++
		}
	}
	p.used += n
	p.peak = max(p.peak, p.used)
	return ids, nil
}

// Release takes blocks back.
func (p *BlockPool) Release(ids ...int) {
	if len(ids) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.free = append(p.free, ids...)
	p.used -= len(ids)
}

// BlocksFor is the most blocks a sequence of up to n tokens holds at once,
// summed over the layers: ⌈n/BlockTokens⌉ for a layer that attends to
// everything; a sliding-window layer keeps only its window's blocks (and,
// while a step's new tokens are stored, those of the window before them).
// A sequence for which it exceeds Blocks can never run.
func (p *BlockPool) BlocksFor(n int) int {
	B := p.blockTokens
	all := (n + B - 1) / B
	total := 0
	for _, w := range p.windows {
		if w > 0 {
			total += min(all, 2*((w+B-1)/B+1))
		} else {
			total += all
		}
	}
	return total
}

// MaxTokens is the longest sequence the whole pool can hold (at most
// limit, which it returns for an unbounded pool).
func (p *BlockPool) MaxTokens(limit int) int {
	total := p.Blocks()
	if p.BlocksFor(limit) <= total {
		return limit
	}
	lo, hi := 0, limit // BlocksFor(lo) ≤ total < BlocksFor(hi)
	for hi-lo > 1 {
		mid := (lo + hi) / 2
		if p.BlocksFor(mid) <= total {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}
