package ring_test

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// TestPeekAtFree: a reader that reads ahead of its head (TryPeekAt) and
// frees later (Free) sees every byte once, across the wrap; the writer
// gets room only as bytes are freed; a leave is seen only once every byte
// was peeked; a skip or a free past the readable bytes is refused.
func TestPeekAtFree(t *testing.T) {
	const c = ring.MinCapacity
	_, w, rd := shmtest.Pipe(t, c, adaptive)
	data := make([]byte, 3*c)
	for i := range data {
		data[i] = byte(i * 7)
	}
	var got []byte
	var sent, freed uint64
	for done := 0; sent < uint64(len(data)); {
		n, err := w.TryWrite(data[done:min(len(data), done+1000)])
		if err != nil {
			t.Fatal(err)
		}
		done += n
		p, err := rd.TryPeekAt(sent-freed, 700)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, p...)
		sent += uint64(len(p))
		if len(p) == 0 || sent-freed > c/2 { // free in steps, as acks come
			if err := rd.Free(sent - freed); err != nil {
				t.Fatal(err)
			}
			freed = sent
		}
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("peeked %d bytes that differ from the %d written", len(got), len(data))
	}
	if err := rd.Free(sent - freed); err != nil {
		t.Fatal(err)
	}
	if _, err := rd.TryPeekAt(1, 10); !errors.Is(err, ring.ErrBadCommit) {
		t.Fatalf("skip past the readable bytes: %v, want ErrBadCommit", err)
	}
	if err := rd.Free(1); !errors.Is(err, ring.ErrBadCommit) {
		t.Fatalf("free past the readable bytes: %v, want ErrBadCommit", err)
	}
	w.TryWrite([]byte{1, 2, 3})
	_ = w.Leave()
	if p, err := rd.TryPeekAt(0, 10); len(p) != 3 || err != nil {
		t.Fatalf("after leave with 3 bytes due: %d bytes, %v", len(p), err)
	}
	if p, err := rd.TryPeekAt(3, 10); len(p) != 0 || !errors.Is(err, ring.ErrLeft) {
		t.Fatalf("after leave, all peeked: %d bytes, %v, want ErrLeft", len(p), err)
	}
	if st := rd.Stats(); st.Read != 3*c {
		t.Fatalf("head %d, want only what was freed (%d)", st.Read, 3*c)
	}
}

// TestPeekAtCorrupt: TryPeekAt checks the writer's tail as TryRead does.
func TestPeekAtCorrupt(t *testing.T) {
	const c = ring.MinCapacity
	mem, w, rd := hostile(t, c)
	w.TryWrite(make([]byte, 100))
	if p, _ := rd.TryPeekAt(0, 100); len(p) != 100 {
		t.Fatalf("peeked %d", len(p))
	}
	put64(mem, ring.OffTail, 50)
	if _, err := rd.TryPeekAt(100, 10); !errors.Is(err, ring.ErrCorrupt) {
		t.Fatalf("tail moved back: %v, want ErrCorrupt", err)
	}
	mem, _, rd = hostile(t, c)
	put64(mem, ring.OffTail, c+1)
	if _, err := rd.TryPeekAt(0, 10); !errors.Is(err, ring.ErrCorrupt) {
		t.Fatalf("tail beyond capacity: %v, want ErrCorrupt", err)
	}
	_, w, rd = hostile(t, c)
	_ = w.CloseWrite()
	if _, err := rd.TryPeekAt(0, 10); err != io.EOF {
		t.Fatalf("after FIN: %v, want io.EOF", err)
	}
}
