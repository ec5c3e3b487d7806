package actquant

import (
	"math"
	"testing"
)

// TestE4M3ByHand: values worked out from the format's definition.
func TestE4M3ByHand(t *testing.T) {
	for _, c := range []struct {
		x, want float32
		b       byte
	}{
		{0, 0, 0x00},
		{1, 1, 0x38},                  // exponent 7 (bias 7), mantissa 0
		{1.0625, 1, 0x38},             // halfway between 1 and 1.125: ties to even (1)
		{1.1875, 1.25, 0x3a},          // halfway between 1.125 and 1.25: to even (1.25)
		{-2.5, -2.5, 0xc2},            // sign, exponent 8, mantissa 2 (1.25·2)
		{448, 448, 0x7e},              // the largest finite value
		{1000, 448, 0x7e},             // saturates
		{0.001953125, 0.001953125, 1}, // 2⁻⁹, the smallest subnormal
		{0.0009765625, 0, 0},          // 2⁻¹⁰, halfway to 0: ties to even (0)
		{0.013671875, 0.013671875, 7}, // 7·2⁻⁹, the largest subnormal
		{0.015625, 0.015625, 0x08},    // 2⁻⁶, the smallest normal
		{240, 240, 0x77},              // 1.875·2⁷
		{250, 256, 0x78},              // spacing 16 above 256; 250 rounds up to 256
		{-0.3, -0.3125, 0xaa},         // 1.25·2⁻², spacing 2⁻⁵ there
	} {
		if got := RoundE4M3(c.x); got != c.want {
			t.Errorf("RoundE4M3(%v) = %v, want %v", c.x, got, c.want)
		}
		if got := EncodeE4M3(c.x); got != c.b {
			t.Errorf("EncodeE4M3(%v) = %#x, want %#x", c.x, got, c.b)
		}
	}
	// Every finite byte decodes to a value that rounds and encodes back to it.
	for b := 0; b < 256; b++ {
		v := DecodeE4M3(byte(b))
		if math.IsNaN(float64(v)) {
			if b&0x7f != 0x7f {
				t.Errorf("byte %#x decodes to NaN", b)
			}
			continue
		}
		if b == 0x80 { // −0 encodes as +0's sign bit kept
			continue
		}
		if RoundE4M3(v) != v || EncodeE4M3(v) != byte(b) {
			t.Errorf("byte %#x → %v → %#x", b, v, EncodeE4M3(v))
		}
	}
}

// TestFakeQuantByHand: per-token INT8 uses each row's max |x| / 127;
// per-tensor uses the threshold and saturates beyond it; FP8 rounds on the
// E4M3 grid of x/s with s = max/448.
func TestFakeQuantByHand(t *testing.T) {
	x := []float32{1.27, -0.5, 0.011, 0, 2.54, 1, -2.54, 0.02}
	Scheme{Bits: 8, PerToken: true}.FakeQuant(x, 2, 4, 0)
	// row 0: s = 0.01: 127, −50, 1.1→1, 0; row 1: s = 0.02: 127, 50, −127, 1
	want := []float32{1.27, -0.5, 0.01, 0, 2.54, 1, -2.54, 0.02}
	for i := range x {
		if math.Abs(float64(x[i]-want[i])) > 1e-6 {
			t.Errorf("per-token: x[%d] = %v, want %v", i, x[i], want[i])
		}
	}
	y := []float32{0.5, 3, -3, 0.26}
	Scheme{Bits: 8}.FakeQuant(y, 1, 4, 1.27) // s = 0.01, saturating at ±1.27
	for i, w := range []float32{0.5, 1.27, -1.27, 0.26} {
		if math.Abs(float64(y[i]-w)) > 1e-6 {
			t.Errorf("per-tensor: y[%d] = %v, want %v", i, y[i], w)
		}
	}
	z := []float32{4.48, 1, -0.3}
	Scheme{Bits: 8, FP8: true, PerToken: true}.FakeQuant(z, 1, 3, 0) // s = 0.01: 448, 100→96, −30→−30
	for i, w := range []float32{4.48, 0.96, -0.3} {
		if math.Abs(float64(z[i]-w)) > 1e-6 {
			t.Errorf("fp8: z[%d] = %v, want %v", i, z[i], w)
		}
	}
}

// observed is an observer fed |x| values one per row.
func observed(vals ...float32) *Observer {
	o := NewObserver(1)
	o.Add(vals, len(vals))
	return o
}

// TestThresholdsByHand: min-max is the largest |x|; the 99th percentile of
// 1000 evenly spread values is the 990th; and KL on a histogram small
// enough to work out (below) clips the lone outlier.
func TestThresholdsByHand(t *testing.T) {
	vals := make([]float32, 1000)
	for i := range vals {
		vals[i] = float32(i+1) / 1000 // 0.001 … 1
	}
	o := observed(vals...)
	s := Scheme{Bits: 8}
	if got, _ := o.Threshold(MinMax, 0, s); got != 1 {
		t.Errorf("min-max %v, want 1", got)
	}
	if got, _ := o.Threshold(Percentile, 99, s); math.Abs(float64(got)-0.99) > 1.0/Bins {
		t.Errorf("99th percentile %v, want 0.99 within a bin", got)
	}
	// KL with 2 levels (1-bit magnitudes) over width-1 bins [100 50 0 0 0 0 0 1]:
	// clipping after 2 bins gives P = [100 51], Q = [100 50]: KL ≈ 6e-5;
	// keeping all 8 bins gives Q = [75 75 0 0 0 0 0 1] against
	// P = [100 50 0 … 1]: KL ≈ 0.056; 3 to 7 bins leave P mass where Q has
	// none. So T = 2 bins = 2.
	h := &Observer{Cols: 1, Amax: 7.5, width: 1, hist: []int64{100, 50, 0, 0, 0, 0, 0, 1}, Count: 151}
	if got, _ := h.Threshold(KL, 0, Scheme{Bits: 2}); got != 2 {
		t.Errorf("KL threshold %v, want 2", got)
	}
	if _, err := o.Threshold("mse", 0, s); err == nil {
		t.Error("unknown method accepted")
	}
	if _, err := o.Threshold(Percentile, 120, s); err == nil {
		t.Error("percentile 120 accepted")
	}
}

// TestObserverGrows: a later batch with larger values adds bins of the
// same width instead of clipping, and the per-channel maxima are kept.
func TestObserverGrows(t *testing.T) {
	o := NewObserver(2)
	o.Add([]float32{1, -2, 0.5, 0}, 2)
	o.Add([]float32{-8, 1}, 1)
	hist, w := o.Histogram()
	var n int64
	for _, c := range hist {
		n += c
	}
	// 8 needs 8193 bins of 2/2048; merged by 5 into 1639 bins of 10/2048.
	if o.Amax != 8 || o.ChannelMax[0] != 8 || o.ChannelMax[1] != 2 || n != 6 || w != 10.0/Bins || len(hist) != 1639 {
		t.Errorf("amax %v channel max %v, %d values in %d bins of %v", o.Amax, o.ChannelMax, n, len(hist), w)
	}
}
