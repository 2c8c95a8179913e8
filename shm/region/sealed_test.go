package region_test

import (
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/shm/region"
)

// sealedRegion makes a sealed pair region with its shadow in a temporary
// state directory, as hostd does for two process guests.
func sealedRegion(t *testing.T) (*region.Files, *region.Pool, *os.File) {
	t.Helper()
	fl, err := region.OpenFiles(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	m := region.Meta{Kind: region.KindPair, ID: 7, GuestA: 1, GuestB: 2}
	p, f, err := fl.CreateSealed("pair-1-2-p7", m, geo, nil)
	if err != nil {
		t.Fatalf("create sealed region: %v", err)
	}
	t.Cleanup(func() { p.Close(); f.Close() })
	return fl, p, f
}

// TestSealedRegionCannotGrow: what a guest holding a pair region's
// descriptor tries, to take more memory than the pair was charged for or
// to keep hostd from taking the memory back: growing it (ftruncate,
// fallocate past its end) and changing its seals all fail.
func TestSealedRegionCannotGrow(t *testing.T) {
	_, _, f := sealedRegion(t)
	fd := int(f.Fd())
	if err := unix.Ftruncate(fd, 1<<40); !errors.Is(err, unix.EPERM) {
		t.Errorf("ftruncate to 1 TiB: %v, want EPERM", err)
	}
	if err := unix.Fallocate(fd, 0, 0, 1<<30); !errors.Is(err, unix.EPERM) {
		t.Errorf("fallocate 1 GiB: %v, want EPERM", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); !errors.Is(err, unix.EPERM) {
		t.Errorf("adding F_SEAL_SHRINK (to block revocation): %v, want EPERM", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Size != geo.Size {
		t.Errorf("region is %d bytes (%v), want %d", st.Size, err, geo.Size)
	}
}

// TestPoolSurvivesTruncation: a guest truncates its pair region under
// hostd. Every pool operation that touches the memory (release, free,
// revoke, counters, a new flow) returns or errs, never faults; the pool
// reports the region dead and keeps its own record, so the flows can
// still be freed. Before, hostd died of SIGBUS in Release.
func TestPoolSurvivesTruncation(t *testing.T) {
	_, p, f := sealedRegion(t)
	s1, e1, err := p.Alloc(req(64 << 10))
	if err != nil {
		t.Fatal(err)
	}
	s2, e2, err := p.Alloc(req(64 << 10))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(0); err != nil {
		t.Fatalf("shrink (what a guest may do): %v", err)
	}
	if _, err := p.Release(s1, e1.Gen, region.SideA); err != nil {
		t.Fatalf("release: %v", err)
	}
	if !p.Dead() {
		t.Fatal("pool does not know its region is dead")
	}
	if _, _, err := p.Stats(s2, e2.Gen); !errors.Is(err, fault.ErrFault) {
		t.Errorf("stats of a dead region: %v, want ErrFault", err)
	}
	if err := p.Revoke(s2, e2.Gen, 1); err != nil {
		t.Errorf("revoke: %v", err)
	}
	if freed, err := p.Release(s1, e1.Gen, region.SideB); err != nil || !freed {
		t.Errorf("release of the second side: freed %v, %v", freed, err)
	}
	if err := p.Free(s2, e2.Gen); err != nil {
		t.Errorf("free: %v", err)
	}
	if _, _, err := p.Alloc(req(64 << 10)); !errors.Is(err, fault.ErrFault) {
		t.Errorf("alloc in a dead region: %v, want ErrFault", err)
	}
	if n, _ := p.Usage(); n != 0 {
		t.Errorf("%d flows left in hostd's record, want 0", n)
	}
}

// TestAdoptSealed: a restarted hostd finds a sealed region again through
// a process that holds its descriptor (here, this one), by inode; one
// that was shrunk is refused, and one nobody holds is not found.
func TestAdoptSealed(t *testing.T) {
	fl, p, f := sealedRegion(t)
	s, e, err := p.Alloc(req(64 << 10))
	if err != nil {
		t.Fatal(err)
	}
	p.Close() // hostd stops; the guest (f) keeps the region
	p2, m, f2, problems, err := fl.AdoptSealed("pair-1-2-p7", nil)
	if err != nil {
		t.Fatalf("adopt: %v", err)
	}
	defer f2.Close()
	defer p2.Close()
	if m.ID != 7 || m.GuestA != 1 || m.GuestB != 2 || len(problems) != 0 {
		t.Fatalf("adopted meta %+v, problems %v", m, problems)
	}
	if _, err := p2.Entry(s, e.Gen); err != nil {
		t.Fatalf("adopted pool lost the flow: %v", err)
	}
	p2.Close()
	if err := f.Truncate(4096); err != nil {
		t.Fatal(err)
	}
	if _, _, _, _, err := fl.AdoptSealed("pair-1-2-p7", nil); !errors.Is(err, region.ErrCorrupt) {
		t.Fatalf("adopting a shrunk region: %v, want ErrCorrupt", err)
	}
	f.Close()
	f2.Close()
	if _, _, _, _, err := fl.AdoptSealed("pair-1-2-p7", nil); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("adopting a region nobody holds: %v, want ErrNotExist", err)
	}
}
