package guestlib

import (
	"os"
	"time"

	"github.com/shuntnet/shunt/guestlib/vstretch"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/ring"
)

// A VM without a Shunt ivshmem device cannot map its flows' regions:
// hostd hands it a pair region it has no descriptor for (REGION without
// one), then READY. The library then carries the flow's stretch over
// vsock (docs/vsock.md, "The data path over vsock"): rings of its own,
// and a bridge between them and an AF_VSOCK stream to hostd, which
// bridges the stream to the flow's real rings. The Conn reads and writes
// those rings exactly as a region's, so the switching (offsets, DOWN,
// LEFT, TCP whenever anything is missing) is the same code.

// stretchDrain bounds how long a Close or CloseWrite waits for the host
// to take the write ring's last bytes (see drainStretch).
const stretchDrain = 10 * time.Second

// stretchEnd bounds how long a released flow's bridge may take to carry
// the last bytes of its rings to the host before the stretch is closed.
const stretchEnd = time.Minute

// stretches reports whether flows of regions this client cannot map go
// over vsock: Options.Vsock, $SHUNT_VSOCK=1, or a control channel over
// vsock (docs/vsock.md, "Wiring").
func (c *Client) stretches() bool {
	return c.opts.Vsock || c.vsockCtl.Load() || os.Getenv("SHUNT_VSOCK") == "1"
}

// attachStretch is attach for a flow over vsock: it opens the stretch
// (a stream to the host, whose device answers at once: this blocks the
// control reader for a connect, no longer) and attaches the Conn's ends
// to its rings. An error gives the READY back (Client.ready: LEFT), and
// the connection stays on TCP.
func (c *Client) attachStretch(m proto.Msg) (*flow, error) {
	conn, err := vstretch.Dial(relay.VsockPort)
	if err != nil {
		return nil, err
	}
	p := c.opts.Wait // the bridge is in this process: futexes, not KICKs
	s, err := vstretch.Open(conn, relay.Hello{Region: m.RegionID, Slot: m.Slot, Gen: m.Gen}, int(m.Capacity), p)
	if err != nil {
		return nil, err
	}
	f := &flow{key: keyOf(m), side: m.Side, relayed: m.Relayed, stretch: s, client: c}
	if f.w, err = ring.NewWriter(s.W, p); err == nil {
		f.rd, err = ring.NewReader(s.R, p)
	}
	if err != nil {
		s.Close()
		return nil, err
	}
	c.logf("shunt: rings %d/%d.%d over vsock", m.RegionID, m.Slot, m.Gen)
	return f, nil
}

// endStretch closes a released flow's stretch once its bridge carried
// the rings' last bytes and marks to the host (both directions left), or
// after stretchEnd.
func (f *flow) endStretch() {
	s := f.stretch
	if s == nil {
		return
	}
	go func() {
		select {
		case <-s.Done():
		case <-time.After(stretchEnd):
		}
		s.Close()
	}()
}

// peerGoneAfterStretch is DOWN(peer-gone) for stretch flow f: the reader
// may leave its ring once empty, without the writer's leave, only after
// the bridge, the ring's writer here, stopped: until then the other end's
// last bytes may still be on their way from the host (hostd stops its
// bridge once they are in, and sends this DOWN after, but a DOWN that
// came before the stretch was bridged cannot know). At most stretchEnd.
func (f *flow) peerGoneAfterStretch(c *Conn) {
	go func() {
		select {
		case <-f.stretch.Done():
		case <-time.After(stretchEnd):
		}
		f.peerGone.Store(true)
		if f.rLeft.Load() {
			return // left already (then the rings may be unmapped)
		}
		f.rd.Interrupt()
		if !c.tryLeave(f) {
			c.startLeaver()
		}
	}()
}

// stretchOf is the flow whose write ring a Close or CloseWrite is about
// to leave, if it is a stretch's (for drainStretch). For writeMu's holder.
func (c *Conn) stretchOf() *flow {
	f := c.wf
	if f == nil {
		f = c.cur.Load()
	}
	if f == nil || f.stretch == nil {
		return nil
	}
	return f
}

// drainStretch waits, once the writer left stretch flow f's write ring
// (a Close or CloseWrite), until the bridge carried the ring's last bytes
// to the host, at most stretchDrain: in a region the bytes would outlive
// this process, here they are in its memory, and the kernel's FIN must
// not overtake them.
func (c *Conn) drainStretch(f *flow) {
	if f == nil || !f.wLeft.Load() {
		return
	}
	deadline := time.Now().Add(stretchDrain)
	select {
	case <-f.stretch.InDone():
		// Its LEFT is queued after the last byte: the program may exit
		// once this returns, so it must be in the kernel first, or the
		// host takes the stream's end for a break (a reset).
		flushed := f.stretch.Flushed(deadline)
		c.client.logf("shunt: %s -> %s: the host took the write ring's last bytes (%+v, %v; end flushed %v)", c.local, c.remote, f.stretch.Stats(), f.stretch.Err(), flushed)
	case <-time.After(time.Until(deadline)):
		c.client.logf("shunt: %s -> %s: the host took no more of the write ring's bytes for %v; closing anyway (%+v, %v)", c.local, c.remote, stretchDrain, f.stretch.Stats(), f.stretch.Err())
	}
}

// stretchEnded is the VM's part of a RESUME for stretch flow f (docs/
// vsock.md, "Switching back"): hostd stopped its bridge, and the RESUME's
// offset is where the ring that bridge wrote ended. This end stops its
// own bridge, which marks the read ring left where the bytes it wrote
// end, and tells hostd that offset (ENDED), which the other end's writer
// resends from. The bridge frees a byte of the write ring only once the
// host's ring holds it, so the writer's resend is still in the ring.
func (c *Conn) stretchEnded(f *flow, r proto.Reason) {
	e := f.stretch.Stop(r)
	off := proto.ResumeAll
	if e.Started {
		off = e.X
	}
	k := f.key
	c.client.logf("shunt: %s -> %s: stretch %d/%d.%d stopped (%s): read ring ended at %d (started %v), %+v", c.local, c.remote, k.region, k.slot, k.gen, r, e.X, e.Started, f.stretch.Stats())
	_ = c.client.send(proto.Msg{Type: proto.Ended, ReqID: c.req, RegionID: k.region, Slot: k.slot, Gen: k.gen, Side: f.side, Offset: off})
}
