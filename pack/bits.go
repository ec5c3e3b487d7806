package pack

import (
	"encoding/binary"
	"fmt"
)

// PackBits packs values of b bits each into int32 words as a little-endian
// bit stream (see the package comment). len(values)·b must be a multiple
// of 32.
func PackBits(values []uint8, b int) ([]int32, error) {
	if len(values)*b%32 != 0 {
		return nil, fmt.Errorf("%d values of %d bits do not fill whole 32-bit words", len(values), b)
	}
	words := make([]uint32, len(values)*b/32)
	for j, v := range values {
		if int(v) >= 1<<b {
			return nil, fmt.Errorf("value %d at %d does not fit in %d bits", v, j, b)
		}
		pos := j * b
		w, off := pos/32, pos%32
		words[w] |= uint32(v) << off
		if off+b > 32 {
			words[w+1] |= uint32(v) >> (32 - off)
		}
	}
	out := make([]int32, len(words))
	for i, w := range words {
		out[i] = int32(w)
	}
	return out, nil
}

// UnpackBits is the inverse of PackBits: n values of b bits.
func UnpackBits(words []int32, b, n int) []uint8 {
	out := make([]uint8, n)
	mask := uint32(1)<<b - 1
	if b == 4 { // a word's eight nibbles spread to eight bytes at once (most layers)
		for w := 0; (w+1)*8 <= n; w++ {
			x := uint64(uint32(words[w]))
			x = (x | x<<16) & 0x0000ffff0000ffff
			x = (x | x<<8) & 0x00ff00ff00ff00ff
			x = (x | x<<4) & 0x0f0f0f0f0f0f0f0f
			binary.LittleEndian.PutUint64(out[8*w:], x)
		}
	}
	if 32%b == 0 { // 2, 4 or 8 bits: whole values a word, word by word (for 4, the last word's part)
		per := 32 / b
		w0 := 0
		if b == 4 {
			w0 = n / 8
		}
		for w := w0; w*per < n; w++ {
			v, vals := uint32(words[w]), out[w*per:min(n, (w+1)*per)]
			for j := range vals {
				vals[j] = uint8(v & mask)
				v >>= b
			}
		}
		return out
	}
	for j := range out {
		pos := j * b
		w, off := pos/32, pos%32
		v := uint32(words[w]) >> off
		if off+b > 32 {
			v |= uint32(words[w+1]) << (32 - off)
		}
		out[j] = uint8(v & mask)
	}
	return out
}
