package server

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
)

// outQueue is how many messages a session may have waiting for its guest
// to read them; a guest that lets more pile up is disconnected.
const outQueue = 256

// lastWords bounds how long the ERROR that ends a session may take to
// reach a guest that does not read.
const lastWords = 5 * time.Second

// session is one guest connection. It implements broker.Session: Send is
// safe for concurrent use and never blocks. Two goroutines serve it:
// readLoop reads and handles the guest's messages, and owns the fields
// marked so; writeLoop is the only writer to the connection.
type session struct {
	srv  *Server
	c    net.Conn
	g    *broker.Guest
	log  hclog.Logger
	out  chan outMsg   // to writeLoop, in order
	once sync.Once     // for shutdown
	done chan struct{} // closed by shutdown
	quit chan struct{} // closed when writeLoop returns

	// readLoop only.
	buf     []byte
	welcome proto.Msg // the answer to every HELLO
	spoke   bool      // the guest acted since its last HELLO
}

// outMsg is a message for the guest; after a last one, the writer closes
// the session.
type outMsg struct {
	m    proto.Msg
	last bool
}

func newSession(s *Server, c net.Conn, g *broker.Guest) *session {
	return &session{srv: s, c: c, g: g, log: s.log.With("guest", g.Name),
		out: make(chan outMsg, outQueue), done: make(chan struct{}), quit: make(chan struct{})}
}

func (ss *session) Guest() *broker.Guest { return ss.g }

// Send queues m; a guest that lets outQueue messages pile up is
// disconnected.
func (ss *session) Send(m proto.Msg) { ss.queue(outMsg{m: m}) }

func (ss *session) queue(o outMsg) {
	select {
	case ss.out <- o:
	case <-ss.done:
	default:
		ss.log.Warn("guest is not reading its control channel; closing it")
		ss.shutdown()
	}
}

// shutdown closes the session at once, dropping what is queued. It is
// idempotent and safe for concurrent use.
func (ss *session) shutdown() {
	ss.once.Do(func() {
		close(ss.done)
		ss.c.Close()
	})
}

// writeLoop writes queued messages in order until the session is shut
// down, a write fails, or it wrote a last message.
func (ss *session) writeLoop() {
	defer ss.srv.wg.Done()
	defer close(ss.quit)
	buf := make([]byte, 0, 512)
	for {
		select {
		case <-ss.done:
			return
		case o := <-ss.out:
			var err error
			if buf, err = o.m.Append(buf[:0]); err == nil {
				_, err = ss.c.Write(buf)
			}
			if err != nil || o.last {
				ss.shutdown()
				return
			}
		}
	}
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

func (ss *session) read() (proto.Msg, error) {
	m, buf, err := proto.Read(ss.c, ss.buf)
	ss.buf = buf
	return m, err
}

// handshake reads until HELLO. A VM's port stays open across a hostd
// restart, so its guest may still be talking to the hostd before: a guest
// message other than HELLO tells us so (a keepalive PING, or an OPEN).
// ERROR(no-hostd) asks it to say HELLO again, the channel stays, and what
// it asked is dropped. Any other message is malformed.
func (ss *session) handshake() (proto.Msg, error) {
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
		ss.Send(proto.Msg{Type: proto.Error, Reason: proto.ReasonNoHostd, Text: "say HELLO: hostd restarted"})
	}
}

// attach registers the session with the broker and answers its HELLO.
func (ss *session) attach(hello proto.Msg) {
	ss.srv.b.Attach(ss)
	g := ss.g.Group
	st := g.Pool.Region()
	ss.welcome = proto.Msg{Type: proto.Welcome, GuestID: ss.g.ID, Gen: st.Generation(), RegionSize: uint64(st.Layout().Size), Region: g.Region}
	ss.Send(ss.welcome)
	ss.log.Debug("guest connected", "pid", hello.PID)
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
		b.Intent(ss, ctrack.Tuple{Src: m.Local, Dst: m.Remote})
	case proto.Open:
		b.Open(ss, m)
	case proto.Close:
		b.CloseFlow(ss, m)
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
		ss.srv.b.Attach(ss)
		ss.spoke = false
	}
	ss.Send(ss.welcome)
}

// fromGuest is what a guest may send.
var fromGuest = map[proto.Type]bool{
	proto.Hello: true, proto.Listen: true, proto.Unlisten: true, proto.Intent: true, proto.Open: true,
	proto.Close: true, proto.Reattach: true, proto.Ping: true, proto.Pong: true, proto.Kick: true,
}

// fail ends the session for err. A guest that went away (EOF, reset) is
// only logged; anything else is malformed input: logged, counted, and
// answered with ERROR(malformed) after the replies already queued, which
// fail waits for (within lastWords).
func (ss *session) fail(err error) {
	if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.ECONNRESET) {
		ss.log.Debug("guest disconnected", "error", err)
		return
	}
	ss.log.Warn("closing control channel: malformed message", "error", err)
	ss.srv.m.Malformed.Inc()
	_ = ss.c.SetWriteDeadline(time.Now().Add(lastWords))
	ss.queue(outMsg{m: proto.Msg{Type: proto.Error, Reason: proto.ReasonMalformed, Text: err.Error()}, last: true})
	<-ss.quit
}

// end closes the session and, unless the server is closing, detaches it
// from the broker.
func (ss *session) end() {
	ss.shutdown()
	ss.srv.mu.Lock()
	delete(ss.srv.sessions, ss)
	closing := ss.srv.closed
	ss.srv.mu.Unlock()
	if !closing {
		ss.srv.b.Detach(ss)
	}
	ss.srv.m.Sessions.WithLabelValues(ss.g.Name).Dec()
}
