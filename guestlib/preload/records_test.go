package preload

import (
	"os/exec"
	"testing"
)

// TestRecords runs each case of the core's record tests (shunt-xtest
// records NAME, guestlib/c/xtest/records.c): records in a ring, in place,
// over plain memory, without root or hostd.
func TestRecords(t *testing.T) {
	bin := xtest(t)
	for _, c := range []string{"stream", "stale", "corrupt", "drain", "half"} {
		t.Run(c, func(t *testing.T) {
			out, err := exec.Command(bin, "records", c).CombinedOutput()
			if err != nil {
				t.Fatalf("shunt-xtest records %s: %v\n%s", c, err, out)
			}
			t.Logf("%s", out)
		})
	}
}
