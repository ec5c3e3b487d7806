package actquant

import "math"

// E4M3 is the FP8 format Hopper's Tensor Cores multiply (OCP 8-bit
// floating point, "float8_e4m3fn" in PyTorch): 1 sign bit, 4 exponent bits
// with bias 7, 3 mantissa bits; no infinities, the largest finite value is
// 448 = 1.75·2⁸, the smallest subnormal 2⁻⁹.
const E4M3Max = 448

// RoundE4M3 rounds x to the nearest E4M3 value (ties to even, as
// hardware conversion does), saturating at ±448.
func RoundE4M3(x float32) float32 {
	if x != x {
		return x
	}
	a := math.Abs(float64(x))
	if a >= E4M3Max {
		return float32(math.Copysign(E4M3Max, float64(x)))
	}
	// The spacing of representable values around a: 2^(e−3) for normals
	// (e = floor(log2 a) ≥ −6), 2⁻⁹ for subnormals.
	e := math.Floor(math.Log2(a))
	if a == 0 || e < -6 {
		e = -6
	}
	step := math.Ldexp(1, int(e)-3)
	q := math.RoundToEven(a/step) * step
	return float32(math.Copysign(math.Min(q, E4M3Max), float64(x)))
}

// EncodeE4M3 returns the byte of the E4M3 value nearest x (saturating).
func EncodeE4M3(x float32) byte {
	r := float64(RoundE4M3(x))
	var sign byte
	if math.Signbit(r) {
		sign, r = 0x80, -r
	}
	if r == 0 {
		return sign
	}
	e := int(math.Floor(math.Log2(r)))
	if e < -6 { // subnormal: exponent field 0, value m·2⁻⁹
		return sign | byte(math.Round(r/math.Ldexp(1, -9)))
	}
	m := math.Round((r/math.Ldexp(1, e) - 1) * 8)
	return sign | byte(e+7)<<3 | byte(m)
}

// DecodeE4M3 is the value of an E4M3 byte (0x7f and 0xff are NaN).
func DecodeE4M3(b byte) float32 {
	sign := 1.0
	if b&0x80 != 0 {
		sign = -1
	}
	e, m := int(b>>3&0xf), float64(b&7)
	switch {
	case e == 15 && m == 7:
		return float32(math.NaN())
	case e == 0:
		return float32(sign * m * math.Ldexp(1, -9))
	}
	return float32(sign * (1 + m/8) * math.Ldexp(1, e-7))
}
