//go:build !unix

package tokenizer

import "time"

func cpuTime() (time.Duration, bool) { return 0, false }
