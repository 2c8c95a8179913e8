// Package mpirig runs Open MPI jobs across namespace guests, for the
// integration tests of btl/shunt on one host (integration) and across two
// (integration/crosshost): the component and the MPI programs built once,
// Open MPI's own component directory, and the rsh agent that starts orted
// in a guest's namespace with that guest's hostd socket (docs/mpi.md,
// "Namespace guests").
package mpirig

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
)

// Build builds mca_btl_shunt.so and shunt-mpirun (make mpi) from the
// repository at root into dir, and the programs of integration/mpi
// (btlcheck, mpibench, ...) with mpicc.
func Build(root, dir string, progs ...string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	cmd := exec.Command("make", "-s", "-C", root, "BIN="+dir, "mpi")
	cmd.Env = append(os.Environ(), "MAKEFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("make mpi: %w\n%s", err, out)
	}
	for _, p := range progs {
		src := filepath.Join(root, "integration", "mpi", p+".c")
		if out, err := exec.Command("mpicc", "-O2", "-o", filepath.Join(dir, p), src).CombinedOutput(); err != nil {
			return fmt.Errorf("mpicc %s: %w\n%s", p, err, out)
		}
	}
	return nil
}

// SysComponents is Open MPI's own component directory, which stays first
// in mca_component_path.
func SysComponents() string {
	out, _ := exec.Command("ompi_info", "--parsable", "--level", "9", "--param", "mca", "base").Output()
	m := regexp.MustCompile(`(?m)^mca:mca:base:param:mca_base_component_path:value:"?([^":\n]+)`).FindSubmatch(out)
	if m == nil {
		return "/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3"
	}
	return string(m[1])
}

// Guest is where orted runs for one --host name.
type Guest struct {
	Addr    string // the --host name: the guest's address
	NS      string // its network namespace's name
	Control string // its hostd socket (SHUNT_CONTROL)
}

// WriteAgent writes an rsh agent (plm_rsh_agent) to dir/rsh that runs
// orted in each guest's namespace with its SHUNT_CONTROL and, since the
// guests share the machine's name, /tmp and /dev/shm, a vader backing
// directory and an ORTE session directory of its own (under dir), as
// separate machines would have. env (may be empty) is put before the
// command, such as LD_PRELOAD=... It returns the agent's path.
func WriteAgent(dir string, guests []Guest, env string) (string, error) {
	var cases strings.Builder
	for i, g := range guests {
		shm, sess := filepath.Join(dir, fmt.Sprintf("shm-%d", i)), filepath.Join(dir, fmt.Sprintf("session-%d", i))
		for _, d := range []string{shm, sess} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return "", err
			}
		}
		fmt.Fprintf(&cases, "%s) ns=%s; ctl=%s; shm=%s; sess=%s ;;\n", g.Addr, g.NS, g.Control, shm, sess)
	}
	rsh := filepath.Join(dir, "rsh")
	script := fmt.Sprintf("#!/bin/sh\n# plm_rsh_agent: rsh HOST CMD -> CMD in that guest's namespace\nhost=$1; shift\ncase $host in\n%s*) echo \"unknown host $host\" >&2; exit 1 ;;\nesac\nexec ip netns exec $ns env SHUNT_CONTROL=$ctl OMPI_MCA_btl_vader_backing_directory=$shm OMPI_MCA_orte_tmpdir_base=$sess %s sh -c \"$*\"\n", cases.String(), env)
	return rsh, os.WriteFile(rsh, []byte(script), 0o755)
}
