package guestlib

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
)

// Path says how a connection's bytes move now.
type Path struct {
	Fast   bool   // true: hostd gave it rings (READY, no DOWN since)
	Reason string // why TCP ("pending", "policy", "no-hostd", ...); "" when fast
}

func (p Path) String() string {
	if p.Fast {
		return "shunt"
	}
	return "tcp(" + p.Reason + ")"
}

// reasonPending is the Reason of a connection hostd has not answered yet.
const reasonPending = "pending"

// Conn is a TCP connection whose bytes move between the kernel's TCP and
// shared-memory rings, per direction, as hostd decides (docs/DESIGN.md,
// "Flow lifecycle: path switching"). It starts on TCP the moment it is
// connected or accepted. It implements net.Conn (and CloseWrite/CloseRead
// like *net.TCPConn, and io.WriterTo and io.ReaderFrom for io.Copy:
// conn_copy.go); as net.Conn requires it is safe for concurrent use,
// with one Read and one Write at a time each.
//
// Each direction keeps its stream offset: the writer moves to a ring at
// the offset it announces there (Start) and back with Leave; the reader
// reads TCP up to the announced start, the ring to its end, then TCP
// again (conn_read.go, conn_write.go). READY, DOWN and REVOKE reach the
// Conn from the Client's reader (flow.go) and never block it.
type Conn struct {
	tcp    *net.TCPConn
	client *Client // nil when the default client could not be made
	local  netip.AddrPort
	remote netip.AddrPort
	role   proto.Role
	req    uint32    // the OPEN's request id for the Conn's whole life; 0: never offered
	toldAt time.Time // when its OPEN went to hostd (zero: it did not); under the Client's mu

	// fmu orders READY, DOWN and Close: a flow is installed only while
	// the Conn is open, and Close sees every installed flow.
	fmu      sync.Mutex
	cur      atomic.Pointer[flow] // the flow of the last READY until both directions left it
	reason   string               // why TCP, when cur is nil or down (guarded by fmu)
	answered chan struct{}        // closed at hostd's first answer or a local reason
	ansOnce  sync.Once
	leaving  chan struct{} // non-nil while a leaver runs (see leaver); guarded by fmu

	annMu    sync.Mutex // orders the delayed OPEN (offerNow) with Close
	leaverWG sync.WaitGroup

	// Reader state, guarded by readMu (conn_read.go).
	readMu  sync.Mutex
	rf      *flow  // the flow whose read ring this end has not left
	rOnRing bool   // reading rf's ring (the TCP stream is at its start)
	roff    uint64 // stream offset of the next byte for the application
	stash   []byte // TCP bytes read past a ring's start (they follow its stretch), after a ring's drained bytes
	// stashRing: how many of stash's first bytes a drain took from a
	// ring (drainLocked), for Stats.
	stashRing int
	// ahead: a ring's stretch copied out while TCP bytes before its
	// start (aheadAt) were still due (holdAheadLocked); one at a time.
	ahead   []byte
	aheadAt uint64
	// aheadHeld: ahead is set. Written under readMu and fmu, read by
	// READY under fmu (flow.attachLater).
	aheadHeld atomic.Bool
	tcpErr    error  // the kernel's EOF or error, seen while a ring stretch was due
	back      []byte // bytes WriteTo's destination did not take: read first (unread)
	zcRead    []byte // TCP emulation of ReadBuffer
	zcPeek    bool   // a ring ReadBuffer awaits ReleaseRead

	// Writer state, guarded by writeMu (conn_write.go).
	writeMu sync.Mutex
	wf      *flow
	wOnRing atomic.Bool // writing wf's ring; read without the lock by Close
	sent    uint64      // stream offset of the next byte written
	zcWrite []byte      // TCP emulation of WriteBuffer
	zcResv  bool        // a ring WriteBuffer awaits CommitWrite
	wstart  uint64      // the stream offset at which the writer started wf's ring
	wtail0  uint64      // wf's ring's byte count then (Written)
	resend  []byte      // ring bytes RESUME gave back to send on TCP before any new byte
	// resending: resend holds bytes (read without writeMu by the leaver).
	resending atomic.Bool

	wshut     atomic.Bool // CloseWrite or Close: no more writes
	rshut     atomic.Bool // CloseRead: reads return EOF
	closed    atomic.Bool
	lost      atomic.Bool // its rings' memory faulted (fault.go)
	rst       atomic.Bool // reset by RESUME (resume.go): reads and writes fail with ECONNRESET
	rstOnce   sync.Once
	closeOnce sync.Once

	// dlMu guards the deadlines and the TCP read interruption: pokeRead
	// sets a past deadline on the socket to wake a Read blocked in the
	// kernel when a ring starts; the Read restores readDL afterwards.
	dlMu            sync.Mutex
	readDL, writeDL time.Time
	readingTCP      bool
	poked           bool
	rdl, wdl        atomic.Int64 // readDL, writeDL in unix ns (0: none), for the data path

	st connStats
}

// connStats are Stats' counters, updated by the owning direction.
type connStats struct {
	ringSent, ringRecv, tcpSent, tcpRecv atomic.Uint64
	wToRing, wToTCP, rToRing, rToTCP     atomic.Uint64
	readies, downs                       atomic.Uint64
	resent                               atomic.Uint64
	rOnRing                              atomic.Bool
}

// Stats are a connection's counters: bytes on each path, switches of each
// direction, and where each direction is now. hostd's tests and tools
// compare them with hostd's own.
type Stats struct {
	ReqID                   uint32
	Path                    Path
	RingSent, RingReceived  uint64 // bytes through the rings
	TCPSent, TCPReceived    uint64 // bytes through the kernel socket
	WriteToRing, WriteToTCP uint64 // the writer's moves
	ReadToRing, ReadToTCP   uint64 // the reader's moves
	Readies, Downs          uint64 // READYs taken, DOWNs (and REVOKEs, RESUMEs) obeyed
	Resent                  uint64 // ring bytes sent again on TCP after RESUME (counted in TCPSent too)
	WriteOnRing, ReadOnRing bool   // each direction's path now
}

// Stats returns a snapshot of the counters (each field atomic on its own).
func (c *Conn) Stats() Stats {
	s := &c.st
	return Stats{
		ReqID: c.reqID(), Path: c.Path(),
		RingSent: s.ringSent.Load(), RingReceived: s.ringRecv.Load(),
		TCPSent: s.tcpSent.Load(), TCPReceived: s.tcpRecv.Load(),
		WriteToRing: s.wToRing.Load(), WriteToTCP: s.wToTCP.Load(),
		ReadToRing: s.rToRing.Load(), ReadToTCP: s.rToTCP.Load(),
		Readies: s.readies.Load(), Downs: s.downs.Load(), Resent: s.resent.Load(),
		WriteOnRing: c.wOnRing.Load(), ReadOnRing: s.rOnRing.Load(),
	}
}

func newConn(c *Client, tcp *net.TCPConn, role proto.Role) *Conn {
	la := tcp.LocalAddr().(*net.TCPAddr).AddrPort()
	ra := tcp.RemoteAddr().(*net.TCPAddr).AddrPort()
	return &Conn{
		tcp: tcp, client: c, role: role, answered: make(chan struct{}),
		local:  proto.Unmap(la), // an IPv4 peer of an AF_INET6 socket: its IPv4 tuple
		remote: proto.Unmap(ra),
		reason: reasonPending,
	}
}

// announce offers the connection to hostd (OPEN, queued: nothing waits
// for it) once it has lived the Client's OpenDelay, or settles it on TCP
// for a local reason.
func (c *Conn) announce() {
	cl := c.client
	switch {
	case cl == nil:
		c.settle(proto.ReasonInternal.String())
	case cl.opts.Disable:
		c.settle(proto.ReasonDisabled.String())
	case c.remote.Addr().IsLoopback() && !cl.loopback:
		c.settle(proto.ReasonLoopback.String())
	case cl.opts.OpenDelay <= 0 || cl.unreachable():
		cl.open(c) // at once; without hostd it only records why (no-hostd, version)
	default:
		cl.opens.add(c, cl.delay.now())
	}
}

// offerNow is the delayed OPEN (opener): unless Close came first.
func (c *Conn) offerNow() {
	c.annMu.Lock()
	defer c.annMu.Unlock()
	if !c.closed.Load() {
		c.client.open(c)
	}
}

// reqID is c.req for readers outside Close and the Client's lock: the
// delayed OPEN sets it on its timer's goroutine.
func (c *Conn) reqID() uint32 {
	c.annMu.Lock()
	defer c.annMu.Unlock()
	return c.req
}

// unannounce waits out an offer under way (closed is set, so none
// starts after it); after it, c.req says for good whether hostd was told
// (Close owes it a CLOSE only then).
func (c *Conn) unannounce() {
	c.annMu.Lock()
	defer c.annMu.Unlock()
}

// settle records a TCP reason that no answer of hostd will change.
func (c *Conn) settle(reason string) {
	c.fmu.Lock()
	c.reason = reason
	c.fmu.Unlock()
	c.ansOnce.Do(func() { close(c.answered) })
	if c.client != nil {
		c.client.logf("shunt: %s -> %s: tcp(%s)", c.local, c.remote, reason)
	}
}

// Path returns the connection's path now: fast from READY until DOWN.
// Each direction follows at its next write or read (Stats tells).
func (c *Conn) Path() Path {
	c.fmu.Lock()
	defer c.fmu.Unlock()
	if f := c.cur.Load(); f != nil && !f.down.Load() {
		return Path{Fast: true}
	}
	return Path{Reason: c.reason}
}

// WaitPath waits until hostd has answered this connection once (READY or
// TCP), or its path is settled locally, or hostd is unreachable, or ctx
// is done, and returns the path then. Nothing else waits for hostd: it is for tools and tests that
// report the path a new connection got.
func (c *Conn) WaitPath(ctx context.Context) Path {
	select {
	case <-c.answered:
	case <-ctx.Done():
	}
	return c.Path()
}

// opErr wraps an error the way the net package reports socket errors, so
// callers can match ECONNRESET, EPIPE, timeouts and net.ErrClosed. Errors
// of the kernel socket come wrapped already.
func (c *Conn) opErr(op string, err error) error {
	var oe *net.OpError
	switch {
	case err == nil || err == io.EOF || errors.As(err, &oe):
		return err
	case errors.Is(err, ring.ErrReset), errors.Is(err, errBrokenStream):
		err = os.NewSyscallError(op, syscall.ECONNRESET)
	case errors.Is(err, ring.ErrPeerClosed), errors.Is(err, errShut):
		err = os.NewSyscallError(op, syscall.EPIPE)
	case errors.Is(err, ring.ErrClosed):
		err = net.ErrClosed
	}
	return &net.OpError{Op: op, Net: "tcp", Source: net.TCPAddrFromAddrPort(c.local), Addr: net.TCPAddrFromAddrPort(c.remote), Err: err}
}

var (
	// errBrokenStream: a ring's start lies behind what this end already
	// read, or the kernel's stream ended before it: a broken or hostile
	// writer. The connection is reset.
	errBrokenStream = errors.New("shunt: stream offsets do not match")
	// errShut: a write after CloseWrite.
	errShut = errors.New("shunt: write after shutdown")
)

// expired reports whether deadline t is set and passed (net.Conn fails a
// call at once then, even if it could make progress).
func expired(t time.Time) bool { return !t.IsZero() && !time.Now().Before(t) }

// LocalAddr implements net.Conn.
func (c *Conn) LocalAddr() net.Addr { return c.tcp.LocalAddr() }

// RemoteAddr implements net.Conn.
func (c *Conn) RemoteAddr() net.Addr { return c.tcp.RemoteAddr() }

// SetDeadline implements net.Conn.
func (c *Conn) SetDeadline(t time.Time) error {
	if err := c.SetReadDeadline(t); err != nil {
		return err
	}
	return c.SetWriteDeadline(t)
}

// SetReadDeadline implements net.Conn. The deadline holds on whichever
// path is active, across switches: the socket gets it (unless a poke is
// pending, after which the Read restores it) and a ring wait re-reads it.
func (c *Conn) SetReadDeadline(t time.Time) error {
	if c.closed.Load() {
		return c.opErr("set", net.ErrClosed)
	}
	c.dlMu.Lock()
	c.readDL = t
	c.rdl.Store(unixNano(t))
	var err error
	if !c.poked {
		err = c.tcp.SetReadDeadline(t)
	}
	c.dlMu.Unlock()
	if f := c.cur.Load(); f != nil {
		f.rd.Interrupt()
	}
	return err
}

// SetWriteDeadline implements net.Conn, like SetReadDeadline.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	if c.closed.Load() {
		return c.opErr("set", net.ErrClosed)
	}
	c.dlMu.Lock()
	c.writeDL = t
	c.wdl.Store(unixNano(t))
	err := c.tcp.SetWriteDeadline(t)
	c.dlMu.Unlock()
	if f := c.cur.Load(); f != nil {
		f.w.Interrupt()
	}
	return err
}

func (c *Conn) readDeadline() time.Time  { return fromUnixNano(c.rdl.Load()) }
func (c *Conn) writeDeadline() time.Time { return fromUnixNano(c.wdl.Load()) }

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromUnixNano(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// CloseWrite shuts down the writing side: the writer leaves its ring
// first, so the peer reads the ring's bytes, then the kernel's FIN (EOF).
func (c *Conn) CloseWrite() error {
	if c.closed.Load() {
		return c.opErr("close", net.ErrClosed)
	}
	c.wshut.Store(true)
	if !c.lockWriterForShut() {
		// A Write is blocked in the kernel (its direction is on TCP):
		// the kernel's shutdown ends it, as it would without Shunt.
		return c.tcp.CloseWrite()
	}
	sf := c.stretchOf()
	c.guarded("close", c.writerSyncLocked)
	c.drainStretch(sf)           // a vsock stretch's bytes before the FIN (stretch.go)
	err := c.flushResendLocked() // RESUME's bytes before the FIN
	c.writeMu.Unlock()
	if err != nil {
		return err
	}
	return c.tcp.CloseWrite()
}

// lockWriterForShut takes writeMu for CloseWrite or Close, waking a Write
// blocked on a ring (it returns at once: wshut). It does not wait for a
// Write blocked in a kernel send, and reports false then.
func (c *Conn) lockWriterForShut() bool {
	if f := c.cur.Load(); f != nil {
		f.w.Interrupt()
	}
	if c.writeMu.TryLock() {
		return true
	}
	if !c.wOnRing.Load() {
		return false
	}
	c.writeMu.Lock()
	return true
}

// CloseRead shuts down the reading side: reads return EOF, on either
// path (a ring's bytes stay until Close, as the kernel keeps its own).
func (c *Conn) CloseRead() error {
	if c.closed.Load() {
		return c.opErr("close", net.ErrClosed)
	}
	c.rshut.Store(true)
	if f := c.cur.Load(); f != nil {
		f.rd.Interrupt()
	}
	c.pokeRead()
	return c.tcp.CloseRead()
}

// Close implements net.Conn: the writer leaves its ring, hostd gets
// CLOSE, and the kernel socket closes, so the peer reads the ring's bytes
// and then what the kernel reports (FIN, or RST when this end left unread
// bytes, as the kernel does). Blocked calls return net.ErrClosed.
func (c *Conn) Close() error {
	err := net.ErrClosed
	c.closeOnce.Do(func() { err = c.close() })
	if err == net.ErrClosed {
		return c.opErr("close", err)
	}
	return err
}

func (c *Conn) close() error {
	c.fmu.Lock()
	c.closed.Store(true)
	c.wshut.Store(true)
	stop := c.leaving
	f := c.cur.Load() // CLOSE names it: its LEFT is not sent now
	c.fmu.Unlock()
	if stop != nil {
		close(stop)
	}
	if f != nil {
		f.rd.Interrupt()
	}
	c.pokeRead()
	wlocked := c.lockWriterForShut()
	if wlocked {
		c.zcResv = false // an uncommitted reservation is dropped
		sf := c.stretchOf()
		c.guarded("close", c.writerSyncLocked)
		c.drainStretch(sf)
		if c.resending.Load() { // RESUME's bytes before the kernel close, for a bounded time
			_ = c.tcp.SetWriteDeadline(time.Now().Add(closeResendWait))
			if err := c.flushResendLocked(); err != nil {
				c.client.logf("shunt: %s -> %s: closed before a RESUME's resend went out: %v", c.local, c.remote, err)
			}
		}
		c.writeMu.Unlock()
	}
	c.readMu.Lock()
	var unread bool
	c.guarded("close", func() { unread = c.leaveReadForCloseLocked() })
	c.readMu.Unlock()
	if unread {
		_ = c.tcp.SetLinger(0)
	}
	c.unannounce() // closed is set: no OPEN from now on
	if c.client != nil && c.req != 0 {
		c.client.connClosed(c, f)
	}
	err := c.tcp.Close()
	if !wlocked { // the kernel close ended the Write blocked in it
		c.writeMu.Lock()
		c.zcResv = false
		c.guarded("close", c.writerSyncLocked)
		c.writeMu.Unlock()
	}
	c.leaverWG.Wait()
	if f != nil {
		f.release()
	}
	return err
}
