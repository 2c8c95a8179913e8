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
// intact. Bytes: SHUNT_RDMA_HOSTD_BYTES (4
// MiB, small for TCG's sake).
func TestRDMAHostd(t *testing.T) {
	n := envInt("SHUNT_RDMA_HOSTD_BYTES", 4<<20)
	client, server := hostdRig(t, "full", n, 6*time.Minute)
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
	client, server := hostdRig(t, "remove", n, 4*time.Minute)
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

// hostdRig boots the two VM hosts of TestRDMAHostd with hostd-agent.sh's
// scenario for a stream of n bytes, waits (at most limit) until both
// agents are done, logs their steps and returns the VMs. A failing agent
// has printed both hosts' state (hostd peers, flows, log) first; the
// agents' watchdog prints it 30 s before limit.
func hostdRig(t *testing.T, scenario string, n int, limit time.Duration) (client, server *vm.VM) {
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
	agent, _ := filepath.Abs("hostd-agent.sh")
	rxe, _ := filepath.Abs("rxe.sh")
	initrd := filepath.Join(dir, "initramfs")
	files = append(files, rxe, hostd, guest, "/etc/libibverbs.d/rxe.driver")
	if err := vm.BuildInitramfsFiles(initrd, kernel, agent, files...); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	server, client = bootPair(t, kernel, initrd, rxe, hostd, guest, cfg, strconv.Itoa(n), scenario,
		strconv.Itoa(int((limit - 30*time.Second).Seconds())))
	t.Cleanup(func() { logStages(t, "HOSTD-AGENT", server, client) })
	// Generous, bounded: the stream stalls for the queue pairs' retries
	// (about 8 s) at the fault, and TCG guests slow down several times on
	// a loaded machine.
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	for _, m := range []*vm.VM{client, server} {
		line, err := m.WaitAny(ctx, 0, "HOSTD-AGENT DONE", "HOSTD-AGENT FAIL", "SHUNT-VM AGENT-EXIT")
		if err != nil || line != "HOSTD-AGENT DONE" {
			t.Fatalf("%s: %q, %v", m.Name, line, err)
		}
	}
	for _, m := range []*vm.VM{server, client} {
		for _, l := range strings.Split(m.Console(), "\n") {
			if strings.HasPrefix(l, "HOSTD-AGENT peers:") || strings.HasPrefix(l, "HOSTD-AGENT flows:") ||
				strings.HasPrefix(l, "HOSTD-AGENT log:") || strings.HasPrefix(l, "HOSTD-AGENT REMOVED") || strings.HasPrefix(l, "GUEST ") {
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
  pair_region_size = "16MiB"
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
