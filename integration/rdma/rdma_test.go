//go:build linux

package rdma

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/vm"
)

// TestRDMASoftRoCE: two QEMU TCG guests (-cpu max) joined by a -netdev
// stream over a Unix socket, each with rdma_rxe on eth0 (Debian's guest
// kernel, the host's /usr over 9p for libibverbs and its rxe provider).
// ibv_rc_pingpong must pass first (the oracle: verbs work on this link),
// then per round ib_write_bw, the relay's RDMA link and its TCP link each
// move a stream one way (the figures side by side, logged); then the
// RDMA link carries seeded streams both ways on 4 flows, which both ends
// check by SHA-256 (shunt-rdma fails on a mismatch); last, the sender's
// queue pair is forced into error mid-stream: both links must end, and
// the stream resumes on TCP at the receiver's offset (between what the
// sender saw acknowledged and what it wrote), the whole checksummed. The
// links are set up as the relay sets them up (relay.NegotiateRDMA over
// a TCP side channel between the guests). Rounds and seconds:
// SHUNT_RDMA_ROUNDS (1), SHUNT_RDMA_SECONDS (2). The checked streams are
// small (1 MiB a flow, 2 MiB across the fault): each pass over the bytes
// is slow under TCG, several times slower on a loaded machine.
func TestRDMASoftRoCE(t *testing.T) {
	kernel := needRig(t)
	rounds, secs := envInt("SHUNT_RDMA_ROUNDS", 1), envInt("SHUNT_RDMA_SECONDS", 2)
	dir := t.TempDir()
	bin := goBuild(t, dir, "../../cmd/shunt-rdma")
	initrd := filepath.Join(dir, "initramfs")
	agent, _ := filepath.Abs("agent.sh")
	rxe, _ := filepath.Abs("rxe.sh")
	if err := vm.BuildInitramfsFiles(initrd, kernel, agent, rxe, bin, "/etc/libibverbs.d/rxe.driver"); err != nil {
		t.Fatal(err)
	}
	// About what rxe under TCG moves in secs seconds on a quiet machine
	// (ib_write_bw gave some 5 to 18 MB/s): the link's stream lasts
	// about as long, and a few times longer under load.
	bytes := strconv.Itoa(secs * 8 << 20)
	start := time.Now()
	server, client := bootPair(t, kernel, initrd, rxe, bin, bytes, strconv.Itoa(rounds), strconv.Itoa(secs))
	defer logStages(t, "RDMA-AGENT", server, client)

	// Generous: under CI the machine also runs other test packages, and
	// TCG guests slow down with it (boot took 42 s under a load of 11).
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(300+60*rounds*secs/2)*time.Second)
	defer cancel()
	for _, m := range []*vm.VM{server, client} {
		line, err := m.WaitAny(ctx, 0, "RDMA-AGENT UP", "RDMA-AGENT FAIL", "SHUNT-VM AGENT-EXIT")
		if err != nil || !strings.HasPrefix(line, "RDMA-AGENT UP") {
			t.Fatalf("%s: rxe0 not up: %q, %v", m.Name, line, err)
		}
	}
	t.Logf("both guests up with rxe0 after %s", time.Since(start).Round(time.Second))
	for _, m := range []*vm.VM{client, server} {
		line, err := m.WaitAny(ctx, 0, "RDMA-AGENT DONE", "RDMA-AGENT FAIL", "SHUNT-VM AGENT-EXIT")
		if err != nil || line != "RDMA-AGENT DONE" {
			t.Fatalf("%s: %q, %v", m.Name, line, err)
		}
	}
	// The figures: the client sends in every one-way run.
	var wbw, link, tcp []float64
	// ib_write_bw's figure is its iterations in the -D seconds: under
	// TCG its own average (from the TSC and the CPU's MHz) is sometimes
	// 0.00 where the iterations say some 10 MB/s.
	writebw := regexp.MustCompile(`^RDMA-AGENT WRITEBW round=\d+ +65536 +(\d+) +[\d.]+ +[\d.]+`)
	ours := regexp.MustCompile(`^SHUNT-RDMA (rdma|tcp) OK flows=1 .*MBps=([\d.]+)`)
	console := client.Console()
	for _, l := range strings.Split(console, "\n") {
		l = strings.TrimSpace(l)
		if strings.HasPrefix(l, "RDMA-AGENT WRITEBW") || strings.HasPrefix(l, "SHUNT-RDMA") {
			t.Log(l)
		}
		if m := writebw.FindStringSubmatch(l); m != nil {
			wbw = append(wbw, atof(m[1])*65536/float64(secs)/1e6)
		}
		if m := ours.FindStringSubmatch(l); m != nil {
			if m[1] == "rdma" {
				link = append(link, atof(m[2]))
			} else {
				tcp = append(tcp, atof(m[2]))
			}
		}
	}
	if len(wbw) != rounds || len(link) != rounds || len(tcp) != rounds {
		t.Fatalf("figures: ib_write_bw %v, RDMA link %v, TCP link %v; want %d each", wbw, link, tcp, rounds)
	}
	both := strings.Count(console, "SHUNT-RDMA rdma OK flows=4") + strings.Count(server.Console(), "SHUNT-RDMA rdma OK flows=4")
	if both != 2 {
		t.Fatalf("the streams both ways were checked by %d ends, want 2", both)
	}
	ratios := make([]float64, rounds)
	for i := range ratios {
		ratios[i] = link[i] / wbw[i]
	}
	// The fault: the sender's queue pair in error after 2 of 8 MiB; both
	// links end, the stream resumes on TCP where the receiver stopped, and
	// the receiver's checksum of the whole matches.
	for _, m := range []*vm.VM{client, server} {
		for _, l := range strings.Split(m.Console(), "\n") {
			if strings.HasPrefix(strings.TrimSpace(l), "SHUNT-RDMA fault OK") {
				t.Logf("%s: %s", m.Name, strings.TrimSpace(l))
			}
		}
	}
	if !strings.Contains(console, "SHUNT-RDMA fault OK sender") || !strings.Contains(server.Console(), "SHUNT-RDMA fault OK receiver") {
		t.Fatal("the fault run did not end well on both ends")
	}
	t.Logf("one way, MB/s, %d rounds of %d s under TCG (medians): ib_write_bw %.1f %.1f, RDMA link %.1f %.1f, TCP link over virtio-net %.1f %.1f; RDMA link / ib_write_bw per round %.2f, median %.2fx",
		rounds, secs, median(wbw), wbw, median(link), link, median(tcp), tcp, ratios, median(ratios))
	t.Logf("took %s", time.Since(start).Round(time.Second))
}

func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

func atof(s string) float64 {
	f, _ := strconv.ParseFloat(s, 64)
	return f
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}
