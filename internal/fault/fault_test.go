package fault_test

import (
	"errors"
	"testing"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/sys"
)

// TestCatchTruncated maps a memfd, truncates it under the mapping (what a
// hostile guest does to a region) and checks that an access returns
// ErrFault instead of killing the test binary with SIGBUS.
func TestCatchTruncated(t *testing.T) {
	f, err := sys.Memfd("fault-test", 1<<16)
	if err != nil {
		t.Fatalf("memfd_create: %v", err)
	}
	defer f.Close()
	mem, err := sys.Map(f, 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer sys.Unmap(mem)
	if err := fault.Do(func() { mem[100] = 1 }); err != nil {
		t.Fatalf("access before truncation: %v", err)
	}
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	var got byte
	err = fault.Do(func() { got = mem[100] })
	if !errors.Is(err, fault.ErrFault) {
		t.Fatalf("read of a truncated mapping: got %v (byte %d), want ErrFault", err, got)
	}
	if err := fault.Do(func() { mem[5000] = 2 }); !errors.Is(err, fault.ErrFault) {
		t.Fatalf("write to a truncated mapping: got %v, want ErrFault", err)
	}
	// The guard is per call: another panic still panics.
	defer func() {
		if x := recover(); x != "other" {
			t.Fatalf("recovered %v, want the other panic to go on", x)
		}
	}()
	_ = fault.Do(func() { panic("other") })
}

func TestCatchNoAllocs(t *testing.T) {
	var sink byte
	mem := make([]byte, 64)
	n := testing.AllocsPerRun(100, func() {
		_ = touch(mem, &sink)
	})
	if n != 0 {
		t.Fatalf("guarded call allocates %v times, want 0", n)
	}
}

func touch(mem []byte, sink *byte) (err error) {
	defer fault.Catch(fault.Arm(), &err)
	*sink = mem[3]
	return nil
}

func BenchmarkGuard(b *testing.B) {
	var sink byte
	mem := make([]byte, 64)
	for b.Loop() {
		_ = touch(mem, &sink)
	}
}
