package llm

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
)

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
// layers dequantized) and the blocks the open caches hold; a forward
// pass's activations are allocated per call and not kept.
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
	kv := m.KVPool()
	return Memory{Weights: 4 * n, Caches: int64(kv.Used()) * kv.BlockBytes()}, nil
}

// Close implements Backend. The CPU model's memory belongs to the garbage
// collector (and its mapped checkpoint to whoever opened it), so there is
// nothing to release.
func (m *Model) Close() error { return nil }

// Forward implements Backend: the whole network for a batch of sequences.
// Linear layers run on all rows of the batch at once; attention runs per
// sequence against its own cache.
func (m *Model) Forward(ctx context.Context, steps []Step) error {
	c := m.Cfg
	rows := 0
	caches := make([]*KVCache, len(steps))
	pool := m.KVPool()
	for i, s := range steps {
		kc, ok := s.Cache.(*KVCache)
		if !ok {
			return fmt.Errorf("step %d: cache is %T, not a CPU KVCache", i, s.Cache)
		}
		if kc.Closed() {
			return fmt.Errorf("step %d: the cache is closed", i)
		}
		if kc.Pool() != pool {
			return fmt.Errorf("step %d: the cache belongs to another model", i)
		}
		if err := kc.RingsLost(); err != nil {
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
		for _, o := range caches[:i] {
			if o == kc {
				return fmt.Errorf("step %d: the cache of step %d again", i, slices.Index(caches, kc))
			}
		}
		caches[i] = kc
		rows += len(s.Tokens)
	}
	// The blocks the new tokens are written to, for all steps or none.
	blocks, ns := make([]*BlockTable[*kvBlock], len(steps)), make([]int, len(steps))
	for i, s := range steps {
		blocks[i], ns[i] = caches[i].BlockTable, len(s.Tokens)
	}
	if err := ReserveAll(pool, blocks, ns); err != nil {
		return err
	}
	if rows == 0 {
		return nil
	}
	done := false
	defer func() {
		if !done { // cancelled or panicked: give back what was reserved
			for _, kc := range caches {
				kc.Rollback()
			}
		}
	}()
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

	scratch := &kvScratch{}
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
		m.selfAttention(att, b, h, l, lens, caches, t.cos, t.sin, q, k, v, scratch)
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
		caches[i].Advance(n)
		first := r
		if s.LastOnly {
			first = r + n - 1
		}
		cnt := r + n - first
		RMSNorm(h, x[first*H:(r+n)*H], m.Norm, cnt, eps)
		m.LMHead.Forward(s.Logits, h, cnt)
		r += n
	}
	done = true
	return nil
}

// ropeTable is one rotary embedding's cos and sin for the rows of a batch.
type ropeTable struct{ cos, sin []float32 }

// selfAttention projects the normed rows h to queries, keys and values,
// norms each head of the queries and keys (QKNorm), rotates them, appends
// keys and values to each sequence's cache (layer l, blocks reserved) and
// writes the attention output (before o_proj) to att. lens[i] rows of h
// belong to sequence i; cos and sin are the rotary tables of the rows for
// this layer's rotary embedding. The keys and values each sequence attends
// to are gathered in scratch.
func (m *Model) selfAttention(att []float32, b *Block, h []float32, l int, lens []int, caches []*KVCache, cos, sin, q, k, v []float32, scratch *kvScratch) {
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
		// The earlier keys in position order (a sliding layer's window
		// of them), then the new ones.
		K, V := scratch.get(nKV * (kc.n + n) * hd)
		base, S := kc.gather(l, ko, vo, n, K, V)
		attention(out, qo, K, V, S*hd, base, kc.n, n, nH, nKV, hd, scale, window)
		kc.store(l, ko, vo, n)
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
