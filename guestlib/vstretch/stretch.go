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
	once sync.Once
}

// Open opens the stretch of flow h on c (a fresh stream to the host; the
// Stretch owns it from now on): it sends the Hello, makes the ring pair
// of capacity bytes each way (a power of two, as a region's rings) in
// anonymous memory, and starts the bridge. p is how the bridge waits for
// this side's rings (nil: adaptive).
func Open(c net.Conn, h relay.Hello, capacity int, p *wait.Policy) (*Stretch, error) {
	size := (ring.Size(capacity) + 4095) &^ 4095
	mem, err := unix.Mmap(-1, 0, 2*size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("vsock stretch: rings: %w", err)
	}
	s := &Stretch{mem: mem}
	for i, rp := range []**ring.Ring{&s.W, &s.R} {
		m := mem[i*size : (i+1)*size]
		if err := ring.Format(m, capacity); err != nil {
			unix.Munmap(mem)
			c.Close()
			return nil, fmt.Errorf("vsock stretch: %w", err)
		}
		if *rp, err = ring.Attach(m, capacity); err != nil {
			unix.Munmap(mem)
			c.Close()
			return nil, fmt.Errorf("vsock stretch: %w", err)
		}
	}
	if _, err := c.Write(h.Encode()); err != nil {
		unix.Munmap(mem)
		c.Close()
		return nil, fmt.Errorf("vsock stretch: hello: %w", err)
	}
	s.link = relay.NewLink([]net.Conn{c}, relay.LinkOptions{})
	f, err := s.link.Open(relay.VsockFlowID)
	if err != nil {
		s.link.Close()
		unix.Munmap(mem)
		return nil, err
	}
	s.b = relay.NewBridge(s.W, s.R, f, relay.BridgeOptions{Policy: p})
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
		unix.Munmap(s.mem)
	})
}
