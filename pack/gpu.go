package pack

import (
	"fmt"
	"slices"
	"sort"

	"github.com/llmq/llmq/llm/mat"
	"github.com/x448/float16"
)

// GPUWeights is a layer in the layout the CUDA W4A16 kernels read
// (cuda/llmq.h): 2-, 3- and 4-bit codes one per nibble (Bits 4: smaller
// codes sit in a nibble's low bits and run at 4-bit speed), 8-bit codes
// one per byte (Bits 8). B is in 16-byte chunks, one per lane of a warp,
// each holding the lane's mma.m16n8k16 B fragments for a 16×64 tile;
// scales and zeros are reordered so a lane reads its eight columns'
// values with one load.
//
// For K = In rows and N = Out columns, tile (nt, kt) covers columns
// nt·64 … nt·64+63 and rows kt·16 … kt·16+15. Lane l = 4·gid + tig holds,
// for each n8 sub-tile j (column n = nt·64 + j·8 + gid), the codes of rows
// 2·tig, 2·tig+1 (mma register b0) and 2·tig+8, 2·tig+9 (b1).
//
// Bits 4: chunk index nt·(K/16) + kt, 4 words w0…w3; word i holds sub-tiles
// j = 2i and 2i+1:
//
//	nibble 0/4: rows 2·tig, 2·tig+1 of sub-tile 2i     (mma b0, low/high half)
//	nibble 1/5: rows 2·tig+8, 2·tig+9 of sub-tile 2i   (mma b1)
//	nibble 2/6, 3/7: the same rows of sub-tile 2i+1
//
// so that (w >> 4p) & 0x000F000F extracts fragment register p as two fp16
// mantissas. Bits 8: two chunks a tile, index 2·(nt·(K/16) + kt) + h;
// word i of chunk h is sub-tile j = 4h + i, bytes 0–3 its rows 2·tig,
// 2·tig+1, 2·tig+8, 2·tig+9, so that a byte permute against 0x64 makes b0
// and b1 as fp16 1024 + q. Act-order layers are handled once here: input
// channels are sorted by g_idx (Perm), so groups are contiguous and the
// kernel never reads g_idx; the runtime gathers A's columns through Perm.
type GPUWeights struct {
	K, N, Group int
	Bits        int      // 4 (codes of 2 to 4 bits, in nibbles) or 8 (bytes)
	B           []uint32 // K·N·Bits/32 words
	Scales      []uint16 // fp16 bits, [G][N/64][8][8]
	// [G][N/64][8][Bits/4]: the zeros of a lane's eight sub-tiles, sub-tile
	// j in nibble j (Bits 4) or byte j (Bits 8).
	Zeros []uint32
	Perm  []int32 // nil when g_idx is sequential
}

// zeroWords is how many words of Zeros hold one lane's eight zeros.
func (g *GPUWeights) zeroWords() int { return g.Bits / 4 }

// zeroAt is where the zero of sub-tile j of lane gid's columns in tile
// column nt, group grp sits: the word of Zeros and the shift in it.
func (g *GPUWeights) zeroAt(grp, nt, gid, j int) (word int, shift uint) {
	per := 32 / g.Bits // zeros a word
	return ((grp*g.N/64+nt)*8+gid)*g.zeroWords() + j/per, uint(g.Bits * (j % per))
}

// GPUShapeError says why a layer of in inputs, out outputs and groups of
// group inputs does not fit the kernels' tiles (nil when it does): out a
// multiple of the 64-column tile, groups whole 16-row steps dividing in.
func GPUShapeError(in, out, group int) error {
	if out%64 != 0 || in%16 != 0 || group <= 0 || group%16 != 0 || in%group != 0 {
		return fmt.Errorf("the GPU kernel needs out %% 64 == 0 and a group that is a multiple of 16 dividing in (have out %d, in %d, group %d)", out, in, group)
	}
	return nil
}

// GPULayout repacks a 2-, 3-, 4- or 8-bit integer layer for the kernels.
func (l *Linear) GPULayout() (*GPUWeights, error) {
	K, N := l.In, l.Out
	if !l.Grid.GPUPacked() {
		return nil, fmt.Errorf("the GPU kernels run 2-, 3-, 4- and 8-bit integer weights, this layer has %s", l.Grid.Describe())
	}
	group := l.Grid.Group(K)
	if err := GPUShapeError(K, N, group); err != nil {
		return nil, err
	}
	G := K / group
	perm, err := groupOrder(l.GIdx, G, group)
	if err != nil {
		return nil, err
	}
	bits := 4
	if l.Grid.Bits == 8 {
		bits = 8
	}
	g := &GPUWeights{K: K, N: N, Group: group, Bits: bits, Perm: perm,
		B: make([]uint32, K*N*bits/32), Scales: make([]uint16, G*N), Zeros: make([]uint32, G*N/8*bits/4)}
	// Q's rows (one an output) in kernel row order: the layer's own, or
	// with act order a copy with each row's channels permuted.
	Q := l.Q
	if perm != nil {
		Q = make([]uint8, len(l.Q))
		mat.ParallelFor(N, 16, func(lo, hi int) {
			for n := lo; n < hi; n++ {
				row, src := Q[n*K:(n+1)*K], l.Q[n*K:(n+1)*K]
				for k, p := range perm {
					row[k] = src[p]
				}
			}
		})
	}
	KT, NT := K/16, N/64
	// Tiles are independent: repack them in parallel (an 8B model has
	// 30 million of them to place at load time).
	mat.ParallelFor(NT, 1, func(lo, hi int) {
		for nt := lo; nt < hi; nt++ {
			for kt := 0; kt < KT; kt++ {
				for lane := 0; lane < 32; lane++ {
					gid, tig := lane/4, lane%4
					k := kt*16 + 2*tig
					// q(n): output n's codes of rows k, k+1, k+8, k+9.
					q := func(n int) (k0, k1, k8, k9 uint32) {
						r := Q[n*K+k : n*K+k+10]
						return uint32(r[0]), uint32(r[1]), uint32(r[8]), uint32(r[9])
					}
					if bits == 8 {
						for j := 0; j < 8; j++ {
							a0, a1, a8, a9 := q(nt*64 + j*8 + gid)
							h, i := j/4, j%4
							g.B[(((nt*KT+kt)*2+h)*32+lane)*4+i] = a0 | a1<<8 | a8<<16 | a9<<24
						}
						continue
					}
					base := ((nt*KT+kt)*32 + lane) * 4
					for i := 0; i < 4; i++ {
						a0, a1, a8, a9 := q(nt*64 + (2*i)*8 + gid)
						b0, b1, b8, b9 := q(nt*64 + (2*i+1)*8 + gid)
						g.B[base+i] = a0 | a8<<4 | b0<<8 | b8<<12 | a1<<16 | a9<<20 | b1<<24 | b9<<28
					}
				}
			}
		}
	})
	for grp := 0; grp < G; grp++ {
		for nt := 0; nt < NT; nt++ {
			for gid := 0; gid < 8; gid++ {
				for j := 0; j < 8; j++ {
					n := nt*64 + j*8 + gid
					g.Scales[((grp*NT+nt)*8+gid)*8+j] = float16.Fromfloat32(l.Scale[grp*N+n]).Bits()
					w, shift := g.zeroAt(grp, nt, gid, j)
					g.Zeros[w] |= uint32(l.Zero[grp*N+n]) << shift
				}
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
// (rows permuted by Perm), with the kernel's fp16 arithmetic: (q − z)·s
// rounded once to fp16. Tests use it as the CPU reference of the kernel.
func (g *GPUWeights) Dequantize() []float32 {
	K, N := g.K, g.N
	KT, NT := K/16, N/64
	W := make([]float32, K*N)
	for nt := 0; nt < NT; nt++ {
		for kt := 0; kt < KT; kt++ {
			grp := kt * 16 / g.Group
			for lane := 0; lane < 32; lane++ {
				gid, tig := lane/4, lane%4
				// code is the code of sub-tile j's r-th row of the lane
				// (rows 2·tig, 2·tig+1, 2·tig+8, 2·tig+9).
				code := func(j, r int) int {
					if g.Bits == 8 {
						w := g.B[(((nt*KT+kt)*2+j/4)*32+lane)*4+j%4]
						return int(w>>(8*r)) & 255
					}
					w := g.B[((nt*KT+kt)*32+lane)*4+j/2]
					nib := (j&1)*2 + (r/2)&1 + (r&1)*4 // nibble 0/4, 1/5 for sub-tile 2i; 2/6, 3/7 for 2i+1
					return int(w>>(4*nib)) & 15
				}
				for j := 0; j < 8; j++ {
					n := nt*64 + j*8 + gid
					s := float16.Frombits(g.Scales[((grp*NT+nt)*8+gid)*8+j]).Float32()
					w, shift := g.zeroAt(grp, nt, gid, j)
					z := int(g.Zeros[w]>>shift) & (1<<g.Bits - 1)
					for r := 0; r < 4; r++ {
						k := kt*16 + 2*tig + r%2 + 8*(r/2)
						W[k*N+n] = RoundF16(float32(code(j, r)-z) * s)
					}
				}
			}
		}
	}
	return W
}

// ConcatGPU joins layers that read the same input into one whose output
// columns are theirs side by side (q, k and v; gate and up), so the
// runtime runs them as one GEMM: the kernel's column tiles are
// independent, so B is their B arrays one after another, and each
// group's scales and zeros are theirs in the same order. The layers must
// pass CanConcatGPU.
func ConcatGPU(ws ...*GPUWeights) (*GPUWeights, error) {
	if err := CanConcatGPU(ws...); err != nil {
		return nil, err
	}
	first := ws[0]
	out := &GPUWeights{K: first.K, Group: first.Group, Bits: first.Bits, Perm: first.Perm}
	for _, w := range ws {
		out.N += w.N
		out.B = append(out.B, w.B...)
	}
	G := first.K / first.Group
	for grp := 0; grp < G; grp++ {
		for _, w := range ws {
			NT, zw := w.N/64, w.zeroWords()
			out.Scales = append(out.Scales, w.Scales[grp*NT*64:(grp+1)*NT*64]...)
			out.Zeros = append(out.Zeros, w.Zeros[grp*NT*8*zw:(grp+1)*NT*8*zw]...)
		}
	}
	return out, nil
}

// CanConcatGPU says why ConcatGPU cannot join ws, or nil: the layers must
// agree on K, the group size, the code width and the act-order permutation.
func CanConcatGPU(ws ...*GPUWeights) error {
	if len(ws) == 0 {
		return fmt.Errorf("ConcatGPU: no layers")
	}
	first := ws[0]
	for i, w := range ws {
		if w.K != first.K || w.Group != first.Group || w.Bits != first.Bits {
			return fmt.Errorf("ConcatGPU: layer %d has in %d, group %d, %d-bit codes; layer 0 has in %d, group %d, %d-bit codes",
				i, w.K, w.Group, w.Bits, first.K, first.Group, first.Bits)
		}
		if !slices.Equal(w.Perm, first.Perm) {
			return fmt.Errorf("ConcatGPU: layer %d's act-order permutation differs from layer 0's", i)
		}
	}
	return nil
}

// InterleaveGPU joins a gated MLP's gate and up layers (same input, same
// width) for a GEMM whose epilogue applies act(gate)·up: output tile t
// holds gate's columns 32t … 32t+31, then up's same 32 columns, so that
// one 64-column tile of the kernel sees both halves of every product it
// writes (H = gate.N wide output from 2H columns). Within the GPU layout
// that is sub-tiles 4h … 4h+3 of gate's tile t/2 (h = t mod 2) as the new
// tile's sub-tiles 0–3 and up's as 4–7: for 4-bit codes a lane's words
// 2h, 2h+1 of each, for 8-bit codes its chunk h of each; the scales and
// zeros move with their sub-tiles. gate.N must equal up.N, a multiple of
// 64, and the layers must pass CanConcatGPU.
func InterleaveGPU(gate, up *GPUWeights) (*GPUWeights, error) {
	if err := CanConcatGPU(gate, up); err != nil {
		return nil, fmt.Errorf("InterleaveGPU: %w", err)
	}
	if gate.N != up.N || gate.N%64 != 0 {
		return nil, fmt.Errorf("InterleaveGPU: gate has %d columns and up %d; they must be equal and a multiple of 64", gate.N, up.N)
	}
	K, H := gate.K, gate.N
	KT, NT, G := K/16, H/64, K/gate.Group
	out := &GPUWeights{K: K, N: 2 * H, Group: gate.Group, Bits: gate.Bits, Perm: gate.Perm,
		B: make([]uint32, len(gate.B)+len(up.B)), Scales: make([]uint16, 2*len(gate.Scales)), Zeros: make([]uint32, 2*len(gate.Zeros))}
	for t := 0; t < 2*NT; t++ {
		T, h := t/2, t%2
		for kt := 0; kt < KT; kt++ {
			for lane := 0; lane < 32; lane++ {
				for i := 0; i < 4; i++ { // the new chunk's word i (4-bit), or chunk c's word i (8-bit)
					if gate.Bits == 8 {
						for c, src := range []*GPUWeights{gate, up} {
							out.B[(((t*KT+kt)*2+c)*32+lane)*4+i] = src.B[(((T*KT+kt)*2+h)*32+lane)*4+i]
						}
						continue
					}
					src := gate
					if i >= 2 {
						src = up
					}
					out.B[((t*KT+kt)*32+lane)*4+i] = src.B[((T*KT+kt)*32+lane)*4+2*h+i%2]
				}
			}
		}
		for grp := 0; grp < G; grp++ {
			for gid := 0; gid < 8; gid++ {
				for j := 0; j < 8; j++ {
					src := gate
					if j >= 4 {
						src = up
					}
					sj := 4*h + j%4 // the sub-tile of src's tile T
					out.Scales[((grp*2*NT+t)*8+gid)*8+j] = src.Scales[((grp*NT+T)*8+gid)*8+sj]
					sw, sshift := src.zeroAt(grp, T, gid, sj)
					z := src.Zeros[sw] >> sshift & (1<<src.Bits - 1)
					w, shift := out.zeroAt(grp, t, gid, j)
					out.Zeros[w] |= z << shift
				}
			}
		}
	}
	return out, nil
}
