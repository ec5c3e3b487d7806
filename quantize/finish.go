package quantize

import "sync"

// When nothing downstream reads a block's quantized weights — RTN, and AWQ
// whose next inputs come from the unquantized block, as on the GPU path —
// rounding its layers, packing and writing them and recording the block as
// done for --resume run in the background while the next block is
// calibrated (on the GPU: searched). One block at a time: handing over a
// second waits for the first to finish, so memory holds at most one block
// being finished beside the one being calibrated, and the parts reach the
// writer in order.

// finisher runs the jobs handed to it one after another on its own
// goroutine; the first error stops it and is returned by every later call.
type finisher struct {
	jobs chan func() error
	done chan struct{}
	mu   sync.Mutex
	err  error
}

func newFinisher() *finisher {
	f := &finisher{jobs: make(chan func() error), done: make(chan struct{})}
	go func() {
		defer close(f.done)
		for job := range f.jobs {
			if f.failed() != nil {
				continue // drain the rest without running them
			}
			if err := job(); err != nil {
				f.mu.Lock()
				f.err = err
				f.mu.Unlock()
			}
		}
	}()
	return f
}

func (f *finisher) failed() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

// later hands job to the driver's finisher (started on first use), waiting
// until the previous job is done. It returns an earlier job's error.
func (d *driver) later(job func() error) error {
	if d.fin == nil {
		d.fin = newFinisher()
	}
	if err := d.fin.failed(); err != nil {
		return err
	}
	d.fin.jobs <- job
	return nil
}

// drain waits for the handed-over jobs and returns the first error; the
// driver's state they touch (report, writer, progress) is the caller's
// again afterwards.
func (d *driver) drain() error {
	if d.fin == nil {
		return nil
	}
	close(d.fin.jobs)
	<-d.fin.done
	err := d.fin.failed()
	d.fin = nil
	return err
}
