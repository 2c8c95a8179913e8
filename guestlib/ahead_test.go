package guestlib

import (
	"testing"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// TestSwitchReadyWhileAheadHeld: the reader holds a ring's stretch ahead
// (the TCP bytes before its start are still due: a firewall drops them
// and their retransmissions), and the connection gets rings again. The
// new read ring must stay unattached until the TCP stream reaches the
// held stretch, so the peer's writer stays on TCP meanwhile: a second
// stretch started past the due bytes could not be held too (one at a
// time), its reader kept the ring past the next DOWN, and hostd's grace
// took it (the connection failed). Once the bytes come, the ring is
// attached, and the stream is whole and in order.
func TestSwitchReadyWhileAheadHeld(t *testing.T) {
	sc, rest := ringPastDueBytes(t, 20)
	_ = sc.pw.Leave()
	sc.s.Send(t, guesttest.Down(sc.f.B, proto.ReasonFirewall))
	sc.s.Expect(t, proto.Left) // the stretch is held ahead

	f2 := sc.h.Pair(t, fakeActive(sc.open), sc.open)
	sc.s.Send(t, f2.B)
	waitFor(t, "the second READY taken", func() bool { return sc.conn.Stats().Readies == 2 })
	ab2, _, err := sc.h.Pool.Region().Rings(int(f2.A.Slot), f2.A.Gen)
	if err != nil {
		t.Fatal(err)
	}
	pw2, _ := ring.NewWriter(ab2, &wait.Policy{})
	if pw2.ReaderAttached() {
		t.Fatalf("the second read ring was attached while a stretch was held ahead\n%+v", sc.conn.Stats())
	}
	if _, err := sc.peer.Write([]byte("BBBBCCCC")); err != nil { // the retransmission, then TCP bytes the peer wrote since
		t.Fatal(err)
	}
	waitFor(t, "the second read ring attached once the held stretch is due", pw2.ReaderAttached)
	pw2.Start(16)
	if _, err := pw2.Write([]byte("SSSS")); err != nil {
		t.Fatal(err)
	}
	_ = pw2.Leave()
	sc.s.Send(t, guesttest.Down(f2.B, proto.ReasonFirewall))
	if m, err := sc.s.Read(guesttest.Wait); err != nil || m.Type != proto.Left || m.Slot != f2.B.Slot {
		t.Fatalf("after the second DOWN: %+v, %v; want LEFT %d.%d\n%+v", m, err, f2.B.Slot, f2.B.Gen, sc.conn.Stats())
	}
	if _, err := sc.peer.Write([]byte("DDDD")); err != nil {
		t.Fatal(err)
	}
	if got := await(t, rest, "the Read"); string(got) != "BBBBRRRRCCCCSSSSDDDD" {
		t.Fatalf("read %q, want BBBBRRRRCCCCSSSSDDDD", got)
	}
	if st := sc.conn.Stats(); st.TCPReceived != 16 || st.RingReceived != 8 {
		t.Fatalf("stats %+v, want 16 TCP and 8 ring bytes", st)
	}
}
