package pack

import (
	"fmt"
	"sort"

	"github.com/llmq/llmq/llm/mat"
	"github.com/x448/float16"
)

// GPUWeights is an integer-quantized layer in the layout the CUDA WNA16
// kernels read (cuda/llmq.h): K = In rows, N = Out columns, 4-bit codes
// (2-, 3- and 4-bit grids; smaller codes sit in the low bits of a nibble)
// or 8-bit codes.
//
// The kernel swaps the operands of mma.m16n8k16: a 16-column tile of the
// weights is the 16×16 A operand and the tokens are the n = 8 operand, so
// at small M the Tensor Core's 16 rows are filled by weights, not padding.
// Rows of K are taken 64 at a time (a "chunk", four k16 steps of the mma).
// Within a chunk, step s and fragment element j ∈ 0…3 of lane l = 4·g + t
// (b0 low/high, b1 low/high; a0/a1 and a2/a3 on the weight side) stand for
// physical row
//
//	kp(s, t, j) = 32·(s/2) + 8·t + 4·(s%2) + j
//
// so that a lane's activations for the chunk are two 16-byte runs of A's
// row (k … k+7 and k+32 … k+39 with k = 8·t), and the steps 0–1 and 2–3
// each cover one aligned half of 32 rows (a group of 32 never straddles
// a step). Lane l's word for step s holds, for the columns c = 16·ct + g
// and c + 8 (the mma A rows g and g+8):
//
//	4-bit: nibble 0/4 = q(c, kp(s,t,0/1)), 1/5 = q(c+8, kp(s,t,0/1)),
//	       2/6 = q(c, kp(s,t,2/3)),        3/7 = q(c+8, kp(s,t,2/3))
//	8-bit: two words; bytes 0/2 = q(c, kp 0/1), 1/3 = q(c+8, kp 0/1), then
//	       the same for kp 2/3
//
// so (w & 0x000F000F) | 0x6400 6400 is fragment a0 as two fp16 values
// 1024 + q, and the odd nibbles OR-ed into 64.0 give 64 + q (8-bit: bytes
// into 1024.0). A chunk of one column tile is 32 lanes × 16 bytes per
// 4 bits of code, lane-contiguous. Tiles go in groups of 8 (the columns
// one CTA of the kernel owns, 128), and within a group chunk by chunk:
// the chunks c of the group's tiles are one contiguous block, so a CTA
// reads 4 KB (8-bit: 8 KB) of consecutive memory per chunk rather than
// eight 512-byte pieces far apart (GPUTileChunk gives the order). K is
// padded to a multiple of 64 with zero codes (the kernel reads no
// activations there).
//
// Scales and zeros are per (group, column tile, g): Scales holds the fp16
// scales of columns c and c+8 as one word (low half c), Zeros the two
// zero points as one byte (4-bit: low nibble c) or two bytes (8-bit, low
// byte c). Act-order layers are handled once here: input channels are
// sorted by g_idx (Perm), so groups are contiguous and the kernel never
// reads g_idx; the runtime gathers A's columns through Perm.
type GPUWeights struct {
	K, N, Group int
	Bits        int      // code width of the layout: 4 or 8
	B           []uint32 // codes, CT·KC chunks of 32·Bits/4 words
	Scales      []uint32 // [G][N/16][8] fp16 pairs
	Zeros       []uint8  // [G][N/16][8] × Bits/4 bytes
	Perm        []int32  // nil when g_idx is sequential
}

// Chunks is the number of 64-row chunks (K rounded up).
func (g *GPUWeights) Chunks() int { return (g.K + 63) / 64 }

// Groups is the number of scale rows: K padded to whole chunks, in groups
// (one when the layer has one group per column).
func (g *GPUWeights) Groups() int {
	if g.Group >= g.K {
		return 1
	}
	return (g.Chunks()*64 + g.Group - 1) / g.Group
}

// GPUTileGroup is the number of column tiles stored interleaved chunk by
// chunk (the kernel's column tiles per CTA).
const GPUTileGroup = 8

// GPUTileChunk is the position, in units of one tile's chunk, of chunk c
// of column tile ct among CT tiles of KC chunks: groups of GPUTileGroup
// tiles one after another, each chunk by chunk (the last group may be
// narrower).
func GPUTileChunk(ct, c, CT, KC int) int {
	grp, i := ct/GPUTileGroup, ct%GPUTileGroup
	width := min(GPUTileGroup, CT-grp*GPUTileGroup)
	return grp*GPUTileGroup*KC + c*width + i
}

// GPURow is kp: the physical row within a chunk of step s, lane-in-group t
// and fragment element j (see GPUWeights).
func GPURow(s, t, j int) int { return 32*(s/2) + 8*t + 4*(s%2) + j }

// codeAt locates the code of column c (in its tile: c = 16·ct + r, r < 16)
// and physical row k: the word index and the bit shift within it.
func (g *GPUWeights) codeAt(k, c int) (word, shift int) {
	ct, r := c/16, c%16
	chunk, kk := k/64, k%64
	half, rest := kk/32, kk%32
	t, sOdd, j := rest/8, (rest%8)/4, rest%4
	s := 2*half + sOdd
	lane := 4*(r%8) + t
	hi := r / 8        // column c+8 of the lane's pair
	per := 32 * g.Bits // words per chunk: 32 lanes × Bits/4 × 4 words
	base := GPUTileChunk(ct, chunk, g.N/16, g.Chunks()) * per
	if g.Bits == 4 {
		nib := (j&1)*4 + (j/2)*2 + hi
		return base + lane*4 + s, 4 * nib
	}
	// 8-bit: words 2s (j 0/1) and 2s+1 (j 2/3) of the lane; uint4 i of a
	// lane holds its words 4i … 4i+3, uint4s of a chunk are 512 bytes apart.
	w := 2*s + j/2
	b := (j&1)*2 + hi
	return base + (w/4)*128 + lane*4 + w%4, 8 * b
}

// GPULayout repacks a 2-, 3-, 4- or 8-bit integer layer for the kernel.
func (l *Linear) GPULayout() (*GPUWeights, error) {
	K, N := l.In, l.Out
	bits := l.Grid.Bits
	if l.Grid.FP8 || l.Grid.PerTensor || bits < 2 || bits > 8 || (bits > 4 && bits != 8) {
		return nil, fmt.Errorf("the GPU kernels run 2-, 3-, 4- and 8-bit integer weights, this layer has %s", l.Grid.Describe())
	}
	group := l.Grid.Group(K)
	if N%16 != 0 || K%16 != 0 || (group < K && (group%16 != 0 || K%group != 0)) {
		return nil, fmt.Errorf("the GPU layout needs out %% 16 == 0, in %% 16 == 0 and a group that is a multiple of 16 dividing in (have out %d, in %d, group %d)", N, K, group)
	}
	G := K / group
	perm, err := groupOrder(l.GIdx, G, group)
	if err != nil {
		return nil, err
	}
	layoutBits := 4
	if bits == 8 {
		layoutBits = 8
	}
	g := &GPUWeights{K: K, N: N, Group: group, Bits: layoutBits, Perm: perm}
	CT, KC := N/16, g.Chunks()
	g.B = make([]uint32, CT*KC*32*layoutBits)
	g.Scales = make([]uint32, g.Groups()*CT*8)
	g.Zeros = make([]uint8, g.Groups()*CT*8*layoutBits/4)
	// Column tiles are independent: repack them in parallel (an 8B model
	// has 30 million chunks to place at load time).
	mat.ParallelFor(CT, 1, func(lo, hi int) {
		for c := lo * 16; c < hi*16; c++ {
			row := l.Q[c*K : (c+1)*K]
			for k := 0; k < K; k++ {
				src := k
				if perm != nil {
					src = int(perm[k])
				}
				w, sh := g.codeAt(k, c)
				g.B[w] |= uint32(row[src]) << sh
			}
		}
	})
	zbytes := layoutBits / 4
	for grp := 0; grp < G; grp++ {
		for c := 0; c < N; c++ {
			ct, r := c/16, c%16
			i := (grp*CT+ct)*8 + r%8
			s, z := uint32(float16.Fromfloat32(l.Scale[grp*N+c]).Bits()), uint32(l.Zero[grp*N+c])
			g.Scales[i] |= s << (16 * (r / 8))
			if zbytes == 1 {
				g.Zeros[i] |= uint8(z << (4 * (r / 8)))
			} else {
				g.Zeros[2*i+r/8] = uint8(z)
			}
		}
	}
	return g, nil
}

// groupOrder returns nil for a sequential g_idx, else the input channels
// sorted (stably) by group, after checking every group has `group` members.
func groupOrder(gidx []int32, G, group int) ([]int32, error) {
	sequential := true
	count := make([]int, G)
	for i, g := range gidx {
		if int(g) != i/group {
			sequential = false
		}
		if g < 0 || int(g) >= G {
			return nil, fmt.Errorf("g_idx[%d] = %d outside [0, %d)", i, g, G)
		}
		count[g]++
	}
	if sequential {
		return nil, nil
	}
	for g, c := range count {
		if c != group {
			return nil, fmt.Errorf("g_idx gives group %d %d channels, the GPU layout needs exactly %d", g, c, group)
		}
	}
	perm := make([]int32, len(gidx))
	for i := range perm {
		perm[i] = int32(i)
	}
	sort.SliceStable(perm, func(a, b int) bool { return gidx[perm[a]] < gidx[perm[b]] })
	return perm, nil
}

// Dequantize decodes the GPU layout back to W[K][N] in kernel row order
// (rows permuted by Perm), with the dequantize kernel's fp16 arithmetic:
// (q − z)·s rounded once to fp16. Tests use it as the CPU reference.
func (g *GPUWeights) Dequantize() []float32 {
	K, N := g.K, g.N
	CT := N / 16
	W := make([]float32, K*N)
	mask := uint32(1)<<g.Bits - 1
	for k := 0; k < K; k++ {
		grp := 0
		if g.Group < K {
			grp = k / g.Group
		}
		for c := 0; c < N; c++ {
			ct, r := c/16, c%16
			w, sh := g.codeAt(k, c)
			q := int(g.B[w]>>sh) & int(mask)
			i := (grp*CT+ct)*8 + r%8
			s := float16.Frombits(uint16(g.Scales[i] >> (16 * (r / 8)))).Float32()
			var z int
			if g.Bits == 4 {
				z = int(g.Zeros[i]>>(4*(r/8))) & 15
			} else {
				z = int(g.Zeros[2*i+r/8])
			}
			W[k*N+c] = RoundF16(float32(q-z) * s)
		}
	}
	return W
}
