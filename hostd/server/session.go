package server

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
)

// outQueue is how many messages a session may have waiting for its guest
// to read them; a guest that lets more pile up is disconnected. Only the
// guest's own requests fill it: KICKs relayed from a flow's peer wait in
// their own coalescing lane (kickLane), so no peer can fill it. And the
// session stops reading the guest's requests while the queue is over half
// full (readLoop, waitRoom), so a guest that pipelines requests faster
// than it reads the answers is slowed down, not cut off.
const outQueue = 256

// batchBytes bounds how much the writer gathers from the queue into one
// write.
const batchBytes = 16 << 10

// maxKicks bounds a session's KICK lane: distinct flow sides with a KICK
// waiting. It is far above what the broker relays (one per flow side of
// the guest's flows); beyond it a KICK is dropped (a sleeper's wait is
// bounded anyway).
const maxKicks = 4096

// epoch is the origin of the sessions' monotonic clock (heard).
var epoch = time.Now()

// session is one guest connection. It implements broker.Session: Send is
// safe for concurrent use and never blocks. Two goroutines serve it:
// readLoop reads and handles the guest's messages, and owns the fields
// marked so; writeLoop is the only writer to the connection, and sends
// the keepalive PINGs.
//
// Every read and write has a deadline that follows the keepalive: a frame
// (HELLO included) must arrive within Silence of the read that waits for
// it, the guest must say something (a PONG will do) within Silence, and it
// must take each write within Silence. Any of these ends this session
// only.
type session struct {
	srv   *Server
	c     net.Conn
	g     *broker.Guest
	log   hclog.Logger
	out   outBox        // to writeLoop, in order
	once  sync.Once     // for shutdown
	done  chan struct{} // closed by shutdown
	quit  chan struct{} // closed when writeLoop returns
	heard atomic.Int64  // when the guest last said something (since epoch)
	ready atomic.Bool   // WELCOME queued: keepalive PINGs may go
	// What the guest library speaks, from its HELLO: the protocol version
	// hostd answers in (proto.Version or an older one), and whether it
	// shares a ring format with hostd (path switching), and whether it
	// announced proto.CapResume (it handles RESUME: relayed flows).
	version atomic.Uint32
	formats atomic.Bool
	resume  atomic.Bool
	room    chan struct{} // 1: the writer drained the queue to a quarter

	kicks kickLane

	// readLoop only.
	br      *bufio.Reader // over c: a burst of messages costs one read
	buf     []byte
	welcome proto.Msg // the answer to every HELLO
	spoke   bool      // the guest acted since its last HELLO
}

// outMsg is a message for the guest; after a last one, the writer closes
// the session.
type outMsg struct {
	m    proto.Msg
	last bool
	file *os.File // sent with m (SCM_RIGHTS), then closed; a duplicate the session owns
}

// outBox is a session's queue of messages for its guest: a slice that
// grows with what is queued, up to outQueue (an idle session, or one
// refused before HELLO, holds nothing), which the writer takes whole.
type outBox struct {
	mu     sync.Mutex
	msgs   []outMsg
	spare  []outMsg      // the writer's last batch, reused
	closed bool          // the writer has gone: nothing more is queued
	ready  chan struct{} // 1: there are messages for the writer
}

// put queues o; it reports false if the box is full, and closes o's file
// if o is not queued.
func (b *outBox) put(o outMsg) bool {
	b.mu.Lock()
	full := len(b.msgs) >= outQueue
	if !full && !b.closed {
		b.msgs = append(b.msgs, o)
		b.mu.Unlock()
		select {
		case b.ready <- struct{}{}:
		default:
		}
		return true
	}
	b.mu.Unlock()
	if o.file != nil {
		o.file.Close()
	}
	return !full
}

// take empties the box; the batch is valid until the next take.
func (b *outBox) take() []outMsg {
	b.mu.Lock()
	defer b.mu.Unlock()
	batch := b.msgs
	b.msgs, b.spare = b.spare[:0], batch
	return batch
}

func (b *outBox) len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.msgs)
}

// close drops what is queued (closing its files); later puts are dropped.
func (b *outBox) close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	for _, o := range b.msgs {
		if o.file != nil {
			o.file.Close()
		}
	}
	b.msgs, b.spare = nil, nil
}

// kickKey is one flow side that a relayed KICK wakes.
type kickKey struct {
	region, slot uint32
	gen          uint64
	side         proto.Side
}

// kickLane holds the KICKs relayed to a session, at most one per flow
// side: a KICK for a side that already has one waiting is merged into it
// (one wake-up wakes the sleeper once, however many were asked for). So a
// flood of KICKs from a flow's peer costs this session at most one
// message per flow side per write, and never fills its queue.
type kickLane struct {
	mu    sync.Mutex
	set   map[kickKey]bool
	order []kickKey
	ready chan struct{} // 1: the lane has KICKs for the writer
}

func newSession(s *Server, c net.Conn, g *broker.Guest) *session {
	ss := &session{srv: s, c: c, g: g, log: s.log.With("guest", g.Name),
		done: make(chan struct{}), quit: make(chan struct{}), room: make(chan struct{}, 1)}
	ss.out.ready = make(chan struct{}, 1)
	ss.kicks.ready = make(chan struct{}, 1)
	ss.heard.Store(int64(time.Since(epoch)))
	return ss
}

func (ss *session) Guest() *broker.Guest { return ss.g }

// Switching implements broker.Switcher: the guest library speaks protocol
// version 3 and a ring format hostd shares; every OPEN of any other gets
// TCP(version).
func (ss *session) Switching() bool {
	return ss.version.Load() == proto.Version && ss.formats.Load()
}

// Resumes implements broker.Resumer: the guest library switches and
// announced proto.CapResume in its HELLO.
func (ss *session) Resumes() bool {
	return ss.Switching() && ss.resume.Load()
}

// learn takes the guest library's protocol version, ring formats and
// capabilities from its HELLO, and returns the WELCOME's formats:
// ring.FormatVersion if the library has it, else 0. Capability bits
// (proto.CapResume) are masked out of the choice; unknown bits are
// ignored.
func (ss *session) learn(hello proto.Msg) uint32 {
	v := uint32(hello.Version)
	if v == 0 {
		v = proto.Version
	}
	ss.version.Store(v)
	var formats uint32
	offered := hello.Formats &^ proto.CapResume
	if v == proto.Version && offered&(1<<ring.FormatVersion) != 0 {
		formats = 1 << ring.FormatVersion
	}
	ss.formats.Store(formats != 0)
	ss.resume.Store(v == proto.Version && hello.Formats&proto.CapResume != 0)
	return formats
}

// SendFile implements broker.FileSender: it queues m with a duplicate of
// f, which the writer sends along with m's frame (SCM_RIGHTS) and then
// closes. The caller keeps f.
func (ss *session) SendFile(m proto.Msg, f *os.File) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		ss.log.Error("cannot duplicate a region's descriptor for the guest; closing its session", "error", err)
		ss.shutdown()
		return
	}
	ss.queue(outMsg{m: m, file: os.NewFile(uintptr(fd), f.Name())})
}

// writeFile writes frame with f's descriptor attached to its first byte.
func (ss *session) writeFile(frame []byte, f *os.File) error {
	uc, ok := ss.c.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("%s: a %T cannot carry a descriptor", proto.RegionMsg, ss.c)
	}
	n, _, err := uc.WriteMsgUnix(frame, unix.UnixRights(int(f.Fd())), nil)
	if err == nil && n < len(frame) {
		_, err = uc.Write(frame[n:])
	}
	return err
}

// Send queues m; a guest that lets outQueue messages pile up is
// disconnected. KICKs go to the coalescing lane instead.
func (ss *session) Send(m proto.Msg) {
	if v := ss.version.Load(); v != 0 && v != proto.Version {
		m.Version = uint8(v) // answered in the guest's own version
	}
	if m.Type == proto.Kick {
		ss.kick(m)
		return
	}
	ss.queue(outMsg{m: m})
}

func (ss *session) queue(o outMsg) {
	if ss.out.put(o) {
		return
	}
	select {
	case <-ss.done:
	default:
		if ok, more := ss.srv.quiet(ss.g, "not-reading"); ok {
			ss.log.Warn("guest is not reading its control channel; closing it", "queued", outQueue, "unlogged_before", more)
		}
		ss.srv.m.ClosedSession.WithLabelValues("not-reading").Inc()
		ss.shutdown()
	}
}

// kick puts a relayed KICK in the lane, merged with one already waiting
// for the same flow side.
func (ss *session) kick(m proto.Msg) {
	k := kickKey{m.RegionID, m.Slot, m.Gen, m.Side}
	l := &ss.kicks
	l.mu.Lock()
	if l.set[k] || len(l.order) >= maxKicks {
		l.mu.Unlock()
		ss.srv.m.KicksMerged.Inc()
		return
	}
	if l.set == nil {
		l.set = map[kickKey]bool{}
	}
	l.set[k] = true
	l.order = append(l.order, k)
	l.mu.Unlock()
	select {
	case l.ready <- struct{}{}:
	default:
	}
}

// takeKicks appends the waiting KICKs' frames to buf and empties the lane.
func (ss *session) takeKicks(buf []byte) []byte {
	l := &ss.kicks
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, k := range l.order {
		m := proto.Msg{Type: proto.Kick, RegionID: k.region, Slot: k.slot, Gen: k.gen, Side: k.side}
		if v := ss.version.Load(); v != 0 && v != proto.Version {
			m.Version = uint8(v)
		}
		if b, err := m.Append(buf); err == nil {
			buf = b
		}
	}
	clear(l.set)
	l.order = l.order[:0]
	return buf
}

// shutdown closes the session at once, dropping what is queued. It is
// idempotent and safe for concurrent use.
func (ss *session) shutdown() {
	ss.once.Do(func() {
		close(ss.done)
		ss.c.Close()
	})
}

// writeLoop writes queued messages in order, and the KICK lane whenever it
// has some, until the session is shut down, a write fails, or it wrote a
// last message. Each write must complete within Silence; a guest that
// does not take it loses this session, and no one else waits for it. It
// also sends the keepalive: a PING when the guest said nothing for
// Keepalive (readLoop closes the session after Silence).
func (ss *session) writeLoop() {
	defer ss.srv.wg.Done()
	defer close(ss.quit)
	defer ss.out.close()
	opts := ss.srv.opts
	tick := time.NewTicker(opts.Keepalive / 2)
	defer tick.Stop()
	var pinged time.Duration // when the last keepalive PING went (since epoch)
	var nonce uint64
	buf := make([]byte, 0, 512)
	for {
		buf = buf[:0]
		select {
		case <-ss.done:
			return
		case <-ss.out.ready:
			if !ss.writeBatch(buf, ss.out.take()) {
				ss.shutdown()
				return
			}
		case <-ss.kicks.ready:
			if !ss.write(ss.takeKicks(buf), nil) {
				ss.shutdown()
				return
			}
		case <-tick.C:
			now := time.Since(epoch)
			if !ss.ready.Load() || now-time.Duration(ss.heard.Load()) < opts.Keepalive || now-pinged < opts.Keepalive {
				continue
			}
			pinged = now
			nonce++
			buf, _ = (&proto.Msg{Type: proto.Ping, Nonce: nonce}).Append(buf)
			if !ss.write(buf, nil) {
				ss.shutdown()
				return
			}
		}
		if ss.out.len() <= outQueue/4 {
			select {
			case ss.room <- struct{}{}:
			default:
			}
		}
	}
}

// writeBatch writes a batch taken from the queue, gathering its messages
// into writes of up to batchBytes. A message with a file goes alone, so
// that its descriptor rides with its own first byte. It reports false
// when the session must end: a write failed, or it wrote a last message
// (what follows it is dropped).
func (ss *session) writeBatch(buf []byte, batch []outMsg) bool {
	ok := true
	for i, o := range batch {
		if !ok {
			if o.file != nil {
				o.file.Close()
			}
			continue
		}
		frame, err := o.m.Append(buf)
		if err != nil {
			ss.log.Error("cannot encode a control message; dropped", "type", o.m.Type, "error", err)
			if o.file != nil {
				o.file.Close()
			}
			continue
		}
		if o.file != nil {
			// Whatever was gathered goes first, then this frame alone.
			if ok = ss.write(buf, nil); ok {
				ok = ss.write(frame[len(buf):], o.file)
			}
			o.file.Close()
			buf = buf[:0]
			continue
		}
		buf = frame
		if o.last || len(buf) >= batchBytes || i == len(batch)-1 {
			ok = ss.write(buf, nil) && !o.last
			buf = buf[:0]
		}
	}
	clear(batch) // no message (and no file) outlives its write
	return ok
}

// write writes b (with f's descriptor on its first byte, if f is not nil)
// within Silence; it reports false if the write failed, which ends the
// session.
func (ss *session) write(b []byte, f *os.File) bool {
	if len(b) == 0 {
		return true
	}
	_ = ss.c.SetWriteDeadline(time.Now().Add(ss.srv.opts.Silence))
	var err error
	if f != nil {
		err = ss.writeFile(b, f)
	} else {
		_, err = ss.c.Write(b)
	}
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			if ok, more := ss.srv.quiet(ss.g, "not-reading"); ok {
				ss.log.Warn("guest did not take a control message in time; closing its session", "bound", ss.srv.opts.Silence, "unlogged_before", more)
			}
			ss.srv.m.ClosedSession.WithLabelValues("not-reading").Inc()
		}
		return false
	}
	return true
}

// waitRoom holds the reader while the queue is over half full, until the
// writer drained it to a quarter; the writer's deadline bounds the wait (a
// guest that does not read is closed, which ends it). It reports whether
// the session is still open.
func (ss *session) waitRoom() bool {
	for ss.out.len() > outQueue/2 {
		select {
		case <-ss.room:
		case <-ss.done:
			return false
		}
	}
	return true
}

// readLoop serves the session: the handshake, then each message in turn.
// When it returns, the session is closed and, unless the server is
// closing, detached from the broker.
func (ss *session) readLoop() {
	defer ss.srv.wg.Done()
	defer ss.end()
	ss.srv.m.Sessions.WithLabelValues(ss.g.Name).Inc()
	hello, err := ss.handshake()
	if err != nil {
		ss.fail(err)
		return
	}
	ss.attach(hello)
	for {
		if !ss.waitRoom() {
			return
		}
		_ = ss.c.SetReadDeadline(time.Now().Add(ss.srv.opts.Silence))
		m, err := ss.read()
		if err == nil {
			err = ss.dispatch(m)
		}
		if err != nil {
			ss.fail(err)
			return
		}
	}
}

// read reads one message (within the deadline the caller set).
func (ss *session) read() (proto.Msg, error) {
	if ss.br == nil {
		ss.br = bufio.NewReaderSize(ss.c, 4096)
	}
	m, buf, err := proto.Read(ss.br, ss.buf)
	ss.buf = buf
	if err == nil {
		ss.heard.Store(int64(time.Since(epoch)))
	}
	return m, err
}

// handshake reads until HELLO, which must come within Silence of the
// connect. A VM's port stays open across a hostd restart, so its guest may
// still be talking to the hostd before: a guest message other than HELLO
// tells us so (a keepalive PING, or an OPEN). ERROR(no-hostd) asks it to
// say HELLO again, the channel stays, and what it asked is dropped. Any
// other message is malformed.
func (ss *session) handshake() (proto.Msg, error) {
	_ = ss.c.SetReadDeadline(time.Now().Add(ss.srv.opts.Silence))
	for {
		m, err := ss.read()
		switch {
		case err != nil:
			return m, err
		case m.Type == proto.Hello:
			return m, nil
		case !fromGuest[m.Type]:
			return m, fmt.Errorf("first message is %s, want HELLO: %w", m.Type, proto.ErrMalformed)
		}
		ss.log.Debug("guest talks before HELLO (hostd restarted?); asking for HELLO", "type", m.Type)
		ss.learn(m) // answer in its version
		ss.Send(proto.Msg{Type: proto.Error, Reason: proto.ReasonNoHostd, Text: "say HELLO: hostd restarted"})
	}
}

// attach registers the session with the broker and answers its HELLO.
func (ss *session) attach(hello proto.Msg) {
	formats := ss.learn(hello)
	ss.srv.b.Attach(ss)
	// Region 0: the group region for a guest that maps it (VMs); none for
	// a process guest, which gets a region per peer as a descriptor.
	ss.welcome = proto.Msg{Type: proto.Welcome, GuestID: ss.g.ID, Formats: formats}
	if path, r := ss.srv.b.RegionZero(ss.g); r != nil {
		ss.welcome.Gen, ss.welcome.RegionSize, ss.welcome.Region = r.Generation(), uint64(r.Layout().Size), path
	}
	ss.Send(ss.welcome)
	ss.ready.Store(true)
	ss.log.Debug("guest connected", "pid", hello.PID, "version", ss.version.Load(), "switching", ss.Switching(), "resume", ss.Resumes())
}

// dispatch handles one message after the handshake; an error ends the
// session.
func (ss *session) dispatch(m proto.Msg) error {
	b := ss.srv.b
	switch m.Type {
	case proto.Hello:
		ss.helloAgain(m)
		return nil
	case proto.Ping:
		ss.Send(proto.Msg{Type: proto.Pong, Nonce: m.Nonce})
		return nil
	case proto.Pong:
		return nil
	case proto.Listen, proto.Unlisten:
		b.Listen(ss, m.Local, m.Type == proto.Listen)
	case proto.Intent:
		// Only version-2 libraries send it; it grants and keeps nothing
		// (their OPENs get TCP(version)), and is accepted so that they
		// keep working.
	case proto.Open:
		b.Open(ss, m)
	case proto.Close:
		b.CloseConn(ss, m)
	case proto.Left:
		b.Left(ss, m)
	case proto.Ended:
		b.StretchEnded(ss, m)
	case proto.Reattach:
		b.Reattach(ss, m)
	case proto.Kick:
		b.Kick(ss, m)
	default:
		return fmt.Errorf("%s is not a guest message: %w", m.Type, proto.ErrMalformed)
	}
	// Anything but HELLO and the keepalive PING/PONG: every retried HELLO
	// of one guest comes before this, since it acts only once WELCOME
	// arrived.
	ss.spoke = true
	return nil
}

// helloAgain answers a HELLO after the handshake. A VM repeats HELLO until
// answered (its port drops data until both ends are open), so a late one
// may arrive; it comes before anything else the guest says. A HELLO after
// the guest acted is a new guest on the same channel: the VM rebooted in
// place (QEMU, and so the channel, stayed) or its program restarted. The
// old one's flows and listeners are gone with it.
func (ss *session) helloAgain(m proto.Msg) {
	if ss.spoke {
		ss.log.Info("guest started again on its channel (VM reboot?); its flows are revoked", "pid", m.PID)
		ss.srv.b.Detach(ss)
		ss.welcome.Formats = ss.learn(m)
		ss.srv.b.Attach(ss)
		ss.spoke = false
	}
	ss.Send(ss.welcome)
}

// fromGuest is what a guest may send.
var fromGuest = map[proto.Type]bool{
	proto.Hello: true, proto.Listen: true, proto.Unlisten: true, proto.Intent: true, proto.Open: true,
	proto.Close: true, proto.Reattach: true, proto.Ping: true, proto.Pong: true, proto.Kick: true,
	proto.Left: true, proto.Ended: true,
}

// fail ends the session for err. A guest that went away (EOF, reset) is
// only logged; one that stayed silent past Silence (no HELLO, no frame, no
// answer to the keepalive) is logged and counted, and closed without a
// word (on a VM's port the next user would read it); anything else is
// malformed input: logged, counted, and answered with ERROR(malformed)
// after the replies already queued, which fail waits for (each write is
// bounded by Silence).
func (ss *session) fail(err error) {
	switch {
	case errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.ECONNRESET):
		ss.log.Debug("guest disconnected", "error", err)
		return
	case errors.Is(err, os.ErrDeadlineExceeded):
		ss.srv.m.ClosedSession.WithLabelValues("silent").Inc()
		if !ss.ready.Load() {
			ss.log.Debug("closing a control session that said no HELLO in time (an unused VM port reconnects)", "silence", ss.srv.opts.Silence)
		} else if ok, more := ss.srv.quiet(ss.g, "silent"); ok {
			ss.log.Info("closing a silent control session: no answer to the keepalive", "silence", ss.srv.opts.Silence, "unlogged_before", more)
		}
		return
	}
	if ok, more := ss.srv.quiet(ss.g, "malformed"); ok {
		ss.log.Warn("closing control channel: malformed message (more of this guest's are logged at most once a minute; all are counted in shunt_control_malformed_total)", "error", err, "unlogged_before", more)
	}
	ss.srv.m.Malformed.Inc()
	ss.queue(outMsg{m: proto.Msg{Type: proto.Error, Reason: proto.ReasonMalformed, Text: err.Error()}, last: true})
	<-ss.quit
}

// end closes the session and, unless the server is closing, detaches it
// from the broker.
func (ss *session) end() {
	ss.shutdown()
	ss.srv.mu.Lock()
	delete(ss.srv.sessions, ss)
	if ss.srv.perGuest[ss.g]--; ss.srv.perGuest[ss.g] <= 0 {
		delete(ss.srv.perGuest, ss.g)
	}
	closing := ss.srv.closed
	ss.srv.mu.Unlock()
	if !closing {
		ss.srv.b.Detach(ss)
	}
	ss.srv.m.Sessions.WithLabelValues(ss.g.Name).Dec()
}
