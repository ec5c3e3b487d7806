//go:build cgo

package cuda

import (
	"context"
	"fmt"
	"math"
	"strings"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
	"github.com/llmq/llmq/pack"
	"github.com/nlpodyssey/safetensors"
	"github.com/x448/float16"
)

// Model is the GPU Backend: the network of package llm with its weights
// resident on the GPU — packed 4-bit linears in the W4A16 kernel's layout,
// unquantized linears, embeddings and lm_head in fp16 through cuBLAS — an
// fp32 residual stream and fp16 activations. Decode steps (every sequence
// adding one token) replay a CUDA graph captured per batch size; other
// passes launch their kernels one by one.
type Model struct {
	lib       *Lib
	cfg       *checkpoint.Config
	dev       Device
	blocks    []*gpuBlock
	embed     Buf // fp16 [vocab][hidden]
	norm      Buf // fp32 [hidden]
	lmHead    *gpuLinear
	cos, sin  Buf // rotary tables [max_position_embeddings][head_dim/2]
	scratch   Buf // K·N fp16: large-M W4 layers dequantize here for cuBLAS
	maxN      int // widest linear (workspace sizing)
	maxPermK  int // widest act-order input (a_perm sizing)
	quantized bool
	weights   int64 // bytes of weights on the GPU

	eager  *acts
	attnWS Buf // the eager passes' attention scratch
	graphs map[[2]int]*decodeGraph
	owned  []Buf
}

type gpuBlock struct {
	attnNorm, mlpNorm          Buf
	q, k, v, o, gate, up, down *gpuLinear
}

// gpuLinear is y = x·Wᵀ (+ b) on the GPU: w4 for a packed layer, w an fp16
// [out][in] matrix otherwise.
type gpuLinear struct {
	in, out int
	w4      *W4
	w, b    Buf
}

// Load uploads a checkpoint (packed or unquantized) to the GPU of lib. It
// first checks that the weights fit in the GPU's free memory.
func Load(lib *Lib, ck *checkpoint.Checkpoint) (*Model, error) {
	c := ck.Config
	dev, err := lib.Device()
	if err != nil {
		return nil, err
	}
	if err := checkFits(ck.Dir, estimateBytes(ck), dev); err != nil {
		return nil, err
	}
	q, err := pack.ParseQuantConfig(c.Quantization)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", ck.Dir, err)
	}
	m := &Model{lib: lib, cfg: c, dev: dev, quantized: q != nil, graphs: map[[2]int]*decodeGraph{}}
	ok := false
	defer func() {
		if !ok {
			m.Close()
		}
	}()
	load := func(ck *checkpoint.Checkpoint, name string, in, out int, bias bool) (llm.Linear, error) {
		return m.loadLinear(ck, q, name, in, out, bias)
	}
	embed, norm, head, err := llm.LoadEmbeddings(ck, load)
	if err != nil {
		return nil, err
	}
	if m.embed, err = m.upload16(embed); err != nil {
		return nil, err
	}
	if m.norm, err = m.upload32(norm); err != nil {
		return nil, err
	}
	switch h := head.(type) {
	case *gpuLinear:
		if h.w4 != nil {
			return nil, fmt.Errorf("%s: a 4-bit lm_head is not supported by the GPU backend yet (it runs checkpoints whose lm_head is unquantized)", ck.Dir)
		}
		m.lmHead = h
	default: // tied: the LM head is the embedding matrix
		m.lmHead = &gpuLinear{in: c.Hidden, out: c.Vocab, w: m.embed}
	}
	cos, sin := llm.RopeTables(c, c.MaxPositions)
	if m.cos, err = m.upload32(cos); err != nil {
		return nil, err
	}
	if m.sin, err = m.upload32(sin); err != nil {
		return nil, err
	}
	for i := 0; i < c.Layers; i++ {
		b, err := llm.LoadBlock(ck, i, load)
		if err != nil {
			return nil, err
		}
		g := &gpuBlock{q: b.Q.(*gpuLinear), k: b.K.(*gpuLinear), v: b.V.(*gpuLinear), o: b.O.(*gpuLinear),
			gate: b.Gate.(*gpuLinear), up: b.Up.(*gpuLinear), down: b.Down.(*gpuLinear)}
		if g.attnNorm, err = m.upload32(b.AttnNorm); err != nil {
			return nil, err
		}
		if g.mlpNorm, err = m.upload32(b.MLPNorm); err != nil {
			return nil, err
		}
		m.blocks = append(m.blocks, g)
	}
	maxKN := 0
	for _, b := range m.blocks {
		for _, l := range []*gpuLinear{b.q, b.k, b.v, b.o, b.gate, b.up, b.down} {
			m.maxN = max(m.maxN, l.out)
			if l.w4 != nil {
				maxKN = max(maxKN, l.in*l.out)
				if !l.w4.Perm.Nil() {
					m.maxPermK = max(m.maxPermK, l.in)
				}
			}
		}
	}
	if maxKN > 0 {
		if m.scratch, err = m.alloc(maxKN * 2); err != nil {
			return nil, err
		}
	}
	ok = true
	return m, nil
}

// checkFits refuses, before anything is allocated, a model that needs
// more memory than the GPU has free.
func checkFits(dir string, need int64, dev Device) error {
	if need > int64(dev.FreeBytes) {
		return fmt.Errorf("%s needs about %.1f GiB of GPU memory for its weights and buffers; %s has %.1f GiB free of %.1f GiB",
			dir, gib(need), dev.Name, gib(int64(dev.FreeBytes)), gib(int64(dev.TotalBytes)))
	}
	return nil
}

// MemoryUsed is the GPU memory in use (by every process), in bytes.
func (m *Model) MemoryUsed() (int64, error) {
	d, err := m.lib.Device()
	return int64(d.TotalBytes) - int64(d.FreeBytes), err
}

func gib(b int64) float64 { return float64(b) / (1 << 30) }

// estimateBytes is the GPU memory a checkpoint's weights take (floating
// tensors as fp16, packed ones as stored) plus the largest dequantize
// scratch and a margin for cuBLAS and activations.
func estimateBytes(ck *checkpoint.Checkpoint) int64 {
	var n int64
	for _, name := range ck.Names() {
		t, err := ck.Tensor(name)
		if err != nil {
			continue
		}
		per := int64(2)
		if t.DType == safetensors.I32 || t.DType == safetensors.F32 && strings.HasSuffix(name, "norm.weight") {
			per = 4
		}
		n += int64(t.Numel()) * per
	}
	c := ck.Config
	n += int64(c.Intermediate) * int64(c.Hidden) * 2 // W4 scratch
	return n + n/20 + 512<<20
}

func (m *Model) alloc(bytes int) (Buf, error) {
	b, err := m.lib.Alloc(bytes)
	if err != nil {
		return b, err
	}
	m.owned = append(m.owned, b)
	return b, nil
}

func (m *Model) upload32(v []float32) (Buf, error) {
	b, err := m.alloc(max(1, len(v)) * 4)
	if err != nil {
		return b, err
	}
	m.weights += int64(len(v)) * 4
	return b, Upload(m.lib, b, v)
}

// upload16 converts to fp16 (in parallel: embeddings of large models have
// half a billion values) and uploads.
func (m *Model) upload16(v []float32) (Buf, error) {
	h := make([]uint16, len(v))
	mat.ParallelFor(len(v), 1<<16, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			h[i] = uint16(float16.Fromfloat32(v[i]))
		}
	})
	b, err := m.alloc(max(1, len(h)) * 2)
	if err != nil {
		return b, err
	}
	m.weights += int64(len(h)) * 2
	return b, Upload(m.lib, b, h)
}

func (m *Model) loadLinear(ck *checkpoint.Checkpoint, q *pack.QuantConfig, name string, in, out int, bias bool) (llm.Linear, error) {
	l := &gpuLinear{in: in, out: out}
	var err error
	if q != nil && q.Stored(ck, name) {
		pl, err := q.Read(ck, name, in, out)
		if err != nil {
			return nil, err
		}
		if pl.Grid.Bits != 4 || pl.Grid.FP8 {
			// The kernel runs 4-bit integer weights; others (FP8, 8-bit)
			// run dequantized, in fp16.
			if l.w, err = m.upload16(pl.Dequantize()); err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
			return m.finishLinear(ck, l, name, out, bias)
		}
		gw, err := pl.GPULayout()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		if l.w4, err = m.lib.UploadW4(gw); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		for _, b := range []Buf{l.w4.B, l.w4.S, l.w4.Z, l.w4.Perm} {
			if !b.Nil() {
				m.owned = append(m.owned, b)
				m.weights += int64(b.Bytes)
			}
		}
	} else {
		d, err := llm.DenseLoader(ck, name, in, out, false)
		if err != nil {
			return nil, err
		}
		if l.w, err = m.upload16(d.(*llm.Dense).W); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	if err != nil {
		return nil, err
	}
	return m.finishLinear(ck, l, name, out, bias)
}

// finishLinear uploads the layer's bias, if it has one.
func (m *Model) finishLinear(ck *checkpoint.Checkpoint, l *gpuLinear, name string, out int, bias bool) (llm.Linear, error) {
	if bias {
		b, err := llm.ReadBias(ck, name, out, true)
		if err != nil {
			return nil, err
		}
		if l.b, err = m.upload16(b); err != nil {
			return nil, err
		}
	}
	return l, nil
}

// In and Out make gpuLinear an llm.Linear while the model is assembled.
func (l *gpuLinear) In() int  { return l.in }
func (l *gpuLinear) Out() int { return l.out }

// Forward is never called: the GPU model runs its layers itself.
func (l *gpuLinear) Forward(y, x []float32, rows int) {
	panic("cuda: a GPU linear layer has no CPU forward pass")
}

// run computes C = A·Wᵀ (+ b) for M rows on the GPU.
func (m *Model) run(l *gpuLinear, A, C Buf, M int, a *acts, f32 bool) error {
	var err error
	if l.w4 != nil {
		err = m.lib.GemmW4(A, C, l.w4, M, a.ws, m.scratch, a.aperm)
	} else {
		err = m.lib.GemmNT(A, l.w, C, M, l.out, l.in, f32)
	}
	if err == nil && !l.b.Nil() {
		err = m.lib.AddBias(C, l.b, M, l.out)
	}
	return err
}

// acts are the buffers of a forward pass over up to rows rows.
type acts struct {
	rows                                     int
	x, h, q, k, v, att, delta, g, u, logits  Buf
	ws, aperm                                Buf
	ids, rowIdx, targets, nll, kvBase, kvCap Buf
	meta                                     RowMeta
	bufs                                     []Buf
}

func (m *Model) newActs(rows int) (*acts, error) {
	c := m.cfg
	a := &acts{rows: rows}
	qd, kvd := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	sizes := []struct {
		b     *Buf
		bytes int
	}{
		{&a.x, rows * c.Hidden * 4}, {&a.h, rows * c.Hidden * 2}, {&a.q, rows * qd * 2}, {&a.k, rows * kvd * 2},
		{&a.v, rows * kvd * 2}, {&a.att, rows * qd * 2}, {&a.delta, rows * c.Hidden * 2},
		{&a.g, rows * c.Intermediate * 2}, {&a.u, rows * c.Intermediate * 2}, {&a.logits, rows * c.Vocab * 4},
		{&a.ws, m.lib.WorkspaceBytes(rows, m.maxN)}, {&a.aperm, rows * m.maxPermK * 2},
		{&a.ids, rows * 4}, {&a.meta.RowSeq, rows * 4}, {&a.meta.RowPos, rows * 4}, {&a.rowIdx, rows * 4},
		{&a.targets, rows * 4}, {&a.nll, rows * 4}, {&a.meta.KVBase, rows * 8}, {&a.meta.KVCap, rows * 4},
	}
	for _, s := range sizes {
		if s.bytes == 0 {
			continue
		}
		b, err := m.lib.Alloc(s.bytes)
		if err != nil {
			a.free(m.lib)
			return nil, fmt.Errorf("activations for %d rows: %w", rows, err)
		}
		*s.b = b
		a.bufs = append(a.bufs, b)
	}
	if err := m.lib.Memset(a.ws, 0, a.ws.Bytes); err != nil {
		a.free(m.lib)
		return nil, err
	}
	return a, nil
}

func (a *acts) free(l *Lib) {
	for _, b := range a.bufs {
		l.Free(b)
	}
	a.bufs = nil
}

// Cache is a sequence's key/value cache on the GPU: fp16
// [2][layers][cap][kv_dim]. Close frees it.
type Cache struct {
	m      *Model
	buf    Buf
	n, cap int
}

func (c *Cache) Len() int { return c.n }
func (c *Cache) Cap() int { return c.cap }
func (c *Cache) Truncate(n int) {
	if n < c.n {
		c.n = max(n, 0)
	}
}

// Close releases the cache's GPU memory.
func (c *Cache) Close() error {
	err := c.m.lib.Free(c.buf)
	c.buf = Buf{}
	return err
}

// NewCache implements llm.Backend.
func (m *Model) NewCache(capacity int) (llm.Cache, error) {
	c := m.cfg
	if capacity <= 0 || capacity > c.MaxPositions {
		return nil, fmt.Errorf("cache capacity %d outside 1..%d (max_position_embeddings)", capacity, c.MaxPositions)
	}
	bytes := 2 * c.Layers * capacity * c.KVHeads * c.HeadDim * 2
	b, err := m.lib.Alloc(bytes)
	if err != nil {
		return nil, fmt.Errorf("key/value cache of %d tokens (%.2f GiB): %w", capacity, gib(int64(bytes)), err)
	}
	return &Cache{m: m, buf: b, cap: capacity}, nil
}

// Config implements llm.Backend.
func (m *Model) Config() *checkpoint.Config { return m.cfg }

// Name implements llm.Backend.
func (m *Model) Name() string {
	kind := "fp16"
	if m.quantized {
		kind = "W4A16"
	}
	return fmt.Sprintf("cuda (%s, %s)", m.dev.Name, kind)
}

// WeightBytes is the GPU memory the weights take.
func (m *Model) WeightBytes() int64 { return m.weights }

// Close frees everything the model holds on the GPU.
func (m *Model) Close() error {
	for _, g := range m.graphs {
		m.lib.DestroyGraph(g.g)
		g.a.free(m.lib)
	}
	m.graphs = nil
	if m.eager != nil {
		m.eager.free(m.lib)
		m.eager = nil
	}
	m.lib.Free(m.attnWS)
	m.attnWS = Buf{}
	for _, b := range m.owned {
		m.lib.Free(b)
	}
	m.owned = nil
	return nil
}

// pass is one forward pass's rows, prepared on the host.
type pass struct {
	ids, rowSeq, rowPos []int32
	kvBase              []uint64
	kvCap               []int32
	maxKeys             int
}

func (m *Model) prepare(steps []llm.Step) (*pass, []*Cache, error) {
	p := &pass{}
	caches := make([]*Cache, len(steps))
	for i, s := range steps {
		c, ok := s.Cache.(*Cache)
		if !ok || c.m != m {
			return nil, nil, fmt.Errorf("step %d: cache %T does not belong to this GPU model", i, s.Cache)
		}
		if c.n+len(s.Tokens) > c.cap {
			return nil, nil, fmt.Errorf("step %d: %d cached + %d new tokens exceed the cache capacity %d", i, c.n, len(s.Tokens), c.cap)
		}
		for j, t := range s.Tokens {
			if t < 0 || t >= m.cfg.Vocab {
				return nil, nil, fmt.Errorf("step %d: token id %d outside the vocabulary [0, %d)", i, t, m.cfg.Vocab)
			}
			p.ids = append(p.ids, int32(t))
			p.rowSeq = append(p.rowSeq, int32(i))
			p.rowPos = append(p.rowPos, int32(c.n+j))
		}
		p.kvBase = append(p.kvBase, c.buf.Ptr())
		p.kvCap = append(p.kvCap, int32(c.cap))
		p.maxKeys = max(p.maxKeys, c.n+len(s.Tokens))
		caches[i] = c
	}
	return p, caches, nil
}

func (m *Model) upload(a *acts, p *pass) error {
	for _, u := range []struct {
		dst Buf
		src []int32
	}{{a.ids, p.ids}, {a.meta.RowSeq, p.rowSeq}, {a.meta.RowPos, p.rowPos}, {a.meta.KVCap, p.kvCap}} {
		if err := Upload(m.lib, u.dst, u.src); err != nil {
			return err
		}
	}
	return Upload(m.lib, a.meta.KVBase, p.kvBase)
}

// layers queues the embedding and every decoder block for T rows, leaving
// the final residual stream in a.x. attnWS is the attention scratch for T
// rows and maxKeys keys.
func (m *Model) layers(ctx context.Context, a *acts, attnWS Buf, T, maxKeys int) error {
	c, lib := m.cfg, m.lib
	H, hd, L := c.Hidden, c.HeadDim, c.Layers
	eps := float32(c.RMSNormEps)
	if err := lib.Embed(a.ids, m.embed, a.x, T, H); err != nil {
		return err
	}
	for l, b := range m.blocks {
		if ctx != nil {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		delta := a.delta
		if l == 0 {
			delta = Buf{}
		}
		steps := []func() error{
			func() error { return lib.RMSNorm(a.x, delta, Buf{}, b.attnNorm, a.h, T, H, eps) },
			func() error { return m.run(b.q, a.h, a.q, T, a, false) },
			func() error { return m.run(b.k, a.h, a.k, T, a, false) },
			func() error { return m.run(b.v, a.h, a.v, T, a, false) },
			func() error { return lib.RoPE(a.q, a.meta.RowPos, m.cos, m.sin, T, c.Heads, hd) },
			func() error { return lib.RoPE(a.k, a.meta.RowPos, m.cos, m.sin, T, c.KVHeads, hd) },
			func() error { return lib.KVStore(a.k, a.v, a.meta, l, L, T, c.KVHeads*hd) },
			func() error {
				return lib.Attention(a.q, a.att, attnWS, a.meta, l, L, T, c.Heads, c.KVHeads, hd, maxKeys)
			},
			func() error { return m.run(b.o, a.att, a.delta, T, a, false) },
			func() error { return lib.RMSNorm(a.x, a.delta, Buf{}, b.mlpNorm, a.h, T, H, eps) },
			func() error { return m.run(b.gate, a.h, a.g, T, a, false) },
			func() error { return m.run(b.up, a.h, a.u, T, a, false) },
			func() error { return lib.SiLUMul(a.g, a.u, T*c.Intermediate) },
			func() error { return m.run(b.down, a.g, a.delta, T, a, false) },
		}
		for _, f := range steps {
			if err := f(); err != nil {
				return fmt.Errorf("layer %d: %w", l, err)
			}
		}
	}
	return lib.Add(a.x, a.delta, T*H)
}

// head queues the final norm of the rows a.rowIdx[:n] and the LM head,
// leaving n rows of fp32 logits in a.logits.
func (m *Model) head(a *acts, n int) error {
	if err := m.lib.RMSNorm(a.x, Buf{}, a.rowIdx, m.norm, a.h, n, m.cfg.Hidden, float32(m.cfg.RMSNormEps)); err != nil {
		return err
	}
	return m.run(m.lmHead, a.h, a.logits, n, a, true)
}

// eagerActs returns the eager buffers, grown to at least rows.
func (m *Model) eagerActs(rows int) (*acts, error) {
	if m.eager != nil && m.eager.rows >= rows {
		return m.eager, nil
	}
	if m.eager != nil {
		m.eager.free(m.lib)
		m.eager = nil
	}
	m.lib.Free(m.attnWS)
	m.attnWS = Buf{}
	a, err := m.newActs(max(rows, 16))
	if err != nil {
		return nil, err
	}
	m.eager = a
	return a, nil
}

// eagerAttnWS returns the eager attention scratch, grown as needed.
func (m *Model) eagerAttnWS(T, maxKeys int) (Buf, error) {
	need := m.lib.AttentionWorkspaceBytes(T, m.cfg.Heads, m.cfg.HeadDim, maxKeys)
	if m.attnWS.Bytes >= need {
		return m.attnWS, nil
	}
	m.lib.Free(m.attnWS)
	m.attnWS = Buf{}
	b, err := m.lib.Alloc(need)
	if err != nil {
		return b, fmt.Errorf("attention scratch for %d rows: %w", T, err)
	}
	m.attnWS = b
	return b, nil
}

// Forward implements llm.Backend.
func (m *Model) Forward(ctx context.Context, steps []llm.Step) error {
	p, caches, err := m.prepare(steps)
	if err != nil || len(p.ids) == 0 {
		return err
	}
	T := len(p.ids)
	V := m.cfg.Vocab
	// Rows whose logits are wanted, in step order.
	var out []int32
	r := 0
	for i, s := range steps {
		want := len(s.Tokens) * V
		if s.LastOnly {
			want = V
		}
		if len(s.Logits) < want {
			return fmt.Errorf("step %d: logits buffer holds %d values, need %d", i, len(s.Logits), want)
		}
		first := r
		if s.LastOnly {
			first = r + len(s.Tokens) - 1
		}
		for j := first; j < r+len(s.Tokens); j++ {
			out = append(out, int32(j))
		}
		r += len(s.Tokens)
	}

	var a *acts
	if T == len(steps) && len(out) == T { // a decode step: replay a graph
		if a, err = m.decode(p); err != nil {
			return err
		}
	} else {
		if a, err = m.eagerActs(T); err != nil {
			return err
		}
		if err := m.upload(a, p); err != nil {
			return err
		}
		if err := Upload(m.lib, a.rowIdx, out); err != nil {
			return err
		}
		ws, err := m.eagerAttnWS(T, p.maxKeys)
		if err != nil {
			return err
		}
		if err := m.layers(ctx, a, ws, T, p.maxKeys); err != nil {
			return err
		}
		if err := m.head(a, len(out)); err != nil {
			return err
		}
	}
	logits := make([]float32, len(out)*V)
	if err := Download(m.lib, logits, a.logits); err != nil {
		return err
	}
	r = 0
	for i, s := range steps {
		n := len(s.Tokens)
		if s.LastOnly {
			n = 1
		}
		copy(s.Logits, logits[r*V:(r+n)*V])
		r += n
		caches[i].n += len(s.Tokens)
	}
	return nil
}

// decodeGraph is a captured decode step for a batch size and a bound on
// the keys attended (the attention kernel's shared memory).
type decodeGraph struct {
	a *acts
	g Graph
}

// decode runs a step where each sequence adds one token, through the
// CUDA graph for its batch size (captured on first use).
func (m *Model) decode(p *pass) (*acts, error) {
	B := len(p.ids)
	keys := 256
	for keys < p.maxKeys {
		keys *= 2
	}
	keys = min(keys, m.cfg.MaxPositions)
	key := [2]int{B, keys}
	dg, ok := m.graphs[key]
	if !ok {
		a, err := m.newActs(B)
		if err != nil {
			return nil, err
		}
		idx := make([]int32, B)
		for i := range idx {
			idx[i] = int32(i)
		}
		if err := Upload(m.lib, a.rowIdx, idx); err != nil {
			a.free(m.lib)
			return nil, err
		}
		ws, err := m.lib.Alloc(m.lib.AttentionWorkspaceBytes(B, m.cfg.Heads, m.cfg.HeadDim, keys))
		if err != nil {
			a.free(m.lib)
			return nil, err
		}
		a.bufs = append(a.bufs, ws)
		g, err := m.lib.Capture(func() error {
			if err := m.layers(nil, a, ws, B, keys); err != nil {
				return err
			}
			return m.head(a, B)
		})
		if err != nil {
			a.free(m.lib)
			return nil, fmt.Errorf("capturing the decode step for batch %d: %w", B, err)
		}
		dg = &decodeGraph{a: a, g: g}
		m.graphs[key] = dg
	}
	if err := m.upload(dg.a, p); err != nil {
		return nil, err
	}
	if err := m.lib.Launch(dg.g); err != nil {
		return nil, err
	}
	return dg.a, nil
}

// WindowNLL implements evals.NLLScorer: one window from an empty cache,
// with log-softmax and the NLL computed on the GPU, so only one float per
// token comes back.
func (m *Model) WindowNLL(ctx context.Context, ids []int) (float64, int, error) {
	if len(ids) < 2 {
		return 0, 0, fmt.Errorf("a window needs at least 2 tokens, got %d", len(ids))
	}
	cache, err := m.NewCache(len(ids))
	if err != nil {
		return 0, 0, err
	}
	defer cache.(*Cache).Close()
	p, _, err := m.prepare([]llm.Step{{Cache: cache, Tokens: ids}})
	if err != nil {
		return 0, 0, err
	}
	T, n := len(ids), len(ids)-1
	a, err := m.eagerActs(T)
	if err != nil {
		return 0, 0, err
	}
	rows, targets := make([]int32, n), make([]int32, n)
	for i := range rows {
		rows[i], targets[i] = int32(i), int32(ids[i+1])
	}
	if err := m.upload(a, p); err != nil {
		return 0, 0, err
	}
	if err := Upload(m.lib, a.rowIdx, rows); err != nil {
		return 0, 0, err
	}
	if err := Upload(m.lib, a.targets, targets); err != nil {
		return 0, 0, err
	}
	ws, err := m.eagerAttnWS(T, p.maxKeys)
	if err != nil {
		return 0, 0, err
	}
	if err := m.layers(ctx, a, ws, T, p.maxKeys); err != nil {
		return 0, 0, err
	}
	if err := m.head(a, n); err != nil {
		return 0, 0, err
	}
	if err := m.lib.NLL(a.logits, a.targets, a.nll, n, m.cfg.Vocab); err != nil {
		return 0, 0, err
	}
	nll := make([]float32, n)
	if err := Download(m.lib, nll, a.nll); err != nil {
		return 0, 0, err
	}
	var sum float64
	for _, v := range nll {
		sum += float64(v)
	}
	if math.IsNaN(sum) || math.IsInf(sum, 0) {
		return 0, 0, fmt.Errorf("non-finite NLL on the GPU (fp16 overflow in the activations?)")
	}
	return sum, n, nil
}

// OpenModel loads the CUDA library (DefaultPath) and uploads a checkpoint.
func OpenModel(ck *checkpoint.Checkpoint) (Backend, error) {
	lib, err := Open("")
	if err != nil {
		return nil, err
	}
	return Load(lib, ck)
}
