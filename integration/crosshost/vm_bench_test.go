//go:build linux

package crosshost_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/internal/testenv"
)

// The cross-host VM benchmarks (in make bench-cross): a QEMU (TCG) VM on
// each host, h1's VM to h2's, by stack: kernel TCP (virtio-net in both
// VMs, forwarded by both hosts) or Shunt through both relays. Each stack
// boots fresh VMs per round on one peered pair of hosts; `make
// bench-cross` interleaves rounds. The load average before each round is
// logged: the machine is shared.

// vmRounds runs round once per iteration of b's loop on a fresh VM pair
// and reports the medians of what it returns. The timer runs throughout:
// a round takes far longer than make bench-cross's -benchtime, so that
// runs one round per stack (a stopped timer would make b.Loop run on).
func vmRounds(b *testing.B, v *vmPair, stack string, round func(port int) (oneway, mbps float64)) {
	var oneway, mbps []float64
	port := 7400
	for b.Loop() {
		port++
		load, _ := os.ReadFile("/proc/loadavg")
		us, rate := round(port)
		b.Logf("%s: one way %.1f us, stream %.1f MB/s (load %s)", stack, us, rate, strings.Fields(string(load))[0])
		oneway, mbps = append(oneway, us), append(mbps, rate)
		for _, m := range v.vms {
			if m != nil {
				m.Stop()
			}
		}
	}
	b.ReportMetric(medianOf(oneway), "us/oneway")
	b.ReportMetric(medianOf(mbps), "MB/s")
}

// BenchmarkCrossVM: the Go agent (guestlib): 1000 8-byte ping-pongs
// (mean one way), then a 64 MiB stream of 64 KiB writes that h2's VM
// sinks (io.Copy to io.Discard); on Shunt, measured once the connection
// is on the rings. Under TCG the Go agent's own copying bounds its
// stream (docs/BENCHMARKS.md, "Between two QEMU VMs").
func BenchmarkCrossVM(b *testing.B) {
	for _, stack := range crossStacks {
		b.Run(stack, func(b *testing.B) {
			v := newVMPair(b)
			var pre, fast []string
			if stack == "kernel" {
				pre = []string{"tcp"}
			} else {
				fast = []string{"fast"}
			}
			vmRounds(b, v, stack, func(port int) (float64, float64) {
				a2, _ := vmAddr(1)
				v.boot(1, append(pre, "pp-server", fmt.Sprint(port))...)
				v.wait(1, "SHUNT-VM LISTENING", 90*time.Second)
				v.boot(0, append(append(pre, "pp-client", fmt.Sprintf("%s:%d", a2, port), "1000"), fast...)...)
				pp := v.wait(0, "SHUNT-VM PINGPONG", 2*time.Minute)
				st := v.wait(0, "SHUNT-VM STREAM", 2*time.Minute)
				var ns, rate float64
				fmt.Sscanf(pp, "SHUNT-VM PINGPONG %g", &ns)
				fmt.Sscanf(st, "SHUNT-VM STREAM %g", &rate)
				if stack == "shunt" && !v.tookRings(0) {
					b.Fatalf("h1's VM never took its rings\n%s", v.flows())
				}
				return ns / 1e3, rate
			})
		})
	}
}

// BenchmarkCrossVMIperf3: unmodified iperf3 in both VMs, plain or under
// the preload library (the C library finds the control port and the BAR
// itself): 64 KiB writes (-l 64K) for 5 s, the first second left out of
// the figure (-O 1: across hosts the connection starts on TCP and moves
// to the relay once both hosts paired it), the receiver's rate. No
// ping-pong (reported as 0).
func BenchmarkCrossVMIperf3(b *testing.B) {
	testenv.NeedTool(b, "iperf3", "iperf3")
	testenv.NeedTool(b, "make", "make")
	testenv.NeedTool(b, "gcc", "gcc")
	for _, stack := range crossStacks {
		b.Run(stack, func(b *testing.B) {
			v := newVMPair(b)
			bin := b.TempDir()
			lib := filepath.Join(bin, "libshunt-preload.so")
			cmd := exec.Command("make", "-s", "-C", "../..", "BIN="+bin, lib)
			cmd.Env = append(os.Environ(), "MAKEFLAGS=")
			if out, err := cmd.CombinedOutput(); err != nil {
				b.Fatalf("build the preload library: %v\n%s", err, out)
			}
			iperf3, _ := exec.LookPath("iperf3")
			v.initrd = filepath.Join(bin, "initramfs-preload")
			if err := vm.BuildInitramfs(v.initrd, v.kernel, filepath.Join(v.dir, "agent"), lib, iperf3); err != nil {
				b.Fatal(err)
			}
			use := lib
			if stack == "kernel" {
				use = "none"
			}
			rx := regexp.MustCompile(`([0-9.]+) Mbits/sec\s+receiver`)
			vmRounds(b, v, stack, func(port int) (float64, float64) {
				a2, _ := vmAddr(1)
				v.boot(1, "run", use, iperf3, "-s", "-1", "-p", fmt.Sprint(port), "--forceflush")
				v.wait(1, "SHUNT-VM OUT Server listening", 90*time.Second)
				v.boot(0, "run", use, iperf3, "-c", a2.String(), "-p", fmt.Sprint(port), "-t", "5", "-O", "1", "-l", "64K", "-f", "m", "--forceflush")
				if line := v.wait(0, "SHUNT-VM EXIT", 2*time.Minute); line != "SHUNT-VM EXIT 0" {
					b.Fatalf("%s\n%s", line, v.flows())
				}
				out := v.vms[0].Console()
				if stack == "shunt" && !strings.Contains(out, ": shunt (slot") {
					b.Fatalf("iperf3 never took the rings:\n%s\n%s", out, v.flows())
				}
				m := rx.FindStringSubmatch(out)
				if m == nil {
					b.Fatalf("no iperf3 result:\n%s", out)
				}
				mbit, _ := strconv.ParseFloat(m[1], 64)
				return 0, mbit / 8
			})
		})
	}
}
