package mat

import "math"

// Exp32 is e^x in float32, within 2 ulp of the correctly rounded value for
// normal results (Cephes' expf: x = n·ln2 + r, |r| ≤ ln2/2, and a degree-6
// polynomial for e^r). It is about 5× faster than math.Exp, which matters
// in softmax and SiLU, where a 2048-token prefill takes billions of calls.
func Exp32(x float32) float32 {
	const (
		log2e = 1.44269504088896341
		ln2Hi = 0.693359375
		ln2Lo = -2.12194440e-4
	)
	switch {
	case x > 88.72283:
		return float32(math.Inf(1))
	case x < -87.33654: // below the smallest normal: flush to zero
		return 0
	case x != x:
		return x
	}
	const magic = 12582912 // 1.5·2²³: adding it rounds a float32 to an integer
	n := (x*log2e + magic) - magic
	r := x - n*ln2Hi - n*ln2Lo
	p := float32(1.9875691500e-4)
	p = p*r + 1.3981999507e-3
	p = p*r + 8.3334519073e-3
	p = p*r + 4.1665795894e-2
	p = p*r + 1.6666665459e-1
	p = p*r + 5.0000001201e-1
	y := p*r*r + r + 1
	e := int32(n)
	if e < -126 { // result near the subnormal range: scale in two steps
		return y * math.Float32frombits(uint32(e+126+127)<<23) * math.Float32frombits(1<<23)
	}
	return y * math.Float32frombits(uint32(e+127)<<23)
}
