//go:build unix

package checkpoint

import (
	"fmt"
	"os"
	"syscall"
)

// mapping is a read-only memory map of a whole file.
type mapping struct{ data []byte }

func mapFile(path string) (*mapping, error) {
	return mapWith(path, syscall.PROT_READ, syscall.MAP_SHARED)
}

// mapFilePrivate maps the file copy-on-write: writes change this process's
// copy of the touched pages, never the file.
func mapFilePrivate(path string) (*mapping, error) {
	return mapWith(path, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE)
}

func mapWith(path string, prot, flags int) (*mapping, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("opening weights: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("opening weights: %w", err)
	}
	if fi.Size() == 0 {
		return &mapping{}, nil
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(fi.Size()), prot, flags)
	if err != nil {
		return nil, fmt.Errorf("mapping %s: %w", path, err)
	}
	return &mapping{data: data}, nil
}

func (m *mapping) close() error {
	if m == nil || m.data == nil {
		return nil
	}
	err := syscall.Munmap(m.data)
	m.data = nil
	return err
}
