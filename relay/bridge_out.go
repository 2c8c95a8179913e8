package relay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/shm/ring"
)

// outChunk bounds one read from the Flow into the ring: a reservation of
// the ring's free space (ring.Batch at most), so the Flow grants the peer
// credit only as bytes go into the ring.
const outChunk = ring.Batch

// runOut is the out-direction: the Flow to the guest's read ring. It
// reads the peer's start S, waits for the guest's reader to attach,
// stores S and the started flag, then moves bytes from the Flow straight
// into the ring's free space (the Flow copies into the reservation), and
// acknowledges them only once they are committed: the peer's Acked never
// covers a byte this ring does not hold. The peer's LEFT ends the ring's stretch: it marks the ring left.
// nil: the direction ended normally.
func (b *Bridge) runOut() (err error) {
	defer func() { // runs after Catch turned a fault into ErrFault
		if errors.Is(err, fault.ErrFault) {
			err = fmt.Errorf("%w: its read ring: %w", ErrGuest, err)
		}
	}()
	defer fault.Catch(fault.Arm(), &err)
	w := b.w
	if b.attached != nil {
		// Tell the other host as soon as the guest's reader attached,
		// before any byte comes: its bridge attaches its guest's write
		// ring only then (HoldIn). It reads the ring's memory, so Stop
		// waits for it (wg) before the rings are let go, and every read
		// is under the fault guard.
		b.wg.Add(1)
		go func() {
			defer b.wg.Done()
			var err error
			if fault.Do(func() { err = b.waitAttached() }) == nil && err == nil {
				b.attached()
			}
		}()
	}
	var sb [8]byte
	if _, err := io.ReadFull(b.flow, sb[:]); err != nil {
		if errors.Is(err, errOutHalted) {
			return err
		}
		if errors.Is(err, io.EOF) && b.flow.peerLeft() { // LEFT before a start: never started
			return w.Leave()
		}
		return b.flowErr(err)
	}
	s := binary.LittleEndian.Uint64(sb[:])
	if s >= MaxStart {
		return fmt.Errorf("%w: %d", ErrPeerStart, s)
	}
	if err := b.waitAttached(); err != nil {
		return err
	}
	w.Start(s)
	b.outStart, b.outStarted = s, true
	return b.pump()
}

// pump moves the Flow's bytes into the guest's read ring, once started.
// While it waits for bytes it is parked: the link's reader then writes
// them into the ring itself (deliver, through the Flow's sink), so a
// message crosses this host without waking this goroutine; it takes over
// only for what did not fit (the guest reads slowly), and waits for room
// for it. The Flow's lock guards the ring's writer from then on: it is
// used under that lock only, or by this goroutine while not parked.
func (b *Bridge) pump() error {
	w, f := b.w, b.flow
	stop := func() bool { return b.stopping.Load() || b.linkBad.Load() || b.outHalt.Load() }
	waiter := w.NewWaiter(stop)
	f.mu.Lock()
	f.sink = b.deliver
	for {
		f.parked = !f.readStop
		err := f.waitBytesLocked()
		f.parked = false
		if f.readStop {
			f.mu.Unlock()
			return errOutHalted // StopOut: before any byte more
		}
		if err != nil {
			left := f.left
			f.mu.Unlock()
			// The peer's guest left its ring: its LEFT, not a link that
			// ended (its error may wrap io.EOF too), which leaves the
			// ring unmarked for Stop (or the caller's reset).
			if errors.Is(err, io.EOF) && left {
				return w.Leave()
			}
			return b.flowErr(err)
		}
		var moved int
		ferr := fault.Do(func() { moved, err = b.moveLocked() })
		if moved > 0 {
			f.grantLocked() // now the ring holds them
		}
		full := err == nil && ferr == nil && f.buffered > 0
		f.mu.Unlock()
		switch {
		case ferr != nil:
			return fmt.Errorf("%w: its read ring: %w", ErrGuest, ferr)
		case errors.Is(err, ring.ErrPeerClosed):
			return nil // the guest closed its end: nobody reads; the in-direction still carries its last bytes
		case err != nil:
			return fmt.Errorf("%w: its read ring: %w", ErrGuest, err)
		}
		if full {
			if err := b.waitRoom(waiter); err != nil {
				if errors.Is(err, ring.ErrPeerClosed) {
					return nil
				}
				return err
			}
		}
		f.mu.Lock()
	}
}

// moveLocked moves buffered bytes of the Flow (locked) into the ring's
// free space, as much as fits, and says how many.
func (b *Bridge) moveLocked() (int, error) {
	f, w := b.flow, b.w
	moved := 0
	for f.buffered > 0 {
		buf, err := w.TryReserve(outChunk)
		if err != nil || len(buf) == 0 {
			return moved, err
		}
		n := f.buf.take(buf)
		f.buffered -= uint64(n)
		f.consumed += uint64(n)
		err = w.Commit(n)
		moved += n
		b.outWritten += uint64(n)
		b.st.bytesOut.Add(uint64(n))
		if err != nil {
			return moved, err
		}
	}
	return moved, nil
}

// deliver is the Flow's sink (takeData, under the Flow's lock, on the
// link's reader, while pump is parked): it writes p into the ring as far
// as it fits and says how much did. Anything that stops it (a full ring,
// the guest's marks or memory) leaves the rest to pump, which meets the
// same condition and acts on it.
func (b *Bridge) deliver(p []byte) int {
	w := b.w
	n := 0
	_ = fault.Do(func() {
		for n < len(p) {
			buf, err := w.TryReserve(len(p) - n)
			if err != nil || len(buf) == 0 {
				return
			}
			k := copy(buf, p[n:])
			err = w.Commit(k)
			n += k
			if err != nil {
				return
			}
		}
	})
	b.outWritten += uint64(n)
	b.st.bytesOut.Add(uint64(n))
	return n
}

// flowErr is the error a Flow's Read ended with, errHalted at Stop.
func (b *Bridge) flowErr(err error) error {
	if b.stopping.Load() || errors.Is(err, errClosed) {
		return errHalted
	}
	return err
}

// waitRoom waits for the guest's reader to free room in the ring (a
// stall), or the link's end, or Stop.
func (b *Bridge) waitRoom(waiter *ring.WriteWaiter) error {
	t := time.Now()
	err := waiter.Wait(time.Time{})
	b.st.outStalls.Add(1)
	b.st.outStalled.Add(int64(time.Since(t)))
	switch {
	case b.stopping.Load():
		return errHalted
	case b.outHalt.Load():
		return errOutHalted
	case b.linkBad.Load():
		if err := b.linkEnd(); err != nil {
			return err
		}
	}
	if err != nil {
		return fmt.Errorf("%w: wait on its read ring: %w", ErrGuest, err)
	}
	return nil
}

// waitAttached polls the guest's reader-attached mark: the libraries set
// it without a wake-up (a writer looks at it before each write), so the
// bridge looks too, from 50 us between looks up to Poll.
func (b *Bridge) waitAttached() error {
	d := 50 * time.Microsecond
	t := time.NewTimer(d)
	defer t.Stop()
	for !b.w.ReaderAttached() {
		if b.w.ReaderLeft() {
			return fmt.Errorf("%w: its reader left the read ring before attaching: %w", ErrGuest, ring.ErrPeerClosed)
		}
		if b.outHalt.Load() {
			return errOutHalted
		}
		if b.linkBad.Load() {
			if err := b.linkEnd(); err != nil {
				return err
			}
		}
		select {
		case <-b.halted:
			return errHalted
		case <-t.C:
		}
		d = min(2*d, b.poll)
		t.Reset(d)
	}
	return nil
}
