package guestlib

import (
	"bytes"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
)

// RESUME (relayed flows): the test plays the relay. It is the other side
// of the Conn's ring pair (scripted's pr reads the ring the Conn writes,
// pw writes the one it reads), reads part of what the Conn wrote, frees
// only some of it (what the other host acknowledged), marks the Conn's
// read ring left (never started), and sends RESUME(offset). The peer's
// kernel socket must then receive exactly the stream minus the bytes the
// other host's ring got ([start, offset)): the TCP bytes before the ring,
// the ring bytes from offset on, resent, then the new bytes.

// resumeCase is one RESUME: tcp0 stream bytes go on TCP first, then ring1
// on the ring (unless the relay never attaches), the relay frees free of
// them, then ring2 more go on the ring (past the end of the data area
// when ring1+ring2 exceeds the capacity), then RESUME(off(start, W)),
// then tcp2 new bytes. With block, a Write of block more bytes waits on
// the full ring when RESUME comes.
type resumeCase struct {
	name                     string
	attach                   bool
	tcp0, ring1, free, ring2 int
	block, tcp2              int
	off                      func(start, end uint64) uint64
	reset                    bool
	// down: the flow is relayed (READY's Relayed) and hostd sends DOWN,
	// not RESUME, without a request id (as a restarted hostd answers the
	// REATTACH of a flow it did not adopt): nobody knows where the other
	// host's ring ended, so the connection must be reset.
	down bool
}

const resumeCap = 64 << 10 // guesttest's rings

func resumeCases() []resumeCase {
	at := func(d uint64) func(s, e uint64) uint64 { return func(s, e uint64) uint64 { return s + d } }
	fixed := func(o uint64) func(s, e uint64) uint64 { return func(s, e uint64) uint64 { return o } }
	return []resumeCase{
		{name: "mid-stretch", attach: true, tcp0: 1000, ring1: 30000, free: 8000, off: at(20000), tcp2: 5000},
		{name: "at the freed bytes", attach: true, tcp0: 1000, ring1: 30000, free: 8000, off: at(8000), tcp2: 5000},
		{name: "at the end", attach: true, tcp0: 1000, ring1: 30000, free: 8000, off: func(s, e uint64) uint64 { return e }, tcp2: 5000},
		{name: "across the wrap", attach: true, tcp0: 777, ring1: 60000, free: 50000, ring2: 30000, off: at(62000), tcp2: 5000},
		{name: "full ring, a Write waiting", attach: true, tcp0: 1000, ring1: resumeCap, free: 0, block: 20000, off: at(30000), tcp2: 5000},
		{name: "all, nothing written after", attach: true, tcp0: 1000, ring1: 30000, off: fixed(proto.ResumeAll)},
		{name: "all", attach: true, tcp0: 1000, ring1: 30000, off: fixed(proto.ResumeAll), tcp2: 5000},
		{name: "all from offset zero", attach: true, ring1: 20000, off: fixed(proto.ResumeAll), tcp2: 5000},
		{name: "never started", attach: false, tcp0: 1000, ring1: 30000, off: fixed(12345), tcp2: 5000},
		{name: "never started, all", attach: false, tcp0: 1000, ring1: 30000, off: fixed(proto.ResumeAll), tcp2: 5000},
		{name: "reset", attach: true, tcp0: 1000, ring1: 30000, free: 8000, off: fixed(proto.ResumeReset), reset: true},
		{name: "below the freed bytes", attach: true, tcp0: 1000, ring1: 30000, free: 8000, off: at(7999), reset: true},
		{name: "all after bytes were freed", attach: true, tcp0: 1000, ring1: 30000, free: 1, off: fixed(proto.ResumeAll), reset: true},
		{name: "before the start", attach: true, tcp0: 1000, ring1: 30000, off: func(s, e uint64) uint64 { return s - 1 }, reset: true},
		{name: "past the end", attach: true, tcp0: 1000, ring1: 30000, free: 8000, off: func(s, e uint64) uint64 { return e + 1 }, reset: true},
		{name: "DOWN on a relayed flow", attach: true, tcp0: 1000, ring1: 30000, free: 8000, off: fixed(0), down: true, reset: true},
	}
}

func TestResume(t *testing.T) {
	for i, tc := range resumeCases() {
		t.Run(tc.name, func(t *testing.T) { testResume(t, tc, uint64(i)) })
	}
}

func testResume(t *testing.T, tc resumeCase, seed uint64) {
	sc := newScripted(t)
	conn := sc.conn
	if tc.down {
		conn.cur.Load().relayed = true // as READY's Relayed bit sets it
	}
	total := tc.tcp0 + tc.ring1 + tc.ring2 + tc.block + tc.tcp2
	stream := make([]byte, total)
	_, _ = rand.NewChaCha8([32]byte{byte(seed), 23}).Read(stream)
	state := func() string {
		return fmt.Sprintf("  guest (side B): %+v\n  its write ring (BA, the relay reads): %+v\n  its read ring (AB, the relay writes): %+v",
			conn.Stats(), sc.ba.Stats(), sc.ab.Stats())
	}
	write := func(from, n int) {
		t.Helper()
		if n == 0 {
			return
		}
		_ = conn.SetWriteDeadline(time.Now().Add(guesttest.Wait))
		if k, err := conn.Write(stream[from : from+n]); err != nil || k != n {
			t.Fatalf("guest Write of %d bytes at %d = %d, %v\n%s", n, from, k, err, state())
		}
	}
	// The peer reads its kernel socket to the end meanwhile (the TCP
	// bytes may exceed the socket buffers).
	type got struct {
		b   []byte
		err error
	}
	_ = sc.peer.SetReadDeadline(time.Now().Add(3 * guesttest.Wait))
	peer := async(func() got { b, err := io.ReadAll(sc.peer); return got{b, err} })
	within := func(ch <-chan got, what string) got {
		t.Helper()
		select {
		case r := <-ch:
			return r
		case <-time.After(4 * guesttest.Wait):
			t.Fatalf("%s: no result within %v\n%s", what, 4*guesttest.Wait, state())
		}
		return got{}
	}

	write(0, tc.tcp0)
	if tc.attach {
		sc.pr.Attach()
	}
	write(tc.tcp0, tc.ring1)
	start, started := sc.pr.Started()
	if started != tc.attach || started && start != uint64(tc.tcp0) {
		t.Fatalf("ring start %d %v, want %d %v\n%s", start, started, tc.tcp0, tc.attach, state())
	}
	if tc.free > 0 { // delivered and acknowledged: the relay frees it, as relay.Bridge does
		b, err := sc.pr.TryPeekAt(0, tc.free)
		if len(b) != tc.free || err != nil || !bytes.Equal(b, stream[tc.tcp0:tc.tcp0+tc.free]) {
			t.Fatalf("relay read %d bytes (%v), want %d of the stream\n%s", len(b), err, tc.free, state())
		}
		if err := sc.pr.Free(uint64(tc.free)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := sc.pr.TryPeek(resumeCap); err != nil { // read, not freed
		t.Fatal(err)
	}
	write(tc.tcp0+tc.ring1, tc.ring2)
	end := uint64(tc.tcp0 + tc.ring1 + tc.ring2)
	if w := conn.Stats(); tc.attach && w.RingSent != uint64(tc.ring1+tc.ring2) {
		t.Fatalf("%d ring bytes written, want %d\n%s", w.RingSent, tc.ring1+tc.ring2, state())
	}
	off := tc.off(start, end)
	var blocked <-chan got
	if tc.block > 0 {
		blocked = async(func() got {
			_, err := conn.Write(stream[end : int(end)+tc.block])
			return got{nil, err}
		})
		time.Sleep(20 * time.Millisecond) // it waits on the full ring (or comes after RESUME: the same stream)
	}

	// The relay marks the guest's read ring left (never started), then
	// hostd sends RESUME; LEFT follows.
	_ = sc.pw.Leave()
	m := sc.f.B
	if tc.down {
		sc.s.Send(t, proto.Msg{Type: proto.Down, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Reason: proto.ReasonPeerGone})
	} else {
		sc.s.Send(t, proto.Msg{Type: proto.Resume, ReqID: m.ReqID, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Reason: proto.ReasonPeerUnreachable, Offset: off})
	}
	if left, err := sc.s.Read(guesttest.Wait); err != nil || left.Type != proto.Left || left.Slot != m.Slot || left.Gen != m.Gen || left.ReqID != m.ReqID {
		t.Fatalf("after RESUME(%d): %+v, %v; want LEFT for %d.%d\n%s", off, left, err, m.Slot, m.Gen, state())
	}

	if tc.reset {
		if _, err := conn.Write([]byte("x")); !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("guest Write after RESUME(%d) = %v, want ECONNRESET\n%s", off, err, state())
		}
		_ = conn.SetReadDeadline(time.Now().Add(guesttest.Wait))
		if _, err := conn.Read(make([]byte, 8)); !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("guest Read after RESUME(%d) = %v, want ECONNRESET\n%s", off, err, state())
		}
		if blocked != nil {
			if r := within(blocked, "the waiting Write"); !errors.Is(r.err, syscall.ECONNRESET) {
				t.Errorf("the waiting Write = %v, want ECONNRESET", r.err)
			}
		}
		r := within(peer, "the peer's reads")
		if !errors.Is(r.err, syscall.ECONNRESET) {
			t.Errorf("peer's read after %d bytes = %v, want ECONNRESET (RST)\n%s", len(r.b), r.err, state())
		}
		return
	}

	resent := 0
	if tc.attach {
		if off == proto.ResumeAll {
			off = start
		}
		resent = int(end - off)
	}
	if blocked != nil {
		if r := within(blocked, "the waiting Write"); r.err != nil {
			t.Fatalf("the waiting Write: %v\n%s", r.err, state())
		}
	} else {
		// Nobody writes: the resend goes out all the same.
		deadline := time.Now().Add(guesttest.Wait)
		for conn.Stats().TCPSent < uint64(tc.tcp0+resent) && tc.attach {
			if time.Now().After(deadline) {
				t.Fatalf("resent bytes not sent on TCP within %v while the application does not write\n%s", guesttest.Wait, state())
			}
			time.Sleep(time.Millisecond)
		}
	}
	write(int(end)+tc.block, tc.tcp2)
	if err := conn.CloseWrite(); err != nil {
		t.Fatalf("CloseWrite: %v\n%s", err, state())
	}
	r := within(peer, "the peer's reads")
	var want []byte
	if tc.attach {
		want = append(append(append(want, stream[:start]...), stream[off:end]...), stream[end:]...)
	} else {
		want = stream
	}
	if r.err != nil || !bytes.Equal(r.b, want) {
		t.Fatalf("peer read %d bytes (crc %08x), %v; want %d (crc %08x): the TCP bytes, ring bytes from %d resent, the new bytes\n%s",
			len(r.b), crc32.ChecksumIEEE(r.b), r.err, len(want), crc32.ChecksumIEEE(want), off, state())
	}
	if st := conn.Stats(); st.Resent != uint64(resent) || st.WriteOnRing {
		t.Fatalf("stats %+v, want %d bytes resent, the writer on TCP", st, resent)
	}
	// The reader goes on over TCP too.
	if _, err := sc.peer.Write([]byte("back")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	_ = conn.SetReadDeadline(time.Now().Add(guesttest.Wait))
	if _, err := io.ReadFull(conn, b); err != nil || string(b) != "back" {
		t.Fatalf("guest read %q, %v after RESUME\n%s", b, err, state())
	}
}
