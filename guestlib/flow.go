package guestlib

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/guestlib/vstretch"
	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
)

// flow is the ring pair of one READY, as a Conn uses it: this end writes
// w and reads rd. Each direction leaves it on its own (wLeft, rLeft);
// once both have, the Conn sends LEFT and lets go of it (release).
type flow struct {
	key  flowKey
	side proto.Side
	// relayed: the other end of its rings is the relay to a peer host
	// (READY's Relayed): the other guest's ring bytes can arrive after
	// its kernel FIN or RST (conn_read.go, relayedEOFLocked).
	relayed bool
	reg     *mapping // the region of its rings (nil for region 0)
	// stretch, in a VM without the flow's region: the rings are this
	// process's own, carried over vsock (stretch.go); nil otherwise.
	stretch *vstretch.Stretch
	w       *ring.Writer
	rd      *ring.Reader
	// The data path's waits, with the Conn's stop conditions bound once.
	rwait *ring.ReadWaiter
	wwait *ring.WriteWaiter

	down     atomic.Bool // DOWN (or REVOKE) came: both directions leave
	peerGone atomic.Bool // ... with reason peer-gone: the reader does not wait for the writer's leave
	wLeft    atomic.Bool
	rLeft    atomic.Bool
	// attachLater: READY came while a stretch was held ahead
	// (holdAheadLocked), so its read ring is attached only once the TCP
	// stream reaches that stretch (aheadDueLocked). Guarded by the
	// Conn's fmu.
	attachLater bool
	// wSync says who may touch w while the writer is not on the ring:
	// the writer, in writerSyncLocked (wsBusy, kept once it started the
	// ring), or the leaver, which leaves a ring the writer never started
	// while the writer's Write blocks in a kernel send (leaveAside).
	wSync atomic.Uint32
	// RESUME (resume.go): the down is a RESUME, and its offset.
	resumed  atomic.Bool
	resumeAt atomic.Uint64

	client   *Client
	leftOnce sync.Once
	relOnce  sync.Once
}

// release lets go of the flow: the Client forgets it and the region hold
// is given back. The Conn's directions have dropped it before.
func (f *flow) release() {
	f.relOnce.Do(func() {
		f.client.unregister(f.key, f.reg)
		f.endStretch()
	})
}

// ready is hostd's READY for this connection: attach both rings and mark
// the read ring reader-attached; the writer moves at its next write. It
// reports an error when the Conn cannot take it (closed, still holding
// the previous rings, rings that do not check out); the Client then gives
// the rings back. Called from the Client's reader: it never blocks.
func (c *Conn) ready(m proto.Msg) (err error) {
	defer c.caught(fault.Arm(), "ready", &err)
	c.fmu.Lock()
	defer c.fmu.Unlock()
	c.ansOnce.Do(func() { close(c.answered) })
	if c.closed.Load() {
		return errConnClosed
	}
	if old := c.cur.Load(); old != nil {
		return fmt.Errorf("READY %d/%d.%d while rings %d/%d.%d are held", m.RegionID, m.Slot, m.Gen, old.key.region, old.key.slot, old.key.gen)
	}
	f, err := c.client.attach(m)
	if err != nil {
		return err
	}
	f.rwait = f.rd.NewWaiter(func() bool { return f.peerGone.Load() || c.closed.Load() || c.rshut.Load() })
	f.wwait = f.w.NewWaiter(func() bool { return f.down.Load() || c.wshut.Load() })
	if c.aheadHeld.Load() {
		// A writer starts its ring only once the reader attached it:
		// unattached, the peer's bytes stay on TCP in this direction,
		// and no second stretch can start past TCP bytes still due
		// (holdAheadLocked keeps one stretch; a second would keep its
		// ring past DOWN, until hostd's grace took it).
		f.attachLater = true
	} else {
		f.rd.Attach()
	}
	c.cur.Store(f)
	c.client.register(f.key, c)
	c.st.readies.Add(1)
	c.client.logf("shunt: %s -> %s: rings %d/%d.%d", c.local, c.remote, m.RegionID, m.Slot, m.Gen)
	// Keep the kernel connection noticed while its bytes take the rings.
	_ = c.tcp.SetKeepAlive(true)
	_ = c.tcp.SetKeepAlivePeriod(15 * time.Second)
	// A Read blocked in the kernel must come back to watch the new ring.
	c.pokeRead()
	return nil
}

// errConnClosed: a READY for a connection closed meanwhile.
var errConnClosed = fmt.Errorf("connection closed")

// tcpAnswer is hostd's TCP(reason): the connection stays on TCP, for now.
func (c *Conn) tcpAnswer(r proto.Reason) {
	c.fmu.Lock()
	if f := c.cur.Load(); f == nil || f.down.Load() {
		c.reason = r.String()
	}
	c.fmu.Unlock()
	c.ansOnce.Do(func() { close(c.answered) })
	c.client.logf("shunt: %s -> %s: tcp(%s)", c.local, c.remote, r)
}

// down is hostd's DOWN (or a REVOKE) for the flow k: both directions
// leave its rings and go on over TCP. Each direction that is idle leaves
// here at once; a busy one leaves at its next step (it is woken); a
// reader that cannot leave yet (bytes still in its ring, or the writer
// not yet gone) is left by its next Read, or by the leaver. It reports
// whether k was this Conn's current flow.
func (c *Conn) down(k flowKey, r proto.Reason) bool {
	c.fmu.Lock()
	f := c.cur.Load()
	if f == nil || f.key != k {
		c.fmu.Unlock()
		return false
	}
	if f.relayed && f.stretch == nil && !f.resumed.Load() && !f.down.Load() {
		// A relayed flow leaves its rings by RESUME, which says where the
		// other host's ring ended. A DOWN means nobody knows (a restarted
		// hostd answers the REATTACH of a flow it did not adopt with
		// DOWN): going on over TCP from this ring's end could skip or
		// repeat bytes, so the connection is reset instead.
		c.fmu.Unlock()
		return c.resume(k, r, proto.ResumeReset)
	}
	if r == proto.ReasonPeerGone {
		if f.stretch != nil {
			f.peerGoneAfterStretch(c)
		} else {
			f.peerGone.Store(true)
		}
	}
	first := !f.down.Swap(true)
	c.reason = r.String()
	c.fmu.Unlock()
	if first {
		c.st.downs.Add(1)
		c.client.logf("shunt: %s -> %s: back to tcp(%s)", c.local, c.remote, r)
	}
	f.w.Interrupt()
	f.rd.Interrupt()
	if !c.tryLeave(f) {
		c.startLeaver()
	}
	return true
}

// tryLeave makes each direction of f that is not busy leave, if it can,
// without blocking; it reports whether both have left.
func (c *Conn) tryLeave(f *flow) bool {
	if !f.wLeft.Load() {
		if c.writeMu.TryLock() {
			c.guarded("leave", c.writerSyncLocked)
			c.writeMu.Unlock()
		} else {
			c.guarded("leave", func() { c.leaveAside(f) })
		}
	}
	if !f.rLeft.Load() {
		if c.readMu.TryLock() {
			c.guarded("leave", c.readerTryLeaveLocked)
			c.readMu.Unlock()
		} else {
			// A Read blocked in the kernel for TCP bytes before the
			// ring's start (nothing watches the ring then) leaves it
			// once woken and the writer left (holdAheadLocked).
			c.guarded("leave", func() {
				if f.rd.WriterLeft() || f.peerGone.Load() {
					c.pokeRead()
				}
			})
		}
	}
	// Rings whose memory is gone cannot be left: the leaver stops, and
	// hostd frees them at CLOSE or when its grace for the region ends.
	return f.wLeft.Load() && f.rLeft.Load() || c.lost.Load()
}

// The writer's claims on a flow's write ring (flow.wSync).
const (
	wsFree  = iota // the writer is on TCP, outside writerSyncLocked
	wsBusy         // the writer looks at the ring, or writes it
	wsAside        // left by leaveAside: the writer drops the flow
)

// leaveAside leaves f's write ring for a writer that holds writeMu in a
// kernel send, so never started the ring: a send that the peer's shut
// window or a firewall stalls must not keep LEFT from hostd, which takes
// a retired region back after its grace (a reader of it then fails). The
// writer finds the flow left at its next step (writerSyncLocked). Not
// for flows whose leave resends (RESUME) or that a stretch carries.
func (c *Conn) leaveAside(f *flow) {
	if !f.down.Load() || f.resumed.Load() || f.relayed || f.stretch != nil || !f.wSync.CompareAndSwap(wsFree, wsAside) {
		return
	}
	_ = f.w.Leave()
	f.wLeft.Store(true)
	c.maybeLeft(f)
}

// Leaver polls: the directions it waits for are busy (their call leaves
// as soon as it can) or idle with a ring the peer has not left yet.
const (
	leaverFirst = time.Millisecond
	leaverMax   = 50 * time.Millisecond
)

// startLeaver starts a goroutine that leaves the rings of the current
// flow, once DOWN came, for directions the application does not use now,
// so that LEFT reaches hostd (and the connection can come back to the
// rings) even if the program never reads again. It polls with backoff
// and ends when no flow is down and no RESUME's resend is pending (it
// sends one itself when no Write does); Close stops it and waits.
func (c *Conn) startLeaver() {
	c.fmu.Lock()
	defer c.fmu.Unlock()
	if c.leaving != nil || c.closed.Load() {
		return
	}
	stop := make(chan struct{})
	c.leaving = stop
	c.leaverWG.Add(1)
	go func() {
		defer c.leaverWG.Done()
		d := leaverFirst
		t := time.NewTimer(d)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			f := c.cur.Load()
			if (f == nil || !f.down.Load() || c.tryLeave(f)) && c.flushIdle() {
				break
			}
			d = min(2*d, leaverMax)
			t.Reset(d)
		}
		c.fmu.Lock()
		if c.leaving == stop {
			c.leaving = nil
		}
		c.fmu.Unlock()
	}()
}

// maybeLeft sends LEFT once both directions have left f, and lets go of
// it. After Close, CLOSE has told hostd already.
func (c *Conn) maybeLeft(f *flow) {
	if !f.wLeft.Load() || !f.rLeft.Load() {
		return
	}
	f.leftOnce.Do(func() {
		// Under fmu, so that exactly one of LEFT and Close's CLOSE
		// names the rings.
		c.fmu.Lock()
		c.cur.CompareAndSwap(f, nil)
		send := !c.closed.Load()
		c.fmu.Unlock()
		if send {
			c.client.left(c, f)
		}
		f.release()
	})
}
