package vsock

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/shuntnet/shunt/vhost/vhostuser"
	"github.com/shuntnet/shunt/vhost/virtq"
)

// Queue indices (virtio 1.2 §5.10.2). The event queue (2) stays QEMU's:
// vhost-user-vsock hands the back-end only rx and tx (QEMU
// hw/virtio/vhost-vsock-common.c uses it for transport resets after a
// migration, which vhost-user-vsock does not support).
const (
	rxQueue = 0
	txQueue = 1
)

// Bounds of what one guest can make the device hold.
const (
	// RecvBuf is each connection's receive buffer: the buf_alloc the
	// device advertises, so a guest that respects its credit never
	// overflows it (one that does not is reset).
	RecvBuf = 256 << 10
	// SendBuf bounds the bytes Write queues ahead of the guest.
	SendBuf = 256 << 10
	// MaxConns bounds the connections of one device.
	MaxConns = 1024
	// Backlog bounds each listener's connections not yet accepted.
	Backlog = 128
	// maxLoose bounds the RSTs queued for packets of no connection.
	maxLoose = 64
)

// Device is one VM's vsock device. Its methods are safe for concurrent
// use.
type Device struct {
	cid uint64
	log func(format string, args ...any)

	mu        sync.Mutex
	sess      *vhostuser.Session
	conns     map[key]*Conn
	listeners map[uint32]*Listener
	any       *Listener
	loose     []Hdr   // RSTs for packets of no connection
	ready     []*Conn // connections with something to send, in turn
	nextPort  uint32
	broken    [2]bool
	txAgain   bool // a later drainTx pass is pending

	stats Stats
}

// key names a connection by its two ports (the CIDs are the device's).
type key struct{ host, guest uint32 }

// Stats are the device's counters.
type Stats struct {
	Conns       atomic.Int64  // open now
	Accepted    atomic.Uint64 // guest connections accepted by a listener
	Dialed      atomic.Uint64 // host connections the guest accepted
	Refused     atomic.Uint64 // guest REQUESTs answered with RST
	Resets      atomic.Uint64 // connections reset for breaking the protocol
	BadPackets  atomic.Uint64 // tx packets dropped (bad header, CID, len)
	RxBytes     atomic.Uint64 // payload bytes from the guest
	TxBytes     atomic.Uint64 // payload bytes to the guest
	QueueBroken atomic.Uint64 // virtqueues stopped for a driver's error
}

// ErrGone is the error of a connection whose VM's front-end went away.
var ErrGone = errors.New("vsock: the VM's vhost-user front-end went away")

// New returns the device of a guest with context id cid (3 up to
// 0xfffffffe: 0-2 are reserved and -1 is VMADDR_CID_ANY). log gets one
// line per refused message or broken queue.
func New(cid uint64, log func(format string, args ...any)) (*Device, error) {
	if cid < 3 || cid >= 0xffffffff {
		return nil, fmt.Errorf("guest CID %d: want 3 to %d", cid, uint32(0xfffffffe))
	}
	if log == nil {
		log = func(string, ...any) {}
	}
	return &Device{cid: cid, log: log, conns: map[key]*Conn{}, listeners: map[uint32]*Listener{}, nextPort: 1 << 15}, nil
}

// CID is the guest's context id.
func (d *Device) CID() uint64 { return d.cid }

// Stats returns the device's counters.
func (d *Device) Stats() *Stats { return &d.stats }

// Lock and Unlock guard the device and its vhost-user session.
func (d *Device) Lock()   { d.mu.Lock() }
func (d *Device) Unlock() { d.mu.Unlock() }

// Features offers no vsock feature bits: no VIRTIO_VSOCK_F_SEQPACKET.
func (d *Device) Features() uint64 { return 0 }

// Config is struct virtio_vsock_config { le64 guest_cid; } (virtio 1.2
// §5.10.4).
func (d *Device) Config() []byte { return binary.LittleEndian.AppendUint64(nil, d.cid) }

// Queues: rx and tx.
func (d *Device) Queues() int { return 2 }

// Attach starts serving a front-end.
func (d *Device) Attach(s *vhostuser.Session) {
	d.sess = s
	d.broken = [2]bool{}
}

// Detach resets every connection: the guest's ends are gone with it.
func (d *Device) Detach(s *vhostuser.Session) {
	if d.sess != s {
		return
	}
	d.sess = nil
	for _, c := range d.conns {
		c.reset(ErrGone)
	}
	d.loose, d.ready = nil, nil
}

// Kick serves a queue the driver kicked: the tx queue's packets, then as
// many pending packets as the rx queue has buffers for.
func (d *Device) Kick(q int) {
	if q == txQueue {
		d.drainTx()
	}
	d.pump()
}

// queue returns queue i if it runs and is not broken.
func (d *Device) queue(i int) *virtq.Queue {
	if d.sess == nil || d.broken[i] {
		return nil
	}
	return d.sess.Queue(i)
}

func (d *Device) broke(i int, err error) {
	d.broken[i] = true
	d.stats.QueueBroken.Add(1)
	d.sess.Broken(i, err)
}

// drainTx takes every packet the driver made available on the tx queue,
// at most a queue's worth per kick (a driver that keeps adding cannot keep
// the device here).
func (d *Device) drainTx() {
	q := d.queue(txQueue)
	if q == nil {
		return
	}
	n, err := q.Pending()
	if err != nil {
		d.broke(txQueue, err)
		return
	}
	hdr := make([]byte, HdrSize)
	for ; n > 0; n-- {
		c, ok, err := q.Pop()
		if err != nil {
			d.broke(txQueue, err)
			break
		}
		if !ok {
			break
		}
		d.packet(c.R, hdr)
		q.Push(c.Head, 0)
	}
	d.sess.Notify(txQueue)
	// What came meanwhile is taken by one more pass, later, so that the
	// lock is let go in between; at most one such pass is pending, however
	// often the driver kicks.
	if more, _ := q.Pending(); more > 0 && !d.txAgain {
		d.txAgain = true
		go func() {
			d.mu.Lock()
			defer d.mu.Unlock()
			d.txAgain = false
			d.Kick(txQueue)
		}()
	}
}

// packet handles one tx packet, the readable buffers of its chain (hdr is
// scratch space for the header).
func (d *Device) packet(r [][]byte, hdr []byte) {
	if virtq.Gather(hdr, r, 0) < HdrSize {
		d.stats.BadPackets.Add(1)
		return
	}
	h, _ := ParseHdr(hdr)
	if h.Len > MaxPayload || int(h.Len) > virtq.Total(r)-HdrSize {
		d.stats.BadPackets.Add(1)
		d.violation(h, "len beyond its buffer or MaxPayload")
		return
	}
	d.receive(h, r)
}

// pump fills rx buffers with pending packets: RSTs first, then one packet
// per ready connection in turn.
func (d *Device) pump() {
	q := d.queue(rxQueue)
	if q == nil {
		return
	}
	sent := false
	buf := make([]byte, HdrSize)
	for {
		for len(d.ready) > 0 && !d.ready[0].sendable() {
			d.ready[0].inReady = false
			d.ready = d.ready[1:]
		}
		if len(d.loose) == 0 && len(d.ready) == 0 {
			break
		}
		ch, ok, err := q.Pop()
		if err != nil {
			d.broke(rxQueue, err)
			break
		}
		if !ok {
			break
		}
		if len(ch.R) > 0 || ch.WriteLen() < HdrSize {
			d.broke(rxQueue, q.Break("receive buffer with %d readable and %d writable bytes, want only writable, at least %d", ch.ReadLen(), ch.WriteLen(), HdrSize))
			break
		}
		var h Hdr
		var payload []byte
		if len(d.loose) > 0 {
			h, d.loose = d.loose[0], d.loose[1:]
		} else {
			c := d.ready[0]
			d.ready = d.ready[1:]
			c.inReady = false
			h, payload = c.next(min(ch.WriteLen()-HdrSize, MaxPayload))
			d.markReady(c)
		}
		h.Len = uint32(len(payload))
		h.Put(buf)
		virtq.Scatter(ch.W, 0, buf)
		virtq.Scatter(ch.W, HdrSize, payload)
		q.Push(ch.Head, uint32(HdrSize+len(payload)))
		d.stats.TxBytes.Add(uint64(len(payload)))
		sent = true
	}
	if sent {
		d.sess.Notify(rxQueue)
	}
}

// markReady puts c in turn to send if it has something to send. The turn
// list holds each connection at most once; ones that have nothing to send
// any more are dropped when they come up, or all at once when the list
// outgrows the connections (no rx buffers to send them with).
func (d *Device) markReady(c *Conn) {
	if c.inReady || !c.sendable() {
		return
	}
	if len(d.ready) >= MaxConns {
		kept := d.ready[:0]
		for _, r := range d.ready {
			if r.sendable() {
				kept = append(kept, r)
			} else {
				r.inReady = false
			}
		}
		clear(d.ready[len(kept):])
		d.ready = kept
	}
	c.inReady = true
	d.ready = append(d.ready, c)
}

// hdr is a header from the host end of c, with c's credit.
func (d *Device) hdr(c *Conn, op uint16) Hdr {
	return Hdr{SrcCID: HostCID, DstCID: d.cid, SrcPort: c.k.host, DstPort: c.k.guest, Type: TypeStream, Op: op, BufAlloc: RecvBuf, FwdCnt: c.fwdCnt}
}

// rst queues an RST answering h (never to an RST).
func (d *Device) rst(h Hdr) {
	if h.Op == OpRst {
		return
	}
	d.queueRst(Hdr{SrcCID: HostCID, DstCID: d.cid, SrcPort: h.DstPort, DstPort: h.SrcPort, Type: TypeStream, Op: OpRst})
}

// queueRst queues an RST, unless maxLoose are waiting for rx buffers
// already: a guest that posts none cannot make the device hold more (it
// only misses RSTs of its own connections).
func (d *Device) queueRst(h Hdr) {
	if len(d.loose) < maxLoose {
		d.loose = append(d.loose, h)
	}
}

// violation resets the connection h belongs to, if any, or answers RST.
func (d *Device) violation(h Hdr, why string) {
	d.log("vsock cid %d: %s: %v", d.cid, why, h)
	if c := d.conns[key{h.DstPort, h.SrcPort}]; c != nil && h.SrcCID == d.cid {
		d.stats.Resets.Add(1)
		c.abort(fmt.Errorf("vsock: the guest broke the protocol: %s", why))
		return
	}
	d.rst(h)
}

// receive handles one packet from the guest; payload is in segs after the
// header.
func (d *Device) receive(h Hdr, segs [][]byte) {
	if h.SrcCID != d.cid {
		// Not from this guest's own address: dropped, as Linux's
		// vhost-vsock drops them; never answered.
		d.stats.BadPackets.Add(1)
		return
	}
	if h.DstCID != HostCID || h.Type != TypeStream {
		d.stats.BadPackets.Add(1)
		d.rst(h)
		return
	}
	k := key{h.DstPort, h.SrcPort}
	c := d.conns[k]
	if c == nil {
		if h.Op == OpRequest {
			d.request(h)
		} else {
			d.rst(h)
		}
		return
	}
	c.receive(h, segs)
}

// request answers a guest's REQUEST: a listener takes it (RESPONSE, then
// Accept), or RST.
func (d *Device) request(h Hdr) {
	l := d.listeners[h.DstPort]
	if l == nil && d.any != nil && d.any.accepts(h.DstPort) {
		l = d.any
	}
	if l == nil || len(l.backlog) >= Backlog || len(d.conns) >= MaxConns {
		d.stats.Refused.Add(1)
		d.rst(h)
		return
	}
	c := d.newConn(key{h.DstPort, h.SrcPort}, h)
	c.state = established
	c.want |= wantResponse
	d.markReady(c)
	l.backlog = append(l.backlog, c)
	l.wake()
}

// remove forgets c: its ports may be used again.
func (d *Device) remove(c *Conn) {
	if d.conns[c.k] == c {
		delete(d.conns, c.k)
		d.stats.Conns.Add(-1)
	}
}

func (d *Device) newConn(k key, h Hdr) *Conn {
	c := &Conn{d: d, k: k, changed: make(chan struct{}), peerBufAlloc: h.BufAlloc, peerFwdCnt: h.FwdCnt,
		in: ringBuf{max: RecvBuf}, out: ringBuf{max: SendBuf}}
	d.conns[k] = c
	d.stats.Conns.Add(1)
	return c
}
