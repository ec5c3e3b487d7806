package llm

import (
	"context"
	"fmt"
	"math"
	"sync/atomic"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
)

// KVCache is the CPU backend's cache: per layer, keys and values stored
// [kv_heads][slots][head_dim] so each head's keys are one contiguous
// matrix for the attention products. A layer attending to every earlier
// position has a slot per position (the capacity); a sliding-window layer
// whose window W is smaller than that keeps only the last W positions,
// position p in slot p mod W (a ring), since no query will look further
// back.
type KVCache struct {
	k, v    [][]float32
	slots   []int // per layer: cap, or the window of a ring
	n, cap  int
	kvh, hd int
	// written is the number of positions whose keys went into the rings
	// since they were last known whole: Truncate can go back only as far
	// as the rings still hold the window before the new end.
	written int
	open    *atomic.Int64 // the model's count of open cache bytes
	bytes   int64
}

// NewCache implements Backend. Layers with a sliding window get a ring
// of min(window, capacity) slots, so the cache of a sliding layer never
// outgrows its window; Bytes and Memory count what is allocated.
func (m *Model) NewCache(capacity int) (Cache, error) {
	c := m.Cfg
	if capacity <= 0 {
		return nil, fmt.Errorf("cache capacity must be positive, got %d", capacity)
	}
	kc := &KVCache{cap: capacity, kvh: c.KVHeads, hd: c.HeadDim}
	for l := 0; l < c.Layers; l++ {
		s := capacity
		if w := c.Window(l); w > 0 {
			s = min(w, capacity)
		}
		kc.slots = append(kc.slots, s)
		kc.k = append(kc.k, make([]float32, c.KVHeads*s*c.HeadDim))
		kc.v = append(kc.v, make([]float32, c.KVHeads*s*c.HeadDim))
	}
	kc.bytes = kc.Bytes()
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
	c.k, c.v, c.slots, c.n, c.cap = nil, nil, nil, 0, 0
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
		n += int64(len(b.AttnNorm) + len(b.MLPNorm) + len(b.QNorm) + len(b.KNorm) + len(b.PostAttnNorm) + len(b.PostMLPNorm))
		for _, l := range b.Linears() {
			n += int64((*l.L).In()) * int64((*l.L).Out())
		}
		if b.MoE != nil {
			n += int64(len(b.MoE.Router.W))
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

// Bytes is the memory the cache reserves (keys and values, all layers; a
// sliding layer's ring counts its window, not the capacity).
func (c *KVCache) Bytes() int64 {
	var n int64
	for _, s := range c.slots {
		n += int64(2*c.kvh*s*c.hd) * 4
	}
	return n
}

// Truncate forgets everything after the first n tokens. A sliding
// layer's ring has overwritten what lay a window before the tokens it
// forgets, so with rings the next Forward fails if more than one token
// was dropped past the window (its error says so); full layers can go
// back anywhere.
func (c *KVCache) Truncate(n int) {
	if n >= 0 && n < c.n {
		c.n = n
	}
}

// ringsLost reports whether a ring no longer holds the window before
// position c.n (Truncate went back too far).
func (c *KVCache) ringsLost() error {
	for l, s := range c.slots {
		if s < c.cap && c.written > max(s, c.n+1) {
			return fmt.Errorf("layer %d keeps only the last %d positions (its sliding window) and the cache was truncated from %d to %d tokens: start a new cache", l, s, c.written, c.n)
		}
	}
	return nil
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
		if err := kc.ringsLost(); err != nil {
			return fmt.Errorf("step %d: %w", i, err)
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

	// Embeddings (scaled by √hidden in Gemma) and each rotary
	// embedding's tables, row by row of the batch.
	half := hd / 2
	tables := map[*rope]*ropeTable{}
	for _, rp := range m.ropes {
		if tables[rp] == nil {
			tables[rp] = &ropeTable{make([]float32, rows*half), make([]float32, rows*half)}
		}
	}
	scale := float32(c.EmbedScale)
	r := 0
	for i, s := range steps {
		for rp, t := range tables {
			cs, sn := rp.table(caches[i].n, len(s.Tokens))
			copy(t.cos[r*half:], cs)
			copy(t.sin[r*half:], sn)
		}
		for _, t := range s.Tokens {
			xr := x[r*H : (r+1)*H]
			copy(xr, m.Embed[t*H:(t+1)*H])
			if scale != 0 {
				for j := range xr {
					xr[j] *= scale
				}
			}
			r++
		}
	}

	lens := make([]int, len(steps))
	for i, s := range steps {
		lens[i] = len(s.Tokens)
	}
	eps := c.RMSNormEps
	for l, b := range m.Blocks {
		if err := ctx.Err(); err != nil {
			return err
		}
		RMSNorm(h, x, b.AttnNorm, rows, eps)
		t := tables[m.ropes[l]]
		m.selfAttention(att, b, h, l, lens, caches, t.cos, t.sin, q, k, v)
		b.O.Forward(tmp, att, rows)
		if b.PostAttnNorm != nil {
			RMSNorm(tmp, tmp, b.PostAttnNorm, rows, eps)
		}
		add(x, tmp)

		RMSNorm(h, x, b.MLPNorm, rows, eps)
		if b.MoE != nil {
			b.MoE.Forward(tmp, h, rows)
		} else {
			b.Gate.Forward(g, h, rows)
			b.Up.Forward(u, h, rows)
			GatedAct(c.Act, g, u)
			b.Down.Forward(tmp, g, rows)
		}
		if b.PostMLPNorm != nil {
			RMSNorm(tmp, tmp, b.PostMLPNorm, rows, eps)
		}
		add(x, tmp)
	}

	r = 0
	for i, s := range steps {
		n := len(s.Tokens)
		caches[i].n += n
		caches[i].written = caches[i].n
		first := r
		if s.LastOnly {
			first = r + n - 1
		}
		cnt := r + n - first
		RMSNorm(h, x[first*H:(r+n)*H], m.Norm, cnt, eps)
		m.LMHead.Forward(s.Logits, h, cnt)
		r += n
	}
	return nil
}

// ropeTable is one rotary embedding's cos and sin for the rows of a batch.
type ropeTable struct{ cos, sin []float32 }

// selfAttention projects the normed rows h to queries, keys and values,
// norms each head of the queries and keys (QKNorm), rotates them, appends
// keys and values to each sequence's cache (layer l) and writes the
// attention output (before o_proj) to att. lens[i] rows of h belong to
// sequence i; cos and sin are the rotary tables of the rows for this
// layer's rotary embedding.
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
	if b.QNorm != nil {
		RMSNorm(q, q, b.QNorm, rows*nH, c.RMSNormEps)
		RMSNorm(k, k, b.KNorm, rows*nKV, c.RMSNormEps)
	}
	rp := m.ropes[b.Layer]
	rp.apply(q, rows, nH, hd, cos, sin)
	rp.apply(k, rows, nKV, hd, cos, sin)
	window := c.Window(b.Layer)
	scale := attnScale(c)
	r0 := 0
	for i, n := range lens {
		kc := caches[i]
		ko, vo, qo, out := k[r0*nKV*hd:], v[r0*nKV*hd:], q[r0*nH*hd:], att[r0*nH*hd:]
		if s := kc.slots[l]; s < kc.cap {
			// A ring: the window's earlier keys in position order, then
			// the new ones.
			K, V, base := kc.window(l, ko, vo, n)
			attention(out, qo, K, V, (kc.n-base+n)*hd, base, kc.n, n, nH, nKV, hd, scale, window)
			kc.store(l, ko, vo, n)
		} else {
			kc.store(l, ko, vo, n)
			attention(out, qo, kc.k[l], kc.v[l], s*hd, 0, kc.n, n, nH, nKV, hd, scale, window)
		}
		r0 += n
	}
}

// attnScale is the factor of q·kᵀ: head_dim^-½, or Gemma's
// query_pre_attn_scalar^-½.
func attnScale(c *checkpoint.Config) float32 {
	d := float64(c.HeadDim)
	if c.QueryPreAttnScalar > 0 {
		d = c.QueryPreAttnScalar
	}
	return float32(1 / math.Sqrt(d))
}

// store writes n new rows of keys and values ([n][kv_heads×hd]) for the
// positions after the kc.n cached ones into layer l, each in its slot
// (only the last ring-size rows of a ring, the others being overwritten).
func (c *KVCache) store(l int, k, v []float32, n int) {
	s := c.slots[l]
	for t := max(0, n-s); t < n; t++ {
		slot := (c.n + t) % s
		for j := 0; j < c.kvh; j++ {
			dst := (j*s + slot) * c.hd
			src := (t*c.kvh + j) * c.hd
			copy(c.k[l][dst:dst+c.hd], k[src:src+c.hd])
			copy(c.v[l][dst:dst+c.hd], v[src:src+c.hd])
		}
	}
}

// window gathers what n new queries of ring layer l attend to: the keys
// and values of the last min(kc.n, slots−1) cached positions from the
// ring, then the n new rows k and v ([n][kv_heads×hd]), per kv head
// contiguous in position order. base is the position of the first.
func (c *KVCache) window(l int, k, v []float32, n int) (K, V []float32, base int) {
	s, hd := c.slots[l], c.hd
	prev := min(c.n, s-1)
	base = c.n - prev
	S := prev + n
	K, V = make([]float32, c.kvh*S*hd), make([]float32, c.kvh*S*hd)
	for j := 0; j < c.kvh; j++ {
		for t := 0; t < prev; t++ {
			src := (j*s + (base+t)%s) * hd
			dst := (j*S + t) * hd
			copy(K[dst:dst+hd], c.k[l][src:src+hd])
			copy(V[dst:dst+hd], c.v[l][src:src+hd])
		}
		for t := 0; t < n; t++ {
			src := (t*c.kvh + j) * hd
			dst := (j*S + prev + t) * hd
			copy(K[dst:dst+hd], k[src:src+hd])
			copy(V[dst:dst+hd], v[src:src+hd])
		}
	}
	return K, V, base
}

// attnBlock is how many query rows share one scores buffer: causal
// attention then only computes keys up to the block's last row, which
// halves the work of a long prefill.
const attnBlock = 256

// attention computes softmax(scale·q·kᵀ + causal mask)·v for n new query
// rows of one sequence at positions pos0 … pos0+n−1. K and V hold, for
// each kv head (stride values apart), the keys and values of positions
// base, base+1, … up to pos0+n−1, [position][hd]. q and out are
// [n][heads×hd]. With a sliding window W > 0 the row at position p sees
// only keys p−W+1 … p (and a block of rows computes only the keys its
// rows can see).
func attention(out, q, K, V []float32, stride, base, pos0, n, heads, kvh, hd int, scale float32, window int) {
	group := heads / kvh
	ld := heads * hd
	mat.ParallelFor(heads, 1, func(h0, h1 int) {
		scores := make([]float32, min(n, attnBlock)*(pos0-base+n))
		for h := h0; h < h1; h++ {
			kv := h / group
			Kh, Vh := K[kv*stride:], V[kv*stride:]
			for r0 := 0; r0 < n; r0 += attnBlock {
				nb := min(attnBlock, n-r0)
				S := pos0 - base + r0 + nb // keys visible to the block's last row
				lo := 0                    // the first key its first row sees
				if window > 0 {
					lo = max(0, pos0-base+r0+1-window)
				}
				L := S - lo
				mat.GemmSerial(false, true, nb, L, hd, scale, q[r0*ld+h*hd:], ld, Kh[lo*hd:], hd, 0, scores, L)
				for i := 0; i < nb; i++ {
					row := scores[i*L : (i+1)*L]
					visible := pos0 - base + r0 + i + 1 - lo
					first := 0
					if window > 0 {
						first = max(0, visible-window)
					}
					softmax(row[first:visible])
					clear(row[:first])
					clear(row[visible:])
				}
				mat.GemmSerial(false, false, nb, hd, L, 1, scores, L, Vh[lo*hd:], hd, 0, out[r0*ld+h*hd:], ld)
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
