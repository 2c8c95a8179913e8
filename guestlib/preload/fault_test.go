package preload

import (
	"os/exec"
	"testing"
)

// TestRegionFaultC runs the core's SIGBUS test (shunt-xtest fault,
// guestlib/c/xtest/fault.c): a ring whose memfd is truncated under it
// fails its next write and read with SHUNT_ERESET, and the process lives
// (before: SIGBUS killed it); a fault outside any region still reaches
// the program's own handler.
func TestRegionFaultC(t *testing.T) {
	bin := xtest(t)
	out, err := exec.Command(bin, "fault").CombinedOutput()
	if err != nil {
		t.Fatalf("shunt-xtest fault: %v\n%s", err, out)
	}
}
