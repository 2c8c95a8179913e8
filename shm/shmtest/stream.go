package shmtest

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// WriteStream is a guest library's writer on r, for tests and test
// guests (p nil: adaptive): it waits for the reader's attach, starts the ring at stream
// offset start, writes all of src, and leaves the ring. Every wait ends
// at deadline (os.ErrDeadlineExceeded). It returns the bytes written.
func WriteStream(r *ring.Ring, p *wait.Policy, start uint64, src io.Reader, deadline time.Time) (int64, error) {
	if p == nil {
		p = &wait.Policy{}
	}
	w, err := ring.NewWriter(r, p)
	if err != nil {
		return 0, err
	}
	for !w.ReaderAttached() {
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("no reader attached: %w", errDeadline)
		}
		time.Sleep(100 * time.Microsecond) // the libraries look at each write
	}
	w.Start(start)
	ww := w.NewWaiter(func() bool { return false })
	buf := make([]byte, 32<<10)
	var done int64
	for {
		n, rerr := src.Read(buf)
		for off := 0; off < n; {
			k, err := w.TryWrite(buf[off:n])
			off += k
			done += int64(k)
			if err != nil {
				return done, err
			}
			if k == 0 {
				if err := ww.Wait(deadline); err != nil {
					return done, err
				}
			}
		}
		if rerr == io.EOF {
			return done, w.Leave()
		}
		if rerr != nil {
			return done, rerr
		}
	}
}

// ReadStream is a guest library's reader on r: it attaches, waits for
// the writer's start, and copies the ring's bytes to dst until the writer
// left and the ring is drained. Every wait ends at deadline. It returns
// the writer's start and the bytes read.
func ReadStream(r *ring.Ring, p *wait.Policy, dst io.Writer, deadline time.Time) (start uint64, n int64, err error) {
	if p == nil {
		p = &wait.Policy{}
	}
	rd, err := ring.NewReader(r, p)
	if err != nil {
		return 0, 0, err
	}
	rd.Attach()
	never := func() bool { return false }
	for {
		var ok bool
		if start, ok = rd.Started(); ok {
			break
		}
		if rd.WriterLeft() {
			return 0, 0, errors.New("the writer left without starting")
		}
		if err := rd.Wait(never, deadline); err != nil {
			return 0, 0, err
		}
	}
	rw := rd.NewWaiter(never)
	buf := make([]byte, 32<<10)
	for {
		k, err := rd.TryRead(buf)
		if k > 0 {
			if _, werr := dst.Write(buf[:k]); werr != nil {
				return start, n, werr
			}
			n += int64(k)
		}
		if errors.Is(err, ring.ErrLeft) {
			return start, n, nil
		}
		if err != nil {
			return start, n, err
		}
		if k == 0 {
			if err := rw.Wait(deadline); err != nil {
				return start, n, err
			}
		}
	}
}

var errDeadline = errors.New("deadline passed")

// Sum is what ReadSum read: the writer's start, the bytes' count and
// SHA-256, and the error that ended it.
type Sum struct {
	Start uint64
	N     int64
	Sum   []byte
	Err   error
}

// ReadSum runs ReadStream on r in a goroutine, hashing what it reads,
// and delivers the outcome on the channel.
func ReadSum(r *ring.Ring, p *wait.Policy, deadline time.Time) <-chan Sum {
	c := make(chan Sum, 1)
	go func() {
		h := sha256.New()
		st, n, err := ReadStream(r, p, h, deadline)
		c <- Sum{st, n, h.Sum(nil), err}
	}()
	return c
}
