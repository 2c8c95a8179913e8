package mpi

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/shuntnet/shunt/internal/testenv"
)

// TestRecords runs each case of shunt-mpi-xtest, built with the Makefile's
// flags (make mpi-xtest), which need the Open MPI headers.
func TestRecords(t *testing.T) {
	for _, tool := range []string{"make", "gcc"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Missing(t, tool+" is not installed", "apt-get install make gcc libc6-dev")
		}
	}
	if _, err := os.Stat("/usr/lib/x86_64-linux-gnu/openmpi/include/openmpi/opal/mca/btl/btl.h"); err != nil {
		testenv.Missing(t, "the Open MPI component headers are not installed", "apt-get install libopenmpi-dev")
	}
	dir := t.TempDir()
	cmd := exec.Command("make", "-s", "-C", "../..", "BIN="+dir, "mpi-xtest")
	cmd.Env = append(os.Environ(), "MAKEFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make mpi-xtest: %v\n%s", err, out)
	}
	for _, c := range []string{"stream", "stale", "corrupt", "drain", "half"} {
		t.Run(c, func(t *testing.T) {
			out, err := exec.Command(filepath.Join(dir, "shunt-mpi-xtest"), c).CombinedOutput()
			if err != nil {
				t.Fatalf("%s: %v\n%s", c, err, out)
			}
			t.Logf("%s", out)
		})
	}
}
