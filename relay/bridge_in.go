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

// inChunk bounds one send from the guest's ring: a link frame's payload.
const inChunk = MaxPayload

// runIn is the in-direction: the guest's write ring to the Flow. It marks
// the ring reader-attached, waits for the writer's start S, sends S, then
// the ring's bytes as they come, and frees them (the ring's head) only as
// the peer acknowledges them. When the writer left the ring and every
// byte went out, it sends LEFT and frees the rest as it is acknowledged.
// nil: the direction ended normally.
func (b *Bridge) runIn() (err error) {
	defer func() { // runs after Catch turned a fault into ErrFault
		if errors.Is(err, fault.ErrFault) {
			err = fmt.Errorf("%w: its write ring: %w", ErrGuest, err)
		}
	}()
	defer fault.Catch(fault.Arm(), &err)
	rd := b.rd
	select {
	case <-b.release: // released at once, or the other guest's reader attached (HoldIn)
	default:
		if left, err := b.hold(); left || err != nil {
			return err
		}
	}
	rd.Attach()
	s, started, err := b.waitStart()
	if err != nil || !started {
		return err
	}
	var sb [8]byte
	binary.LittleEndian.PutUint64(sb[:], s)
	if err := b.send(sb[:]); err != nil {
		return err
	}
	b.freedTo.Store(8) // S needs no freeing
	// sent and freed are ring bytes past the head at start; the link's
	// offsets are 8 more (S went first).
	var sent, freed uint64
	seen := b.events.Load()
	_, ww := b.in.Waiters()
	waiter := rd.NewWaiter(func() bool {
		return b.stopping.Load() || b.events.Load() != seen || (ww.Load() != 0 && b.ackedTo.Load() > b.freedTo.Load())
	})
	for {
		if b.stopping.Load() {
			return errHalted
		}
		if b.linkBad.Load() {
			if err := b.linkEnd(); err != nil {
				return err
			}
		}
		seen = b.events.Load()
		if err := b.free(&freed, sent); err != nil {
			return err
		}
		p, err := rd.TryPeekAt(sent-freed, inChunk)
		if len(p) > 0 {
			if err := b.send(p); err != nil {
				return err
			}
			sent += uint64(len(p))
			b.st.bytesIn.Add(uint64(len(p)))
			continue
		}
		switch {
		case errors.Is(err, ring.ErrLeft) || errors.Is(err, io.EOF):
			b.flow.Left()
			return b.drainAcks(&freed, sent)
		case err != nil:
			return fmt.Errorf("%w: its write ring: %w", ErrGuest, err)
		}
		// A ring full of bytes the peer has not acknowledged: the other
		// side reads slowly, and the guest's writer waits (a stall).
		full := sent-freed == uint64(b.in.Capacity())
		t := time.Now()
		if err := waiter.Wait(time.Time{}); err != nil {
			return fmt.Errorf("%w: wait on its write ring: %w", ErrGuest, err)
		}
		if full {
			b.st.inStalls.Add(1)
			b.st.inStalled.Add(int64(time.Since(t)))
		}
	}
}

// hold waits for ReleaseIn (HoldIn) with the guest's write ring
// unattached, so its writer stays on TCP. A writer that leaves the ring
// meanwhile (unstarted: nothing attached it) ends the direction as
// waitStart would (LEFT before S, left true): its close must not wait for
// a release that may never come (the other end's reader never attaches),
// nor its other end take the missing LEFT for a break. A reset ring stops
// the bridge (ErrGuest). The marks come without a wake-up to an
// unattached reader, so it looks, from 50 us between looks up to Poll.
func (b *Bridge) hold() (left bool, err error) {
	d := 50 * time.Microsecond
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-b.release:
			return false, nil
		case <-b.halted:
			return false, errHalted
		case <-t.C:
		}
		if b.linkBad.Load() {
			if err := b.linkEnd(); err != nil {
				return false, err
			}
		}
		if b.in.IsReset() {
			return false, fmt.Errorf("%w: its write ring: %w", ErrGuest, ring.ErrReset)
		}
		if _, started, l := b.rd.WriterState(); (l || b.in.Stats().FIN) && !started {
			b.flow.Left()
			return true, nil
		}
		d = min(2*d, b.poll)
		t.Reset(d)
	}
}

// waitStart waits for the guest's writer to start the ring (started) or
// to leave it without starting (then it tells the peer LEFT, and the
// direction ends). Bytes without a start, or a start of MaxStart or more,
// are the guest's corruption.
func (b *Bridge) waitStart() (s uint64, started bool, err error) {
	rd := b.rd
	stop := func() bool { return b.stopping.Load() || b.linkBad.Load() }
	for {
		if b.stopping.Load() {
			return 0, false, errHalted
		}
		if b.linkBad.Load() {
			if err := b.linkEnd(); err != nil {
				return 0, false, err
			}
		}
		if s, ok := rd.Started(); ok {
			if s >= MaxStart {
				return 0, false, fmt.Errorf("%w: its writer's start %d is out of range: %w", ErrGuest, s, ring.ErrCorrupt)
			}
			return s, true, nil
		}
		p, err := rd.TryPeekAt(0, 1)
		switch {
		case len(p) > 0:
			// The flag may have come after the bytes' tail (a writer
			// stores it before them; a racing look sees both next time).
			if _, ok := rd.Started(); ok {
				continue
			}
			return 0, false, fmt.Errorf("%w: bytes in its write ring before a start: %w", ErrGuest, ring.ErrCorrupt)
		case errors.Is(err, ring.ErrLeft) || errors.Is(err, io.EOF):
			if _, ok := rd.Started(); ok {
				continue
			}
			b.flow.Left() // never started: a LEFT before S
			return 0, false, nil
		case err != nil:
			return 0, false, fmt.Errorf("%w: its write ring: %w", ErrGuest, err)
		}
		if err := rd.Wait(stop, time.Time{}); err != nil {
			return 0, false, fmt.Errorf("%w: wait on its write ring: %w", ErrGuest, err)
		}
	}
}

// send writes p on the Flow, counting a send that must wait for credit
// as a stall.
func (b *Bridge) send(p []byte) error {
	if b.flow.credit() >= uint64(len(p)) {
		_, err := b.write(p)
		return err
	}
	t := time.Now()
	_, err := b.write(p)
	b.st.inStalls.Add(1)
	b.st.inStalled.Add(int64(time.Since(t)))
	return err
}

// write sends p on the Flow: by reference from the registered region
// (zero copy), or copied.
func (b *Bridge) write(p []byte) (int, error) {
	if b.zc != nil {
		return b.flow.writeFrom(p, b.zc)
	}
	return b.flow.Write(p)
}

// free gives the guest back the ring bytes the peer acknowledged: the
// head moves to what Flow.Acked covers, never further.
func (b *Bridge) free(freed *uint64, sent uint64) error {
	a := b.flow.Acked()
	if a <= 8 {
		return nil
	}
	acked := min(a-8, sent) // the link never acks past what was sent
	if acked <= *freed {
		return nil
	}
	if err := b.rd.Free(acked - *freed); err != nil {
		return fmt.Errorf("relay bridge: free %d bytes: %w", acked-*freed, err)
	}
	b.st.freed.Add(acked - *freed)
	*freed = acked
	b.freedTo.Store(8 + acked)
	return nil
}

// drainAcks frees the rest of the ring as the peer acknowledges it, after
// LEFT: the guest's writer has left, but its bytes stay until the other
// host's ring holds them.
func (b *Bridge) drainAcks(freed *uint64, sent uint64) error {
	for {
		if err := b.free(freed, sent); err != nil || *freed == sent {
			return err
		}
		select {
		case <-b.halted:
			return errHalted
		case <-b.evCh:
		}
		if b.linkBad.Load() {
			if err := b.linkEnd(); err != nil {
				return err
			}
		}
	}
}
