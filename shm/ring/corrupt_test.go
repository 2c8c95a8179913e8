package ring_test

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// hostile gives a test the raw header of a fresh ring and both its ends.
func hostile(t *testing.T, c int) ([]byte, *ring.Writer, *ring.Reader) {
	t.Helper()
	mem := shmtest.Aligned(ring.Size(c))
	if err := ring.Format(mem, c); err != nil {
		t.Fatal(err)
	}
	r, err := ring.Attach(mem, c)
	if err != nil {
		t.Fatal(err)
	}
	w, _ := ring.NewWriter(r, adaptive)
	rd, _ := ring.NewReader(r, adaptive)
	return mem, w, rd
}

func put64(mem []byte, off int, v uint64) { binary.LittleEndian.PutUint64(mem[off:], v) }

func TestCorruptIndices(t *testing.T) {
	const c = ring.MinCapacity
	tests := []struct {
		name string
		prep func(mem []byte, w *ring.Writer, rd *ring.Reader)
		op   func(w *ring.Writer, rd *ring.Reader) error
	}{
		{"tail beyond capacity", func(m []byte, w *ring.Writer, rd *ring.Reader) { put64(m, ring.OffTail, c+1) },
			func(w *ring.Writer, rd *ring.Reader) error { _, err := rd.TryRead(make([]byte, 10)); return err }},
		{"tail far ahead (peek)", func(m []byte, w *ring.Writer, rd *ring.Reader) { put64(m, ring.OffTail, 1<<62) },
			func(w *ring.Writer, rd *ring.Reader) error { _, err := rd.TryPeek(10); return err }},
		{"tail moves back", func(m []byte, w *ring.Writer, rd *ring.Reader) {
			w.TryWrite(make([]byte, 100))
			rd.TryRead(make([]byte, 100))
			put64(m, ring.OffTail, 50)
		}, func(w *ring.Writer, rd *ring.Reader) error { _, err := rd.TryRead(make([]byte, 10)); return err }},
		{"head beyond tail", func(m []byte, w *ring.Writer, rd *ring.Reader) {
			w.TryWrite(make([]byte, c))
			put64(m, ring.OffHead, c+5)
		}, func(w *ring.Writer, rd *ring.Reader) error { _, err := w.TryWrite([]byte{1}); return err }},
		{"head moves back", func(m []byte, w *ring.Writer, rd *ring.Reader) {
			w.TryWrite(make([]byte, c))
			rd.TryPeekAt(0, 10)
			rd.Free(10)                  // published at once (TryRead's head is lazy)
			w.TryWrite(make([]byte, 10)) // the writer has seen head = 10
			put64(m, ring.OffHead, 3)
		}, func(w *ring.Writer, rd *ring.Reader) error { _, err := w.TryReserve(1); return err }},
		{"blocking read with tail beyond capacity", func(m []byte, w *ring.Writer, rd *ring.Reader) { put64(m, ring.OffTail, 3*c) },
			func(w *ring.Writer, rd *ring.Reader) error { _, err := rd.Read(make([]byte, 10)); return err }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mem, w, rd := hostile(t, c)
			tt.prep(mem, w, rd)
			if err := tt.op(w, rd); !errors.Is(err, ring.ErrCorrupt) {
				t.Fatalf("got %v, want ErrCorrupt", err)
			}
		})
	}
}

// A peer that rewrites the capacity after attach cannot move the window.
func TestCapacityRewriteIgnored(t *testing.T) {
	const c = ring.MinCapacity
	mem, w, rd := hostile(t, c)
	put64(mem, ring.OffCapacity, 1<<30)
	mustWrite(t, w, seq(c, 0))
	if n, _ := w.TryWrite([]byte{1}); n != 0 {
		t.Fatalf("wrote past the attached capacity after a header rewrite")
	}
	mustRead(t, rd, seq(c, 0))
}

func TestAttachRejects(t *testing.T) {
	const c = ring.MinCapacity
	tests := []struct {
		name string
		mod  func(mem []byte) []byte
		want int
	}{
		{"bad magic", func(m []byte) []byte { m[0] ^= 0xff; return m }, 0},
		{"capacity not a power of two", func(m []byte) []byte { put64(m, ring.OffCapacity, c+1); return m }, 0},
		{"capacity too small", func(m []byte) []byte { put64(m, ring.OffCapacity, 1024); return m }, 0},
		{"capacity beyond window", func(m []byte) []byte { put64(m, ring.OffCapacity, 2*c); return m }, 0},
		{"window shorter than header", func(m []byte) []byte { return m[:100] }, 0},
		{"capacity other than expected", func(m []byte) []byte { return m }, 2 * c},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mem := shmtest.Aligned(ring.Size(c))
			ring.Format(mem, c)
			if _, err := ring.Attach(tt.mod(mem), tt.want); !errors.Is(err, ring.ErrCorrupt) {
				t.Fatalf("Attach = %v, want ErrCorrupt", err)
			}
		})
	}
	// And a corrupt starting state is refused when an end is taken.
	mem := shmtest.Aligned(ring.Size(c))
	ring.Format(mem, c)
	put64(mem, ring.OffTail, c+1)
	r, err := ring.Attach(mem, c)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ring.NewReader(r, adaptive); !errors.Is(err, ring.ErrCorrupt) {
		t.Fatalf("NewReader on corrupt indices = %v, want ErrCorrupt", err)
	}
	if _, err := ring.NewWriter(r, adaptive); !errors.Is(err, ring.ErrCorrupt) {
		t.Fatalf("NewWriter on corrupt indices = %v, want ErrCorrupt", err)
	}
}

// FuzzAttach: any header bytes either attach with a valid capacity inside
// the window or fail with ErrCorrupt; never a panic.
func FuzzAttach(f *testing.F) {
	good := shmtest.Aligned(ring.Size(ring.MinCapacity))
	ring.Format(good, ring.MinCapacity)
	f.Add(good[:ring.HeaderSize])
	f.Add(make([]byte, ring.HeaderSize))
	f.Fuzz(func(t *testing.T, hdr []byte) {
		mem := shmtest.Aligned(ring.Size(ring.MinCapacity))
		copy(mem, hdr)
		r, err := ring.Attach(mem, 0)
		if err != nil {
			if !errors.Is(err, ring.ErrCorrupt) {
				t.Fatalf("Attach error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		if r.Capacity() > len(mem)-ring.HeaderSize {
			t.Fatalf("attached capacity %d beyond the %d-byte window", r.Capacity(), len(mem))
		}
	})
}

// FuzzIndices: a hostile peer rewrites the shared indices and flags between
// operations; the local end must return data or an error, never panic, read
// more than asked, or report a position outside the ring.
func FuzzIndices(f *testing.F) {
	f.Add(uint64(0), uint64(0), uint32(0), []byte{0, 1, 2, 3})
	f.Add(uint64(ring.MinCapacity+1), uint64(5), uint32(1), []byte{3, 2, 1, 0, 5})
	f.Add(^uint64(0), ^uint64(0)-3, uint32(0), []byte{1, 1, 1, 4, 4})
	f.Fuzz(func(t *testing.T, tail, head uint64, flags uint32, ops []byte) {
		const c = ring.MinCapacity
		mem, w, rd := hostile(t, c)
		buf := make([]byte, 3000)
		for i, op := range ops {
			switch op % 6 {
			case 0:
				put64(mem, ring.OffTail, tail+uint64(i))
			case 1:
				put64(mem, ring.OffHead, head+uint64(i))
			case 2:
				binary.LittleEndian.PutUint32(mem[ring.OffWFlags:], flags)
			case 3:
				if n, err := w.TryWrite(buf[:int(op)*11%len(buf)]); n < 0 || n > len(buf) || (err != nil && n != 0) {
					t.Fatalf("TryWrite = %d, %v", n, err)
				}
			case 4:
				if n, _ := rd.TryRead(buf[:int(op)*13%len(buf)]); n < 0 || n > int(op)*13%len(buf) {
					t.Fatalf("TryRead returned %d bytes", n)
				}
			case 5:
				if b, err := rd.TryPeek(int(op) * 17); err == nil {
					if len(b) > c {
						t.Fatalf("TryPeek returned %d bytes", len(b))
					}
					rd.Release(len(b))
				}
			}
		}
	})
}
