package guestlib

import (
	"errors"
	"io"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// TestRegionTruncatedUnderConn: a hostile peer truncates the pair region
// while the Conn is on its rings, once with a Read blocked on the empty
// ring and once between calls. Every call returns ErrRegionLost instead
// of killing the program with SIGBUS (before: SIGBUS in
// ring.readerCond.Ready), and Close still closes.
func TestRegionTruncatedUnderConn(t *testing.T) {
	h := guesttest.Start(t)
	c := processClient(t, h)
	l, s := listenBare(t, c, h)
	conn, _, open := accepted(t, l, s)
	reg := h.NewRegion(t, 5)
	s.SendRegion(t, reg)
	f := h.PairIn(t, reg, fakeActive(open), open)
	s.Send(t, f.B)
	waitFor(t, "the fast path", func() bool { return conn.Path().Fast })
	ab, _, err := reg.Pool.Region().Rings(int(f.A.Slot), f.A.Gen)
	if err != nil {
		t.Fatal(err)
	}
	pw, _ := ring.NewWriter(ab, &wait.Policy{})
	waitFor(t, "the Conn's reader to attach", pw.ReaderAttached)
	pw.Start(0)
	if _, err := pw.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(conn, buf); err != nil {
		t.Fatal(err)
	}
	read := make(chan error, 1)
	go func() { _, err := conn.Read(buf); read <- err }()
	time.Sleep(50 * time.Millisecond) // let the Read block on the empty ring; the test holds either way
	if err := reg.File.Truncate(0); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write([]byte("pong")); !errors.Is(err, ErrRegionLost) {
		t.Errorf("write after truncation: %v, want ErrRegionLost", err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(2 * time.Second))
	select {
	case err := <-read:
		if !errors.Is(err, ErrRegionLost) {
			t.Errorf("blocked read after truncation: %v, want ErrRegionLost", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a Read blocked on a truncated ring never returned")
	}
	if _, err := conn.Read(buf); !errors.Is(err, ErrRegionLost) {
		t.Errorf("read after truncation: %v, want ErrRegionLost", err)
	}
	done := make(chan error, 1)
	go func() { done <- conn.Close() }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close of a Conn whose region was truncated hangs")
	}
}
