//go:build cgo

package cuda

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"sync"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
	"github.com/llmq/llmq/pack"
	"github.com/nlpodyssey/safetensors"
	"github.com/x448/float16"
)

// Model is the GPU backend (llm.Backend): the network of package llm with
// its weights resident on the GPU — packed 4-bit linears in the W4A16
// kernel's layout, unquantized linears, embeddings and lm_head in fp16
// through cuBLAS — an fp32 residual stream and fp16 activations. Decode
// steps (every sequence adding one token) replay a CUDA graph captured per
// batch size and key bound; other passes launch their kernels one by one.
//
// Ownership: everything the model puts on the GPU — weights, caches,
// activation buffers, graphs, the cuBLAS handle and its workspace — is
// allocated through the model's own Context, so Close (which destroys the
// context) releases all of it, and Memory accounts for every byte of it.
//
// Concurrency: a Model is safe for use from several goroutines. Every
// method that touches the GPU (Forward, WindowNLL, NewCache, a cache's
// Close, Memory, Close) holds mu for its whole duration, so passes run one
// at a time, in call order, on the context's one stream; a pass's host
// bookkeeping (cache lengths, the graph table) is under the same lock.
type Model struct {
	mu  sync.Mutex
	lib *Lib
	x   *Context // nil once closed

	cfg        *checkpoint.Config
	dev        Device
	blocks     []*gpuBlock
	embed      Buf // fp16 [vocab][hidden]
	norm       Buf // fp32 [hidden]
	lmHead     *gpuLinear
	ropes      []ropeTables // each layer's rotary tables (Gemma 3's sliding layers have their own)
	scratch    Buf          // K·N fp16: large-M W4 layers dequantize here for cuBLAS
	headOut    Buf          // a packed LM head's fp16 logits, headRows rows (head)
	maxN       int          // widest linear (workspace sizing)
	maxPermK   int          // widest act-order input (a_perm sizing)
	w4Layers   int          // linears the W4A16 kernels run, 8-bit codes included
	w8Layers   int          // of those, the ones with 8-bit codes
	wideLayers int          // quantized linears run in fp16, dequantized at load (other grids: 5–7-bit, FP8; experts the grouped kernel cannot run)
	join       bool         // run joinable q/k/v and gate/up as one GEMM each (gpuBlock)
	split      splitSums    // which layers leave their K splits' sums to the next kernel (LoadOptions.HalfDeltas, LLMQ_SPLIT_SUMS)
	act        *ActQuant    // simulated quantization of the decoder linears' inputs, or nil
	maxIn      int          // widest decoder linear input (the fake-quant buffer)

	weights int64   // bytes of weights (and rotary tables) on the GPU
	caches  int64   // bytes of key/value blocks' segments and caches' tables
	kv      kvPages // the caches' blocks (kvcache.go)

	eager  *acts
	attnWS Buf // the eager passes' attention scratch
	// Decode graphs, keyed by batch size and key bound; graphs of one
	// batch size share its activation buffers (batchActs). At most
	// maxGraphs are kept: the least recently used is destroyed first.
	graphs    map[graphKey]*decodeGraph
	batchActs map[int]*acts
	tick      uint64
	// flashPasses counts the eager passes whose attention the flash
	// kernel computed (pass.windows): for tests.
	flashPasses int
}

// maxGraphs bounds the decode graphs a model keeps (batch sizes × key
// bounds a server meets); each holds its attention scratch.
const maxGraphs = 48

// blockNorms are a decoder block's norm weights on the GPU (fp32): the
// attention's and the MLP's, and Qwen3's per-head q_norm and k_norm (unset
// in the families without them).
type blockNorms struct{ attn, mlp, q, k, postAttn, postMLP Buf }

// ropeTables are a rotary embedding's tables on the GPU, fp32
// [max_position_embeddings][head_dim/2].
type ropeTables struct{ cos, sin Buf }

// upload puts b's norms on the GPU with up.
func (n *blockNorms) upload(b *llm.Block, up func([]float32) (Buf, error)) error {
	for _, s := range []struct {
		dst *Buf
		w   []float32
	}{{&n.attn, b.AttnNorm}, {&n.mlp, b.MLPNorm}, {&n.q, b.QNorm}, {&n.k, b.KNorm}, {&n.postAttn, b.PostAttnNorm}, {&n.postMLP, b.PostMLPNorm}} {
		if s.w == nil {
			continue
		}
		var err error
		if *s.dst, err = up(s.w); err != nil {
			return err
		}
	}
	return nil
}

// bufs are the buffers, unset ones included (Free takes those).
func (n *blockNorms) bufs() []Buf { return []Buf{n.attn, n.mlp, n.q, n.k, n.postAttn, n.postMLP} }

type gpuBlock struct {
	norms                      blockNorms
	q, k, v, o, gate, up, down *gpuLinear
	// Packed q, k, v (gate, up) with the same group and act-order run as
	// one joined GEMM that writes three (two) outputs; the parts are then
	// nil. Fewer launches, and one wider GEMM streams better.
	qkv, gateUp *gpuLinear
	// moe replaces gate, up and down in a sparse layer.
	moe *gpuMoE
}

// gpuMoE is a sparse layer's mixture of experts (llm.MoE) on the GPU: the
// router in fp32, and the experts' layers stacked by kind, expert after
// expert — gate and up joined (an expert's gate columns, then its up
// columns) and down — either 4-bit (the grouped W4A16 GEMV) or fp16.
type gpuMoE struct {
	router           Buf // fp32 [E][hidden]
	gateUp, down     *W4 // 4-bit experts (UploadExperts; gateUp interleaved where W4.Gated), or
	gateUp16, down16 Buf // fp16 experts [E][2I][hidden], [E][hidden][I]
}

// gpuLinear is y = x·Wᵀ (+ b) on the GPU: w4 for a packed layer (joined
// layers: their w4.Cols), w an fp16 [out][in] matrix otherwise; b the
// bias of each part (Nil without).
type gpuLinear struct {
	name    string // its (first part's) checkpoint name
	in, out int
	w4      *W4
	w       Buf
	b       []Buf
	// actIn: its input is quantized and dequantized first (Model.act),
	// with threshold when the scheme is per tensor.
	actIn     bool
	threshold float32
	// ws, when set, is the layer's own split-K workspace (the packed LM
	// head's, vocabulary-wide), used instead of the pass's.
	ws Buf
}

// hostLinear is a layer as read from the checkpoint, before upload.
type hostLinear struct {
	name    string
	in, out int
	gw      *pack.GPUWeights // a layer the W4A16 kernel runs
	w       []float32        // otherwise its weights [out][in]
	bias    []float32        // nil without
	// dequantized: w was stored on a grid the kernel does not run (8-bit,
	// FP8) and is run as fp16.
	dequantized bool
}

// Load uploads a checkpoint (packed or unquantized) to the GPU of lib, in
// a new context. It first checks that the weights fit in the GPU's free
// memory.
func Load(lib *Lib, ck *checkpoint.Checkpoint) (*Model, error) {
	return LoadWith(lib, ck, LoadOptions{})
}

// LoadWith is Load with options.
func LoadWith(lib *Lib, ck *checkpoint.Checkpoint, opt LoadOptions) (*Model, error) {
	c := ck.Config
	if err := Supports(c); err != nil {
		return nil, fmt.Errorf("%s: %w", ck.Dir, err)
	}
	dev, err := lib.Device()
	if err != nil {
		return nil, err
	}
	q, err := pack.ParseQuantConfig(c.Quantization)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", ck.Dir, err)
	}
	if opt.Act != nil && c.MoE != nil {
		return nil, fmt.Errorf("%s: the GPU backend does not simulate activation quantization in a mixture of experts yet", ck.Dir)
	}
	if err := checkFits(ck.Dir, estimateBytes(ck, q), dev); err != nil {
		return nil, err
	}
	split, err := splitSumsFrom(opt.HalfDeltas, os.Getenv("LLMQ_SPLIT_SUMS"))
	if err != nil {
		return nil, err
	}
	x, err := lib.NewContext()
	if err != nil {
		return nil, err
	}
	// Per-tensor activation thresholds are per layer: such a run keeps
	// q/k/v and gate/up separate.
	join := !opt.Separate && (opt.Act == nil || opt.Act.PerToken)
	m := &Model{lib: lib, x: x, cfg: c, dev: dev, join: join, act: opt.Act, split: split,
		graphs: map[graphKey]*decodeGraph{}, batchActs: map[int]*acts{}, kv: newKVPages(c.Layers, c.KVHeads*c.HeadDim)}
	if err := m.load(ck, q); err != nil {
		m.Close()
		return nil, fmt.Errorf("loading %s on the GPU: %w", ck.Dir, err)
	}
	return m, nil
}

func (m *Model) load(ck *checkpoint.Checkpoint, q *pack.QuantConfig) error {
	c := m.cfg
	embed, norm, err := llm.ReadEmbeddings(ck)
	if err != nil {
		return err
	}
	if m.embed, err = m.upload16(embed); err != nil {
		return err
	}
	if m.norm, err = m.upload32(norm); err != nil {
		return err
	}
	spec, tied, err := llm.HeadLinear(ck)
	switch {
	case err != nil:
		return err
	case tied: // the LM head is the embedding matrix
		m.lmHead = &gpuLinear{in: c.Hidden, out: c.Vocab, w: m.embed}
	default:
		// A quantized lm_head (quantize --quantize-lm-head) stays packed
		// where the kernels run it without a scratch (headPackable) and
		// runs headRows rows at a time (head), through the model's one
		// fp16 output and split-K workspace, which every pass shares (they
		// run one at a time, on one stream, and the kernels leave the
		// workspace zeroed); otherwise it is dequantized at load and runs
		// in fp16 like an unquantized one.
		h, err := m.readLinearAs(ck, q, spec, func(gw *pack.GPUWeights) bool { return headPackable(gw.K, gw.N, gw.Group) })
		if err != nil {
			return err
		}
		if m.lmHead, err = m.uploadLinear(h); err != nil {
			return err
		}
		if w := m.lmHead.w4; w != nil {
			if !w.Perm.Nil() {
				m.maxPermK = max(m.maxPermK, h.in)
			}
			if m.headOut, err = m.x.Alloc(headRows * c.Vocab * 2); err != nil {
				return fmt.Errorf("lm_head's fp16 logits: %w", err)
			}
			ws := m.lib.WorkspaceBytes(headRows, c.Vocab)
			if m.lmHead.ws, err = m.x.Alloc(ws); err != nil {
				return fmt.Errorf("lm_head's workspace: %w", err)
			}
			if err := m.x.Memset(m.lmHead.ws, 0, ws); err != nil {
				return err
			}
		}
	}
	// The rotary tables, one pair per distinct rotary embedding.
	byRope := map[checkpoint.Rope]ropeTables{}
	for l := 0; l < c.Layers; l++ {
		r := c.LayerRope(l)
		t, ok := byRope[r]
		if !ok {
			cos, sin := llm.RopeTablesOf(r, c.HeadDim, c.MaxPositions)
			if t.cos, err = m.upload32(cos); err != nil {
				return err
			}
			if t.sin, err = m.upload32(sin); err != nil {
				return err
			}
			byRope[r] = t
		}
		m.ropes = append(m.ropes, t)
	}
	for i := 0; i < c.Layers; i++ {
		g := &gpuBlock{}
		var norms llm.Block
		if err := llm.ReadNorms(ck, i, &norms); err != nil {
			return err
		}
		if err := g.norms.upload(&norms, m.upload32); err != nil {
			return err
		}
		specs := llm.BlockLinears(c, i) // q, k, v, o, then gate, up, down (of each expert in a sparse layer)
		dense := specs
		if c.Sparse(i) {
			dense = specs[:4]
			if g.moe, err = m.loadMoE(ck, q, i, specs[4:]); err != nil {
				return err
			}
		}
		var h []*hostLinear
		if h, err = m.readLinears(ck, q, dense, nil); err != nil {
			return err
		}
		type unit struct {
			joined **gpuLinear
			parts  []**gpuLinear
			host   []*hostLinear
		}
		units := []unit{{&g.qkv, []**gpuLinear{&g.q, &g.k, &g.v}, h[0:3]}, {nil, []**gpuLinear{&g.o}, h[3:4]}}
		if g.moe == nil {
			units = append(units, unit{&g.gateUp, []**gpuLinear{&g.gate, &g.up}, h[4:6]}, unit{nil, []**gpuLinear{&g.down}, h[6:7]})
		}
		for _, u := range units {
			if u.joined == &g.gateUp && m.join && gateable(u.host) {
				if g.gateUp, err = m.uploadGated(u.host[0], u.host[1], GatingFor(c.Act)); err != nil {
					return err
				}
				continue
			}
			if u.joined != nil && m.join && joinable(u.host) {
				if *u.joined, err = m.uploadLinear(u.host...); err != nil {
					return err
				}
				continue
			}
			for j, dst := range u.parts {
				if *dst, err = m.uploadLinear(u.host[j]); err != nil {
					return err
				}
			}
		}
		if err := m.markActInputs(g); err != nil {
			return err
		}
		m.blocks = append(m.blocks, g)
	}
	maxKN := 0
	for _, b := range m.blocks {
		for _, l := range []*gpuLinear{b.q, b.k, b.v, b.qkv, b.o, b.gate, b.up, b.gateUp, b.down} {
			if l == nil {
				continue
			}
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
		if m.scratch, err = m.x.Alloc(maxKN * 2); err != nil {
			return fmt.Errorf("the dequantize scratch: %w", err)
		}
	}
	return nil
}

// loadMoE uploads layer's mixture of experts: the router (kept in fp32,
// as on the CPU) and the experts (specs: each expert's gate, up and down).
// Experts stored 4-bit go to the grouped W4A16 kernel, gate and up joined;
// unquantized experts, and packed ones the grouped kernel cannot run (act
// order, wider grids, other groups), are uploaded in fp16, dequantized,
// one expert at a time.
func (m *Model) loadMoE(ck *checkpoint.Checkpoint, q *pack.QuantConfig, layer int, specs []llm.LinearSpec) (*gpuMoE, error) {
	c := m.cfg
	E, H, I := c.MoE.Experts, c.Hidden, c.MoE.Intermediate
	if len(specs) != 3*E {
		return nil, fmt.Errorf("layer %d: %d expert layers, want 3 for each of %d experts", layer, len(specs), E)
	}
	name := llm.RouterName(c, layer)
	if err := pack.Unexplained(ck, name); err != nil {
		return nil, err
	}
	w, err := ck.Float32(name+".weight", E, H)
	if err != nil {
		return nil, err
	}
	mo := &gpuMoE{}
	if mo.router, err = m.upload32(w); err != nil {
		return nil, err
	}
	// The grouped 4-bit kernel runs the layer when every expert's three
	// linears are packed in a layout it takes: 2- to 4-bit codes, no act
	// order (a permutation per expert), a power-of-two group or one group, gate and up
	// joinable. Otherwise the whole layer runs in fp16, its packed experts
	// dequantized (slower, but every checkpoint runs), one expert at a
	// time.
	grouped := func(gw *pack.GPUWeights) bool {
		return gw.Perm == nil && gw.Bits == 4 && (gw.Group >= gw.K || gw.Group&(gw.Group-1) == 0)
	}
	runs := func(hs []*hostLinear) bool { // one expert's gate, up and down
		return hs[0].gw != nil && hs[1].gw != nil && hs[2].gw != nil && joinable(hs[:2])
	}
	// Expert 0 first: where the kernel cannot run it, the others are not
	// read here (packed ones it cannot run would be dequantized, all at
	// once), but one at a time by the fp16 path below.
	all, err := m.readLinears(ck, q, specs[:3], grouped)
	if err != nil {
		return nil, err
	}
	if runs(all) {
		rest, err := m.readLinears(ck, q, specs[3:], grouped)
		if err != nil {
			return nil, err
		}
		all = append(all, rest...)
	}
	experts := make([][]*hostLinear, E) // gate, up, down of each expert
	gated := m.join
	for e := range experts {
		hs := all[3*e : 3*e+3]
		if !runs(hs) {
			experts = nil
			break
		}
		// Gate and up interleaved when every expert's can be (gateable,
		// a multiple of 64 wide), so that the GEMV writes act(gate)·up
		// itself (MoEGemv's g); else side by side, and MoEAct follows.
		gated = gated && gateable(hs[:2]) && hs[0].out%64 == 0
		experts[e] = hs
	}
	var gateUp, down []*pack.GPUWeights
	join := func(gate, up *pack.GPUWeights) (*pack.GPUWeights, error) { return pack.ConcatGPU(gate, up) }
	if gated {
		join = pack.InterleaveGPU
	}
	if experts != nil {
		gateUp, down = make([]*pack.GPUWeights, E), make([]*pack.GPUWeights, E)
		if err := forEach(E, func(e int) (err error) {
			hs := experts[e]
			if gateUp[e], err = join(hs[0].gw, hs[1].gw); err != nil {
				return fmt.Errorf("%s: %w", specs[3*e].Name, err)
			}
			down[e] = hs[2].gw
			return nil
		}); err != nil {
			return nil, err
		}
	}
	if gateUp != nil {
		if mo.gateUp, err = m.x.UploadExperts(gateUp); err != nil {
			return nil, fmt.Errorf("layer %d's experts' gate and up: %w", layer, err)
		}
		if gated {
			mo.gateUp.Gated = GatingFor(c.Act)
		}
		if mo.down, err = m.x.UploadExperts(down); err != nil {
			return nil, fmt.Errorf("layer %d's experts' down: %w", layer, err)
		}
		m.weights += mo.gateUp.Bytes() + mo.down.Bytes()
		m.w4Layers += 2
		return mo, nil
	}
	for _, b := range []struct {
		dst   *Buf
		bytes int
	}{{&mo.gateUp16, E * 2 * I * H * 2}, {&mo.down16, E * H * I * 2}} {
		if *b.dst, err = m.x.Alloc(b.bytes); err != nil {
			return nil, fmt.Errorf("layer %d's experts: %w", layer, err)
		}
		m.weights += int64(b.bytes)
	}
	fp16 := func(*pack.GPUWeights) bool { return false }
	for e := 0; e < E; e++ {
		for j, dst := range []Buf{mo.gateUp16.Offset(e * 2 * I * H * 2), mo.gateUp16.Offset((e*2 + 1) * I * H * 2), mo.down16.Offset(e * H * I * 2)} {
			h, err := m.readLinearAs(ck, q, specs[3*e+j], fp16)
			if err != nil {
				return nil, err
			}
			if err := Upload(m.x, dst, toF16(h.w)); err != nil {
				return nil, fmt.Errorf("%s: %w", specs[3*e+j].Name, err)
			}
			if h.dequantized {
				m.wideLayers++
			}
		}
	}
	return mo, nil
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

func gib(b int64) float64 { return float64(b) / (1 << 30) }

// estimateBytes is the GPU memory a checkpoint's weights take (floating
// tensors as fp16; packed codes as the GPU holds them: 4 bits a weight
// for 2- to 4-bit grids, fp16 for wider ones; other integer tensors as
// stored) plus the largest dequantize scratch and a margin for cuBLAS and
// activations.
func estimateBytes(ck *checkpoint.Checkpoint, q *pack.QuantConfig) int64 {
	var n int64
	for _, name := range ck.Names() {
		t, err := ck.Tensor(name)
		if err != nil {
			continue
		}
		n += tensorGPUBytes(t, q)
	}
	c := ck.Config
	n += 2 * int64(c.Intermediate) * int64(c.Hidden) * 2 // W4 scratch: gate and up joined
	if c.MoE != nil {
		for l := 0; l < c.Layers; l++ {
			if c.Sparse(l) { // the router: stored in 16 bits, held in fp32
				n += int64(c.MoE.Experts) * int64(c.Hidden) * 2
			}
		}
	}
	return n + n/20 + 512<<20
}

// tensorGPUBytes is one tensor's share of estimateBytes.
func tensorGPUBytes(t checkpoint.Tensor, q *pack.QuantConfig) int64 {
	bytes := int64(t.Numel()) * 2
	if t.DType == safetensors.I32 || t.DType == safetensors.F32 && strings.HasSuffix(t.Name, "norm.weight") {
		bytes = int64(t.Numel()) * 4
	}
	if prefix, ok := strings.CutSuffix(t.Name, ".qweight"); ok && q != nil {
		if g, ok := q.GridFor(prefix); ok && g.Bits > 0 {
			weights := bytes * 8 / int64(g.Bits) // a stored byte holds 8/bits codes
			var in, out int                      // qweight is [in·bits/32][out]
			if len(t.Shape) == 2 && t.Shape[1] > 0 {
				out = t.Shape[1]
				in = int(weights) / out
			}
			switch {
			case (prefix == "lm_head" || strings.HasSuffix(prefix, ".lm_head")) && !headPackable(in, out, g.Group(in)): // dequantized at load (Load)
				return weights * 2
			case g.GPUPacked() && g.Bits == 8:
				return weights // a byte a code
			case g.GPUPacked():
				return weights / 2 // a nibble a code
			}
			return weights * 2
		}
	}
	return bytes
}

func (m *Model) upload32(v []float32) (Buf, error) {
	b, err := AllocFrom(m.x, v)
	if err == nil {
		m.weights += int64(b.Bytes)
	}
	return b, err
}

// toF16 converts to fp16 bits, in parallel.
func toF16(v []float32) []uint16 {
	h := make([]uint16, len(v))
	mat.ParallelFor(len(v), 1<<16, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			h[i] = uint16(float16.Fromfloat32(v[i]))
		}
	})
	return h
}

// upload16 converts to fp16 (in parallel: embeddings of large models have
// half a billion values) and uploads.
func (m *Model) upload16(v []float32) (Buf, error) {
	b, err := AllocFrom(m.x, toF16(v))
	if err == nil {
		m.weights += int64(b.Bytes)
	}
	return b, err
}

// markActInputs flags the block's linear layers whose inputs the
// activation scheme quantizes (all of them), with their thresholds.
func (m *Model) markActInputs(g *gpuBlock) error {
	if m.act == nil {
		return nil
	}
	for _, l := range []*gpuLinear{g.q, g.k, g.v, g.qkv, g.o, g.gate, g.up, g.gateUp, g.down} {
		if l == nil {
			continue
		}
		l.actIn = true
		m.maxIn = max(m.maxIn, l.in)
		if m.act.PerToken {
			continue
		}
		t, ok := m.act.Thresholds[l.name]
		if !ok {
			return fmt.Errorf("per-tensor activation scales need a calibrated threshold for every layer; none for %s", l.name)
		}
		l.threshold = t
	}
	return nil
}

// readLinear reads the layer s names: repacked for the W4A16 kernel when
// the checkpoint stores it packed at 2–4 bits, dequantized otherwise
// (wider grids) or read as stored (unquantized layers).
func (m *Model) readLinear(ck *checkpoint.Checkpoint, q *pack.QuantConfig, s llm.LinearSpec) (*hostLinear, error) {
	return m.readLinearAs(ck, q, s, nil)
}

// readLinears is readLinearAs of each of specs, in order, run on the
// host's cores at once: a mixture's layer is hundreds of packed linears,
// and unpacking and repacking them (pack's Read and GPULayout, each
// parallel within a linear too) is most of a load's time. The error is
// the first spec's that failed.
func (m *Model) readLinears(ck *checkpoint.Checkpoint, q *pack.QuantConfig, specs []llm.LinearSpec, packed func(*pack.GPUWeights) bool) ([]*hostLinear, error) {
	hs := make([]*hostLinear, len(specs))
	err := forEach(len(specs), func(i int) (err error) {
		hs[i], err = m.readLinearAs(ck, q, specs[i], packed)
		return err
	})
	if err != nil {
		return nil, err
	}
	return hs, nil
}

// forEach calls f(i) for each i in [0, n) on the host's cores
// (mat.ParallelFor) and returns the error of the lowest i that failed.
func forEach(n int, f func(i int) error) error {
	errs := make([]error, n)
	mat.ParallelFor(n, 1, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			errs[i] = f(i)
		}
	})
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// readLinearAs is readLinear where packed (a function of the repacked
// layer, nil: every layer) says which packed layers stay packed; the
// others, those the GPU layout cannot hold included, are dequantized.
func (m *Model) readLinearAs(ck *checkpoint.Checkpoint, q *pack.QuantConfig, s llm.LinearSpec, packed func(*pack.GPUWeights) bool) (*hostLinear, error) {
	h := &hostLinear{name: s.Name, in: s.In, out: s.Out}
	if q != nil && q.Stored(ck, s.Name) {
		pl, err := q.Read(ck, s.Name, s.In, s.Out)
		if err != nil {
			return nil, err
		}
		if pl.Grid.GPUPacked() {
			gw, err := pl.GPULayout()
			switch {
			case err == nil && (packed == nil || packed(gw)):
				h.gw = gw
			case err != nil && packed == nil:
				return nil, fmt.Errorf("%s: %w", s.Name, err)
			}
		}
		if h.gw == nil {
			h.w, h.dequantized = pl.Dequantize(), true
		}
	} else {
		if err := pack.Unexplained(ck, s.Name); err != nil {
			return nil, err
		}
		w, err := ck.Float32(s.Name+".weight", s.Out, s.In)
		if err != nil {
			return nil, err
		}
		h.w = w
	}
	if s.Bias {
		b, err := llm.ReadBias(ck, s.Name, s.Out, true)
		if err != nil {
			return nil, err
		}
		h.bias = b
	}
	return h, nil
}

// joinable: several packed layers the kernel can run as one GEMM
// (pack.CanConcatGPU), each part's width a multiple of the kernel's
// 64-column tile so that a tile writes to one part.
func joinable(parts []*hostLinear) bool {
	gws := make([]*pack.GPUWeights, len(parts))
	for i, h := range parts {
		if h.gw == nil || h.out%64 != 0 {
			return false
		}
		gws[i] = h.gw
	}
	return len(parts) > 1 && pack.CanConcatGPU(gws...) == nil
}

// gateable: a gated MLP's gate and up the GEMM can join with act(gate)·up
// in its epilogue (pack.InterleaveGPU): joinable, the same width, and no
// bias (which would have to be added before the activation).
func gateable(gateUp []*hostLinear) bool {
	return joinable(gateUp) && gateUp[0].out == gateUp[1].out && gateUp[0].bias == nil && gateUp[1].bias == nil
}

// uploadGated puts a gated MLP's gate and up on the GPU as one GEMM whose
// output is act(gate)·up (W4.Gated), the Intermediate-wide input of down.
func (m *Model) uploadGated(gate, up *hostLinear, g Gating) (*gpuLinear, error) {
	gw, err := pack.InterleaveGPU(gate.gw, up.gw)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", gate.name, err)
	}
	l := &gpuLinear{name: gate.name, in: gate.in, out: gw.N}
	if l.w4, err = m.x.UploadW4(gw); err != nil {
		return nil, fmt.Errorf("%s: %w", gate.name, err)
	}
	l.w4.Gated = g
	m.account(l, gate.dequantized)
	return l, nil
}

// account adds an uploaded layer to the model's counts: its packed bytes
// and layers (4- or 8-bit), and whether it was dequantized to fp16.
func (m *Model) account(l *gpuLinear, dequantized bool) {
	if l.w4 != nil {
		m.weights += l.w4.Bytes()
		m.w4Layers++
		if l.w4.Bits == 8 {
			m.w8Layers++
		}
	}
	if dequantized {
		m.wideLayers++
	}
}

// uploadLinear puts one layer, or several joinable ones as one GEMM, on
// the GPU.
func (m *Model) uploadLinear(parts ...*hostLinear) (*gpuLinear, error) {
	h := parts[0]
	l := &gpuLinear{name: h.name, in: h.in, out: h.out}
	var err error
	switch {
	case len(parts) > 1:
		gws := make([]*pack.GPUWeights, len(parts))
		var cols []int
		for i, p := range parts {
			gws[i] = p.gw
			cols = append(cols, p.out)
		}
		gw, err := pack.ConcatGPU(gws...)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", h.name, err)
		}
		if l.w4, err = m.x.UploadW4(gw); err != nil {
			return nil, fmt.Errorf("%s: %w", h.name, err)
		}
		l.w4.Cols = cols
		l.out = gw.N
	case h.gw != nil:
		if l.w4, err = m.x.UploadW4(h.gw); err != nil {
			return nil, fmt.Errorf("%s: %w", h.name, err)
		}
	default:
		if l.w, err = m.upload16(h.w); err != nil {
			return nil, fmt.Errorf("%s: %w", h.name, err)
		}
	}
	m.account(l, h.dequantized)
	for _, p := range parts {
		var b Buf
		if p.bias != nil {
			if b, err = m.upload16(p.bias); err != nil {
				return nil, fmt.Errorf("%s bias: %w", p.name, err)
			}
		}
		l.b = append(l.b, b)
	}
	return l, nil
}

// input is A as layer l reads it: quantized and dequantized first when
// its inputs are (Model.act).
func (m *Model) input(l *gpuLinear, A Buf, M int, a *acts) (Buf, error) {
	if !l.actIn {
		return A, nil
	}
	return a.aq, m.x.FakeQuant(A, a.aq, M, l.in, m.act, l.threshold)
}

// gemmBufs are the split-K workspace and the dequantize scratch a packed
// layer runs with: the pass's workspace unless it has its own, and the
// model's scratch, which is sized for the decoder's layers, unless the
// layer is larger (a packed LM head runs without one).
func (m *Model) gemmBufs(l *gpuLinear, a *acts) (ws, scratch Buf) {
	ws, scratch = a.ws, m.scratch
	if !l.ws.Nil() {
		ws = l.ws
	}
	if l.in*l.out*2 > scratch.Bytes {
		scratch = Buf{}
	}
	return ws, scratch
}

// leavesSums says whether packed layer l can leave its fp32 sums for T
// rows in the pass's workspace for the kernel after it to finish
// (runSums): a plain layer (not gated, no bias, no workspace of its own)
// in a pass of at most SumsMaxRows rows.
func (m *Model) leavesSums(l *gpuLinear, T int) bool {
	if l == nil || T > SumsMaxRows || l.w4 == nil || l.w4.Gated != NotGated || !l.ws.Nil() {
		return false
	}
	for _, bias := range l.b {
		if !bias.Nil() {
			return false
		}
	}
	return true
}

// sums says whether block b's o or down (l, followed by the norm post,
// Gemma 3's, or none) leaves its sums to the next RMSNorm: in a dense
// block whose output has no norm of its own.
func (m *Model) sums(b *gpuBlock, l *gpuLinear, post Buf, T int) bool {
	return m.split.od && b.moe == nil && post.Nil() && m.leavesSums(l, T)
}

// moeSums says whether mixture block b's o leaves its sums to the norm
// with the router (RMSNormRouter reads them) and the combine after the
// experts (RMSNormExperts adds and zeroes them); the experts' kernels
// between never use the workspace.
func (m *Model) moeSums(b *gpuBlock, T int) bool {
	return m.split.moe && b.routesInNorm(T) && m.leavesSums(b.o, T)
}

// qkvSums says whether block b's joined q/k/v leaves its sums to the
// RoPE kernel (QKRoPEStore's sums). The kernel takes the sums' columns as
// q's, k's and v's heads in turn.
func (m *Model) qkvSums(b *gpuBlock, T int) bool {
	c := m.cfg
	return m.split.qkv && m.leavesSums(b.qkv, T) &&
		slices.Equal(b.qkv.w4.Cols, []int{c.Heads * c.HeadDim, c.KVHeads * c.HeadDim, c.KVHeads * c.HeadDim})
}

// runSums adds A·Wᵀ's fp32 sums for M rows into the pass's workspace and
// leaves them there (GemmW4Sums) for a later kernel to read and zero: the
// RoPE kernel after q/k/v (QKRoPEStore's sums) and the norm after a dense
// block's o or down (RMSNormExperts' sums) at once; a mixture's o's, the
// norm with its router reads, and the combine after the experts adds and
// zeroes (moeSums). An error between leaves them there; the pass fails,
// and the next one's GEMMs would find the workspace dirty, as after any
// failed launch.
func (m *Model) runSums(l *gpuLinear, A Buf, M int, a *acts) error {
	A, err := m.input(l, A, M, a)
	if err != nil {
		return err
	}
	ws, scratch := m.gemmBufs(l, a)
	return m.x.GemmW4Sums(A, l.w4, M, ws, scratch, a.aperm)
}

// run computes C = A·Wᵀ (+ b) for M rows on the GPU; a joined layer
// writes one output per part (C[i]: part i's columns).
func (m *Model) run(l *gpuLinear, A Buf, M int, a *acts, f32 bool, C ...Buf) error {
	A, err := m.input(l, A, M, a)
	if err != nil {
		return err
	}
	if l.w4 != nil {
		ws, scratch := m.gemmBufs(l, a)
		err = m.x.GemmW4Into(A, C, l.w4, M, ws, scratch, a.aperm)
	} else {
		err = m.x.GemmNT(A, l.w, C[0], M, l.out, l.in, f32)
	}
	for i, b := range l.b {
		if err == nil && !b.Nil() {
			width := l.out
			if l.w4 != nil && len(l.w4.Cols) > 0 {
				width = l.w4.Cols[i]
			}
			err = m.x.AddBias(C[i], b, M, width)
		}
	}
	return err
}

// runParts runs layers reading the same input A: as their joined GEMM
// when there is one, else one after another; outs[i] is part i's output.
func (m *Model) runParts(joined *gpuLinear, parts []*gpuLinear, A Buf, M int, a *acts, outs ...Buf) error {
	if joined != nil {
		return m.run(joined, A, M, a, false, outs...)
	}
	for i, l := range parts {
		if err := m.run(l, A, M, a, false, outs[i]); err != nil {
			return err
		}
	}
	return nil
}

// acts are the buffers of a forward pass over up to rows rows.
type acts struct {
	rows                                     int
	x, h, q, k, v, att, delta, g, u, logits  Buf
	ws, aperm, aq                            Buf // aq: a linear's input quantized (Model.act)
	ids, rowIdx, targets, nll, kvBase, kvCap Buf
	next                                     Buf // the ids picked on the device (argmax or sampled)
	draws                                    Buf // sample_rows's parameters, 4 fp64 a row
	meta                                     RowMeta
	// A mixture of experts' pass (rows·k slots): router logits, each
	// slot's expert and weight, the plan's order and chunks, the experts'
	// joined gate/up outputs gu [slots][2I] and outputs y [slots][hidden]
	// (fp32, kept zeroed between passes: the kernels that read them clear
	// them; the activations between go to g).
	routerLogits, expert, weight, order, chunks, gu, y Buf
	// chain: a greedy chain's positions and picked ids (DecodeGreedy),
	// kept between chains and grown to the longest asked for.
	chain Buf
	// sent holds what upload last copied into meta's RowSeq, KVCap and
	// KVBase, which no kernel writes. For a decode batch they change only
	// with the batch's sequences or their order (KVBase is each cache's
	// block-table address, fixed for the cache's life; a new block changes
	// the table's contents, Cache.sync), so an unchanged one is not copied
	// again.
	sent struct {
		rowSeq, kvCap []int32
		kvBase        []uint64
	}
	bufs  []Buf
	bytes int64
}

func (m *Model) newActs(rows int) (*acts, error) {
	c := m.cfg
	a := &acts{rows: rows}
	qd, kvd := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	// The dense MLP's gate and up outputs a row (none when every layer is
	// a mixture); g also holds a mixture's activations, k·I a row.
	var dense int
	for l := 0; l < c.Layers; l++ {
		if !c.Sparse(l) {
			dense = c.Intermediate
		}
	}
	gWidth := dense
	var E, slots, moeI int // a mixture's experts, slots (rows·k) and intermediate size
	if c.MoE != nil {
		E, slots, moeI = c.MoE.Experts, rows*c.MoE.TopK, c.MoE.Intermediate
		gWidth = max(gWidth, c.MoE.TopK*moeI)
	}
	maxChunks := max(MoEMaxChunks(slots, E, 1), MoEMaxChunks(slots, E, 4))
	sizes := []struct {
		b     *Buf
		bytes int
	}{
		{&a.x, rows * c.Hidden * 4}, {&a.h, rows * c.Hidden * 2}, {&a.q, rows * qd * 2}, {&a.k, rows * kvd * 2},
		{&a.v, rows * kvd * 2}, {&a.att, rows * qd * 2}, {&a.delta, rows * c.Hidden * 2},
		{&a.g, rows * gWidth * 2}, {&a.u, rows * dense * 2}, {&a.logits, rows * c.Vocab * 4},
		{&a.ws, m.lib.WorkspaceBytes(rows, m.maxN)}, {&a.aperm, rows * m.maxPermK * 2}, {&a.aq, rows * m.maxIn * 2},
		{&a.ids, rows * 4}, {&a.meta.RowSeq, rows * 4}, {&a.meta.RowPos, rows * 4}, {&a.rowIdx, rows * 4},
		{&a.targets, rows * 4}, {&a.nll, rows * 4}, {&a.next, rows * 4}, {&a.draws, rows * 32}, {&a.meta.KVBase, rows * 8}, {&a.meta.KVCap, rows * 4},
		{&a.routerLogits, rows * E * 4}, {&a.expert, slots * 4}, {&a.weight, slots * 4}, {&a.order, slots * 4},
		{&a.chunks, maxChunks * 3 * 4}, {&a.gu, slots * 2 * moeI * 4}, {&a.y, slots * c.Hidden * 4},
	}
	for _, s := range sizes {
		if s.bytes == 0 {
			continue
		}
		if err := a.alloc(m.x, s.b, s.bytes); err != nil {
			a.free(m.x)
			return nil, fmt.Errorf("activations for %d rows: %w", rows, err)
		}
	}
	for _, b := range []Buf{a.ws, a.gu, a.y} { // kept zeroed by the kernels that use them
		if err := m.x.Memset(b, 0, b.Bytes); err != nil {
			a.free(m.x)
			return nil, err
		}
	}
	return a, nil
}

// alloc allocates one of a's buffers (or one a owns, such as a graph's
// attention scratch) and counts it.
func (a *acts) alloc(x *Context, b *Buf, bytes int) error {
	buf, err := x.Alloc(bytes)
	if err != nil {
		return err
	}
	*b = buf
	a.bufs = append(a.bufs, buf)
	a.bytes += int64(bytes)
	return nil
}

// chainBuf is a's chain buffer with room for n steps' positions and
// picked ids ([2][n][rows] int32), allocated anew only when a longer chain
// than any before asks for it.
func (a *acts) chainBuf(x *Context, n int) (Buf, error) {
	need := 2 * n * a.rows * 4
	if a.chain.Bytes >= need {
		return a.chain, nil
	}
	if old := a.chain; old.Bytes > 0 {
		a.chain = Buf{}
		if err := a.release(x, old); err != nil {
			return Buf{}, err
		}
	}
	if err := a.alloc(x, &a.chain, need); err != nil {
		return Buf{}, err
	}
	return a.chain, nil
}

// release frees b, one of the buffers a owns, and takes it off a's list
// and count (nothing when a does not own it): a longer chain's buffer,
// an evicted graph's scratch.
func (a *acts) release(x *Context, b Buf) error {
	i := slices.Index(a.bufs, b)
	if i < 0 {
		return nil
	}
	a.bufs = slices.Delete(a.bufs, i, i+1)
	a.bytes -= int64(b.Bytes)
	return x.Free(b)
}

func (a *acts) free(x *Context) {
	for _, b := range a.bufs {
		x.Free(b)
	}
	a.bufs, a.bytes = nil, 0
}

var errModelClosed = errors.New("cuda: the model is closed")

// Config implements llm.Backend.
func (m *Model) Config() *checkpoint.Config { return m.cfg }

// DeviceName is the GPU the model runs on (evals.NewRecordOn puts it in
// a result's device).
func (m *Model) DeviceName() string { return m.dev.Name }

// Name implements llm.Backend.
func (m *Model) Name() string {
	kind, packed := "fp16", "W4A16"
	switch {
	case m.w8Layers == m.w4Layers:
		packed = "W8A16"
	case m.w8Layers > 0:
		packed = "W4A16 and W8A16"
	}
	switch {
	case m.w4Layers > 0 && m.wideLayers > 0:
		kind = packed + ", some layers dequantized to fp16"
	case m.w4Layers > 0:
		kind = packed
	case m.wideLayers > 0:
		kind = "fp16, quantized layers dequantized"
	}
	return fmt.Sprintf("cuda (%s, %s)", m.dev.Name, kind)
}

// WeightBytes is the GPU memory the weights take.
func (m *Model) WeightBytes() int64 { return m.weights }

// Memory implements llm.Backend. Weights, Caches, Activations and
// Workspace together are every byte the model's context holds (the
// context's own count is checked against them); DeviceUsed is the whole
// GPU's use, the CUDA context and other processes included.
func (m *Model) Memory() (llm.Memory, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.x == nil {
		return llm.Memory{}, errModelClosed
	}
	cm, err := m.x.Memory()
	if err != nil {
		return llm.Memory{}, err
	}
	var act int64
	if m.eager != nil {
		act += m.eager.bytes
	}
	act += int64(m.attnWS.Bytes)
	for _, a := range m.batchActs {
		act += a.bytes
	}
	r := llm.Memory{Weights: m.weights, Caches: m.caches, Activations: act,
		Workspace: int64(m.scratch.Bytes+m.headOut.Bytes) + cm.CuBLASBytes, Graphs: cm.Graphs}
	if m.lmHead != nil {
		r.Workspace += int64(m.lmHead.ws.Bytes)
	}
	if r.Total() != cm.LiveBytes {
		return r, fmt.Errorf("cuda: memory accounting is off: the categories add up to %d bytes, the context holds %d", r.Total(), cm.LiveBytes)
	}
	if d, err := m.lib.Device(); err == nil {
		r.DeviceUsed, r.DeviceTotal = int64(d.TotalBytes-d.FreeBytes), int64(d.TotalBytes)
	}
	return r, nil
}

// Close implements llm.Backend: it destroys the model's context, which
// waits for the GPU and frees everything the model holds — weights,
// caches still open, activations, graphs, the cuBLAS handle, the stream.
func (m *Model) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.x == nil {
		return nil
	}
	err := m.x.Close()
	m.x = nil
	m.graphs, m.batchActs, m.eager = nil, nil, nil
	m.blocks, m.lmHead = nil, nil
	if err != nil {
		return fmt.Errorf("closing the GPU model: %w", err)
	}
	return nil
}

// pass is one forward pass's rows, prepared on the host.
type pass struct {
	ids, rowSeq, rowPos []int32
	kvBase              []uint64
	kvCap               []int32
	maxKeys             int
	// windows is set when every step starts an empty cache with the same
	// number of tokens (a prefill, a perplexity window) and the flash
	// kernel takes the head dimension: attention is then causal within
	// each step's rows, computed from k and v as they are, not read back
	// from the cache (which is still written, for the decode steps after).
	windows int
}

// prepare checks steps against their caches and lays out their rows; it
// reserves each cache's blocks for its tokens and ahead more (a chain of
// greedy steps, DecodeGreedy, writes them without the host) and writes
// those blocks into the device's tables. (The GPU's pool keeps every
// layer's blocks whole — no sliding window hands any back — so a block
// reserved for a chain's last token cannot be one its first still reads;
// a windowed GPU pool would have to reserve the chain's whole span.)
func (m *Model) prepare(steps []llm.Step, ahead int) (*pass, []*Cache, error) {
	p := &pass{}
	caches := make([]*Cache, len(steps))
	for i, s := range steps {
		c, ok := s.Cache.(*Cache)
		if !ok || c.m != m {
			return nil, nil, fmt.Errorf("step %d: cache %T does not belong to this GPU model", i, s.Cache)
		}
		if c.Closed() {
			return nil, nil, fmt.Errorf("step %d: the cache is closed", i)
		}
		if len(s.Tokens) == 0 {
			return nil, nil, fmt.Errorf("step %d: no tokens", i)
		}
		if c.Len()+len(s.Tokens)+ahead > c.Cap() {
			return nil, nil, fmt.Errorf("step %d: %d cached + %d new tokens exceed the cache capacity %d", i, c.Len(), len(s.Tokens)+ahead, c.Cap())
		}
		if slices.Contains(caches[:i], c) {
			return nil, nil, fmt.Errorf("step %d: the cache of step %d again", i, slices.Index(caches, c))
		}
		for j, t := range s.Tokens {
			if t < 0 || t >= m.cfg.Vocab {
				return nil, nil, fmt.Errorf("step %d: token id %d outside the vocabulary [0, %d)", i, t, m.cfg.Vocab)
			}
			p.ids = append(p.ids, int32(t))
			p.rowSeq = append(p.rowSeq, int32(i))
			p.rowPos = append(p.rowPos, int32(c.Len()+j))
		}
		p.kvBase = append(p.kvBase, c.table.Ptr())
		p.kvCap = append(p.kvCap, -1) // paged: kv_base is the block table
		p.maxKeys = max(p.maxKeys, c.Len()+len(s.Tokens))
		caches[i] = c
	}
	// The blocks the new tokens go to, for every step or none, and the
	// device tables' rows for them: the caller advances the caches after
	// the pass, or rolls them back.
	tables, ns := make([]*llm.BlockTable[uint64], len(steps)), make([]int, len(steps))
	for i, s := range steps {
		tables[i], ns[i] = caches[i].blocks, len(s.Tokens)+ahead
	}
	if err := llm.ReserveAll(m.kv.pool, tables, ns); err != nil {
		return nil, nil, err
	}
	for i := range steps {
		if err := caches[i].sync(ns[i]); err != nil {
			for _, c := range caches {
				c.blocks.Rollback()
			}
			return nil, nil, fmt.Errorf("step %d: %w", i, err)
		}
	}
	if CausalHeadDims(m.cfg.HeadDim) {
		p.windows = len(steps)
		for i, s := range steps {
			if caches[i].Len() != 0 || len(s.Tokens) != len(steps[0].Tokens) {
				p.windows = 0
			}
		}
	}
	return p, caches, nil
}

// upload copies a pass's inputs to a's buffers, and the draws of a step
// whose tokens are picked on the device (sample_rows's parameters) when
// there are any. The row metadata that matches what a holds already is
// skipped (acts.sent).
func (m *Model) upload(a *acts, p *pass, draws []float64) error {
	if err := Upload(m.x, a.ids, p.ids); err != nil {
		return err
	}
	if err := Upload(m.x, a.meta.RowPos, p.rowPos); err != nil {
		return err
	}
	if err := uploadChanged(m.x, a.meta.RowSeq, p.rowSeq, &a.sent.rowSeq); err != nil {
		return err
	}
	if err := uploadChanged(m.x, a.meta.KVCap, p.kvCap, &a.sent.kvCap); err != nil {
		return err
	}
	if err := uploadChanged(m.x, a.meta.KVBase, p.kvBase, &a.sent.kvBase); err != nil {
		return err
	}
	if draws != nil {
		return Upload(m.x, a.draws, draws)
	}
	return nil
}

// uploadChanged uploads src to dst unless *last, what was last uploaded
// there, holds the same values; *last then holds src (or nothing, when
// the copy failed and dst's contents are unknown).
func uploadChanged[T int32 | uint64](x *Context, dst Buf, src []T, last *[]T) error {
	if *last != nil && slices.Equal(*last, src) {
		return nil
	}
	*last = nil
	if err := Upload(x, dst, src); err != nil {
		return err
	}
	*last = append(make([]T, 0, len(src)), src...)
	return nil
}

// layers queues the embedding and every decoder block for T rows, leaving
// the final residual stream in a.x. With windows > 0 the rows are that
// many whole windows attended causally by the flash kernel (pass.windows);
// otherwise attention reads the caches, and attnWS is its scratch for T
// rows and maxKeys keys.
func (m *Model) layers(ctx context.Context, a *acts, attnWS Buf, T, maxKeys, windows int) error {
	c, x := m.cfg, m.x
	H, hd, L := c.Hidden, c.HeadDim, c.Layers
	eps := float32(c.RMSNormEps)
	if err := x.Embed(a.ids, m.embed, a.x, T, H, float32(c.EmbedScale)); err != nil {
		return err
	}
	if windows > 0 {
		m.flashPasses++
	}
	for l, b := range m.blocks {
		if ctx != nil {
			if err := ctx.Err(); err != nil {
				if l > 0 && m.blocks[l-1].moe != nil {
					// The experts' outputs wait in a.y for this layer's
					// norm, which would have zeroed them: zero them here,
					// or the next pass adds its own to them. (a.x, which
					// may lack a pending a.delta, the next pass rewrites.)
					err = errors.Join(err, x.Memset(a.y, 0, a.y.Bytes))
				}
				if l > 0 && !m.mlpOutput(m.blocks[l-1], a, T).sums.Nil() {
					// Likewise down's or a mixture's o's sums in the
					// workspace (runSums): the next pass's GEMMs count on
					// finding it zeroed.
					err = errors.Join(err, x.Memset(a.ws, 0, a.ws.Bytes))
				}
				return err
			}
		}
		// The previous block's MLP output joins the residual stream here
		// (through its post-feedforward norm in Gemma 3; a mixture's
		// experts are summed here too).
		var prev blockOutput
		if l > 0 {
			prev = m.mlpOutput(m.blocks[l-1], a, T)
		}
		var qkvSums Buf // q/k/v's sums in the workspace, for the RoPE kernel to finish
		if m.qkvSums(b, T) {
			qkvSums = a.ws
		}
		steps := []func() error{
			func() error {
				return x.RMSNormExperts(a.x, prev.delta, prev.sums, prev.experts, prev.norm, Buf{}, b.norms.attn, a.h, T, H, eps)
			},
			func() error {
				if !qkvSums.Nil() {
					return m.runSums(b.qkv, a.h, T, a)
				}
				return m.runParts(b.qkv, []*gpuLinear{b.q, b.k, b.v}, a.h, T, a, a.q, a.k, a.v)
			},
			func() error {
				r := m.ropes[l]
				return x.QKRoPEStore(a.q, a.k, a.v, qkvSums, b.norms.q, b.norms.k, eps, a.meta, r.cos, r.sin, l, L, T, c.Heads, c.KVHeads, hd, true)
			},
			func() error {
				if windows > 0 {
					return x.AttentionCausal(a.q, a.k, a.v, a.att, windows, T/windows, c.Heads, c.KVHeads, hd, attnOptions(c, l))
				}
				return x.Attention(a.q, a.att, attnWS, a.meta, l, L, T, c.Heads, c.KVHeads, hd, maxKeys, attnOptions(c, l))
			},
			func() error { return m.run(b.o, a.att, T, a, false, a.delta) },
		}
		norm := func() error { return x.RMSNorm(a.x, a.delta, b.norms.postAttn, Buf{}, b.norms.mlp, a.h, T, H, eps) }
		runOSums := func() error { return m.runSums(b.o, a.att, T, a) }
		if m.sums(b, b.o, b.norms.postAttn, T) { // o's sums finished by the norm (runSums)
			steps[len(steps)-1] = runOSums
			norm = func() error {
				return x.RMSNormExperts(a.x, Buf{}, a.ws, ExpertSum{}, Buf{}, Buf{}, b.norms.mlp, a.h, T, H, eps)
			}
		}
		switch {
		case b.routesInNorm(T):
			// The router joins the norm, and a.x takes the attention's
			// delta at the next norm (mlpOutput): o's fp16 output, or its
			// sums left in the workspace through the experts (moeSums).
			delta, sums := a.delta, Buf{}
			if m.moeSums(b, T) {
				steps[len(steps)-1] = runOSums
				delta, sums = Buf{}, a.ws
			}
			steps = append(steps, func() error {
				return x.RMSNormRouter(a.x, delta, sums, b.norms.mlp, a.h, b.moe.router, a.routerLogits, T, H, c.MoE.Experts, eps)
			}, func() error { return m.moeMLP(b.moe, a, T, true) })
		case b.moe != nil:
			steps = append(steps, norm, func() error { return m.moeMLP(b.moe, a, T, false) })
		default:
			steps = append(steps, norm,
				func() error {
					if b.gateUp != nil && b.gateUp.w4 != nil && b.gateUp.w4.Gated != NotGated {
						return m.run(b.gateUp, a.h, T, a, false, a.g) // act(gate)·up in the GEMM's epilogue
					}
					if err := m.runParts(b.gateUp, []*gpuLinear{b.gate, b.up}, a.h, T, a, a.g, a.u); err != nil {
						return err
					}
					return x.GatedAct(a.g, a.u, T*c.Intermediate, c.Act)
				},
				func() error {
					if m.sums(b, b.down, b.norms.postMLP, T) { // finished by the next norm (mlpOutput)
						return m.runSums(b.down, a.g, T, a)
					}
					return m.run(b.down, a.g, T, a, false, a.delta)
				})
		}
		for _, f := range steps {
			if err := f(); err != nil {
				return fmt.Errorf("layer %d: %w", l, err)
			}
		}
	}
	last := m.mlpOutput(m.blocks[len(m.blocks)-1], a, T)
	if !last.norm.Nil() || last.experts.K > 0 || !last.sums.Nil() {
		// The last MLP output through Gemma 3's norm, a mixture's experts
		// summed, or sums left in the workspace; the normed rows written
		// to a.h are not used (head norms the rows it needs).
		return x.RMSNormExperts(a.x, last.delta, last.sums, last.experts, last.norm, Buf{}, m.norm, a.h, T, H, eps)
	}
	return x.Add(a.x, last.delta, T*H)
}

// blockOutput is what a block leaves for the norm after it to add into
// the residual stream (RMSNormExperts).
type blockOutput struct {
	delta, sums Buf       // fp16 rows (a.delta), or fp32 sums left in the workspace (a.ws, runSums)
	experts     ExpertSum // a mixture's slots not yet summed, added after delta or sums
	norm        Buf       // the norm the output goes through first (Gemma 3's post-feedforward norm), else nil
}

// mlpOutput is where block b leaves its MLP's output for the norm after
// it: a.delta (fp16); down's sums in the workspace (sums); or a mixture's
// expert slots not yet summed, after the attention's output that a norm
// with the router left pending (a.delta, or o's sums: moeSums).
func (m *Model) mlpOutput(b *gpuBlock, a *acts, T int) blockOutput {
	if b.moe != nil {
		out := blockOutput{experts: ExpertSum{Y: a.y, IDs: a.expert, Weights: a.weight, K: m.cfg.MoE.TopK}, norm: b.norms.postMLP}
		switch {
		case m.moeSums(b, T):
			out.sums = a.ws
		case b.routesInNorm(T):
			out.delta = a.delta
		}
		return out
	}
	if m.sums(b, b.down, b.norms.postMLP, T) { // down's fp32 sums in the workspace (runSums)
		return blockOutput{sums: a.ws}
	}
	return blockOutput{delta: a.delta, norm: b.norms.postMLP}
}

// routesInNorm: block b is a mixture whose router runs in the launch of
// the norm before it (RMSNormRouter), which leaves the attention's output
// to the next norm — in a decode step (T ≤ normRouterMaxRows rows), whose
// time is its launches; a prefill keeps the norm and the router apart (the
// joined kernel's ⌈E/4⌉ CTAs a row would each read the row again). A norm
// of that output or of the experts' (Gemma 3's post-attention and
// post-feedforward norms) keeps the two launches too.
func (b *gpuBlock) routesInNorm(T int) bool {
	return b.moe != nil && T <= normRouterMaxRows && b.norms.postAttn.Nil() && b.norms.postMLP.Nil()
}

// normRouterMaxRows is the most rows whose mixture's router runs in the
// norm's launch: a decode step's (the batches the benchmarks decode).
const normRouterMaxRows = 64

// moeMLP queues a mixture of experts on the normed rows a.h (T of them),
// leaving each slot's output in a.y, all on the device (no host round
// trip, so decode graphs capture it): the router's logits (unless the norm
// before left them: haveLogits); each row's top k and the T·k slots grouped
// by expert (one launch); the experts' gate and up as one grouped GEMV
// over the slots, which writes act(gate)·up itself when they are
// interleaved (W4.Gated), else the gated activation follows; down. A
// decode step's few rows of 4-bit experts route inside the gate/up GEMV
// instead (MoEGemvRouted: one launch fewer), and that call runs down too
// where the experts are gated (inside the routed launch with
// LLMQ_MOE_FUSED_DOWN=1: one launch fewer again). The weighted sum of each
// row's k outputs, in ascending expert order, is the next norm's
// (mlpOutput, RMSNormExperts).
func (m *Model) moeMLP(mo *gpuMoE, a *acts, T int, haveLogits bool) error {
	c, x := m.cfg, m.x
	E, k, H, I := c.MoE.Experts, c.MoE.TopK, c.Hidden, c.MoE.Intermediate
	S := T * k
	mt := moeChunk(S, E)
	maxChunks := MoEMaxChunks(S, E, mt)
	var steps []func() error
	if !haveLogits {
		steps = append(steps, func() error { return x.MoERouter(a.h, mo.router, a.routerLogits, T, E, H) })
	}
	var gated Buf // act(gate)·up, written by gated experts
	if mo.gateUp != nil && mo.gateUp.Gated != NotGated {
		gated = a.g
	}
	downDone := false // the routed call ran down too
	if mo.gateUp != nil && mt == 1 && MoERoutable(T, k) {
		var y Buf
		if !gated.Nil() && mo.down != nil {
			y, downDone = a.y, true
		}
		steps = append(steps, func() error {
			return x.MoEGemvRouted(a.h, a.routerLogits, T, E, k, c.MoE.NormTopK, a.expert, a.weight, a.order, a.chunks,
				mo.gateUp, a.gu, gated, 2*I, H, mo.down, y)
		})
	} else {
		steps = append(steps, func() error {
			return x.MoERoutePlan(a.routerLogits, a.expert, a.weight, T, E, k, c.MoE.NormTopK, mt, a.order, a.chunks, maxChunks)
		}, func() error {
			return x.MoEGemv(a.h, k, a.order, a.chunks, maxChunks, mt, S, mo.gateUp, mo.gateUp16, a.gu, gated, 2*I, H)
		})
	}
	if gated.Nil() {
		steps = append(steps, func() error { return x.MoEAct(a.gu, a.g, S, I, c.Act, false) })
	}
	if !downDone {
		steps = append(steps, func() error {
			return x.MoEGemv(a.g, 1, a.order, a.chunks, maxChunks, mt, S, mo.down, mo.down16, a.y, Buf{}, H, I)
		})
	}
	for _, f := range steps {
		if err := f(); err != nil {
			return fmt.Errorf("mixture of experts: %w", err)
		}
	}
	return nil
}

// moeChunk is how many slots of one expert a grouped GEMV's CTA takes:
// 4 once the slots average two or more an expert (a large batch, a
// prefill: the expert's weights are read once for four rows), else 1 (a
// decode step's slots mostly have an expert each, and the GEMV's
// arithmetic grows with the rows it carries).
func moeChunk(slots, experts int) int {
	if slots >= 2*experts {
		return 4
	}
	return 1
}

// headRows is how many rows a packed LM head runs at a time: the W4A16
// kernels write its logits in fp16 into a [headRows][vocab] buffer
// (Model.headOut), which f16_to_f32 widens into the fp32 logits; and up
// to 64 rows every W4A16 path of 4- and 8-bit codes runs without the
// dequantize scratch (with the default LLMQ_W4_MMA_MAX_M), which is
// sized for the decoder's layers, not for a vocabulary-wide one.
const headRows = 64

// headPackable says whether a quantized LM head of k inputs, n outputs
// and groups of group inputs stays packed on the GPU: it must fit the
// kernels' tiles (pack.GPUShapeError), and its groups be a power of two
// or one a column, since other groups go through dequantize + cuBLAS,
// whose scratch a head would need vocabulary-wide. Other heads are
// dequantized at load.
func headPackable(k, n, group int) bool {
	return pack.GPUShapeError(k, n, group) == nil && (group >= k || group&(group-1) == 0)
}

// head queues the final norm of the rows a.rowIdx[:n] and the LM head,
// leaving n rows of fp32 logits in a.logits: an fp16 head in one cuBLAS
// call with fp32 outputs, a packed one headRows rows at a time (its
// logits rounded to fp16 on the way, as vLLM's are in the model's dtype).
func (m *Model) head(a *acts, n int) error {
	if err := m.x.RMSNorm(a.x, Buf{}, Buf{}, a.rowIdx, m.norm, a.h, n, m.cfg.Hidden, float32(m.cfg.RMSNormEps)); err != nil {
		return err
	}
	if m.lmHead.w4 == nil {
		return m.run(m.lmHead, a.h, n, a, true, a.logits)
	}
	H, V := m.cfg.Hidden, m.cfg.Vocab
	for r := 0; r < n; r += headRows {
		rows := min(headRows, n-r)
		if err := m.run(m.lmHead, a.h.Offset(r*H*2), rows, a, false, m.headOut); err != nil {
			return err
		}
		if err := m.x.F16ToF32(m.headOut, a.logits.Offset(r*V*4), rows*V); err != nil {
			return err
		}
	}
	return nil
}

// eagerActs returns the eager buffers, grown to at least rows.
func (m *Model) eagerActs(rows int) (*acts, error) {
	if m.eager != nil && m.eager.rows >= rows {
		return m.eager, nil
	}
	if m.eager != nil {
		m.eager.free(m.x)
		m.eager = nil
	}
	a, err := m.newActs(max(rows, 16))
	if err != nil {
		return nil, err
	}
	m.eager = a
	return a, nil
}

// eagerAttnWS returns the eager attention scratch for p's T rows, grown
// as needed; none when the flash kernel attends (it needs no scratch).
func (m *Model) eagerAttnWS(p *pass, T int) (Buf, error) {
	if p.windows > 0 {
		return Buf{}, nil
	}
	need := m.lib.AttentionWorkspaceBytes(T, m.cfg.Heads, m.cfg.HeadDim, p.maxKeys)
	if m.attnWS.Bytes >= need {
		return m.attnWS, nil
	}
	if err := m.x.Free(m.attnWS); err != nil {
		return Buf{}, err
	}
	m.attnWS = Buf{}
	b, err := m.x.Alloc(need)
	if err != nil {
		return b, fmt.Errorf("attention scratch for %d rows: %w", T, err)
	}
	m.attnWS = b
	return b, nil
}

// AnswersGreedy marks the model an llm.Greedier: when every step of a
// Forward is Greedy and LastOnly, the argmax runs on the device and only
// the ids come back (a batch that mixes them gets its argmaxes from the
// logits; a Greedy step without LastOnly is an ordinary one).
func (m *Model) AnswersGreedy() {}

// AnswersDraw marks the model an llm.Drawer: when every step of a Forward
// is Greedy or has a Draw, and LastOnly, the tokens are picked on the
// device (sample_rows: the sampler's rule with the step's draw; argmax
// for the greedy ones) and only the ids come back; a row whose candidates
// do not fit the kernel is picked on the host from its logits, with the
// same draw. In a batch with a step that wants its logits, the drawn
// steps are picked on the host from theirs, in parallel.
func (m *Model) AnswersDraw() {}

// Forward implements llm.Backend.
func (m *Model) Forward(ctx context.Context, steps []llm.Step) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.x == nil {
		return errModelClosed
	}
	p, caches, err := m.prepare(steps, 0)
	if err != nil || len(p.ids) == 0 {
		return err
	}
	done := false
	defer func() {
		if !done { // the pass failed: give back the blocks prepare took
			for _, c := range caches {
				c.blocks.Rollback()
			}
		}
	}()
	T := len(p.ids)
	V := m.cfg.Vocab
	// Rows whose logits are wanted, in step order; picked on the device
	// when every step asks only for its last row's token (llm.Step.Greedy
	// or Draw).
	var out []int32
	r := 0
	onDevice := true
	for i, s := range steps {
		picks := (s.Greedy || s.Draw != nil) && s.LastOnly
		onDevice = onDevice && picks
		want := len(s.Tokens) * V
		if s.LastOnly {
			want = V
		}
		if len(s.Logits) < want && !picks {
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

	// The draws of a step picked on the device (sample_rows's parameters),
	// uploaded with the pass's inputs: an upload waits for the stream.
	var draws []float64
	if onDevice && slices.ContainsFunc(steps, func(s llm.Step) bool { return s.Draw != nil }) {
		ds := make([]*llm.Draw, len(steps))
		for i := range steps {
			ds[i] = steps[i].Draw
		}
		draws = drawParams(ds)
	}
	var a *acts
	if T == len(steps) && len(out) == T { // a decode step: replay a graph
		if a, err = m.decode(p, draws); err != nil {
			return err
		}
	} else {
		if a, err = m.eagerActs(T); err != nil {
			return err
		}
		if err := m.upload(a, p, draws); err != nil {
			return err
		}
		if err := Upload(m.x, a.rowIdx, out); err != nil {
			return err
		}
		ws, err := m.eagerAttnWS(p, T)
		if err != nil {
			return err
		}
		if err := m.layers(ctx, a, ws, T, p.maxKeys, p.windows); err != nil {
			return err
		}
		if err := m.head(a, len(out)); err != nil {
			return err
		}
	}
	if onDevice {
		// Every step wants only its next token: picked on the device, and
		// one int32 a step to the host instead of a row of logits.
		if err := m.pick(a, steps, draws != nil, V); err != nil {
			return err
		}
	} else {
		logits := make([]float32, len(out)*V)
		if err := Download(m.x, logits, a.logits); err != nil {
			return err
		}
		r = 0
		var drawRows []int
		var rows [][]float32
		for i, s := range steps {
			n := len(s.Tokens)
			if s.LastOnly {
				n = 1
			}
			copy(s.Logits, logits[r*V:(r+n)*V])
			if s.LastOnly && s.Draw != nil {
				drawRows, rows = append(drawRows, i), append(rows, logits[r*V:(r+1)*V])
			} else if s.Greedy && s.LastOnly {
				steps[i].Argmax = llm.Argmax(logits[r*V : (r+1)*V])
			}
			r += n
		}
		pickOnHost(steps, drawRows, rows)
	}
	for i, s := range steps {
		caches[i].blocks.Advance(len(s.Tokens))
	}
	done = true
	return nil
}

var _ llm.Chainer = (*Model)(nil)

// DecodeGreedy implements llm.Chainer: n greedy decode steps of
// len(steps) sequences (each step's Cache and one token), queued on the
// stream at once — the decode graph, the argmax, and device-to-device
// copies that make the picked ids the next step's input and advance the
// positions by one — and one read-back of every picked id at the end, so
// the GPU runs the n steps without waiting for the host between them.
// Each cache's blocks for the n tokens the chain writes are reserved and
// written into the device's tables first. The graph is the one for the
// chain's last step (its key bound covers every step's keys).
func (m *Model) DecodeGreedy(ctx context.Context, steps []llm.Step, n int) ([][]int, error) {
	if n < 1 {
		return nil, fmt.Errorf("greedy chain of %d steps (want at least 1)", n)
	}
	for i, s := range steps {
		if len(s.Tokens) != 1 {
			return nil, fmt.Errorf("greedy chain: step %d has %d tokens (a chain decodes one a sequence)", i, len(s.Tokens))
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.x == nil {
		return nil, errModelClosed
	}
	p, caches, err := m.prepare(steps, n-1)
	if err != nil || len(p.ids) == 0 {
		return nil, err
	}
	done := false
	defer func() {
		if !done {
			for _, c := range caches {
				c.blocks.Rollback()
			}
		}
	}()
	B, V := len(steps), m.cfg.Vocab
	p.maxKeys += n - 1
	dg, a, err := m.graphFor(p)
	if err != nil {
		return nil, err
	}
	// The later steps' positions ([n][B]; step 0's slot unused, its
	// positions go with the pass's inputs) and every step's picked ids
	// ([n][B]), in a's chain buffer.
	chain, err := a.chainBuf(m.x, n)
	if err != nil {
		return nil, fmt.Errorf("greedy chain of %d steps: %w", n, err)
	}
	picked := chain.Offset(n * B * 4)
	if n > 1 {
		pos := make([]int32, (n-1)*B)
		for k := 1; k < n; k++ {
			for i, r := range p.rowPos {
				pos[(k-1)*B+i] = r + int32(k)
			}
		}
		if err := Upload(m.x, chain.Offset(B*4), pos); err != nil {
			return nil, err
		}
	}
	if err := m.upload(a, p, nil); err != nil {
		return nil, err
	}
	for k := range n {
		if k > 0 {
			if err := m.x.Copy(a.ids, a.next, B*4); err != nil {
				return nil, err
			}
			if err := m.x.Copy(a.meta.RowPos, chain.Offset(k*B*4), B*4); err != nil {
				return nil, err
			}
		}
		if err := m.x.Launch(dg.g); err != nil {
			return nil, err
		}
		if err := m.x.ArgmaxRows(a.logits, a.next, B, V); err != nil {
			return nil, err
		}
		if err := m.x.Copy(picked.Offset(k*B*4), a.next, B*4); err != nil {
			return nil, err
		}
	}
	ids := make([]int32, n*B)
	if err := Download(m.x, ids, picked); err != nil {
		return nil, err
	}
	out := make([][]int, B)
	for i := range out {
		out[i] = make([]int, n)
		for k := range n {
			out[i][k] = int(ids[k*B+i])
		}
	}
	for _, c := range caches {
		c.blocks.Advance(n)
	}
	done = true
	return out, nil
}

// pick sets each step's Argmax from its row of a.logits (one a step) on
// the device: sample_rows with the draws upload put in a.draws (temperature 0
// for the greedy steps) when drawn, else argmax_rows. The rows sample_rows
// leaves to the host (−1) are copied back and picked there.
func (m *Model) pick(a *acts, steps []llm.Step, drawn bool, V int) error {
	n := len(steps)
	if drawn {
		if err := m.x.SampleRows(a.logits, a.draws, a.next, n, V); err != nil {
			return err
		}
	} else if err := m.x.ArgmaxRows(a.logits, a.next, n, V); err != nil {
		return err
	}
	next := make([]int32, n)
	if err := Download(m.x, next, a.next); err != nil {
		return err
	}
	var left []int
	var rows [][]float32
	for i := range steps {
		steps[i].Argmax = int(next[i])
		if next[i] >= 0 {
			continue
		}
		if steps[i].Draw == nil {
			return fmt.Errorf("sample_rows left greedy row %d to the host", i)
		}
		row := make([]float32, V)
		if err := Download(m.x, row, a.logits.Offset(i*V*4)); err != nil {
			return err
		}
		left, rows = append(left, i), append(rows, row)
	}
	pickOnHost(steps, left, rows)
	return nil
}

// drawParams lays out SampleRows's parameters: 4 fp64 a row, the draw's
// temperature, top-k, top-p and u; a nil draw is a greedy row (all 0).
func drawParams(ds []*llm.Draw) []float64 {
	p := make([]float64, 4*len(ds))
	for i, d := range ds {
		if d != nil {
			p[4*i], p[4*i+1], p[4*i+2], p[4*i+3] = d.Temperature, float64(d.TopK), d.TopP, d.U
		}
	}
	return p
}

// pickOnHost sets steps[idx[j]].Argmax to its draw's pick from rows[j],
// the rows in parallel (a pick over 128k logits takes milliseconds).
func pickOnHost(steps []llm.Step, idx []int, rows [][]float32) {
	mat.ParallelFor(len(idx), 1, func(lo, hi int) {
		for j := lo; j < hi; j++ {
			steps[idx[j]].Argmax = steps[idx[j]].Draw.Pick(rows[j])
		}
	})
}

// graphKey is a decode graph's batch size and bound on the keys attended
// (which sizes the attention kernel's chunks and scratch).
type graphKey struct{ batch, keys int }

// decodeGraph is a captured decode step.
type decodeGraph struct {
	g    Graph
	ws   Buf // its attention scratch
	used uint64
}

// decode runs a step where each sequence adds one token, through the
// CUDA graph for its batch size and key bound (captured on first use).
func (m *Model) decode(p *pass, draws []float64) (*acts, error) {
	dg, a, err := m.graphFor(p)
	if err != nil {
		return nil, err
	}
	if err := m.upload(a, p, draws); err != nil {
		return nil, err
	}
	return a, m.x.Launch(dg.g)
}

// graphFor is the decode graph for p's rows and key bound, captured on
// first use, and its batch size's buffers.
func (m *Model) graphFor(p *pass) (*decodeGraph, *acts, error) {
	B := len(p.ids)
	key := graphKeyFor(p.maxKeys, B, m.cfg.MaxPositions)
	dg, ok := m.graphs[key]
	if !ok {
		var err error
		if dg, err = m.capture(key); err != nil {
			return nil, nil, fmt.Errorf("capturing the decode step for batch %d: %w", B, err)
		}
	}
	m.tick++
	dg.used = m.tick
	return dg, m.batchActs[B], nil
}

// graphKeyFor is the decode graph for B rows whose longest attends to
// maxKeys keys: its key bound the next power of two from 256 (so a few
// graphs serve every length), at most the model's positions.
func graphKeyFor(maxKeys, B, maxPositions int) graphKey {
	keys := 256
	for keys < maxKeys {
		keys *= 2
	}
	return graphKey{B, min(keys, maxPositions)}
}

// capture records the decode graph for key, making room first when
// maxGraphs are held, and the batch size's buffers when it has none.
func (m *Model) capture(key graphKey) (*decodeGraph, error) {
	if len(m.graphs) >= maxGraphs {
		if err := m.evictGraph(); err != nil {
			return nil, err
		}
	}
	B := key.batch
	a := m.batchActs[B]
	if a == nil {
		var err error
		if a, err = m.newActs(B); err != nil {
			return nil, err
		}
		idx := make([]int32, B)
		for i := range idx {
			idx[i] = int32(i)
		}
		if err := Upload(m.x, a.rowIdx, idx); err != nil {
			a.free(m.x)
			return nil, err
		}
		m.batchActs[B] = a
	}
	dg := &decodeGraph{}
	if err := a.alloc(m.x, &dg.ws, m.lib.AttentionWorkspaceBytes(B, m.cfg.Heads, m.cfg.HeadDim, key.keys)); err != nil {
		m.dropBatchActs(B)
		return nil, err
	}
	g, err := m.x.Capture(func() error {
		if err := m.layers(nil, a, dg.ws, B, key.keys, 0); err != nil {
			return err
		}
		return m.head(a, B)
	})
	if err != nil {
		a.release(m.x, dg.ws)
		m.dropBatchActs(B)
		return nil, err
	}
	dg.g = g
	m.graphs[key] = dg
	return dg, nil
}

// evictGraph destroys the least recently used decode graph and its
// scratch (and its batch size's buffers when no other graph uses them).
func (m *Model) evictGraph() error {
	var old graphKey
	var oldest *decodeGraph
	for k, g := range m.graphs {
		if oldest == nil || g.used < oldest.used {
			old, oldest = k, g
		}
	}
	if oldest == nil {
		return nil
	}
	delete(m.graphs, old)
	err := m.x.DestroyGraph(oldest.g)
	m.batchActs[old.batch].release(m.x, oldest.ws)
	m.dropBatchActs(old.batch)
	return err
}

// dropBatchActs frees batch size B's buffers when no graph uses them.
func (m *Model) dropBatchActs(B int) {
	for k := range m.graphs {
		if k.batch == B {
			return
		}
	}
	if a := m.batchActs[B]; a != nil {
		a.free(m.x)
		delete(m.batchActs, B)
	}
}

// WindowNLL implements llm.Backend: one window from an empty cache, with
// log-softmax and the NLL computed on the GPU, so only one float per
// token comes back.
func (m *Model) WindowNLL(ctx context.Context, ids []int) (float64, int, error) {
	if len(ids) < 2 {
		return 0, 0, fmt.Errorf("a window needs at least 2 tokens, got %d", len(ids))
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	cache, err := m.newCache(len(ids))
	if err != nil {
		return 0, 0, err
	}
	defer func() {
		cache.close()
	}()
	sum, n, err := m.windowNLL(ctx, cache, ids)
	if err != nil {
		return 0, 0, fmt.Errorf("window NLL on the GPU: %w", err)
	}
	return sum, n, nil
}

func (m *Model) windowNLL(ctx context.Context, cache *Cache, ids []int) (float64, int, error) {
	p, _, err := m.prepare([]llm.Step{{Cache: cache, Tokens: ids}}, 0)
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
	if err := m.upload(a, p, nil); err != nil {
		return 0, 0, err
	}
	if err := Upload(m.x, a.rowIdx, rows); err != nil {
		return 0, 0, err
	}
	if err := Upload(m.x, a.targets, targets); err != nil {
		return 0, 0, err
	}
	ws, err := m.eagerAttnWS(p, T)
	if err != nil {
		return 0, 0, err
	}
	if err := m.layers(ctx, a, ws, T, p.maxKeys, p.windows); err != nil {
		return 0, 0, err
	}
	if err := m.head(a, n); err != nil {
		return 0, 0, err
	}
	if err := m.x.NLL(a.logits, a.targets, a.nll, n, m.cfg.Vocab); err != nil {
		return 0, 0, err
	}
	nll := make([]float32, n)
	if err := Download(m.x, nll, a.nll); err != nil {
		return 0, 0, err
	}
	var sum float64
	for _, v := range nll {
		sum += float64(v)
	}
	if math.IsNaN(sum) || math.IsInf(sum, 0) {
		return 0, 0, fmt.Errorf("non-finite NLL (fp16 overflow in the activations?)")
	}
	return sum, n, nil
}

// OpenModel loads the CUDA library (DefaultPath) and uploads a checkpoint
// in a context of its own; Close releases everything.
func OpenModel(ck *checkpoint.Checkpoint) (Backend, error) { return OpenModelWith(ck, LoadOptions{}) }

// OpenModelWith is OpenModel with options.
func OpenModelWith(ck *checkpoint.Checkpoint, opt LoadOptions) (Backend, error) {
	if err := Supports(ck.Config); err != nil {
		return nil, fmt.Errorf("%s: %w", ck.Dir, err)
	}
	lib, err := Open("")
	if err != nil {
		return nil, err
	}
	return LoadWith(lib, ck, opt)
}

// attnOptions are layer l's sliding window and score scale.
func attnOptions(c *checkpoint.Config, l int) AttnOptions {
	o := AttnOptions{Window: c.Window(l)}
	if c.QueryPreAttnScalar > 0 {
		o.Scale = float32(1 / math.Sqrt(c.QueryPreAttnScalar))
	}
	return o
}

// Supports refuses, by name, what the GPU backend does not run yet
// rather than running it wrongly: a mixture wider than the route kernel
// (more than 256 experts, or a top k past 16); the CPU backend runs them.
func Supports(c *checkpoint.Config) error {
	if c.Hidden%4 != 0 || c.Hidden > MaxNormHidden {
		return fmt.Errorf("%s: the GPU backend runs hidden sizes that are multiples of 4 up to %d, not %d (--device cpu runs it)",
			c.Architecture, MaxNormHidden, c.Hidden)
	}
	if c.MoE != nil && (c.MoE.Experts > 256 || c.MoE.TopK > 16) {
		return fmt.Errorf("%s: the GPU backend runs mixtures of up to 256 experts and a top k up to 16, not %d top %d (--device cpu runs it)",
			c.Architecture, c.MoE.Experts, c.MoE.TopK)
	}
	return nil
}

// CalibratorSupports is Supports for quantizing on the GPU: the
// calibration forward does not run mixtures of experts or Gemma 3's
// sandwich norms yet.
func CalibratorSupports(c *checkpoint.Config) error {
	if err := Supports(c); err != nil {
		return err
	}
	if c.MoE != nil {
		return fmt.Errorf("%s: the GPU calibrator does not run mixtures of experts yet (--device cpu quantizes it)", c.Architecture)
	}
	if c.SandwichNorm {
		return fmt.Errorf("%s: the GPU calibrator does not run Gemma 3's sandwich norms yet (--device cpu quantizes it)", c.Architecture)
	}
	return nil
}
