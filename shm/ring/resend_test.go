package ring_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/shuntnet/shunt/shm/ring"
)

// TestUnfreed: a writer gets back exactly the bytes its reader has not
// freed, across the end of the data area, and nothing before the
// reader's head or past its own tail.
func TestUnfreed(t *testing.T) {
	const c = ring.MinCapacity
	mem, w, rd := hostile(t, c)
	mustWrite(t, w, seq(c-100, 0))
	mustRead(t, rd, seq(c-100, 0))
	mustWrite(t, w, seq(300, 50)) // straddles the end of the data area
	if err := w.Leave(); err != nil {
		t.Fatal(err)
	}
	b, err := rd.TryPeek(120) // read, not freed
	if err != nil || len(b) != 100 {
		t.Fatalf("TryPeek = %d bytes, %v", len(b), err)
	}
	tail := uint64(c - 100 + 300)
	for _, tc := range []struct {
		from uint64
		want []byte
	}{
		{c - 100, seq(300, 50)},
		{c - 100 + 1, seq(299, 51)},
		{c, seq(200, 150)},
		{tail, []byte{}},
	} {
		got, err := w.Unfreed(tc.from)
		if err != nil || !bytes.Equal(got, tc.want) {
			t.Errorf("Unfreed(%d) = %d bytes, %v; want %d", tc.from, len(got), err, len(tc.want))
		}
	}
	for _, from := range []uint64{0, c - 101, tail + 1} {
		if _, err := w.Unfreed(from); !errors.Is(err, ring.ErrNotHeld) {
			t.Errorf("Unfreed(%d) = %v, want ErrNotHeld", from, err)
		}
	}
	if err := rd.Free(10); err != nil { // the relay's way: published at once
		t.Fatal(err)
	}
	if _, err := w.Unfreed(c - 100); !errors.Is(err, ring.ErrNotHeld) {
		t.Errorf("Unfreed below a head that moved: %v, want ErrNotHeld", err)
	}
	put64(mem, ring.OffHead, tail+1) // a hostile reader
	if _, err := w.Unfreed(tail); !errors.Is(err, ring.ErrCorrupt) {
		t.Errorf("Unfreed with the head past the tail: %v, want ErrCorrupt", err)
	}
}
