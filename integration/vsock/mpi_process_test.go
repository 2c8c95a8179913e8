//go:build linux

package vsock_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/nsexec"
)

// TestVsockMPIProcessGuest: an MPI job between a rank in a vsock VM (TCG,
// vhost-user-vsock served by hostd, no ivshmem; SHUNT_VSOCK=1 and
// shunt-vstretchd, as in TestVsockMPI) and a rank in a namespace (process)
// guest. hostd does not mark such a pair relayed (the process guest's
// library takes the DOWN(peer-gone) it gets when the VM's end goes for a
// reset), so the VM's BTL turns each stretch down, and both directions
// must stay on their leases, neither end on a ring: the fallback is both
// ends or neither (docs/mpi.md, "Between vsock VMs"). Every byte is still
// checked; the VM's stretches must never have opened (its vsock device
// carried nothing of the job).
func TestVsockMPIProcessGuest(t *testing.T) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	dir, bin := buildMPI(t)
	var v *vsockVM
	how := vmHow{files: mpiFiles(bin), before: func(vm *vsockVM) {
		v = vm
		// The agent: the VM's orted through its exec server, the
		// process guest's in its namespace with its own hostd socket and
		// session directory.
		g := v.s.Rig.Guests[0]
		sess := filepath.Join(dir, "session-g")
		if err := os.MkdirAll(sess, 0o755); err != nil {
			t.Fatal(err)
		}
		script := fmt.Sprintf("#!/bin/sh\n# plm_rsh_agent: rsh HOST CMD\ncase $1 in\n%s) exec %s rsh %d \"$@\" ;;\n%s) shift; exec nsenter --net=%s env SHUNT_CONTROL=%s OMPI_MCA_orte_tmpdir_base=%s sh -c \"$*\" ;;\nesac\necho \"unknown host $1\" >&2; exit 1\n",
			vsockVMAddr, bin("shunt-vm-agent"), execPort, g.Addr, g.NSPath(), v.s.Control(g), sess)
		if err := os.WriteFile(bin("rsh"), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}}
	if err := os.WriteFile(bin("rsh"), nil, 0o755); err != nil { // in the initramfs's list; written in before
		t.Fatal(err)
	}
	startVsockVMHow(t, ctx, how, mpiPhases(dir)...)
	if line, err := v.r.v.WaitAny(v.r.ctx, 0, "SHUNT-VSOCK MPIEXEC", "SHUNT-VSOCK ERROR"); err != nil || !strings.HasPrefix(line, "SHUNT-VSOCK MPIEXEC") {
		v.fail("the VM's exec server: %q %v", line, err)
	}
	before := counters(v.hostd, v.s.Admin)
	const maxBytes = 256 << 10
	cmd := exec.CommandContext(ctx, "mpirun", mpirunArgs(dir, vsockVMAddr, v.s.Rig.Guests[0].Addr.String(), maxBytes, 2)...)
	var out lockedBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	v.more = func() string { return "the job's output:\n" + out.String() }
	if err := nsexec.In(v.s.Rig.HostNSPath(), cmd.Start); err != nil {
		t.Fatal(err)
	}
	err := cmd.Wait()
	job := out.String()
	if ctx.Err() != nil {
		v.fail("the job did not end within the test's bound")
	}
	if err != nil || !strings.Contains(job, "data ok") || strings.Contains(job, "ERROR") {
		v.fail("the job: %v; want \"data ok\" and no BTL error", err)
	}
	if strings.Contains(job, "ring (slot ") {
		v.fail("a direction moved to a ring; want both on their leases")
	}
	if n := strings.Count(job, "is a vsock stretch that hostd does not mark relayed"); n != 2 {
		v.fail("the VM's rank turned %d stretches down; want 2 (one per lease) and a word on why", n)
	}
	after := counters(v.hostd, v.s.Admin)
	for _, d := range []string{"rx", "tx"} {
		key := fmt.Sprintf("shunt_vsock_bytes_total{direction=%s,guest=vm}", d)
		if g := grew(before, after, key); g != 0 {
			v.fail("%s grew by %v during the job; want 0 (no stretch opened)", key, g)
		}
	}
	for _, l := range strings.Split(job, "\n") {
		if strings.Contains(l, "data ok") || strings.Contains(l, "vsock stretch") {
			t.Logf("job: %s", l)
		}
	}
	t.Logf("both directions stayed on their leases, every byte checked; boot %v, whole test %v", v.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}
