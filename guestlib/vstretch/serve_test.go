//go:build linux

package vstretch_test

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/guestlib/vstretch"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// host stands for hostd's room: it takes each stream the daemon dials,
// reads its Hello and bridges it to a ring pair of its own (procW is the
// ring the process guest writes, procR the one it reads).
type host struct {
	hello        chan relay.Hello
	procW, procR *ring.Ring
	bridge       chan *relay.Bridge
}

func newHost(t *testing.T, capacity int) (*host, func() (net.Conn, error)) {
	h := &host{hello: make(chan relay.Hello, 1), procW: shmtest.Ring(t, capacity), procR: shmtest.Ring(t, capacity), bridge: make(chan *relay.Bridge, 1)}
	dial := func() (net.Conn, error) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer ln.Close()
		vm, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			return nil, err
		}
		hc, err := ln.Accept()
		if err != nil {
			vm.Close()
			return nil, err
		}
		go func() {
			hello, err := relay.ReadHello(hc)
			if err != nil {
				hc.Close()
				return
			}
			h.hello <- hello
			l := relay.NewLink([]net.Conn{hc}, relay.LinkOptions{})
			f, err := l.Open(relay.VsockFlowID)
			if err != nil {
				l.Close()
				return
			}
			// As hostd's room: ATTACHED once procR's reader attached.
			h.bridge <- relay.NewBridge(h.procW, h.procR, f, relay.BridgeOptions{Attached: f.Attached})
		}()
		return vm, nil
	}
	return h, dial
}

// client is the C library's side of the protocol (guestlib/c/stretch.c),
// in Go.
type client struct {
	c    *net.UnixConn
	W, R *ring.Ring
	mem  []byte
}

func ask(t *testing.T, c *net.UnixConn, r vstretch.Req) (vstretch.Reply, int) {
	t.Helper()
	if _, err := c.Write(r.Encode()); err != nil {
		t.Fatal(err)
	}
	b, oob := make([]byte, vstretch.ReplySize+1), make([]byte, 64)
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	n, oobn, _, _, err := c.ReadMsgUnix(b, oob)
	if err != nil {
		t.Fatal(err)
	}
	fd := -1
	if msgs, _ := unix.ParseSocketControlMessage(oob[:oobn]); len(msgs) == 1 {
		if fds, _ := unix.ParseUnixRights(&msgs[0]); len(fds) == 1 {
			fd = fds[0]
		}
	}
	rep, err := vstretch.DecodeReply(b[:n])
	if err != nil {
		t.Fatal(err)
	}
	return rep, fd
}

func openClient(t *testing.T, sock string, capacity int) *client {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	rep, fd := ask(t, c, vstretch.Req{Op: vstretch.OpOpen, Region: 9, Slot: 3, Gen: 77, Capacity: uint32(capacity)})
	if rep.Status != 0 || fd < 0 {
		t.Fatalf("open: %+v fd %d", rep, fd)
	}
	span := vstretch.RingSpan(capacity)
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || rep.Span != uint64(span) || rep.Size != uint64(2*span) || st.Size != int64(2*span) {
		t.Fatalf("open: %+v, memfd of %d bytes, want span %d", rep, st.Size, span)
	}
	mem, err := unix.Mmap(fd, 0, 2*span, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	unix.Close(fd)
	if err != nil {
		t.Fatal(err)
	}
	// Not unmapped at the end: a reader of the test's (ReadSum) may still
	// look at the rings until its deadline.
	cl := &client{c: c, mem: mem}
	if cl.W, err = ring.Attach(mem[:span], capacity); err == nil {
		cl.R, err = ring.Attach(mem[span:], capacity)
	}
	if err != nil {
		t.Fatal(err)
	}
	return cl
}

func serve(t *testing.T, dial func() (net.Conn, error)) string {
	sock := filepath.Join(t.TempDir(), "d.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- vstretch.Serve(l, vstretch.ServeOptions{Dial: dial}) }() // no t.Logf: its connections may log after the test
	t.Cleanup(func() {
		l.Close()
		if err := <-done; !errors.Is(err, net.ErrClosed) {
			t.Errorf("Serve: %v", err)
		}
	})
	return sock
}

func seeded(seed uint64, n int64) io.Reader {
	var b [32]byte
	for i := range b {
		b[i] = byte(seed >> (8 * (i % 8)))
	}
	return io.LimitReader(rand.NewChaCha8(b), n)
}

func sum(r io.Reader) []byte {
	h := sha256.New()
	io.Copy(h, r)
	return h.Sum(nil)
}

// TestServe: a process asks the daemon for a stretch, maps the memfd it
// gets and streams 4 MiB each way at once on its rings against the
// host's ring pair: the Hello names the flow asked for, both streams
// arrive whole at their exact starts, DRAIN says the last bytes crossed,
// and BYE ends both bridges cleanly.
func TestServe(t *testing.T) {
	const capacity, n = 64 << 10, 4 << 20
	h, dial := newHost(t, capacity)
	cl := openClient(t, serve(t, dial), capacity)
	deadline := time.Now().Add(60 * time.Second)
	// The stream opens once the library's reader attached R (serveConn).
	select {
	case hello := <-h.hello:
		t.Fatalf("the stream opened (%+v) before the library's reader attached its ring", hello)
	case <-time.After(50 * time.Millisecond): // a way to see it too early, not a wait for an event
	}
	vmGot := shmtest.ReadSum(cl.R, nil, deadline)
	if hello := <-h.hello; hello != (relay.Hello{Region: 9, Slot: 3, Gen: 77, Flags: relay.HelloHold}) {
		t.Fatalf("hello %+v", hello)
	}
	hb := <-h.bridge
	procGot := shmtest.ReadSum(h.procR, nil, deadline)
	werr := make(chan error, 2)
	go func() { _, err := shmtest.WriteStream(cl.W, nil, 1000, seeded(1, n), deadline); werr <- err }()
	go func() { _, err := shmtest.WriteStream(h.procW, nil, 2000, seeded(2, n), deadline); werr <- err }()
	for range 2 {
		if err := <-werr; err != nil {
			t.Fatalf("writer: %v (host bridge %v %+v)", err, hb.Err(), hb.Stats())
		}
	}
	for _, w := range []struct {
		c     <-chan shmtest.Sum
		start uint64
		seed  uint64
	}{{procGot, 1000, 1}, {vmGot, 2000, 2}} {
		r := <-w.c
		if r.Err != nil || r.Start != w.start || r.N != n || !bytes.Equal(r.Sum, sum(seeded(w.seed, n))) {
			t.Fatalf("read: start %d (want %d), %d bytes, err %v", r.Start, w.start, r.N, r.Err)
		}
	}
	if rep, _ := ask(t, cl.c, vstretch.Req{Op: vstretch.OpDrain}); rep.Status != 0 || rep.Flag != 1 {
		t.Fatalf("drain: %+v", rep)
	}
	cl.c.Write(vstretch.Req{Op: vstretch.OpBye}.Encode())
	cl.c.Close()
	select {
	case <-hb.Done():
	case <-time.After(time.Until(deadline)):
		t.Fatalf("the host's bridge did not end: %+v", hb.Stats())
	}
	if !errors.Is(hb.Err(), relay.ErrEnded) {
		t.Fatalf("host bridge: %v, want a clean end", hb.Err())
	}
}

// TestServeBreak: a process that goes without BYE (killed) breaks its
// stretch: the host's bridge ends with an error, not ErrEnded, even
// though the process's bytes so far crossed.
func TestServeBreak(t *testing.T) {
	const capacity = 64 << 10
	h, dial := newHost(t, capacity)
	cl := openClient(t, serve(t, dial), capacity)
	deadline := time.Now().Add(30 * time.Second)
	_ = shmtest.ReadSum(cl.R, nil, deadline) // attaches R: the stream opens
	<-h.hello
	hb := <-h.bridge
	_ = shmtest.ReadSum(h.procR, nil, deadline) // the host's reader takes what crosses
	w, err := ring.NewWriter(cl.W, &wait.Policy{})
	if err != nil {
		t.Fatal(err)
	}
	w.Start(0)
	if _, err := w.Write(bytes.Repeat([]byte{7}, 10000)); err != nil {
		t.Fatal(err)
	}
	cl.c.Close() // no BYE
	select {
	case <-hb.Done():
	case <-time.After(time.Until(deadline)):
		t.Fatalf("the host's bridge did not end: %+v", hb.Stats())
	}
	if hb.Err() == nil || errors.Is(hb.Err(), relay.ErrEnded) {
		t.Fatalf("host bridge: %v, want a break", hb.Err())
	}
}

// TestServeRefuses: a first request that is not an open, or a capacity
// that is not a power of two in bounds, gets a failed reply and no fd.
func TestServeRefuses(t *testing.T) {
	_, dial := newHost(t, 4096)
	sock := serve(t, dial)
	for _, r := range []vstretch.Req{{Op: vstretch.OpDrain}, {Op: vstretch.OpOpen, Capacity: 5000}, {Op: vstretch.OpOpen, Capacity: 1 << 30}} {
		t.Run(fmt.Sprintf("op%d-cap%d", r.Op, r.Capacity), func(t *testing.T) {
			c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			rep, fd := ask(t, c, r)
			if rep.Status == 0 || fd >= 0 || rep.Text == "" {
				t.Fatalf("reply %+v fd %d: want a refusal with a reason", rep, fd)
			}
		})
	}
}
