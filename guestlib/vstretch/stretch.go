package vstretch

import (
	"fmt"
	"net"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// Stretch is one flow's stretch over a stream to the host: W is the ring
// this side writes (the bridge sends it), R the ring it reads (the bridge
// fills it from the host's side).
type Stretch struct {
	W, R *ring.Ring

	link *relay.Link
	b    *relay.Bridge
	mem  []byte
	free func() // lets mem go
	once sync.Once
}

// RingSpan is the bytes one ring of capacity takes in a stretch's
// memory: its ring, rounded up to whole pages. W is at 0, R at RingSpan.
func RingSpan(capacity int) int { return (ring.Size(capacity) + 4095) &^ 4095 }

// Open opens the stretch of flow h on c (a fresh stream to the host; the
// Stretch owns it from now on): it sends the Hello, makes the ring pair
// of capacity bytes each way (a power of two, as a region's rings) in
// anonymous memory, and starts the bridge. p is how the bridge waits for
// this side's rings (nil: adaptive).
func Open(c net.Conn, h relay.Hello, capacity int, p *wait.Policy) (*Stretch, error) {
	if capacity <= 0 || capacity > ring.MaxCapacity {
		c.Close()
		return nil, fmt.Errorf("vsock stretch: ring capacity %d out of range", capacity)
	}
	mem, err := unix.Mmap(-1, 0, 2*RingSpan(capacity), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("vsock stretch: rings: %w", err)
	}
	return OpenIn(c, h, capacity, p, mem, func() { unix.Munmap(mem) })
}

// OpenIn is Open with the rings in mem (2*RingSpan(capacity) bytes, W
// first), which the Stretch owns from now on: free is called once nothing
// touches mem any more (at Close or Abort, or when OpenIn fails).
// shunt-vstretchd gives mem as a memfd's mapping, which the C library
// maps too (docs/vsock.md, "The C library's stretches").
func OpenIn(c net.Conn, h relay.Hello, capacity int, p *wait.Policy, mem []byte, free func()) (*Stretch, error) {
	if err := FormatRings(mem, capacity); err != nil {
		free()
		c.Close()
		return nil, fmt.Errorf("vsock stretch: %w", err)
	}
	return openOn(c, h, capacity, p, mem, free)
}

// FormatRings formats the ring pair of a stretch in mem (W first).
func FormatRings(mem []byte, capacity int) error {
	size := RingSpan(capacity)
	if len(mem) < 2*size {
		return fmt.Errorf("%d bytes of memory for rings of %d bytes", len(mem), capacity)
	}
	for i := range 2 {
		if err := ring.Format(mem[i*size:(i+1)*size], capacity); err != nil {
			return err
		}
	}
	return nil
}

// openOn is OpenIn on rings formatted already (FormatRings), which a
// process may have attached meanwhile (shunt-vstretchd).
func openOn(c net.Conn, h relay.Hello, capacity int, p *wait.Policy, mem []byte, free func()) (*Stretch, error) {
	size := RingSpan(capacity)
	fail := func(err error) (*Stretch, error) {
		free()
		c.Close()
		return nil, fmt.Errorf("vsock stretch: %w", err)
	}
	if len(mem) < 2*size {
		return fail(fmt.Errorf("%d bytes of memory for rings of %d bytes", len(mem), capacity))
	}
	s := &Stretch{mem: mem, free: free}
	for i, rp := range []**ring.Ring{&s.W, &s.R} {
		var err error
		if *rp, err = ring.Attach(mem[i*size:(i+1)*size], capacity); err != nil {
			return fail(err)
		}
	}
	h.Flags |= relay.HelloHold
	if _, err := c.Write(h.Encode()); err != nil {
		return fail(fmt.Errorf("hello: %w", err))
	}
	s.link = relay.NewLink([]net.Conn{c}, relay.LinkOptions{})
	f, err := s.link.Open(relay.VsockFlowID)
	if err != nil {
		s.link.Close()
		free()
		return nil, err
	}
	// W stays unattached, and so this side's writer on TCP, until the
	// host says the ring W's bytes go into is attached (HelloHold):
	// attached end to end, as across hosts (docs/vsock.md). The wait
	// ends with the bridge.
	s.b = relay.NewBridge(s.W, s.R, f, relay.BridgeOptions{Policy: p, HoldIn: true})
	go func() {
		select {
		case <-f.PeerAttached():
			s.b.ReleaseIn()
		case <-s.b.Done():
		}
	}()
	return s, nil
}

// Done is closed once the bridge stopped: both directions left (Err is
// relay.ErrEnded), the host stopped the stretch, or the stream failed.
func (s *Stretch) Done() <-chan struct{} { return s.b.Done() }

// InDone is closed once the bridge carried every byte of W to the host
// (W's writer left, the host's side acknowledged them all) or stopped: a
// program closing its connection waits for it, since its ring's bytes
// die with the process.
func (s *Stretch) InDone() <-chan struct{} { return s.b.InDone() }

// Flushed waits, at most until deadline, until every frame the bridge
// queued (its LEFT after the last byte among them) was handed to the
// kernel: a program may exit once it returns without its stream losing
// its end (see relay.Link.Flushed). It reports whether they were.
func (s *Stretch) Flushed(deadline time.Time) bool { return s.link.Flushed(deadline) }

// Err is why the bridge stopped by itself (nil while it runs).
func (s *Stretch) Err() error { return s.b.Err() }

// Stats are the bridge's counters.
func (s *Stretch) Stats() relay.BridgeStats { return s.b.Stats() }

// Stop stops the bridge (telling the host DOWN(reason) if it still
// listens), marks R left, and returns where R's stretch ended.
func (s *Stretch) Stop(reason proto.Reason) relay.End { return s.b.Stop(reason) }

// closeFlush bounds how long Close waits for the bridge's last frames
// to reach the kernel.
const closeFlush = 5 * time.Second

// Close stops the stretch and frees its rings: the caller no longer
// touches W or R.
func (s *Stretch) Close() {
	s.once.Do(func() {
		s.b.Stop(proto.ReasonShutdown)
		// The bridge's last frames (its LEFT after the last byte, when
		// both directions ended) may still be queued: closing the link
		// drops them, and the host takes a stream that ends without its
		// LEFT for a break (a reset at the other end).
		s.link.Flushed(time.Now().Add(closeFlush))
		s.link.Close()
		s.link.Wait()
		s.free()
	})
}

// Abort ends the stretch as a break: the stream is closed first, so no
// frame the bridge had queued (nor a DOWN) reaches the host, which then
// resets the other end's ring unless this side's LEFT already crossed
// (docs/vsock.md, "A stream that dies under a writer is a reset").
// shunt-vstretchd aborts the stretch of a process that died without
// closing it. Then as Close.
func (s *Stretch) Abort() {
	s.once.Do(func() {
		s.link.Close()
		s.b.Stop(proto.ReasonShutdown)
		s.link.Wait()
		s.free()
	})
}
