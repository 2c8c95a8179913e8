package preload

import (
	"bytes"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// TestResume: RESUME (relayed flows) in the C library. The edge server,
// under the library, streams seeded bytes ("stream": a writer thread with
// every write call). The test is its fake hostd (scripted: READY, then
// RESUME), its TCP peer, and the relay: the other side of its ring pair.
// The relay attaches the ring the server writes once some bytes went on
// TCP, lets it fill, frees some (the other host acknowledged them), looks
// at more (delivered, not acknowledged), marks the server's read ring
// left, and sends RESUME(offset). The TCP peer must then receive exactly
// the stream minus the bytes the other host's ring got: [0, start),
// then [offset, end) (resent from the ring, then new): with the relay's
// [start, offset) the whole stream, no loss, no duplicate. A reset case
// gives the server ECONNRESET and the peer a RST. Each case runs its own
// server process.
func TestResume(t *testing.T) {
	lib, edge := buildPreload(t)
	const capacity = 64 << 10 // guesttest's rings
	at := func(d uint64) func(s, f, c uint64) uint64 { return func(s, f, c uint64) uint64 { return s + d } }
	fixed := func(o uint64) func(s, f, c uint64) uint64 { return func(s, f, c uint64) uint64 { return o } }
	for i, tc := range []struct {
		name   string
		attach bool
		free   uint64
		off    func(start, free, capacity uint64) uint64
		reset  bool
		// down: hostd sends DOWN, not RESUME, for the relayed pair:
		// nobody knows where the other host's ring ended, so reset.
		down bool
	}{
		{"mid-stretch", true, 16 << 10, at(24 << 10), false, false},
		{"at the freed bytes", true, 16 << 10, at(16 << 10), false, false},
		{"across the wrap", true, 60000, at(62000), false, false},
		{"all", true, 0, fixed(proto.ResumeAll), false, false},
		{"never started", false, 0, fixed(12345), false, false},
		{"reset", true, 16 << 10, fixed(proto.ResumeReset), true, false},
		{"below the freed bytes", true, 16 << 10, at(16<<10 - 1), true, false},
		{"past the end", true, 16 << 10, func(s, f, c uint64) uint64 { return s + f + c + 1 }, true, false},
		{"DOWN, not RESUME", true, 16 << 10, fixed(0), true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := startResume(t, lib, edge, uint64(100+i), tc.down, true)
			r.run(t, tc.attach, tc.free, capacity, tc.off, tc.reset, tc.down)
		})
	}
}

// resumeRig is one case's edge server, its fake hostd and the relay's
// ring ends.
type resumeRig struct {
	out   *syncBuffer
	s     *guesttest.Session
	f     guesttest.Flow
	tcp   *net.TCPConn
	seed  uint64
	size  int
	ab    *ring.Ring // the server reads it; the relay writes it (pw)
	ba    *ring.Ring // the server writes it; the relay reads it (pr)
	pw    *ring.Writer
	pr    *ring.Reader
	state func() string
}

// startResume starts the edge server under the library and gives its
// connection a ring pair (READY, relayed: its other end is the relay;
// sent now if ready, else by the caller: r.s.Send(t, r.f.B)).
func startResume(t *testing.T, lib, edge string, seed uint64, relayed, ready bool) *resumeRig {
	h := guesttest.Start(t)
	port := freePort(t)
	r := &resumeRig{out: &syncBuffer{}, seed: seed, size: 32 << 20}
	srv := exec.Command(edge, "server", "127.0.0.1", port)
	srv.Env = append(os.Environ(), "LD_PRELOAD="+lib, "SHUNT_CONTROL="+h.Control, "SHUNT_TEST_LOOPBACK=1", "SHUNT_OPEN_DELAY_MS=0",
		"SHUNT_OPEN_DELAY_ADAPT=0", "SHUNT_VERBOSE=2", "SHUNT_STATS=1")
	srv.Stdout, srv.Stderr = r.out, r.out
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	r.state = func() string {
		var a, b ring.Stats
		if r.ab != nil {
			a, b = r.ab.Stats(), r.ba.Stats()
		}
		lines := strings.Split(r.out.String(), "\n")
		if len(lines) > 40 {
			lines = append([]string{"..."}, lines[len(lines)-40:]...)
		}
		return fmt.Sprintf("  server's write ring (BA, the relay reads): %+v\n  server's read ring (AB, the relay writes): %+v\n  server (last lines):\n%s",
			b, a, strings.Join(lines, "\n"))
	}
	r.s = h.Accept(t)
	if m := r.s.Expect(t, proto.Hello); m.Formats != 1<<ring.FormatVersion|proto.CapResume {
		t.Fatalf("HELLO formats %#x, want format 2 and CapResume (%#x)", m.Formats, 1<<ring.FormatVersion|proto.CapResume)
	}
	r.s.Welcome(t)
	r.s.Pongs = true
	r.s.Expect(t, proto.Listen)
	for deadline := time.Now().Add(guesttest.Wait); ; time.Sleep(10 * time.Millisecond) {
		c, err := net.Dial("tcp", "127.0.0.1:"+port)
		if err == nil {
			r.tcp = c.(*net.TCPConn)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the server does not listen: %v\n%s", err, r.state())
		}
	}
	t.Cleanup(func() { r.tcp.Close() })
	open, err := r.s.Read(guesttest.Wait)
	if err != nil || open.Type != proto.Open {
		t.Fatalf("want the server's OPEN: %+v, %v\n%s", open, err, r.state())
	}
	active := proto.Msg{Type: proto.Open, ReqID: 1 << 20, Role: proto.Active, Local: open.Remote, Remote: open.Local}
	r.f = h.Pair(t, active, open)
	r.f.B.Relayed = relayed
	if ready {
		r.s.Send(t, r.f.B)
	}
	if r.ab, r.ba, err = h.Pool.Region().Rings(int(r.f.A.Slot), r.f.A.Gen); err != nil {
		t.Fatal(err)
	}
	r.pw, _ = ring.NewWriter(r.ab, &wait.Policy{})
	r.pr, _ = ring.NewReader(r.ba, &wait.Policy{})
	return r
}

var resentRE = regexp.MustCompile(`stashed \d+; resent (\d+)`)

// freePort returns a loopback TCP port free a moment ago, for a server
// to listen on.
func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
}

// run plays one case (see TestResume).
func (r *resumeRig) run(t *testing.T, attach bool, free, capacity uint64, off func(start, free, capacity uint64) uint64, reset, down bool) {
	want := make([]byte, r.size)
	newGen(r.seed, 1).Fill(want) // the server's stream
	// The peer: its own stream to the server on TCP, and reads.
	if _, err := fmt.Fprintf(r.tcp, "stream %d %d\n", r.seed, r.size); err != nil {
		t.Fatal(err)
	}
	wdone := make(chan struct{})
	go func() {
		defer close(wdone)
		p := make([]byte, r.size)
		newGen(r.seed, 0).Fill(p)
		if _, err := r.tcp.Write(p); err == nil {
			r.tcp.CloseWrite()
		}
	}()
	// The peer reads the first bytes, then, if the relay is to attach,
	// waits until it did: the server's writer is still writing then
	// (blocked in the kernel), so its next write starts the ring.
	var mu sync.Mutex
	var got []byte
	var rerr error
	done, gate := make(chan struct{}), make(chan struct{})
	const first = 100 << 10
	_ = r.tcp.SetReadDeadline(time.Now().Add(60 * time.Second))
	go func() {
		defer close(done)
		buf := make([]byte, 256<<10)
		for have := 0; ; {
			size := len(buf)
			if have < first {
				size = min(size, first-have)
			} else if attach {
				<-gate
			}
			n, err := r.tcp.Read(buf[:size])
			have += n
			mu.Lock()
			got = append(got, buf[:n]...)
			if err != nil {
				rerr = err
			}
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	received := func() int { mu.Lock(); defer mu.Unlock(); return len(got) }
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(2 * guesttest.Wait); !cond(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("waited %v for %s; the peer received %d bytes\n%s", 2*guesttest.Wait, what, received(), r.state())
			}
		}
	}

	waitFor("the server to attach its read ring (READY)", r.pw.ReaderAttached)
	var start, end uint64
	var delivered []byte // what the relay got to the other host: from the ring's start
	if attach {
		waitFor("bytes on TCP first", func() bool { return received() >= first })
		r.pr.Attach()
		close(gate)
		waitFor("the server's writer to start its ring", func() bool { _, ok := r.pr.Started(); return ok })
		start, _ = r.pr.Started()
		waitFor("the TCP bytes before the ring's start", func() bool { return uint64(received()) >= start })
		waitFor("the ring to fill", func() bool { st := r.ba.Stats(); return st.Written-st.Read == capacity })
		if free > 0 {
			b := make([]byte, free)
			if n, err := r.pr.TryRead(b); uint64(n) != free || err != nil {
				t.Fatalf("relay read %d, %v\n%s", n, err, r.state())
			}
			delivered = b
			// The writer fills the room (across the data area's end).
			waitFor("the ring to fill again", func() bool { st := r.ba.Stats(); return st.Written-st.Read == capacity })
		}
	} else {
		waitFor("bytes on TCP", func() bool { return received() >= 100<<10 })
	}
	x := off(start, free, capacity)
	if attach && x != proto.ResumeAll && x != proto.ResumeReset && x > start+free && x-start-free <= 16<<10 {
		p, err := r.pr.TryPeek(int(x - start - free)) // delivered, not freed
		if err != nil || uint64(len(p)) != x-start-free {
			t.Fatalf("relay peek %d, %v\n%s", len(p), err, r.state())
		}
		delivered = append(delivered, p...)
	}
	if tcp := received(); uint64(tcp) != start && attach {
		// (more would be bytes the writer sent on TCP while on its ring)
		t.Fatalf("the peer has %d TCP bytes while the server's writer is on its ring from %d\n%s", tcp, start, r.state())
	}
	// The peer's own stream is all sent first: else its writer, not its
	// reader, may be the one told of the RST.
	waitFor("the peer's stream to go out", func() bool {
		select {
		case <-wdone:
			return true
		default:
			return false
		}
	})
	_ = r.pw.Leave() // the relay ends the server's read ring (never started)
	m := r.f.B
	if down {
		r.s.Send(t, proto.Msg{Type: proto.Down, ReqID: m.ReqID, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Reason: proto.ReasonPeerGone})
	} else {
		r.s.Send(t, proto.Msg{Type: proto.Resume, ReqID: m.ReqID, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Reason: proto.ReasonPeerUnreachable, Offset: x})
	}
	for {
		lm, err := r.s.Read(guesttest.Wait)
		if err != nil {
			t.Fatalf("no LEFT after RESUME(%d): %v\n%s", x, err, r.state())
		}
		if lm.Type == proto.Left {
			if lm.Slot != m.Slot || lm.Gen != m.Gen || lm.ReqID != m.ReqID {
				t.Fatalf("LEFT %+v, want %+v's", lm, m)
			}
			break
		}
	}
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("the peer's reads did not end\n%s", r.state())
	}
	end = start + r.ba.Stats().Written
	if reset {
		if !errors.Is(rerr, syscall.ECONNRESET) {
			t.Errorf("the peer's read after %d bytes: %v, want ECONNRESET (RST)\n%s", len(got), rerr, r.state())
		}
		waitFor("the server's verdict", func() bool { return strings.Contains(r.out.String(), "FAIL stream-server") })
		if !strings.Contains(r.out.String(), "reset") {
			t.Errorf("no log line of the reset\n%s", r.state())
		}
		return
	}
	if rerr != io.EOF {
		t.Fatalf("the peer's read: %v after %d bytes\n%s", rerr, len(got), r.state())
	}
	full := got
	if attach {
		if x == proto.ResumeAll {
			x = start
		}
		if uint64(len(delivered)) != x-start {
			t.Fatalf("test: %d bytes delivered for [%d, %d)", len(delivered), start, x)
		}
		full = append(append(append([]byte(nil), got[:start]...), delivered...), got[start:]...)
	}
	if !bytes.Equal(full, want) {
		i := 0
		for i < len(full) && i < len(want) && full[i] == want[i] {
			i++
		}
		t.Fatalf("the stream (TCP [0, %d), the relay's [%d, %d), TCP from %d; ring end %d): %d bytes (crc %08x), want %d (crc %08x); first difference at %d\n%s",
			start, start, x, x, end, len(full), crc32.ChecksumIEEE(full), len(want), crc32.ChecksumIEEE(want), i, r.state())
	}
	waitFor("the server's verdict", func() bool { return strings.Contains(r.out.String(), "stream-server") })
	if !strings.Contains(r.out.String(), "PASS stream-server") {
		t.Fatalf("the server's verdict\n%s", r.state())
	}
	resent := uint64(0)
	if attach {
		resent = end - x
		t.Logf("ring from %d, relay got [%d, %d), ring end %d, resent %d", start, start, x, end, resent)
	}
	// The library counts them too (SHUNT_STATS, at the close).
	var said []string
	waitFor("the server's stats line", func() bool {
		said = resentRE.FindStringSubmatch(r.out.String())
		return said != nil
	})
	if said[1] != strconv.FormatUint(resent, 10) {
		t.Fatalf("the library says it resent %s bytes, want %d\n%s", said[1], resent, r.state())
	}
}

// TestRelayedEOF: the kernel's FIN comes before the relayed ring's last
// bytes (they cross two relays; the FIN only the kernels). The C reader
// of a relayed ring pair (READY's Relayed) holds the EOF until its ring
// starts or is left, reads the ring's stretch, then reports the EOF:
// here the peer sends half its stream on TCP, its FIN, and only then
// (300 ms later) the relay starts the ring at the next offset with the
// other half. The edge server must have received the whole stream.
// Without the hold it reads the EOF at the half and fails. "blocked":
// READY comes while the reader sleeps in the kernel's recv (it marks
// its ring attached only when the FIN wakes it): seen across hosts, the
// recv's EOF went to the program at once.
func TestRelayedEOF(t *testing.T) {
	lib, edge := buildPreload(t)
	for i, blocked := range []bool{false, true} {
		t.Run(map[bool]string{false: "attached", true: "blocked"}[blocked], func(t *testing.T) {
			testRelayedEOF(t, lib, edge, uint64(7+i), blocked)
		})
	}
}

func testRelayedEOF(t *testing.T, lib, edge string, seed uint64, blocked bool) {
	const size = 1 << 20
	r := startResume(t, lib, edge, seed, true, !blocked)
	go io.Copy(io.Discard, r.tcp) // the server's own stream, on TCP (the relay never attaches its ring)
	name := fmt.Sprintf("stream %d %d\n", seed, size)
	stream := make([]byte, size)
	newGen(seed, 0).Fill(stream)
	half := size / 2
	if _, err := r.tcp.Write(append([]byte(name), stream[:half]...)); err != nil {
		t.Fatal(err)
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(2 * guesttest.Wait); !cond(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("waited %v for %s\n%s", 2*guesttest.Wait, what, r.state())
			}
		}
	}
	if blocked {
		time.Sleep(300 * time.Millisecond) // it read the half and sleeps in the kernel
		r.s.Send(t, r.f.B)
		time.Sleep(100 * time.Millisecond) // READY taken: its attach is due
	} else {
		waitFor("the server to attach its read ring", r.pw.ReaderAttached)
	}
	if err := r.tcp.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	waitFor("the server to attach its read ring", r.pw.ReaderAttached)
	time.Sleep(300 * time.Millisecond) // the FIN is there first
	r.pw.Start(uint64(len(name) + half))
	r.pw.SetDeadline(time.Now().Add(2 * guesttest.Wait))
	if n, err := r.pw.Write(stream[half:]); err != nil || n != size-half {
		t.Fatalf("relay wrote %d bytes of the ring's stretch: %v\n%s", n, err, r.state())
	}
	_ = r.pw.Leave()
	waitFor("the server's verdict", func() bool { return strings.Contains(r.out.String(), "stream-server") })
	if !strings.Contains(r.out.String(), "PASS stream-server") {
		t.Fatalf("the server did not get the whole stream\n%s", r.state())
	}
}
