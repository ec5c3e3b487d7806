package main

import (
	"fmt"
	"strconv"
	"strings"
)

// parseSize reads a size as save_pretrained's max_shard_size does: a byte
// count, or a number with a decimal (kB, MB, GB, TB) or binary (KiB, MiB,
// GiB, TiB) unit; "5GB" is 5·10⁹ bytes.
func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	units := []struct {
		suffix string
		mult   float64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
		{"kB", 1e3}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"B", 1}}
	mult := 1.0
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || !(v > 0) || !(v*mult >= 1 && v*mult <= 1<<62) { // !(…) also refuses NaN
		return 0, fmt.Errorf("%q: want a positive size such as 5GB, 500MB or 2GiB", s)
	}
	return int64(v * mult), nil
}
