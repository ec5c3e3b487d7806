package cuda

import (
	"strings"
	"testing"
)

// TestSplitSumsFrom: LLMQ_SPLIT_SUMS picks the layers that leave their K
// splits' sums to the next kernel — all by default, none with "0" or
// LoadOptions.HalfDeltas, else the parts named — and refuses a part it
// does not know, naming it.
func TestSplitSumsFrom(t *testing.T) {
	all, none := splitSums{qkv: true, od: true, moe: true}, splitSums{}
	for _, c := range []struct {
		half bool
		env  string
		want splitSums
	}{
		{false, "", all}, {true, "", none}, {false, "0", none}, {true, "qkv,od", none},
		{false, "od", splitSums{od: true}}, {false, "qkv,od", splitSums{qkv: true, od: true}},
		{false, "moe,qkv", splitSums{qkv: true, moe: true}}, {false, "qkv,od,moe", all},
	} {
		if got, err := splitSumsFrom(c.half, c.env); err != nil || got != c.want {
			t.Errorf("HalfDeltas %v, LLMQ_SPLIT_SUMS=%q: %+v, %v; want %+v", c.half, c.env, got, err, c.want)
		}
	}
	for _, bad := range []string{"1", "od,", "qkv,o"} {
		if _, err := splitSumsFrom(false, bad); err == nil || !strings.Contains(err.Error(), "LLMQ_SPLIT_SUMS") {
			t.Errorf("LLMQ_SPLIT_SUMS=%q: %v, want a refusal naming the variable", bad, err)
		}
	}
}
