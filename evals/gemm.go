//go:build cgo

package evals

import (
	"fmt"
	"math/rand/v2"

	"github.com/llmq/llmq/cuda"
	"github.com/llmq/llmq/pack"
	"github.com/x448/float16"
)

// GemmShape is one linear layer: K inputs → N outputs.
type GemmShape struct {
	Name string `json:"name"`
	K    int    `json:"k"`
	N    int    `json:"n"`
}

// LlamaShapes are Llama-3-8B's linear layers (fused qkv, o, fused gate+up,
// down) and Llama-3-70B's down projection.
var LlamaShapes = []GemmShape{
	{"8B qkv 4096→6144", 4096, 6144}, {"8B o 4096→4096", 4096, 4096},
	{"8B gate+up 4096→28672", 4096, 28672}, {"8B down 14336→4096", 14336, 4096},
	{"70B down 28672→8192", 28672, 8192},
}

// GemmResult is one shape at one M.
type GemmResult struct {
	Shape       string  `json:"shape"`
	M           int     `json:"m"`
	K           int     `json:"k"`
	N           int     `json:"n"`
	Variant     string  `json:"variant"` // the kernel that ran (cuda.Context.Plan)
	W4Micros    float64 `json:"w4a16_us"`
	CuBLASMicro float64 `json:"cublas_fp16_us"`
	Speedup     float64 `json:"speedup"`
	// The peer, PyTorch's int4 kernel (tinygemm), timed in the same device
	// call by evals/torchref/tinygemm.py; 0 where not measured.
	PeerMicros float64 `json:"tinygemm_us,omitempty"`
	VsPeer     float64 `json:"speedup_vs_tinygemm,omitempty"`
	TFLOPS     float64 `json:"w4a16_tflops"`
	Bytes      int64   `json:"bytes_moved"`
	BWFraction float64 `json:"fraction_of_read_bw"`
}

// GemmBench times the W4A16 kernel against cuBLAS fp16 with CUDA events:
// calls captured in CUDA graphs, rotating among enough copies of the
// weights that L2 (60 MB on the H200) cannot serve them.
type GemmBench struct {
	GPU   *cuda.Context // the context the weights and timings live in
	Iters int
	Bits  int // the weights' codes: 4 (0 reads as 4) or 8
	// Sums times the GEMM with no outputs (cuda.Context.GemmW4Sums): the
	// fp32 sums left in the workspace, as a decode step's o and down run.
	// The workspace is zeroed after each M (the sums pile up over the runs).
	Sums bool
	// ReadBW is the measured read bandwidth in bytes/s (MeasureReadBW).
	ReadBW float64
}

// MeasureReadBW reads a 2 GiB buffer once per run and returns bytes/s.
func (b *GemmBench) MeasureReadBW() (float64, error) {
	const n = 2 << 30
	buf, err := b.GPU.Alloc(n)
	if err != nil {
		return 0, err
	}
	defer b.GPU.Free(buf)
	out, _ := b.GPU.Alloc(16)
	defer b.GPU.Free(out)
	b.GPU.Memset(buf, 1, n)
	ms, err := b.median(func(int) error { return b.GPU.ReadProbe(buf, n, out) }, 100)
	if err != nil {
		return 0, err
	}
	b.ReadBW = n / (ms / 1e3)
	return b.ReadBW, nil
}

// perCall is how many calls one timed CUDA graph holds.
const perCall = 20

// median times perCall calls of fn (given the call number) in a CUDA
// graph (cuda.Context.TimeGraph: three warm-up replays, then
// max(iters/perCall, 5) timed ones) and returns the median milliseconds
// per call.
func (b *GemmBench) median(fn func(i int) error, iters int) (float64, error) {
	times, err := b.GPU.TimeGraph(perCall, fn, 3, max(iters/perCall, 5))
	if err != nil {
		return 0, err
	}
	return Median(times), nil
}

// randomGPUWeights makes a random layer of bits-bit codes in the kernel
// layout (values uniform over the grid, realistic scales; act-order off).
func randomGPUWeights(r *rand.Rand, K, N, bits int) (*pack.GPUWeights, error) {
	G := K / 128
	l := &pack.Linear{In: K, Out: N, Grid: pack.Grid{Bits: bits, GroupSize: 128}, Q: make([]uint8, N*K),
		Scale: make([]float32, G*N), Zero: make([]uint8, G*N), GIdx: pack.SequentialGIdx(K, 128)}
	for i := range l.Q {
		l.Q[i] = uint8(r.IntN(1 << bits))
	}
	for i := range l.Scale {
		l.Scale[i] = pack.RoundF16(0.001 + 0.01*r.Float32())
		l.Zero[i] = uint8(r.IntN(1 << bits))
	}
	return l.GPULayout()
}

// Run measures one shape at each M.
func (b *GemmBench) Run(s GemmShape, Ms []int) ([]GemmResult, error) {
	l := b.GPU
	r := rand.New(rand.NewPCG(uint64(s.K), uint64(s.N)))
	bits := b.Bits
	if bits == 0 {
		bits = 4
	}
	g, err := randomGPUWeights(r, s.K, s.N, bits)
	if err != nil {
		return nil, err
	}
	w4Bytes := len(g.B)*4 + len(g.Scales)*2 + len(g.Zeros)*4
	f16Bytes := s.K * s.N * 2
	copies := func(bytes int) int { return max(1, min(16, (256<<20)/bytes+1)) }
	var ws4 []*cuda.W4
	for i := 0; i < copies(w4Bytes); i++ {
		w, err := l.UploadW4(g)
		if err != nil {
			return nil, err
		}
		defer w.Free(l)
		ws4 = append(ws4, w)
	}
	var wf16 []cuda.Buf
	for i := 0; i < copies(f16Bytes); i++ {
		w, err := l.Alloc(f16Bytes)
		if err != nil {
			return nil, err
		}
		defer l.Free(w)
		if err := l.Dequant(ws4[0], w); err != nil {
			return nil, err
		}
		wf16 = append(wf16, w)
	}
	maxM := 0
	for _, m := range Ms {
		maxM = max(maxM, m)
	}
	abits := make([]uint16, maxM*s.K)
	for i := range abits {
		abits[i] = float16.Fromfloat32(float32(r.NormFloat64())).Bits()
	}
	A, err := cuda.AllocFrom(l, abits)
	if err != nil {
		return nil, err
	}
	defer l.Free(A)
	C, _ := l.Alloc(maxM * s.N * 2)
	defer l.Free(C)
	ws, err := l.Alloc(l.Lib().WorkspaceBytes(maxM, s.N))
	if err != nil {
		return nil, err
	}
	defer l.Free(ws)
	l.Memset(ws, 0, ws.Bytes)
	scratch, err := l.Alloc(f16Bytes)
	if err != nil {
		return nil, err
	}
	defer l.Free(scratch)

	var out []GemmResult
	for _, M := range Ms {
		variant, err := l.Plan(ws4[0], M)
		if err != nil {
			return nil, fmt.Errorf("%s M=%d: %w", s.Name, M, err)
		}
		t4, err := b.median(func(i int) error {
			if b.Sums {
				return l.GemmW4Sums(A, ws4[i%len(ws4)], M, ws, scratch, cuda.Buf{})
			}
			return l.GemmW4(A, C, ws4[i%len(ws4)], M, ws, scratch, cuda.Buf{})
		}, b.Iters)
		if err != nil {
			return nil, fmt.Errorf("%s M=%d: %w", s.Name, M, err)
		}
		if b.Sums {
			variant += " sums"
			if err := l.Memset(ws, 0, ws.Bytes); err != nil {
				return nil, err
			}
		}
		t16, err := b.median(func(i int) error {
			return l.GemmF16(A, wf16[i%len(wf16)], C, M, s.N, s.K)
		}, b.Iters)
		if err != nil {
			return nil, fmt.Errorf("%s M=%d cuBLAS: %w", s.Name, M, err)
		}
		outBytes := M * s.N * 2 // fp16 outputs, or with Sums fp32 sums added into the workspace
		if b.Sums {
			outBytes *= 2
		}
		bytes := int64(w4Bytes) + int64(M*s.K*2) + int64(outBytes)
		res := GemmResult{Shape: s.Name, M: M, K: s.K, N: s.N, Variant: variant, W4Micros: t4 * 1e3, CuBLASMicro: t16 * 1e3,
			Speedup: t16 / t4, TFLOPS: 2 * float64(M) * float64(s.K) * float64(s.N) / (t4 / 1e3) / 1e12, Bytes: bytes}
		if b.ReadBW > 0 {
			res.BWFraction = float64(bytes) / (t4 / 1e3) / b.ReadBW
		}
		out = append(out, res)
	}
	return out, nil
}

// PeerRun is the JSON evals/torchref/tinygemm.py writes.
type PeerRun struct {
	Torch   string `json:"torch"`
	GPU     string `json:"gpu"`
	Command string `json:"command"`
	Date    string `json:"date"`
	Results []struct {
		K, N, M int
		Micros  float64 `json:"tinygemm_us"`
	} `json:"results"`
}

// AddPeer fills the peer's time and the ratio to it into results of the
// same K, N and M, and returns how many rows got one.
func AddPeer(res []GemmResult, p *PeerRun) int {
	matched := 0
	for i := range res {
		for _, q := range p.Results {
			if q.K == res[i].K && q.N == res[i].N && q.M == res[i].M && q.Micros > 0 {
				res[i].PeerMicros, res[i].VsPeer = q.Micros, q.Micros/res[i].W4Micros
				matched++
			}
		}
	}
	return matched
}
