package relay

import (
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// RDMAOptions tune an RDMA link.
type RDMAOptions struct {
	// Window and MaxEarly are the flows' (as LinkOptions).
	Window, MaxEarly int
	// Spin is how long the poller and a writer waiting for ring credit
	// spin before they sleep (on the completion channel, or a growing
	// pause); 0 = 50 us.
	Spin time.Duration
	// Timeout bounds the setup over the side channel; 0 = 10 s.
	Timeout time.Duration
	// ZeroCopyWait bounds the waits for frames by reference from guests'
	// rings to be written (Bridge.Released, Region.Deregister) while the
	// link completes no write: then the link ends (zerocopy.go); 0 = 5 s.
	ZeroCopyWait time.Duration
}

// Ring limits: a batch is at most a quarter ring, so a writer that waits
// for ring credit always has room once the peer's lagging release (under
// a quarter ring) comes, wrap included.
const (
	MinRing  = 2 << 20
	MaxRing  = 1 << 30
	MinDepth = 8
	MaxDepth = 4096
)

// RDMALink carries flows between two relays over one RC queue pair: the
// same flows, credits, marks and checks as Link (flows.go), with the
// frames batched into RDMA WRITE WITH IMMEDIATE into the peer's ring.
//
// The ring protocol (docs/rdma.md): each end owns a receive ring of Size
// bytes that the peer writes. A batch is whole frames, n bytes, written
// at the writer's running position modulo Size, or at 0 if it would not
// fit before the end (the tail is skipped); the immediate is n, and the
// receiver derives the position itself by the same rule, so no offset
// from the peer is ever used. The receiver copies each batch out at once
// and releases ring bytes and batches by an RDMA WRITE of two counters
// into the writer's credit area; a writer may have at most Size bytes
// and Depth batches unreleased.
type RDMALink struct {
	mux
	v        Verbs
	size     uint64
	depth    uint64
	maxBatch int
	spin     time.Duration

	qmu  sync.Mutex
	q    []frame
	wake chan struct{}

	// writer's
	wpos, wbatches      uint64 // bytes (skips included) and batches written
	freed, freedBatches uint64 // what the peer released (its credit area)
	inflight            atomic.Int64
	// poller's
	rpos, rbatches       uint64 // bytes and batches received
	relBytes, relBatches uint64 // the release last written to the peer
	creditBusy           bool
	closeOnce            sync.Once

	// zero copy, sending side (zerocopy.go)
	maxSGE     int   // scatter entries a write may gather; 0: no Gather
	sg         []SGE // the writer's entries of the batch being built
	pmu        sync.Mutex
	posted     [][]*zcFlow   // per posted write, in order, the frames by reference it gathers (nil: none)
	written    atomic.Uint64 // writes completed: the progress the zero-copy waits look for
	zcWait     time.Duration // how long those waits go without progress (RDMAOptions.ZeroCopyWait)
	regMu      sync.Mutex
	regs       map[*Region]struct{}
	regsClosed bool          // the link finished: no new registration
	finished   chan struct{} // closed once the queue pair and registrations are freed
}

// DialRDMA sets up an RDMA link over v: the two ends exchange their
// endpoints over side (any reliable stream, e.g. the peers' TLS channel),
// check them, connect the queue pair and say ready. Both ends call it.
// The link owns v; side is left open for the caller.
func DialRDMA(side io.ReadWriter, v Verbs, o RDMAOptions) (*RDMALink, error) {
	return dialRDMA(side, v, o, false)
}

// dialRDMA is DialRDMA; with watch, the link owns side (a net.Conn) and
// ends when it does (NegotiateRDMA).
func dialRDMA(side io.ReadWriter, v Verbs, o RDMAOptions, watch bool) (*RDMALink, error) {
	if o.Timeout <= 0 {
		o.Timeout = 10 * time.Second
	}
	if c, ok := side.(net.Conn); ok {
		c.SetDeadline(time.Now().Add(o.Timeout))
		defer c.SetDeadline(time.Time{})
	}
	me := v.Local()
	if me.Size < MinRing || me.Size > MaxRing || me.Depth < MinDepth || me.Depth > MaxDepth ||
		len(v.Send()) != int(me.Size) || len(v.Recv()) != int(me.Size) {
		return nil, fmt.Errorf("relay rdma: ring of %d bytes, depth %d: out of bounds", me.Size, me.Depth)
	}
	peer, err := exchange(side, me.Marshal(), endpointSize)
	if err != nil {
		return nil, fmt.Errorf("relay rdma: endpoint exchange: %w", err)
	}
	pe, err := UnmarshalEndpoint(peer)
	if err == nil {
		err = me.Check(pe)
	}
	if err != nil {
		return nil, err
	}
	if err := v.PostRecv(int(me.Depth)); err != nil {
		return nil, fmt.Errorf("relay rdma: post receives: %w", err)
	}
	if err := v.Connect(pe); err != nil {
		return nil, fmt.Errorf("relay rdma: connect: %w", err)
	}
	// Both queue pairs can take writes once both said ready.
	if r, err := exchange(side, []byte("RDY1"), 4); err != nil || string(r) != "RDY1" {
		return nil, fmt.Errorf("relay rdma: ready: %q, %v", r, err)
	}
	var c net.Conn
	if watch {
		c, _ = side.(net.Conn)
	}
	return newRDMALink(v, o, c), nil
}

// exchange writes mine and reads the peer's n bytes, concurrently (a
// synchronous side channel would deadlock otherwise).
func exchange(side io.ReadWriter, mine []byte, n int) ([]byte, error) {
	werr := make(chan error, 1)
	go func() { _, err := side.Write(mine); werr <- err }()
	got := make([]byte, n)
	_, err := io.ReadFull(side, got)
	if err2 := <-werr; err == nil {
		err = err2
	}
	return got, err
}

// NewRDMALink runs a link over v, connected and with its receives posted
// (DialRDMA does that).
func NewRDMALink(v Verbs, o RDMAOptions) *RDMALink { return newRDMALink(v, o, nil) }

// newRDMALink is NewRDMALink; a side channel, if given, is watched and
// closed with the link.
func newRDMALink(v Verbs, o RDMAOptions, side net.Conn) *RDMALink {
	me := v.Local()
	l := &RDMALink{v: v, size: uint64(me.Size), depth: uint64(me.Depth), maxBatch: int(me.Size / 4),
		spin: o.Spin, zcWait: o.ZeroCopyWait, wake: make(chan struct{}, 1)}
	if l.spin <= 0 {
		l.spin = 50 * time.Microsecond
	}
	if l.zcWait <= 0 {
		l.zcWait = zcWait
	}
	l.finished, l.regs = make(chan struct{}), map[*Region]struct{}{}
	if g, ok := v.(Gather); ok {
		l.maxSGE = g.MaxSGE()
	}
	l.init(o.Window, o.MaxEarly)
	l.route = func(uint32) func(frame) { return l.send }
	l.teardown = func() {} // the goroutines stop at done; the last closes v
	if side != nil {
		l.teardown = func() { side.Close() }
		go l.watch(side)
	}
	l.wg.Add(2)
	go l.writer()
	go l.poller()
	go func() {
		l.wg.Wait()
		l.closeOnce.Do(func() {
			l.deregisterAll() // before the queue pair and its protection domain go
			v.Close()
		})
		close(l.finished)
	}()
	return l
}

func (l *RDMALink) send(f frame) {
	l.qmu.Lock()
	l.q = append(l.q, f)
	l.qmu.Unlock()
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// writer packs queued frames into batches of at most a quarter ring and
// writes each with one RDMA WRITE WITH IMMEDIATE.
func (l *RDMALink) writer() {
	defer l.wg.Done()
	for {
		select {
		case <-l.done:
			return
		case <-l.wake:
		}
		l.qmu.Lock()
		q := l.q
		l.q = nil
		l.qmu.Unlock()
		for len(q) > 0 {
			k, n, ents, run := 0, 0, 0, false
			for k < len(q) && n+q[k].size() <= l.maxBatch {
				// Scatter entries: a run of the send buffer (headers,
				// copied payloads) and one per payload by reference.
				e := ents
				if !run {
					e++
				}
				if q[k].zc != nil {
					e++
				}
				if k > 0 && l.maxSGE > 0 && e > l.maxSGE {
					break // the device gathers no more: the next batch takes it
				}
				ents, run = e, q[k].zc == nil
				n += q[k].size()
				k++
			}
			if err := l.writeBatch(q[:k], n); err != nil {
				l.fail(err)
				return
			}
			q = q[k:]
		}
	}
}

// writeBatch waits for room in the peer's ring, lays the frames out in
// Send at the batch's place (headers, and payloads it copies) and posts
// the write: one entry for a batch of copies, else a gather whose
// payloads by reference the NIC reads from the guests' rings.
func (l *RDMALink) writeBatch(fs []frame, n int) error {
	off := l.wpos % l.size
	skip := uint64(0)
	if off+uint64(n) > l.size {
		skip, off = l.size-off, 0
	}
	if err := l.waitRoom(skip + uint64(n)); err != nil {
		return err
	}
	buf := l.v.Send()[off : off+uint64(n)]
	sg := l.sg[:0]
	var zcs []*zcFlow
	var gathered uint64
	add := func(e SGE) {
		if k := len(sg) - 1; k >= 0 && sg[k].Key == 0 && e.Key == 0 && sg[k].Off+uint64(sg[k].Len) == e.Off {
			sg[k].Len += e.Len
			return
		}
		sg = append(sg, e)
	}
	p := 0
	for i := range fs {
		h := p
		p += copy(buf[p:], fs[i].header(buf[p:p]))
		if z := fs[i].zc; z != nil {
			add(SGE{Key: 0, Off: off + uint64(h), Len: headerSize})
			add(SGE{Key: z.r.key, Off: fs[i].zoff, Len: uint32(len(fs[i].data))})
			zcs = append(zcs, z)
			gathered += uint64(len(fs[i].data))
			p += len(fs[i].data)
			continue
		}
		p += copy(buf[p:], fs[i].data)
		fs[i].release()
		add(SGE{Key: 0, Off: off + uint64(h), Len: uint32(p - h)})
	}
	l.sg = sg
	l.inflight.Add(1)
	l.pmu.Lock()
	l.posted = append(l.posted, zcs)
	l.pmu.Unlock()
	// Counted before the post: the peer may have the bytes before the
	// post returns.
	l.stats.frames.Add(uint64(len(fs)))
	l.stats.writes.Add(1)
	if gathered > 0 {
		l.stats.gathered.Add(gathered)
		l.stats.gatherWrites.Add(1)
	}
	var err error
	if len(zcs) == 0 {
		err = l.v.Write(int(off), n)
	} else {
		err = l.v.(Gather).WriteSG(int(off), n, sg)
	}
	if err != nil {
		return fmt.Errorf("relay rdma: post write: %w", err)
	}
	l.wpos += skip + uint64(n)
	l.wbatches++
	return nil
}

// writeDone: the oldest posted write completed (an RC queue pair
// completes its sends in order): its frames by reference are written.
func (l *RDMALink) writeDone() {
	l.pmu.Lock()
	var zcs []*zcFlow
	if len(l.posted) > 0 {
		zcs = l.posted[0]
		l.posted[0] = nil
		l.posted = l.posted[1:]
	}
	l.pmu.Unlock()
	l.written.Add(1)
	for _, z := range zcs {
		z.written()
	}
}

// waitRoom waits until need more bytes and one more batch fit in what the
// peer released, and the send queue has room: it reads the credit area
// (spinning, then pausing longer each time up to a millisecond).
func (l *RDMALink) waitRoom(need uint64) error {
	pause := time.Duration(0)
	var since time.Time
	for {
		if err := l.readCredit(); err != nil {
			return err
		}
		if l.wpos+need-l.freed <= l.size && l.wbatches-l.freedBatches < l.depth && l.inflight.Load() < int64(l.depth) {
			return nil
		}
		if since.IsZero() {
			since = time.Now()
		}
		select {
		case <-l.done:
			return l.Err()
		default:
		}
		if time.Since(since) > l.spin {
			pause = min(max(2*pause, 10*time.Microsecond), time.Millisecond)
			time.Sleep(pause)
		} else {
			runtime.Gosched()
		}
	}
}

// readCredit takes the peer's release from the credit area, checked: it
// never goes back, and never past what was written.
func (l *RDMALink) readCredit() error {
	c := l.v.Credit()
	b, k := atomic.LoadUint64(&c[0]), atomic.LoadUint64(&c[1])
	if b < l.freed || b > l.wpos || k < l.freedBatches || k > l.wbatches {
		return fmt.Errorf("%w: ring credit %d bytes, %d batches; released %d, %d; written %d, %d",
			ErrProtocol, b, k, l.freed, l.freedBatches, l.wpos, l.wbatches)
	}
	l.freed, l.freedBatches = b, k
	return nil
}

// poller reaps completions: spinning while they come, then sleeping on
// the completion channel.
func (l *RDMALink) poller() {
	defer l.wg.Done()
	cs := make([]Completion, 64)
	last := time.Now()
	watch, _ := l.v.(DeviceWatch)
	check := last.Add(DeviceCheck)
	for {
		select {
		case <-l.done:
			return
		default:
		}
		if watch != nil && time.Now().After(check) {
			if err := watch.Gone(); err != nil {
				l.fail(fmt.Errorf("%w: %w", ErrDeviceGone, err))
				return
			}
			check = time.Now().Add(DeviceCheck)
		}
		n, err := l.v.Poll(cs)
		if err == nil {
			for _, c := range cs[:n] {
				if err = l.complete(c); err != nil {
					break
				}
			}
		}
		if err == nil {
			err = l.release()
		}
		if err != nil {
			l.fail(err)
			return
		}
		if n > 0 {
			last = time.Now()
			continue
		}
		// Spinning yields: the goroutines it would wake (a flow's reader,
		// the writer) need a P, and there may be one (a 1-vCPU guest).
		runtime.Gosched()
		if time.Since(last) > l.spin {
			if err := l.v.Sleep(100 * time.Millisecond); err != nil {
				l.fail(fmt.Errorf("relay rdma: completion channel: %w", err))
				return
			}
		}
	}
}

func (l *RDMALink) complete(c Completion) error {
	if c.Status != 0 {
		return fmt.Errorf("relay rdma: work completion %d: status %d (%s)", c.Op, c.Status, c.Detail)
	}
	switch c.Op {
	case OpWrite:
		l.inflight.Add(-1)
		l.writeDone()
	case OpCredit:
		l.creditBusy = false
	case OpRecv:
		return l.batch(c.Imm)
	default:
		return fmt.Errorf("relay rdma: completion of op %d", c.Op)
	}
	return nil
}

// batch takes one batch of n bytes from the ring, at the place the ring
// rule gives: n is the peer's word and is checked; the frames are read
// once (header copied, then checked) and their payloads copied into the
// flows, so the ring space is free again at once.
func (l *RDMALink) batch(n uint32) error {
	if n < headerSize || int(n) > l.maxBatch {
		return fmt.Errorf("%w: a batch of %d bytes (at most %d)", ErrProtocol, n, l.maxBatch)
	}
	off := l.rpos % l.size
	skip := uint64(0)
	if off+uint64(n) > l.size {
		skip, off = l.size-off, 0
	}
	if l.rpos+skip+uint64(n) > l.relBytes+l.size || l.rbatches+1 > l.relBatches+l.depth {
		return fmt.Errorf("%w: a batch beyond the ring credit", ErrProtocol)
	}
	l.rpos += skip + uint64(n)
	l.rbatches++
	if err := l.v.PostRecv(1); err != nil {
		return fmt.Errorf("relay rdma: post receive: %w", err)
	}
	b := l.v.Recv()[off : off+uint64(n)]
	for len(b) > 0 {
		if len(b) < headerSize {
			return fmt.Errorf("%w: %d stray bytes at a batch's end", ErrProtocol, len(b))
		}
		var h [headerSize]byte
		copy(h[:], b)
		fr, m, err := parseHeader(&h)
		if err != nil {
			return err
		}
		b = b[headerSize:]
		if uint64(m) > uint64(len(b)) {
			return fmt.Errorf("%w: a frame of %d bytes past its batch's end", ErrProtocol, m)
		}
		fr.data, b = b[:m], b[m:]
		if err := l.take(fr); err != nil {
			return err
		}
	}
	return nil
}

// release writes the ring bytes and batches taken to the peer's credit
// area once a quarter of either is unreleased (one write at a time).
func (l *RDMALink) release() error {
	if l.creditBusy || (l.rpos-l.relBytes < l.size/4 && l.rbatches-l.relBatches < l.depth/4) {
		return nil
	}
	if err := l.v.WriteCredit(l.rpos, l.rbatches); err != nil {
		return fmt.Errorf("relay rdma: post credit: %w", err)
	}
	l.relBytes, l.relBatches, l.creditBusy = l.rpos, l.rbatches, true
	return nil
}
