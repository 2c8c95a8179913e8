package integration

import (
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestMPIBTLDefaults: jobs with hostd's defaults, as a user who follows
// docs/mpi.md has them (no pair_region_size, guest_ring_bytes or
// guest_flows in the trust group; the rig's roomy ones are not set),
// with no policy rule (1 MiB rings), with the 4 MiB rule docs/mpi.md
// gives, and with a 32 MiB rule (larger than the defaults hold for every
// lease: the rest get the default ring): at 2 and at 4 ranks every direction between the guests takes a
// ring (none says no-space, and hostd counts one first switch to the rings per direction), and a job
// that ends well prints nothing at btl_shunt_verbose 0 (no "ring ended
// ... (peer-gone)" as the first rank leaves).
func TestMPIBTLDefaults(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	needBTL(t)
	for _, c := range []struct{ name, policy string }{
		{"default-ring", ""},
		{"mpi-rule-4MiB", mpiRingPolicy},
		// Rings larger than the defaults hold: the first leases get them,
		// the rest the default ring (hostd/broker/ringsize.go).
		{"mpi-rule-32MiB", strings.Replace(mpiRingPolicy, `"4MiB"`, `"32MiB"`, 1)},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := startEnv(t, "d", stack.Options{Guests: 2, HostdBin: hostdBin, Policy: c.policy, Group: "  # hostd's defaults\n"})
			for _, np := range []int{2, 4} {
				// Directions that took a ring: hostd's counter of first
				// switches (a 2-rank job can be on and off the rings
				// between two polls of hostd's flows).
				before := e.counter(firstSwitches)
				out := e.runMPI(t, mpiJob{np: np, prog: "btlcheck", args: []string{"-m", "1048576"}, mca: []string{"--mca", "btl_shunt_verbose", "0"}})
				flows := int(e.counter(firstSwitches) - before)
				want := np * np / 2 // np/2 ranks per guest, each to np/2 in the other, both ways
				if !strings.Contains(out, "data ok") || strings.Contains(out, "no-space") || strings.Contains(out, "tcp (") || flows != want {
					t.Fatalf("%d ranks: hostd counted %d directions onto the rings, want %d, and no direction on tcp\n%s\nhostd's flows: %s", np, flows, want, out, e.flowsJSON())
				}
				for _, bad := range []string{"peer-gone", "ring ended", "btl/shunt: "} {
					if strings.Contains(out, bad) {
						t.Fatalf("%d ranks: a job that ended well printed %q at verbosity 0\n%s", np, bad, out)
					}
				}
				t.Logf("%d ranks: %d flows on rings; %v given the default ring so far", np, flows, e.counter("shunt_ring_floor_total"))
			}
			if floor := e.counter("shunt_ring_floor_total"); (c.name == "mpi-rule-32MiB") != (floor > 0) {
				t.Fatalf("hostd gave %v flows the default ring instead of the rule's: want some only with 32 MiB rings, which the defaults cannot hold for every lease", floor)
			}
		})
	}
}

// TestMPIBTLFirewallRejectNoTCP: as TestMPIBTLFirewallReject, with tcp
// not in the job's BTL list: the BTL says that no BTL of the job reaches
// the peer (it said "left to the next BTL (tcp)" before), and the job
// fails as Open MPI fails an unreachable peer, within its deadline.
func TestMPIBTLFirewallRejectNoTCP(t *testing.T) {
	e := newEnv(t, 2, "")
	if err := e.rig.Firewall("tcp dport " + btlPorts + " reject with tcp reset"); err != nil {
		t.Fatal(err)
	}
	r := e.startMPI(t, mpiJob{btl: "self,vader,shunt", prog: "btlcheck", args: []string{"-m", "1024"}, timeout: time.Minute})
	select {
	case err := <-r.done:
		if err == nil {
			t.Fatalf("the job succeeded with its only cross-guest BTL rejected\n%s", r.out.String())
		}
	case <-time.After(r.job.timeout):
		r.cmd.Process.Kill()
		<-r.done
		t.Fatalf("the job did not end in %s\n%s", r.job.timeout, r.out.String())
	}
	out := r.out.String()
	if !strings.Contains(out, "the lease connect was refused (a firewall REJECT?): no BTL of the job reaches it (tcp is not in the btl list)") ||
		strings.Contains(out, "left to the next BTL (tcp)") {
		t.Fatalf("the BTL did not say that no BTL of the job reaches the peer\n%s", out)
	}
}
