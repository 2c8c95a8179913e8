package mpi

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestMpirunDropsShuntControl: shunt-mpirun started with SHUNT_CONTROL set
// in the launching shell says so and starts mpirun without it (mpirun
// would hand it to the ranks it starts, and every rank would use one
// guest's socket: tcp (not-owner)); it sets the BTL list and keeps
// Open MPI's own component directory first. mpirun is a stand-in that
// prints its environment. Before the fix the warning was printed and the
// variable passed on all the same.
func TestMpirunDropsShuntControl(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "mca_btl_shunt.so"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	fake := filepath.Join(dir, "mpirun")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\nenv\necho ARGS \"$@\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", "shunt-mpirun", "-np", "2", "./app")
	cmd.Env = append(os.Environ(), "SHUNT_CONTROL=/run/shunt/g1.sock", "SHUNT_MCA_DIR="+dir, "MPIRUN="+fake,
		"OMPI_MCA_btl=", "OMPI_MCA_pml=", "OMPI_MCA_mca_component_path=")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("shunt-mpirun: %v\n%s", err, stderr.String())
	}
	env := "\n" + string(out)
	if strings.Contains(env, "\nSHUNT_CONTROL=") {
		t.Errorf("mpirun got SHUNT_CONTROL from the launching shell:\n%s", out)
	}
	if !strings.Contains(stderr.String(), "SHUNT_CONTROL=/run/shunt/g1.sock in this shell is not passed to the ranks") {
		t.Errorf("no warning about SHUNT_CONTROL: %q", stderr.String())
	}
	if !strings.Contains(env, "\nOMPI_MCA_btl=self,vader,shunt,tcp\n") || !strings.Contains(env, "\nARGS -np 2 ./app\n") {
		t.Errorf("mpirun's environment or arguments:\n%s", out)
	}
	if m := strings.Split(strings.SplitN(env, "\nOMPI_MCA_mca_component_path=", 2)[1], "\n")[0]; !strings.HasSuffix(m, dir) {
		t.Errorf("component path %q: want Open MPI's own directories, then %s", m, dir)
	}
}
