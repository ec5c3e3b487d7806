// Package progress draws a one-line progress bar on a terminal (stderr),
// and falls back to a line per 10% when output is not a terminal.
package progress

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// Bar is a progress bar for a known number of steps.
type Bar struct {
	w       io.Writer
	label   string
	total   int
	start   time.Time
	tty     bool
	lastPct int
}

// New starts a bar writing to stderr.
func New(label string, total int) *Bar {
	fi, err := os.Stderr.Stat()
	tty := err == nil && fi.Mode()&os.ModeCharDevice != 0
	return &Bar{w: os.Stderr, label: label, total: total, start: time.Now(), tty: tty, lastPct: -1}
}

// Set reports that done of total steps are finished; extra is shown after.
func (b *Bar) Set(done int, extra string) {
	if b == nil || b.total <= 0 {
		return
	}
	pct := 100 * done / b.total
	el := time.Since(b.start)
	eta := ""
	if done > 0 && done < b.total {
		eta = " eta " + (el * time.Duration(b.total-done) / time.Duration(done)).Round(time.Second).String()
	}
	if b.tty {
		const width = 30
		fill := width * done / b.total
		fmt.Fprintf(b.w, "\r%s [%s%s] %d/%d %s%s %s\033[K", b.label, strings.Repeat("=", fill), strings.Repeat(" ", width-fill),
			done, b.total, el.Round(time.Second), eta, extra)
		if done == b.total {
			fmt.Fprintln(b.w)
		}
		return
	}
	if pct/10 != b.lastPct/10 || done == b.total {
		b.lastPct = pct
		fmt.Fprintf(b.w, "%s %d/%d (%d%%) %s%s %s\n", b.label, done, b.total, pct, el.Round(time.Second), eta, extra)
	}
}
