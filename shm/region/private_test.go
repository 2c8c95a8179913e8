package region_test

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// Directory slot offsets, as docs/region.md fixes them.
const (
	soState  = 0
	soGen    = 8
	soRingAB = 24
	soRingBA = 32
)

func slotBytes(r *region.Region, i int) []byte {
	l := r.Layout()
	off := l.DirOff + int64(i)*region.SlotSize
	return r.Mem()[off : off+region.SlotSize]
}

// TestAllocIgnoresScribbledDirectory: a guest that writes state Reserved
// into every free slot of the directory does not stop hostd from
// allocating: the pool picks slots from its own table.
func TestAllocIgnoresScribbledDirectory(t *testing.T) {
	r, _ := shmtest.Region(t, geo)
	pool := region.NewPool(r, nil)
	for i := range geo.Slots {
		binary.LittleEndian.PutUint32(slotBytes(r, i)[soState:], uint32(region.Reserved))
	}
	s, e, err := pool.Alloc(req(64 << 10))
	if err != nil {
		t.Fatalf("alloc after the directory was scribbled on: %v", err)
	}
	// Guests see the flow as hostd published it.
	if got, err := r.Entry(s); err != nil || got != e {
		t.Fatalf("directory says %+v, %v; hostd allocated %+v", got, err, e)
	}
}

// TestReleaseUsesOwnRecord: a guest that points its flow's ring offsets at
// another flow and closes makes hostd free its own flow's rings, never the
// victim's: the victim's rings keep their data, and the next flow does not
// land on them.
func TestReleaseUsesOwnRecord(t *testing.T) {
	r, _ := shmtest.Region(t, geo)
	pool := region.NewPool(r, nil)
	vs, ve, _ := pool.Alloc(req(64 << 10)) // the victim
	hs, he, _ := pool.Alloc(req(64 << 10)) // the hostile guest's
	vab, _, _ := r.Rings(vs, ve.Gen)
	w, _ := ring.NewWriter(vab, &wait.Policy{})
	if _, err := w.Write([]byte("victim's bytes")); err != nil {
		t.Fatal(err)
	}
	b := slotBytes(r, hs)
	binary.LittleEndian.PutUint64(b[soRingAB:], uint64(ve.RingAB))
	binary.LittleEndian.PutUint64(b[soRingBA:], uint64(ve.RingBA))
	if err := pool.Revoke(hs, he.Gen, 9); err != nil {
		t.Fatal(err)
	}
	for _, side := range []uint32{region.SideA, region.SideB} {
		if _, err := pool.Release(hs, he.Gen, side); err != nil {
			t.Fatal(err)
		}
	}
	rd, _ := ring.NewReader(vab, &wait.Policy{})
	buf := make([]byte, 64)
	n, err := rd.Read(buf)
	if err != nil || string(buf[:n]) != "victim's bytes" || vab.IsReset() {
		t.Fatalf("victim's ring after the attack: read %q, %v, reset %v", buf[:n], err, vab.IsReset())
	}
	_, ne, err := pool.Alloc(req(64 << 10))
	if err != nil {
		t.Fatal(err)
	}
	if vstart, vend := ve.Span(); ne.RingAB < vend && vstart < ne.RingAB+region.PairSize(64<<10) {
		t.Fatalf("new flow at %d overlaps the victim's rings [%d, %d)", ne.RingAB, vstart, vend)
	}
	if ne.RingAB != he.RingAB {
		t.Fatalf("new flow at %d, want the freed flow's place %d", ne.RingAB, he.RingAB)
	}
}

// TestGenerationNeverReused: a guest that rewrites a slot's state and
// generation cannot make hostd hand out a slot and generation again.
func TestGenerationNeverReused(t *testing.T) {
	r, _ := shmtest.Region(t, region.Geometry{Size: 4 << 20, Slots: 2})
	pool := region.NewPool(r, nil)
	seen := map[[2]uint64]bool{}
	for range 20 {
		s, e, err := pool.Alloc(req(ring.MinCapacity))
		if err != nil {
			t.Fatal(err)
		}
		k := [2]uint64{uint64(s), e.Gen}
		if seen[k] {
			t.Fatalf("slot %d generation %d handed out twice", s, e.Gen)
		}
		seen[k] = true
		// Scribble: the slot is free, with generation 0.
		b := slotBytes(r, s)
		binary.LittleEndian.PutUint32(b[soState:], uint32(region.Free))
		binary.LittleEndian.PutUint64(b[soGen:], 0)
		if err := pool.Free(s, e.Gen); err != nil {
			t.Fatalf("free slot %d gen %d: %v", s, e.Gen, err)
		}
	}
}

// TestRevokeRestoresScribbledRing: revocation resets the rings at the
// offsets in hostd's record even when a guest wrote garbage over a ring
// header and the slot, so an end attached before the scribbling still
// fails with ErrReset.
func TestRevokeRestoresScribbledRing(t *testing.T) {
	r, _ := shmtest.Region(t, geo)
	pool := region.NewPool(r, nil)
	s, e, _ := pool.Alloc(req(64 << 10))
	ab, ba, err := r.Rings(s, e.Gen)
	if err != nil {
		t.Fatal(err)
	}
	rd, _ := ring.NewReader(ba, &wait.Policy{})
	clear(r.Mem()[e.RingAB : e.RingAB+ring.HeaderSize])
	clear(r.Mem()[e.RingBA : e.RingBA+ring.HeaderSize])
	clear(slotBytes(r, s))
	if err := pool.Revoke(s, e.Gen, 7); err != nil {
		t.Fatal(err)
	}
	if _, err := rd.Read(make([]byte, 8)); !errors.Is(err, ring.ErrReset) {
		t.Fatalf("read on a revoked flow = %v, want ErrReset", err)
	}
	if !ab.IsReset() {
		t.Fatal("ring AB not reset")
	}
	got, err := r.Entry(s)
	if err != nil || got.State != region.Revoked || got.Gen != e.Gen || got.RingAB != e.RingAB {
		t.Fatalf("directory after revoke: %+v, %v; want hostd's record, revoked", got, err)
	}
}

// files returns a Files over a fresh state directory.
func files(t *testing.T) (*region.Files, string) {
	t.Helper()
	dir := t.TempDir()
	fl, err := region.OpenFiles(filepath.Join(dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	return fl, dir
}

// TestShadowRoundTrip: a region made with Files and adopted again has the
// same live flows (slot, generation, rings, owners, released bits), frees
// the slots freed before, hands out new generations, and bumps the header
// generation.
func TestShadowRoundTrip(t *testing.T) {
	fl, dir := files(t)
	path := filepath.Join(dir, "r")
	m := region.Meta{Kind: region.KindPair, ID: 7, GuestA: 1, GuestB: 2}
	pool, f, err := fl.Create(path, "r", m, geo, region.NoGroup, nil)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if id, a, b := pool.Region().Name(); id != 7 || a != 1 || b != 2 {
		t.Fatalf("header names region %d of %d-%d, want 7 of 1-2", id, a, b)
	}
	_, e1, _ := pool.Alloc(req(64 << 10))
	s2, e2, _ := pool.Alloc(req(64 << 10))
	s3, e3, _ := pool.Alloc(req(256 << 10))
	if _, err := pool.Release(s2, e2.Gen, region.SideB); err != nil {
		t.Fatal(err)
	}
	if err := pool.Free(s3, e3.Gen); err != nil {
		t.Fatal(err)
	}
	if err := pool.Revoke(s2, e2.Gen, 5); err != nil {
		t.Fatal(err)
	}
	want := pool.Live()
	pool.Close()

	again, got, f, problems, err := fl.Adopt(path, "r", region.NoGroup, nil)
	if err != nil || len(problems) != 0 {
		t.Fatalf("adopt: %v, problems %v", err, problems)
	}
	defer again.Close()
	f.Close()
	if got.Kind != m.Kind || got.ID != m.ID || got.GuestA != 1 || got.GuestB != 2 || got.Generation != 2 {
		t.Fatalf("meta %+v, want %+v at generation 2", got, m)
	}
	if g := again.Region().Generation(); g != 2 {
		t.Fatalf("header generation %d after adoption, want 2", g)
	}
	if id, a, b := again.Region().Name(); id != 7 || a != 1 || b != 2 {
		t.Fatalf("header names region %d of %d-%d after adoption, want 7 of 1-2 (a VM finds its pair region's device by it)", id, a, b)
	}
	live := again.Live()
	if len(live) != 2 || live[0] != want[0] || live[1] != want[1] || live[1].Released != region.SideB || live[1].State != region.Revoked {
		t.Fatalf("adopted %+v, want %+v", live, want)
	}
	_, e4, err := again.Alloc(req(64 << 10))
	if err != nil {
		t.Fatal(err)
	}
	if e4.Gen <= e3.Gen || e4.Gen <= e1.Gen {
		t.Fatalf("generation %d after adoption; the earlier ones went up to %d", e4.Gen, e3.Gen)
	}
}

// TestAdoptIgnoresScribbledDirectory: while hostd is away a guest rewrites
// the header and the whole directory; the restarted hostd adopts from its
// shadow, and the directory guests see is hostd's again.
func TestAdoptIgnoresScribbledDirectory(t *testing.T) {
	fl, dir := files(t)
	path := filepath.Join(dir, "r")
	pool, f, err := fl.Create(path, "r", region.Meta{Kind: region.KindGroup}, geo, region.NoGroup, nil)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	s1, e1, _ := pool.Alloc(req(64 << 10))
	want := pool.Live()
	mem := pool.Region().Mem()
	for i := range mem[:pool.Region().Layout().HeapOff] {
		mem[i] = 0xa5
	}
	pool.Close()

	again, _, f, problems, err := fl.Adopt(path, "r", region.NoGroup, nil)
	if err != nil || len(problems) != 0 {
		t.Fatalf("adopt after scribbling: %v, problems %v", err, problems)
	}
	defer again.Close()
	f.Close()
	if live := again.Live(); len(live) != 1 || live[0] != want[0] {
		t.Fatalf("adopted %+v, want %+v", live, want)
	}
	// A guest's fresh view validates, and shows the flow.
	g, err := region.Open(path)
	if err != nil {
		t.Fatalf("guest view after adoption: %v", err)
	}
	defer g.Close()
	if e, err := g.Entry(s1); err != nil || e != e1 {
		t.Fatalf("guest sees %+v, %v; want %+v", e, err, e1)
	}
	for i := range geo.Slots {
		if i == s1 {
			continue
		}
		if e, err := g.Entry(i); err != nil || e.State != region.Free {
			t.Fatalf("slot %d after adoption: %+v, %v; want free", i, e, err)
		}
	}
}

// TestAdoptDropsBadShadowRecords: records that do not validate or overlap
// are dropped and reported; the rest are adopted.
func TestAdoptDropsBadShadowRecords(t *testing.T) {
	fl, dir := files(t)
	path := filepath.Join(dir, "r")
	pool, f, err := fl.Create(path, "r", region.Meta{Kind: region.KindGroup}, geo, region.NoGroup, nil)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if id, a, b := pool.Region().Name(); id != 0 || a != 0 || b != 0 {
		t.Fatalf("a group region's header names region %d of %d-%d, want zeros", id, a, b)
	}
	_, e1, _ := pool.Alloc(req(64 << 10))
	s2, _, _ := pool.Alloc(req(64 << 10))
	pool.Close()
	sf, err := os.OpenFile(filepath.Join(dir, "state", "r.state"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(e1.RingAB)) // slot 2's rings over slot 1's
	if _, err := sf.WriteAt(b[:], int64(4096+s2*region.SlotSize+soRingAB)); err != nil {
		t.Fatal(err)
	}
	sf.Close()
	again, _, f, problems, err := fl.Adopt(path, "r", region.NoGroup, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	f.Close()
	if len(problems) != 1 || len(again.Live()) != 1 {
		t.Fatalf("problems %v, live %+v; want slot %d dropped", problems, again.Live(), s2)
	}
}

// TestFilesRefuse: Create never follows a symlink or takes over an
// existing file, and Adopt refuses what hostd did not create: a file with
// no shadow, a symlink, another file at the path than the shadow names, a
// file others can open. Each error says what to remove, and nothing at the
// path (or behind a symlink) is changed.
func TestFilesRefuse(t *testing.T) {
	fl, dir := files(t)
	target := filepath.Join(dir, "target")
	if err := os.WriteFile(target, []byte("precious"), 0o600); err != nil {
		t.Fatal(err)
	}
	untouched := func() {
		t.Helper()
		if b, _ := os.ReadFile(target); string(b) != "precious" {
			t.Fatalf("target changed: %q", b)
		}
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if _, _, err := fl.Create(link, "link", region.Meta{Kind: region.KindGroup}, geo, region.NoGroup, nil); err == nil {
		t.Fatal("Create through a symlink succeeded")
	}
	untouched()
	if _, _, _, _, err := fl.Adopt(link, "link", region.NoGroup, nil); !errors.Is(err, region.ErrNotOurs) || !strings.Contains(err.Error(), "symlink") {
		t.Fatalf("Adopt of a symlink: %v", err)
	}
	untouched()
	if _, _, _, _, err := fl.Adopt(target, "target", region.NoGroup, nil); !errors.Is(err, region.ErrNotOurs) || !strings.Contains(err.Error(), "rm "+target) {
		t.Fatalf("Adopt of a file with no shadow: %v", err)
	}
	untouched()
	if _, _, err := fl.Create(target, "target", region.Meta{Kind: region.KindGroup}, geo, region.NoGroup, nil); !errors.Is(err, region.ErrNotOurs) {
		t.Fatalf("Create over an existing file: %v", err)
	}
	untouched()

	// A region hostd made, replaced by another file (same name).
	path := filepath.Join(dir, "r")
	pool, f, err := fl.Create(path, "r", region.Meta{Kind: region.KindGroup}, geo, region.NoGroup, nil)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	pool.Close()
	if err := os.Rename(path, path+".old"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, make([]byte, geo.Size), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, _, _, err := fl.Adopt(path, "r", region.NoGroup, nil); !errors.Is(err, region.ErrNotOurs) || !strings.Contains(err.Error(), "not the file hostd created") {
		t.Fatalf("Adopt of a replaced file: %v", err)
	}
	// The original back, but readable by others.
	if err := os.Rename(path+".old", path); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o666); err != nil {
		t.Fatal(err)
	}
	if _, _, _, _, err := fl.Adopt(path, "r", region.NoGroup, nil); !errors.Is(err, region.ErrNotOurs) || !strings.Contains(err.Error(), "mode 0666") {
		t.Fatalf("Adopt of a file others could open: %v", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(path, path+".2"); err != nil {
		t.Fatal(err)
	}
	if _, _, _, _, err := fl.Adopt(path, "r", region.NoGroup, nil); !errors.Is(err, region.ErrNotOurs) || !strings.Contains(err.Error(), "links") {
		t.Fatalf("Adopt of a file with two links: %v", err)
	}
	os.Remove(path + ".2")
	p, _, f, _, err := fl.Adopt(path, "r", region.NoGroup, nil)
	if err != nil {
		t.Fatalf("Adopt of hostd's own file: %v", err)
	}
	p.Close()
	f.Close()
	if _, _, _, _, err := fl.Adopt(filepath.Join(dir, "none"), "none", region.NoGroup, nil); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Adopt of a missing file: %v, want ErrNotExist", err)
	}
}

// TestSecureDir: hostd's directories end up 0700 and its own; a symlink in
// their place is refused.
func TestSecureDir(t *testing.T) {
	dir := t.TempDir()
	d := filepath.Join(dir, "a", "state")
	if err := region.SecureDir(d); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(d, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := region.SecureDir(d); err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(d)
	if st.Mode().Perm() != 0o700 {
		t.Fatalf("mode %v, want 0700", st.Mode().Perm())
	}
	l := filepath.Join(dir, "l")
	if err := os.Symlink(d, l); err != nil {
		t.Fatal(err)
	}
	if err := region.SecureDir(l); err == nil || !strings.Contains(err.Error(), "rm "+l) {
		t.Fatalf("SecureDir of a symlink: %v", err)
	}
	if os.Geteuid() != 0 {
		return
	}
	other := filepath.Join(dir, "other")
	if err := os.Mkdir(other, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(other, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	if err := region.SecureDir(other); err == nil || !strings.Contains(err.Error(), "owned by uid 65534") {
		t.Fatalf("SecureDir of another user's directory: %v", err)
	}
}

// BenchmarkPairRegion: what a pair's first flow costs hostd beyond the
// flow itself (making the region: file, size, map, format, shadow) and
// what its last costs (unmap, remove both files), on tmpfs.
func BenchmarkPairRegion(b *testing.B) {
	dir, err := os.MkdirTemp("/dev/shm", "shunt-bench")
	if err != nil {
		b.Skip("no /dev/shm:", err)
	}
	defer os.RemoveAll(dir)
	fl, err := region.OpenFiles(filepath.Join(dir, "state"))
	if err != nil {
		b.Fatal(err)
	}
	g := region.Geometry{Size: 16 << 20, Slots: 256}
	path := filepath.Join(dir, "pair")
	for b.Loop() {
		p, f, err := fl.Create(path, "pair", region.Meta{Kind: region.KindPair, ID: 1, GuestA: 1, GuestB: 2}, g, region.NoGroup, nil)
		if err != nil {
			b.Fatal(err)
		}
		p.Close()
		f.Close()
		if err := fl.Remove(path, "pair"); err != nil {
			b.Fatal(err)
		}
	}
}
