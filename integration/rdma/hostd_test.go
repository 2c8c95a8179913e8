//go:build linux

package rdma

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/peers/peertest"
	"github.com/shuntnet/shunt/integration/mpirig"
	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestRDMAHostd: hostd's relay carries a guest's connection across two
// hosts over the RDMA link, end to end. Each of two QEMU TCG VMs (joined
// by -netdev stream, rdma_rxe on eth0, as in TestRDMASoftRoCE) is a host:
// conntrack and nftables, one namespace guest behind a veth, forwarding
// to the other, and hostd built with -tags rdma, peered with the other
// over mutual TLS (hostd-agent.sh). Asserted, from the guests' consoles:
// both hostds' `hostd peers` show the relay link `up (rdma)`; a Go guest
// on h2 streams seeded bytes to an echo on h1's guest in four parts and
// checks the echo byte for byte (both directions); after part 1 the
// connection is on the rings through the relay (`hostd flows`: relay h1);
// during part 2 h2's policy flips to TCP and back twice, the connection
// leaving and coming back to the relay each time; during part 3 the RoCE
// packets coming into h2 are dropped (tc at eth0's ingress, a fabric
// fault: the queue pairs' retries run out), the RDMA link ends, the link
// comes back as TCP (`up (tcp)`, the minute's back-off) and the
// connection is back on the relay over it; the whole stream arrives
// intact; each host's relay sent some of its guest's bytes by scatter
// entry straight from the guest's ring (zero copy, sending side:
// shunt_relay_gathered_bytes_total above 0 and at most the bytes sent).
// Bytes: SHUNT_RDMA_HOSTD_BYTES (4 MiB, small for TCG's sake).
func TestRDMAHostd(t *testing.T) {
	n := envInt("SHUNT_RDMA_HOSTD_BYTES", 4<<20)
	client, server := hostdRig(t, "full", n, 6*time.Minute, nil)
	for _, want := range []string{"HOSTD-AGENT LINK rdma", "HOSTD-AGENT RELAYED", "HOSTD-AGENT FLIP 1", "HOSTD-AGENT FLIP 2",
		"HOSTD-AGENT RDMA-ENDED", "HOSTD-AGENT DOWNGRADED", fmt.Sprintf("GUEST OK dial sent=%d echoed=%d ", n, n)} {
		if !client.Has(0, want) {
			t.Errorf("h2 (client) never said %q", want)
		}
	}
	for _, want := range []string{"HOSTD-AGENT LINK rdma", fmt.Sprintf("GUEST OK serve echoed=%d", n)} {
		if !server.Has(0, want) {
			t.Errorf("h1 (server) never said %q", want)
		}
	}
	// Zero copy, sending side: each host's relay sent bytes of its
	// guest's stream by scatter entry from the guest's ring (the NIC read
	// them there) while the link was RDMA.
	for name, v := range map[string]*vm.VM{"h2 (client)": client, "h1 (server)": server} {
		var g, out float64
		found := false
		for _, l := range strings.Split(v.Console(), "\n") {
			if _, rest, ok := strings.Cut(l, "HOSTD-AGENT ZEROCOPY "); ok {
				_, err := fmt.Sscanf(rest, "gathered=%g out=%g", &g, &out)
				found = err == nil
			}
		}
		if !found || g <= 0 || g > out {
			t.Errorf("%s: %v bytes gathered from the guest's ring of %v sent (found %v); want some, at most all", name, g, out, found)
		}
		t.Logf("%s: %v of %v bytes sent gathered from the guest's ring (zero copy)", name, g, out)
	}
}

// TestRDMARxeRemoved: the RDMA device removed under hostd's relay
// mid-stream. The rig of TestRDMAHostd; the Go guest on h2 streams
// seeded bytes to h1's echo in four parts; once part 1 is on the relay
// over RDMA, and while part 3 streams, h2 deletes its rxe device (`rdma
// link delete rxe0`). Asserted: h2's RDMA link ends (hostd sees the
// device's removal begin: its uverbs node goes first), the removal
// completes within a minute (rxe in Linux 6.1 waits until hostd lets
// go of the device: without the watch it waited for ever), the link
// comes back as TCP with the connection on the relay over it, `hostd
// peers` and the log give the reason (device rxe0 removed), and the
// whole stream arrives intact both ways. Bytes:
// SHUNT_RDMA_REMOVED_BYTES (2 MiB).
func TestRDMARxeRemoved(t *testing.T) {
	n := envInt("SHUNT_RDMA_REMOVED_BYTES", 2<<20)
	client, server := hostdRig(t, "remove", n, 4*time.Minute, nil)
	for _, want := range []string{"HOSTD-AGENT LINK rdma", "HOSTD-AGENT RELAYED", "HOSTD-AGENT RDMA-ENDED", "HOSTD-AGENT REMOVED",
		"HOSTD-AGENT DOWNGRADED", fmt.Sprintf("GUEST OK dial sent=%d echoed=%d ", n, n)} {
		if !client.Has(0, want) {
			t.Errorf("h2 (client) never said %q", want)
		}
	}
	for _, want := range []string{"HOSTD-AGENT LINK rdma", fmt.Sprintf("GUEST OK serve echoed=%d", n)} {
		if !server.Has(0, want) {
			t.Errorf("h1 (server) never said %q", want)
		}
	}
}

// TestRDMAMPI: an Open MPI job with 2 ranks per host across the RDMA
// link. The rig of TestRDMAHostd (hostd on each VM host, relay link `up
// (rdma)`); btl/shunt (built here, make mpi) and btlcheck go into the
// images, Open MPI comes from the host's /usr. mpirun runs in h1's
// guest g1 and starts orted in h2's g1 through the guest program's exec
// server; 2 ranks in each g1 (btlcheck -m SHUNT_RDMA_MPI_BYTES, 64 KiB:
// point-to-point of every size with a partner on the other host,
// non-blocking, wildcard, collectives; every byte checked). Asserted:
// "data ok"; the BTL moved the job's directions across the hosts onto
// relayed rings (8: 4 pairs across, 2 directions each; fewer only where
// the BTL says a lease's pairing timed out) and left the pairs within a
// guest to vader; h1's relay to h2 stayed the one link made (hostd's
// shunt_relay_links_total 1, still `up (rdma)`) and carried bytes both
// ways (shunt_relay_bytes_total): the relayed directions went over the
// RDMA link.
func TestRDMAMPI(t *testing.T) {
	testenv.NeedTool(t, "mpicc", "libopenmpi-dev openmpi-bin")
	testenv.NeedTool(t, "mpirun", "openmpi-bin")
	testenv.NeedTool(t, "make", "make")
	needRig(t)
	n := envInt("SHUNT_RDMA_MPI_BYTES", 64<<10)
	dir := filepath.Join(t.TempDir(), "mpi")
	if err := mpirig.Build("../..", dir, "btlcheck"); err != nil {
		testenv.Missing(t, "cannot build btl/shunt: "+err.Error(), "apt-get install make gcc libopenmpi-dev openmpi-bin")
	}
	client, server := hostdRig(t, "mpi", n, 4*time.Minute,
		[]string{filepath.Join(dir, "mca_btl_shunt.so"), filepath.Join(dir, "btlcheck")}, dir, mpirig.SysComponents())
	out := server.Console()
	var mpi strings.Builder
	for _, l := range strings.Split(out, "\n") {
		if l, ok := strings.CutPrefix(strings.TrimSpace(l), "HOSTD-AGENT mpi: "); ok {
			mpi.WriteString(l + "\n")
		}
	}
	job := mpi.String()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Logf("the job's output:\n%s", job)
		t.Fatalf(format, args...)
	}
	if !strings.Contains(job, "data ok") || strings.Contains(job, "ERROR") {
		fail("the job did not end with \"data ok\", or the BTL reported an error")
	}
	rel := strings.Count(job, ": relayed ring (slot ")
	if rel != 8 && (rel < 1 || !strings.Contains(job, ": tcp (timeout)")) {
		fail("the BTL moved %d directions to relayed rings; want 8 (4 pairs across the hosts)", rel)
	}
	for _, pair := range [][2]int{{0, 1}, {1, 0}, {2, 3}, {3, 2}} {
		if w := fmt.Sprintf("rank %d: rank %d is in this guest: left to vader", pair[0], pair[1]); !strings.Contains(job, w) {
			fail("no %q: a pair within a guest did not stay on vader", w)
		}
	}
	var links, bout, bin, gath float64
	found := false
	for _, l := range strings.Split(out, "\n") {
		if _, rest, ok := strings.Cut(l, "HOSTD-AGENT MPI-RDMA "); ok {
			_, err := fmt.Sscanf(rest, "links=%g out=%g in=%g gathered=%g", &links, &bout, &bin, &gath)
			found = err == nil
		}
	}
	if !found || links != 1 || bout < float64(n) || bin < float64(n) {
		fail("h1's relay to h2: %v links made, %v bytes out, %v in; want the one RDMA link, at least %d bytes each way", links, bout, bin, n)
	}
	if gath <= 0 || gath > bout {
		fail("h1's relay to h2: %v of %v bytes out gathered from the guests' rings; want some (zero copy), at most all", gath, bout)
	}
	if !client.Has(0, "HOSTD-AGENT DONE") {
		fail("h2 never said DONE")
	}
	t.Logf("%d directions on relayed rings; h1's RDMA link to h2 carried %v bytes out (%v of them gathered from the rings), %v in", rel, bout, gath, bin)
}

// hostdRig boots the two VM hosts of TestRDMAHostd with hostd-agent.sh's
// scenario for a stream of n bytes (extra: more files for the images,
// more arguments for the agents), waits (at most limit) until both
// agents are done, logs their steps and returns the VMs. A failing agent
// has printed both hosts' state (hostd peers, flows, log) first; the
// agents' watchdog prints it 30 s before limit.
func hostdRig(t *testing.T, scenario string, n int, limit time.Duration, extra []string, args ...string) (client, server *vm.VM) {
	t.Helper()
	kernel := needRig(t)
	testenv.NeedTool(t, "nft", "nftables") // the VMs run the host's /usr
	testenv.NeedTool(t, "tc", "iproute2")
	dir := t.TempDir()
	hostd := goBuild(t, dir, "../../cmd/hostd")
	guest := goBuild(t, dir, "./guest")
	cfg := filepath.Join(dir, "cfg")
	files, err := hostdConfigs(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if os.Getenv("SHUNT_RDMA_HOSTD_LOG") != "" {
		// The agents print hostd's whole log at the end, not only the
		// relay's links and switches (go test -v shows it on success).
		p := filepath.Join(cfg, "fulllog")
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		files = append(files, p)
	}
	agent, _ := filepath.Abs("hostd-agent.sh")
	rxe, _ := filepath.Abs("rxe.sh")
	initrd := filepath.Join(dir, "initramfs")
	files = append(files, rxe, hostd, guest, "/etc/libibverbs.d/rxe.driver")
	files = append(files, extra...)
	if err := vm.BuildInitramfsFiles(initrd, kernel, agent, files...); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	server, client = bootPair(t, kernel, initrd, append([]string{rxe, hostd, guest, cfg, strconv.Itoa(n), scenario,
		strconv.Itoa(int((limit - 30*time.Second).Seconds()))}, args...)...)
	t.Cleanup(func() { logStages(t, "HOSTD-AGENT", server, client) })
	// Generous, bounded: the stream stalls for the queue pairs' retries
	// (about 8 s) at the fault, and TCG guests slow down several times on
	// a loaded machine.
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	// Either host's failure ends the wait (it printed both hosts' state).
	type end struct {
		m    *vm.VM
		line string
		err  error
	}
	ends := make(chan end, 2)
	for _, m := range []*vm.VM{client, server} {
		go func() {
			line, err := m.WaitAny(ctx, 0, "HOSTD-AGENT DONE", "HOSTD-AGENT FAIL", "SHUNT-VM AGENT-EXIT")
			ends <- end{m, line, err}
		}()
	}
	for range 2 {
		if e := <-ends; e.err != nil || e.line != "HOSTD-AGENT DONE" {
			t.Fatalf("%s: %q, %v", e.m.Name, e.line, e.err)
		}
	}
	for _, m := range []*vm.VM{server, client} {
		for _, l := range strings.Split(m.Console(), "\n") {
			if strings.HasPrefix(l, "HOSTD-AGENT peers:") || strings.HasPrefix(l, "HOSTD-AGENT flows:") ||
				strings.HasPrefix(l, "HOSTD-AGENT log:") || strings.HasPrefix(l, "HOSTD-AGENT REMOVED") || strings.HasPrefix(l, "HOSTD-AGENT MPI-RDMA") || strings.HasPrefix(l, "GUEST ") {
				t.Logf("%s: %s", m.Name, l)
			}
		}
	}
	t.Logf("took %s", time.Since(start).Round(time.Second))
	return client, server
}

// hostdConfigs writes into dir each host's hostd.hcl, with its policy on
// the rings (hK-rings.hcl) and on TCP (hK-tcp.hcl), and the peers' TLS
// material, and returns the files' paths (for the initramfs). h1 is the
// server VM (10.98.0.1, guests 10.77.0.0/16), h2 the client (10.98.0.2,
// 10.78.0.0/16).
func hostdConfigs(dir string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	ca, err := peertest.NewCA(dir, "ca")
	if err != nil {
		return nil, err
	}
	files := []string{ca.Path}
	for k := 1; k <= 2; k++ {
		o := 3 - k
		cert, key, err := ca.Issue(fmt.Sprintf("h%d", k))
		if err != nil {
			return nil, err
		}
		files = append(files, cert, key)
		base := fmt.Sprintf(`log_level = "debug"
admin_socket = "/tmp/admin.sock"
pairing_timeout = "2s"
state_dir = "/tmp/shunt/state"
region_dir = "/tmp/shunt/regions"
trust_group "t" {
  region = "/dev/shm/shunt-t"
  region_size = "16MiB"
  slots = 64
  pair_region_size = "32MiB" # 8 relayed rings of 1 MiB and more (TestRDMAMPI)
  pair_slots = 64
  guest_ring_bytes = "64MiB"
  guest_flows = 64
}
guest "g1" {
  id = 1
  group = "t"
  control = "/tmp/shunt/g1.sock"
  interface = "vg1"
}
peering {
  listen      = "10.98.0.%d:7470"
  certificate = %q
  key         = %q
  ca          = %q
  interval    = "2s"  # a TCG guest's hostd may be slow to answer: 6 s of silence is down
}
peer "h%d" {
  address  = "10.98.0.%d:7470"
  prefixes = ["10.%d.0.0/16"]
}
`, k, cert, key, ca.Path, o, o, 76+o)
		for name, policy := range map[string]string{"rings": "", "tcp": `default = "tcp"`} {
			p := filepath.Join(dir, fmt.Sprintf("h%d-%s.hcl", k, name))
			if err := os.WriteFile(p, []byte(base+"policy {\n"+policy+"\n}\n"), 0o644); err != nil {
				return nil, err
			}
			files = append(files, p)
		}
	}
	return files, nil
}
