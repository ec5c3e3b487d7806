package llm

import (
	"context"
	"fmt"
	"math"
	"sync/atomic"

	"github.com/llmq/llmq/llm/mat"
)

// KVCache is the CPU backend's cache: per layer, keys and values stored
// [kv_heads][capacity][head_dim] so each head's keys are one contiguous
// matrix for the attention products.
type KVCache struct {
	k, v    [][]float32
	n, cap  int
	kvh, hd int
	open    *atomic.Int64 // the model's count of open cache bytes
	bytes   int64
}

// NewCache implements Backend.
func (m *Model) NewCache(capacity int) (Cache, error) {
	c := m.Cfg
	if capacity <= 0 {
		return nil, fmt.Errorf("cache capacity must be positive, got %d", capacity)
	}
	kc := &KVCache{cap: capacity, kvh: c.KVHeads, hd: c.HeadDim}
	for l := 0; l < c.Layers; l++ {
		kc.k = append(kc.k, make([]float32, c.KVHeads*capacity*c.HeadDim))
		kc.v = append(kc.v, make([]float32, c.KVHeads*capacity*c.HeadDim))
	}
	kc.bytes = int64(2*c.Layers*c.KVHeads*capacity*c.HeadDim) * 4
	kc.open = &m.caches
	kc.open.Add(kc.bytes)
	return kc, nil
}

// Close implements Cache: it drops the keys and values (the garbage
// collector reclaims them) and stops counting them in Memory.
func (c *KVCache) Close() error {
	if c.open != nil {
		c.open.Add(-c.bytes)
		c.open = nil
	}
	c.k, c.v, c.n, c.cap = nil, nil, 0, 0
	return nil
}

// WindowNLL implements Backend with LogitsNLL.
func (m *Model) WindowNLL(ctx context.Context, ids []int) (float64, int, error) {
	return LogitsNLL(ctx, m, ids)
}

// LogitsNLL is WindowNLL for any backend that brings logits back: one
// forward pass over the window from an empty cache with every position's
// logits, then NLL of each next token.
func LogitsNLL(ctx context.Context, b Backend, ids []int) (float64, int, error) {
	if len(ids) < 2 {
		return 0, 0, fmt.Errorf("a window needs at least 2 tokens, got %d", len(ids))
	}
	V := b.Config().Vocab
	cache, err := b.NewCache(len(ids))
	if err != nil {
		return 0, 0, err
	}
	defer cache.Close()
	logits := make([]float32, len(ids)*V)
	if err := b.Forward(ctx, []Step{{Cache: cache, Tokens: ids, Logits: logits}}); err != nil {
		return 0, 0, err
	}
	var sum float64
	for i := 0; i+1 < len(ids); i++ {
		sum += NLL(logits[i*V:(i+1)*V], ids[i+1])
	}
	return sum, len(ids) - 1, nil
}

// Memory implements Backend: the float32 weights as loaded (quantized
// layers dequantized) and the open caches; a forward pass's activations
// are allocated per call and not kept.
func (m *Model) Memory() (Memory, error) {
	n := int64(len(m.Embed) + len(m.Norm))
	for _, b := range m.Blocks {
		n += int64(len(b.AttnNorm) + len(b.MLPNorm))
		for _, l := range b.Linears() {
			n += int64((*l.L).In()) * int64((*l.L).Out())
		}
	}
	if m.LMHead != nil && !m.TiedHead {
		n += int64(m.LMHead.In()) * int64(m.LMHead.Out())
	}
	return Memory{Weights: 4 * n, Caches: m.caches.Load()}, nil
}

// Close implements Backend. The CPU model's memory belongs to the garbage
// collector (and its mapped checkpoint to whoever opened it), so there is
// nothing to release.
func (m *Model) Close() error { return nil }

func (c *KVCache) Len() int { return c.n }
func (c *KVCache) Cap() int { return c.cap }

// Bytes is the memory the cache reserves (keys and values, all layers).
func (c *KVCache) Bytes() int64 { return int64(2*len(c.k)*c.kvh*c.cap*c.hd) * 4 }
func (c *KVCache) Truncate(n int) {
	if n >= 0 && n < c.n {
		c.n = n
	}
}

// Forward implements Backend: the whole network for a batch of sequences.
// Linear layers run on all rows of the batch at once; attention runs per
// sequence against its own cache.
func (m *Model) Forward(ctx context.Context, steps []Step) error {
	c := m.Cfg
	rows := 0
	caches := make([]*KVCache, len(steps))
	for i, s := range steps {
		kc, ok := s.Cache.(*KVCache)
		if !ok {
			return fmt.Errorf("step %d: cache is %T, not a CPU KVCache", i, s.Cache)
		}
		if kc.open == nil && kc.k == nil {
			return fmt.Errorf("step %d: the cache is closed", i)
		}
		if kc.n+len(s.Tokens) > kc.cap {
			return fmt.Errorf("step %d: %d cached + %d new tokens exceed the cache capacity %d", i, kc.n, len(s.Tokens), kc.cap)
		}
		want := len(s.Tokens) * c.Vocab
		if s.LastOnly {
			want = c.Vocab
		}
		if len(s.Logits) < want {
			return fmt.Errorf("step %d: logits buffer holds %d values, need %d", i, len(s.Logits), want)
		}
		for _, t := range s.Tokens {
			if t < 0 || t >= c.Vocab {
				return fmt.Errorf("step %d: token id %d outside the vocabulary [0, %d)", i, t, c.Vocab)
			}
		}
		caches[i] = kc
		rows += len(s.Tokens)
	}
	if rows == 0 {
		return nil
	}
	H, hd, nH, nKV := c.Hidden, c.HeadDim, c.Heads, c.KVHeads
	x := make([]float32, rows*H)
	h := make([]float32, rows*H)
	tmp := make([]float32, rows*H)
	q := make([]float32, rows*nH*hd)
	k := make([]float32, rows*nKV*hd)
	v := make([]float32, rows*nKV*hd)
	att := make([]float32, rows*nH*hd)
	g := make([]float32, rows*c.Intermediate)
	u := make([]float32, rows*c.Intermediate)

	// Embeddings and rotary tables, row by row of the batch.
	half := hd / 2
	cos, sin := make([]float32, rows*half), make([]float32, rows*half)
	r := 0
	for i, s := range steps {
		cs, sn := m.rope.table(caches[i].n, len(s.Tokens))
		copy(cos[r*half:], cs)
		copy(sin[r*half:], sn)
		for _, t := range s.Tokens {
			copy(x[r*H:(r+1)*H], m.Embed[t*H:(t+1)*H])
			r++
		}
	}

	lens := make([]int, len(steps))
	for i, s := range steps {
		lens[i] = len(s.Tokens)
	}
	for l, b := range m.Blocks {
		if err := ctx.Err(); err != nil {
			return err
		}
		RMSNorm(h, x, b.AttnNorm, rows, c.RMSNormEps)
		m.selfAttention(att, b, h, l, lens, caches, cos, sin, q, k, v)
		b.O.Forward(tmp, att, rows)
		add(x, tmp)

		RMSNorm(h, x, b.MLPNorm, rows, c.RMSNormEps)
		b.Gate.Forward(g, h, rows)
		b.Up.Forward(u, h, rows)
		SwiGLU(g, u)
		b.Down.Forward(tmp, g, rows)
		add(x, tmp)
	}

	r = 0
	for i, s := range steps {
		n := len(s.Tokens)
		caches[i].n += n
		first := r
		if s.LastOnly {
			first = r + n - 1
		}
		cnt := r + n - first
		RMSNorm(h, x[first*H:(r+n)*H], m.Norm, cnt, c.RMSNormEps)
		m.LMHead.Forward(s.Logits, h, cnt)
		r += n
	}
	return nil
}

// selfAttention projects the normed rows h to queries, keys and values,
// rotates them, appends keys and values to each sequence's cache (layer l)
// and writes the attention output (before o_proj) to att. lens[i] rows of
// h belong to sequence i; cos and sin are the rotary tables of the rows.
func (m *Model) selfAttention(att []float32, b *Block, h []float32, l int, lens []int, caches []*KVCache, cos, sin, q, k, v []float32) {
	c := m.Cfg
	hd, nH, nKV := c.HeadDim, c.Heads, c.KVHeads
	rows := 0
	for _, n := range lens {
		rows += n
	}
	b.Q.Forward(q, h, rows)
	b.K.Forward(k, h, rows)
	b.V.Forward(v, h, rows)
	m.rope.apply(q, rows, nH, hd, cos, sin)
	m.rope.apply(k, rows, nKV, hd, cos, sin)
	r0 := 0
	for i, n := range lens {
		kc := caches[i]
		kc.store(l, k[r0*nKV*hd:], v[r0*nKV*hd:], n)
		attention(att[r0*nH*hd:], q[r0*nH*hd:], kc, l, n, nH, c.SlidingWindow)
		r0 += n
	}
}

// store writes n new rows of keys and values ([n][kv_heads×hd]) at the end
// of layer l's cache.
func (c *KVCache) store(l int, k, v []float32, n int) {
	for t := 0; t < n; t++ {
		for j := 0; j < c.kvh; j++ {
			dst := (j*c.cap + c.n + t) * c.hd
			src := (t*c.kvh + j) * c.hd
			copy(c.k[l][dst:dst+c.hd], k[src:src+c.hd])
			copy(c.v[l][dst:dst+c.hd], v[src:src+c.hd])
		}
	}
}

// attnBlock is how many query rows share one scores buffer: causal
// attention then only computes keys up to the block's last row, which
// halves the work of a long prefill.
const attnBlock = 256

// attention computes softmax(q·kᵀ/√hd + causal mask)·v for n new query rows
// of one sequence, whose keys and values (layer l) are already in the cache
// after the kc.n earlier ones. q and out are [n][heads×hd]. With a sliding
// window W > 0 the row at position p sees only keys p−W+1 … p.
func attention(out, q []float32, kc *KVCache, l, n, heads, window int) {
	hd, pos0 := kc.hd, kc.n
	group := heads / kc.kvh
	ld := heads * hd
	scale := float32(1 / math.Sqrt(float64(hd)))
	mat.ParallelFor(heads, 1, func(h0, h1 int) {
		scores := make([]float32, min(n, attnBlock)*(pos0+n))
		for h := h0; h < h1; h++ {
			kv := h / group
			K := kc.k[l][kv*kc.cap*hd:]
			V := kc.v[l][kv*kc.cap*hd:]
			for r0 := 0; r0 < n; r0 += attnBlock {
				nb := min(attnBlock, n-r0)
				S := pos0 + r0 + nb // keys visible to the block's last row
				mat.GemmSerial(false, true, nb, S, hd, scale, q[r0*ld+h*hd:], ld, K, hd, 0, scores, S)
				for i := 0; i < nb; i++ {
					row := scores[i*S : (i+1)*S]
					visible := pos0 + r0 + i + 1
					first := 0
					if window > 0 {
						first = max(0, visible-window)
					}
					softmax(row[first:visible])
					clear(row[:first])
					clear(row[visible:])
				}
				mat.GemmSerial(false, false, nb, hd, S, 1, scores, S, V, hd, 0, out[r0*ld+h*hd:], ld)
			}
		}
	})
}

// softmax normalises x in place.
func softmax(x []float32) {
	mx := x[0]
	for _, v := range x {
		mx = max(mx, v)
	}
	var sum float32
	for i, v := range x {
		e := mat.Exp32(v - mx)
		x[i] = e
		sum += e
	}
	inv := 1 / sum
	for i := range x {
		x[i] *= inv
	}
}

// RMSNorm writes out[r] = x[r] / sqrt(mean(x[r]²) + eps) ⊙ w for each row.
func RMSNorm(out, x, w []float32, rows int, eps float64) {
	d := len(w)
	mat.ParallelFor(rows, 64, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			xr, or := x[r*d:(r+1)*d], out[r*d:(r+1)*d]
			var ss float64
			for _, v := range xr {
				ss += float64(v) * float64(v)
			}
			inv := float32(1 / math.Sqrt(ss/float64(d)+eps))
			for i, v := range xr {
				or[i] = v * inv * w[i]
			}
		}
	})
}

// SwiGLU sets g = SiLU(g) ⊙ u, SiLU(z) = z·σ(z).
func SwiGLU(g, u []float32) {
	mat.ParallelFor(len(g), 4096, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			z := g[i]
			g[i] = z / (1 + mat.Exp32(-z)) * u[i]
		}
	})
}

func add(x, y []float32) {
	for i := range x {
		x[i] += y[i]
	}
}
