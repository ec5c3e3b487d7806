package main

import "testing"

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"5GB": 5_000_000_000, "500MB": 500_000_000, "2GiB": 2 << 30, "1.5 kB": 1500, "4096": 4096, "10B": 10, "3KiB": 3072} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "GB", "-1GB", "0", "five", "1XB", "0.1B", "NaN", "NaNGB", "Inf"} {
		if got, err := parseSize(bad); err == nil {
			t.Errorf("parseSize(%q) = %d, want an error", bad, got)
		}
	}
}
