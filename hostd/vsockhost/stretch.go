package vsockhost

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// Flows is how the room finds the rings of a flow a VM names in a
// stretch's Hello: hostd's own record of its flows (the broker), never
// anything the guest wrote.
type Flows interface {
	// Stretch holds guest's side of flow h for the stretch's bridge. It
	// fails if guest is not an end of a live flow h, or if h already has
	// a stretch.
	Stretch(guest uint32, h relay.Hello) (Held, error)
}

// Held is a VM's side of a flow, held by its stretch's bridge until
// Release.
type Held struct {
	// Writes is the ring the VM writes, Reads the ring it reads, both in
	// hostd's mapping.
	Writes, Reads *ring.Ring
	// Gone is closed once the VM's end of the flow is done (CLOSE, LEFT,
	// its session or guest gone): the bridge carries what the VM's
	// writer left in its ring into Writes, then stops.
	Gone <-chan struct{}
	// PeerGone is closed once the other end is done: the bridge carries
	// what that end left in Reads to the VM, then stops.
	PeerGone <-chan struct{}
	// Release gives the side back once the bridge on it stopped: hostd
	// then tells the surviving end, if any, DOWN(peer-gone). Until then
	// it tells it nothing, since a reader told peer-gone leaves its ring
	// once empty, and the bridge may still be writing into it.
	Release func()
	// Stop delivers a downgrade's reason when the flow leaves its rings by
	// RESUME (docs/vsock.md, "Switching back"): the bridge stops at once,
	// and Stopped says where. With Pair, only its out-direction stops at
	// once; the in-direction first carries the other VM's stretch to its
	// leave mark into this VM's ring (docs/vsock.md, "VM to VM").
	Stop <-chan proto.Reason
	// Pair: the other end is another VM's stretch, bridged by its own room
	// onto the same ring pair.
	Pair bool
	// Stopped is called once the bridge stopped, whatever the reason,
	// before Release: started and x are where the ring the VM writes
	// (Writes) ended as the bridge wrote it (its RESUME offset), outLeft
	// whether the VM's writer's LEFT reached that ring, inLeft whether the
	// other end's stretch reached the VM's ring whole, to its leave mark
	// (every byte acknowledged by the VM's bridge). A Release without it
	// says that no bridge ran (the stream ended first).
	Stopped func(started bool, x uint64, outLeft, inLeft bool)
}

// helloWait bounds how long a new stream may take to say its Hello.
const helloWait = 5 * time.Second

// endLinger bounds how long an ended stretch waits for the VM to close
// its stream.
const endLinger = 10 * time.Second

// goneDrain bounds how long the bridge of a flow with an end gone may go
// without moving a byte while it carries that end's last bytes to the
// other (the survivor's reader may not read, or a hostile VM may never
// send its LEFT); then it stops. A survivor that reads, however slowly,
// is never cut. A var for tests.
var goneDrain = 10 * time.Second

// stretches are one device's live stretches.
type stretches struct {
	mu     sync.Mutex
	open   map[*relay.Bridge]bool
	closed bool
	wg     sync.WaitGroup
	served uint64 // stretches bridged
	bad    uint64 // streams refused: bad Hello, unknown flow
}

// ServeStretches takes the VM's stretches (guest the VM's guest id) on
// its device's relay.VsockPort until the room closes: each stream's Hello
// is resolved through flows for this guest only, then a Bridge joins the
// stream to the flow's rings. p is how the bridges wait for the other
// end's library (nil: adaptive, futex).
func (r *Room) ServeStretches(guest uint32, flows Flows, p *wait.Policy) error {
	d := r.devs[guest]
	if d == nil {
		return fmt.Errorf("guest %d has no vsock device", guest)
	}
	l, err := d.listen(relay.VsockPort)
	if err != nil {
		return err
	}
	st := &d.st
	st.mu.Lock()
	if st.closed {
		st.mu.Unlock()
		l.Close()
		return errors.New("vsock room closed")
	}
	st.open = map[*relay.Bridge]bool{}
	d.stopStretches = func() {
		l.Close()
		st.mu.Lock()
		st.closed = true
		var bs []*relay.Bridge
		for b := range st.open {
			bs = append(bs, b)
		}
		st.mu.Unlock()
		for _, b := range bs {
			b.Stop(proto.ReasonShutdown)
		}
		st.wg.Wait()
	}
	st.wg.Add(1)
	st.mu.Unlock()
	go func() {
		defer st.wg.Done()
		var delay time.Duration
		for {
			c, err := l.Accept()
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if err != nil {
				// A hybrid VM's listener is a Unix socket: EMFILE (any
				// guest can push hostd there) must not end this VM's
				// stretches for good. Retried with backoff, as the
				// control sockets are (hostd/server).
				if delay == 0 {
					d.log.Warn("accepting a stretch failed; retrying with backoff", "error", err)
				}
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				time.Sleep(delay)
				continue
			}
			delay = 0
			st.wg.Add(1)
			go func() {
				defer st.wg.Done()
				st.serve(c, guest, flows, p, d.log)
			}()
		}
	}()
	return nil
}

// serve bridges one stream to the flow its Hello names, until the bridge
// stops; a stream that names no flow of this guest is closed.
func (st *stretches) serve(c net.Conn, guest uint32, flows Flows, p *wait.Policy, log hclog.Logger) {
	_ = c.SetReadDeadline(time.Now().Add(helloWait))
	h, err := relay.ReadHello(c)
	var held Held
	if err == nil {
		held, err = flows.Stretch(guest, h)
	}
	if err != nil {
		st.mu.Lock()
		st.bad++
		st.mu.Unlock()
		log.Warn("vsock stretch refused", "error", err)
		c.Close()
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	link := relay.NewLink([]net.Conn{c}, relay.LinkOptions{})
	defer func() { link.Close(); link.Wait(); held.Release() }()
	f, err := link.Open(relay.VsockFlowID)
	if err != nil {
		return
	}
	// The bridge stands for the VM on the flow's rings: it reads the ring
	// the other end writes (the VM's read ring) and writes the VM's write
	// ring, from the stream. Once that ring's reader (the other end's
	// library, or the other VM's room) attached it, the VM's bridge may
	// attach the VM's write ring: ATTACHED, if the VM's Hello asked.
	o := relay.BridgeOptions{Policy: p}
	if h.Holds() {
		o.Attached = f.Attached
	}
	b := relay.NewBridge(held.Reads, held.Writes, f, o)
	st.mu.Lock()
	if st.closed {
		st.mu.Unlock()
		end := b.Stop(proto.ReasonShutdown)
		if held.Stopped != nil {
			held.Stopped(end.Started, end.X, b.OutLeft(), b.InLeft())
		}
		return
	}
	st.open[b] = true
	st.served++
	st.mu.Unlock()
	log.Debug("vsock stretch", "region", h.Region, "slot", h.Slot, "gen", h.Gen)
	gone, cut, stopped := drainGone(b, held, p)
	if errors.Is(b.Err(), relay.ErrEnded) {
		// Both directions ended here; the VM's bridge may not have taken
		// the last LEFT yet. It closes the stream once it has: closing
		// first could end its bridge with the stream's EOF instead.
		t := time.AfterFunc(endLinger, link.Close)
		link.Wait()
		t.Stop()
	}
	broken := stopped == proto.ReasonNone && !cut && !b.OutLeft()
	if broken {
		// The VM's writer's stretch did not end by its LEFT: the stream
		// died under it (the VM's program killed, the VM gone, the
		// stream broken), and what it wrote last may never have crossed.
		// The other end's reader gets ECONNRESET where it stops, not a
		// clean end of a stream cut short (marking the ring left would
		// read as EOF). A downgrade's stop is no break: RESUME resends.
		if p == nil {
			p = &wait.Policy{}
		}
		_ = fault.Do(func() { held.Writes.Abort(uint32(proto.ReasonPeerGone), p) })
	}
	end := b.Stop(proto.ReasonShutdown) // marks the out ring left if the stream ended first
	if held.Stopped != nil {
		held.Stopped(end.Started, end.X, b.OutLeft(), b.InLeft())
	}
	switch err := b.Err(); {
	case stopped != proto.ReasonNone:
		log.Debug("vsock stretch stopped for a downgrade", "region", h.Region, "slot", h.Slot, "gen", h.Gen, "reason", stopped, "end", fmt.Sprintf("%+v", end), "stats", fmt.Sprintf("%+v", b.Stats()))
	case broken:
		log.Info("vsock stretch broken before the VM's writer left its ring: the other end's connection reset", "region", h.Region, "slot", h.Slot, "gen", h.Gen, "gone", gone, "error", err, "stats", fmt.Sprintf("%+v", b.Stats()))
	case cut:
		log.Info("vsock stretch of a done end stopped before its last bytes were carried: nothing moved within the bound (the VM's end done: the other end's connection reset)", "region", h.Region, "slot", h.Slot, "gen", h.Gen, "gone", gone, "bound", goneDrain, "stats", fmt.Sprintf("%+v", b.Stats()))
	case gone != "":
		log.Debug("vsock stretch of a gone end drained", "region", h.Region, "slot", h.Slot, "gen", h.Gen, "gone", gone, "error", err, "stats", fmt.Sprintf("%+v", b.Stats()))
	case err != nil && !errors.Is(err, relay.ErrEnded):
		log.Info("vsock stretch ended", "region", h.Region, "slot", h.Slot, "gen", h.Gen, "error", err, "stats", fmt.Sprintf("%+v", b.Stats()))
	default:
		log.Debug("vsock stretch done", "region", h.Region, "slot", h.Slot, "gen", h.Gen, "stats", fmt.Sprintf("%+v", b.Stats()))
	}
	st.mu.Lock()
	delete(st.open, b)
	st.mu.Unlock()
}

// drainGone waits until b stops by itself or an end of its flow is done.
// For a done end, the bridge first carries what that end's writer left in
// its ring to the other end (the VM's: the out-direction into Writes; the
// other's: the in-direction to the VM), until it has gone goneDrain
// without moving a byte, and stops: the done end reads nothing more, and
// hostd tells the survivor DOWN(peer-gone) only at Release, so its
// reader, which leaves once its ring is empty, has every byte by then.
// A drain cut short resets the process guest's ring (the VM's end done):
// its reader fails with ECONNRESET instead of reading a clean end, or a
// gap, where the VM's last bytes were. A downgrade by RESUME (held.Stop)
// stops the bridge at once, draining or not. It says which end was done
// ("": none), whether the bound cut the drain, and the downgrade's reason
// if one stopped it.
func drainGone(b *relay.Bridge, held Held, p *wait.Policy) (gone string, cut bool, stopped proto.Reason) {
	var drained <-chan struct{}
	select {
	case <-b.Done():
		return "", false, proto.ReasonNone
	case r := <-held.Stop:
		stopFor(b, held, r)
		return "", false, r
	case <-held.Gone:
		drained, gone = b.OutDone(), "vm"
	case <-held.PeerGone:
		drained, gone = b.InDone(), "peer"
	}
	moved := func() uint64 { st := b.Stats(); return st.BytesIn + st.BytesOut }
	last, since := moved(), time.Now()
	tick := time.NewTicker(min(goneDrain/10, time.Second))
	defer tick.Stop()
wait:
	for {
		select {
		case <-drained:
			break wait
		case <-b.Done():
			break wait
		case r := <-held.Stop:
			stopFor(b, held, r)
			return gone, false, r
		case <-tick.C:
			if n := moved(); n != last {
				last, since = n, time.Now()
			}
			if time.Since(since) >= goneDrain {
				cut = true
				break wait
			}
		}
	}
	if cut && gone == "vm" {
		if p == nil {
			p = &wait.Policy{}
		}
		held.Writes.Abort(uint32(proto.ReasonPeerGone), p)
	}
	b.Stop(proto.ReasonPeerGone)
	return gone, cut, proto.ReasonNone
}

// stopFor stops b for a downgrade by RESUME. Between two VMs (Pair) the
// out-direction stops first, its ring (the other VM's read ring on the
// flow) left where the bytes written end, and the in-direction carries
// the other VM's stretch into this VM's ring up to the mark its room left
// (InDone), until that is done or nothing moved for goneDrain: each VM's
// ring then holds the other's stretch to the offset the other resends
// from (docs/vsock.md, "VM to VM"). Then, or at once without Pair, Stop.
func stopFor(b *relay.Bridge, held Held, r proto.Reason) {
	if held.Pair {
		b.StopOut()
		moved := func() uint64 { st := b.Stats(); return st.BytesIn + st.Freed }
		last, since := moved(), time.Now()
		tick := time.NewTicker(min(goneDrain/10, time.Second))
		defer tick.Stop()
	wait:
		for {
			select {
			case <-b.InDone():
				break wait
			case <-tick.C:
				if n := moved(); n != last {
					last, since = n, time.Now()
				}
				if time.Since(since) >= goneDrain {
					break wait
				}
			}
		}
	}
	b.Stop(r)
}
