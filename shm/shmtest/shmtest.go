package shmtest

import (
	"os"
	"testing"

	"github.com/shuntnet/shunt/internal/sys"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// Ring formats a ring of the given capacity in plain memory and returns it.
func Ring(t testing.TB, capacity int) *ring.Ring {
	t.Helper()
	mem := Aligned(ring.Size(capacity))
	if err := ring.Format(mem, capacity); err != nil {
		t.Fatalf("format ring: %v", err)
	}
	r, err := ring.Attach(mem, capacity)
	if err != nil {
		t.Fatalf("attach ring: %v", err)
	}
	return r
}

// Pipe returns a fresh ring and both its ends, using policy p.
func Pipe(t testing.TB, capacity int, p *wait.Policy) (*ring.Ring, *ring.Writer, *ring.Reader) {
	t.Helper()
	r := Ring(t, capacity)
	w, err := ring.NewWriter(r, p)
	if err != nil {
		t.Fatalf("writer: %v", err)
	}
	rd, err := ring.NewReader(r, p)
	if err != nil {
		t.Fatalf("reader: %v", err)
	}
	t.Cleanup(func() { w.Close(); rd.Close() })
	return r, w, rd
}

// Memfd returns a memfd of size bytes, closed with the test.
func Memfd(t testing.TB, size int64) *os.File {
	t.Helper()
	f, err := sys.Memfd("shunt-test", size)
	if err != nil {
		t.Fatalf("memfd: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// Region formats a memfd-backed region with geometry g; both the file (for
// handing to another process) and the mapped region are closed with the test.
func Region(t testing.TB, g region.Geometry) (*region.Region, *os.File) {
	t.Helper()
	f := Memfd(t, g.Size)
	r, err := region.CreateFile(f, g)
	if err != nil {
		t.Fatalf("create region: %v", err)
	}
	t.Cleanup(func() { r.Close() })
	return r, f
}
