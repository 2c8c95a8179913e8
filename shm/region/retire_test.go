package region_test

import (
	"testing"

	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// TestRetireLeavesHarmlessMemory: a retired region's addresses stay
// readable and writable (zeros, private), so a ring end that races with
// its Conn's Close cannot fault; the shared file no longer sees writes.
func TestRetireLeavesHarmlessMemory(t *testing.T) {
	r, f := shmtest.Region(t, region.Geometry{Size: 1 << 20, Slots: 8})
	mem := r.Mem()
	if err := r.Retire(); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int{0, len(mem) / 2, len(mem) - 1} {
		if mem[off] != 0 {
			t.Fatalf("byte %d of a retired region reads %d, want 0", off, mem[off])
		}
		mem[off] = 1 // must not fault
	}
	again, err := region.OpenFile(f)
	if err != nil {
		t.Fatalf("the file is still a region: %v", err)
	}
	defer again.Close()
	if again.Mem()[len(mem)/2] != 0 {
		t.Fatal("a write to the retired mapping reached the shared file")
	}
	if err := r.Retire(); err != nil {
		t.Fatalf("a second Retire: %v", err)
	}
}
