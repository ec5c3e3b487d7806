//go:build !unix

package checkpoint

import (
	"fmt"
	"os"
)

// mapping holds a whole file; systems without mmap read it into memory.
type mapping struct{ data []byte }

func mapFile(path string) (*mapping, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("opening weights: %w", err)
	}
	return &mapping{data: data}, nil
}

// mapFilePrivate is mapFile: the copy in memory is already private.
func mapFilePrivate(path string) (*mapping, error) { return mapFile(path) }

func (m *mapping) close() error { m.data = nil; return nil }
