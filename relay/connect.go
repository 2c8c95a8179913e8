package relay

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"time"
)

// A link's connections are plain TCP: the bytes they carry are the
// guests' own TCP payload, which crosses the fabric in the clear without
// Shunt too. Who may connect is decided by a token: the two hostds agree
// on a fresh one over their mutual-TLS channel (hostd/peers) for each
// link, and each connection presents it first, with its index among the
// link's connections. A connection with a token nobody expects, or that
// says nothing within the handshake time, is closed. Anyone who reaches
// the port may connect, so the handshakes are bounded: maxHandshaking in
// all, and at most a link's worth (maxLinkConns) from one address, so that
// one host holding its slots silently cannot keep a peer's link out.
const (
	TokenSize      = 32
	helloSize      = TokenSize + 2 // token, index, count
	linkHandshake  = 5 * time.Second
	maxHandshaking = 64
	maxLinkConns   = 16
)

// LinkListener accepts the connections of links that peers dial.
type LinkListener struct {
	ln   net.Listener
	busy chan struct{}

	mu    sync.Mutex
	want  map[string]*pendingLink
	hands map[netip.Addr]int // connections in their handshake, by source
}

type pendingLink struct {
	conns []net.Conn
	got   int
	done  chan struct{}
}

// ListenLinks serves ln until Close.
func ListenLinks(ln net.Listener) *LinkListener {
	l := &LinkListener{ln: ln, busy: make(chan struct{}, maxHandshaking), want: map[string]*pendingLink{}, hands: map[netip.Addr]int{}}
	go l.accept()
	return l
}

// Port is the listener's TCP port (the peer learns it over the channel).
func (l *LinkListener) Port() uint16 {
	if a, ok := l.ln.Addr().(*net.TCPAddr); ok {
		return uint16(a.Port)
	}
	return 0
}

// Close stops accepting and fails every Expect.
func (l *LinkListener) Close() { l.ln.Close() }

func (l *LinkListener) accept() {
	for {
		c, err := l.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(50 * time.Millisecond) // EMFILE and friends: retry
			continue
		}
		src := sourceOf(c)
		l.mu.Lock()
		ok := l.hands[src] < maxLinkConns
		if ok {
			select {
			case l.busy <- struct{}{}:
				l.hands[src]++
			default:
				ok = false
			}
		}
		l.mu.Unlock()
		if !ok {
			c.Close()
			continue
		}
		go func() {
			defer func() {
				l.mu.Lock()
				if l.hands[src]--; l.hands[src] == 0 {
					delete(l.hands, src)
				}
				l.mu.Unlock()
				<-l.busy
			}()
			l.hello(c)
		}()
	}
}

// sourceOf is a connection's remote address (the zero Addr if not IP).
func sourceOf(c net.Conn) netip.Addr {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// hello reads a connection's token and index and files it.
func (l *LinkListener) hello(c net.Conn) {
	var h [helloSize]byte
	_ = c.SetReadDeadline(time.Now().Add(linkHandshake))
	if _, err := io.ReadFull(c, h[:]); err != nil {
		c.Close()
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	idx, n := int(h[TokenSize]), int(h[TokenSize+1])
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.want[string(h[:TokenSize])]
	if p == nil || n != len(p.conns) || idx >= n || p.conns[idx] != nil {
		c.Close()
		return
	}
	p.conns[idx] = c
	if p.got++; p.got == n {
		close(p.done)
	}
}

// Expect waits up to wait for the n connections that present token and
// returns them in index order.
func (l *LinkListener) Expect(token []byte, n int, wait time.Duration) ([]net.Conn, error) {
	w, err := l.Want(token, n)
	if err != nil {
		return nil, err
	}
	return w.Wait(wait, nil)
}

// Wanted is a link's connections a LinkListener expects (Want).
type Wanted struct {
	l     *LinkListener
	token string
	p     *pendingLink
}

// Want registers token for a link of n connections at once, so that a
// peer told the listener's port right after may connect at once (a
// connection with a token nobody expects yet is closed); Wait takes them.
func (l *LinkListener) Want(token []byte, n int) (*Wanted, error) {
	if len(token) != TokenSize || n < 1 || n > maxLinkConns {
		return nil, fmt.Errorf("relay link: bad token or count %d", n)
	}
	p := &pendingLink{conns: make([]net.Conn, n), done: make(chan struct{})}
	l.mu.Lock()
	l.want[string(token)] = p
	l.mu.Unlock()
	return &Wanted{l: l, token: string(token), p: p}, nil
}

// Wait waits up to wait for the connections, or until cancel is closed
// (a newer offer from the same peer replaces this one: a peer's offers
// must not pile up waits), and returns them in index order.
func (w *Wanted) Wait(wait time.Duration, cancel <-chan struct{}) ([]net.Conn, error) {
	l, p, n := w.l, w.p, len(w.p.conns)
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
	case <-cancel:
	}
	l.mu.Lock()
	if l.want[w.token] == p {
		delete(l.want, w.token)
	}
	ok := p.got == n
	l.mu.Unlock()
	if !ok {
		for _, c := range p.conns {
			if c != nil {
				c.Close()
			}
		}
		return nil, fmt.Errorf("relay link: %d of %d connections came within %s", p.got, n, wait)
	}
	return p.conns, nil
}

// DialLink makes a link's n connections with dial, each presenting token
// and its index.
func DialLink(dial func() (net.Conn, error), token []byte, n int) ([]net.Conn, error) {
	if len(token) != TokenSize || n < 1 || n > maxLinkConns {
		return nil, fmt.Errorf("relay link: bad token or count %d", n)
	}
	var conns []net.Conn
	fail := func(err error) ([]net.Conn, error) {
		for _, c := range conns {
			c.Close()
		}
		return nil, err
	}
	for i := range n {
		c, err := dial()
		if err != nil {
			return fail(err)
		}
		conns = append(conns, c)
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetNoDelay(true)
		}
		h := append(bytes.Clone(token), byte(i), byte(n))
		_ = c.SetWriteDeadline(time.Now().Add(linkHandshake))
		if _, err := c.Write(h); err != nil {
			return fail(err)
		}
		_ = c.SetWriteDeadline(time.Time{})
	}
	return conns, nil
}

// WaitOpen waits up to d for the peer to open the flow too (its first
// CREDIT came). It reports false if it did not, or the flow or link
// ended first: a bridge attaches a guest's ring only once both relays
// have the flow, so that no guest byte goes into a ring nobody carries.
func (f *Flow) WaitOpen(d time.Duration) bool {
	t := time.AfterFunc(d, func() {
		f.mu.Lock()
		f.cond.Broadcast()
		f.mu.Unlock()
	})
	defer t.Stop()
	end := time.Now().Add(d)
	f.mu.Lock()
	defer f.mu.Unlock()
	for !f.peerOpen && f.err == nil && !f.closed && !f.down && !f.left && time.Now().Before(end) {
		f.cond.Wait()
	}
	return f.peerOpen && f.err == nil && !f.closed
}
