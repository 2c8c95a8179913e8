//go:build linux

package vsock_test

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/nsexec"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// The two VMs of TestVsockVMToVM, each on a tap of its own in the rig's
// host namespace, which routes between them.
const (
	vmAAddr, vmAHost = "10.77.152.2", "10.77.152.1"
	vmBAddr, vmBHost = "10.77.153.2", "10.77.153.1"
	vmAID, vmBID     = 52, 53
	vm2vmPort        = 7200
	vm2vmLen         = 4 << 20
	vmASeed, vmBSeed = 21, 23
)

// vmPair is a rig host with hostd and two TCG VMs (vhost-user-vsock served
// by hostd, virtio-serial control, no ivshmem), booted at once: A runs
// phasesA (it dials B), B listens on vm2vmPort with glisten.
type vmPair struct {
	t      testing.TB
	s      *stack.Stack
	hostd  string
	a, b   *rig
	booted time.Duration
	// fail fails the test with the state of everything: hostd's
	// connections, counters and debug log, both VMs' QEMU output and
	// consoles (their libraries' logs among them).
	fail func(format string, args ...any)
}

func startVMPair(t testing.TB, ctx context.Context, bytes int64, phaseA string) *vmPair {
	return startVMPairWith(t, ctx, fmt.Sprintf("glisten:%d:%d:%d", vm2vmPort, bytes, vmBSeed), phaseA)
}

// startVMPairWith is startVMPair with B running phaseB.
func startVMPairWith(t testing.TB, ctx context.Context, phaseB, phaseA string) *vmPair {
	return startVMPairFiles(t, ctx, nil, []string{phaseB}, []string{phaseA})
}

// startVMPairFiles is startVMPairWith with files in both VMs' initramfs
// (at their own paths, the host's /usr over 9p: bootOpts.files) and each
// VM running phases of its own.
func startVMPairFiles(t testing.TB, ctx context.Context, files, phasesB, phasesA []string) *vmPair {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	start := time.Now()
	dir := t.TempDir()
	hostd := filepath.Join(dir, "hostd")
	if out, err := exec.Command("go", "build", "-o", hostd, "../../cmd/hostd").CombinedOutput(); err != nil {
		t.Fatalf("build hostd: %v\n%s", err, out)
	}
	type vmSpec struct {
		name, addr, gw, tap string
		id, cid             int
	}
	specs := []vmSpec{{"vma", vmAAddr, vmAHost, "vtap0", vmAID, guestCID}, {"vmb", vmBAddr, vmBHost, "vtap1", vmBID, guestCID + 1}}
	var extra string
	for _, v := range specs {
		extra += fmt.Sprintf("guest %q {\n  id = %d\n  group = \"t\"\n  control = %q\n  addresses = [%q]\n  vsock {\n    socket = %q\n    cid = %d\n  }\n}\n",
			v.name, v.id, filepath.Join(dir, v.name+".sock"), v.addr, filepath.Join(dir, v.name+".vsock"), v.cid)
	}
	s, err := stack.Start(stack.Options{Name: fmt.Sprintf("vv%d", os.Getpid()%100000), Guests: 1, HostdBin: hostd, Dir: dir, Extra: extra, Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	p := &vmPair{t: t, s: s, hostd: hostd}
	p.fail = func(format string, args ...any) {
		t.Helper()
		flows, _ := s.Conns()
		js, _ := json.MarshalIndent(flows, "", "  ")
		state := func(r *rig) string {
			if r == nil {
				return "not booted"
			}
			return r.state()
		}
		t.Fatalf("%s\nhostd's connections: %s\nhostd counters:\n%s\nhostd log:\n%s\nVM A: %s\nVM B: %s", fmt.Sprintf(format, args...), js, counters(hostd, s.Admin), s.Log(),
			state(p.a), state(p.b))
	}
	boot := func(v vmSpec, phases ...string) *rig {
		ports, err := vserial.Port{ID: "shunt0", Socket: filepath.Join(dir, v.name+".sock"), Ports: 1}.QEMUArgs()
		if err != nil {
			t.Fatal(err)
		}
		return bootWith(t, ctx, bootOpts{netns: s.Rig.HostNSPath(), addr: v.addr, gw: v.gw, tap: v.tap, sock: filepath.Join(dir, v.name+".vsock"), qemu: ports, noWait: true, files: files},
			append(phases, "pause:5000:0:0")...)
	}
	p.b = boot(specs[1], phasesB...)
	p.a = boot(specs[0], append([]string{fmt.Sprintf("target:%s:0:0", vmBAddr)}, phasesA...)...)
	p.a.ready()
	p.b.ready()
	p.booted = time.Since(start)
	return p
}

// onRings waits until both VMs say their connection is on the fast path
// and hostd's flows show it on the rings via vsock.
func (p *vmPair) onRings(ctx context.Context) {
	p.t.Helper()
	for _, r := range []*rig{p.a, p.b} {
		saidOnRings(r.ctx, r, p.fail)
	}
	p.waitPath(ctx, "rings")
}

// waitPath waits until hostd's flows show the connection on path ("rings":
// via vsock).
func (p *vmPair) waitPath(ctx context.Context, path string) {
	p.t.Helper()
	waitConnPath(ctx, p.t, p.s, vm2vmPort, path, p.fail)
}

// tellB is the host's word to B's program (a TCP connection to
// vm2vmPort+1 from the host namespace): go, or (flips) end your stream.
func (p *vmPair) tellB() {
	p.t.Helper()
	err := nsexec.In(p.s.Rig.HostNSPath(), func() error {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("%s:%d", vmBAddr, vm2vmPort+1), 10*time.Second)
		if err == nil {
			c.Close()
		}
		return err
	})
	if err != nil {
		p.fail("tell VM B: %v", err)
	}
}

// line waits for r's result line of mode (until the test's deadline, or
// r's QEMU exits) and returns its fields.
func (p *vmPair) line(r *rig, mode string) map[string]string {
	p.t.Helper()
	prefix := fmt.Sprintf("SHUNT-VSOCK %s port=%d ", mode, vm2vmPort)
	line, err := r.v.WaitAny(r.ctx, 0, prefix, "SHUNT-VSOCK ERROR")
	if err != nil || !strings.HasPrefix(line, prefix) {
		p.fail("the VM's %s: %q %v", mode, line, err)
	}
	p.t.Logf("%s", line)
	return fields(line)
}

// seededSum is the SHA-256 of the first n bytes of seed's stream.
func seededSum(seed uint64, n int64) string {
	h := sha256.New()
	io.CopyN(h, rand.NewChaCha8(seedBytes(seed)), n)
	return fmt.Sprintf("%x", h.Sum(nil))
}

// pathCounts reports whether a VM's line shows bytes both ways on the
// rings (and, with tcp, on TCP too).
func pathCounts(f map[string]string, tcp bool) bool {
	ring, tc := strings.Split(f["ring"], "/"), strings.Split(f["tcp"], "/")
	ok := len(ring) == 2 && ring[0] != "0" && ring[1] != "0" && len(tc) == 2
	if tcp {
		ok = ok && tc[0] != "0" && tc[1] != "0"
	}
	return ok
}

// TestVsockVMToVM: two TCG VMs with vhost-user-vsock and no ivshmem, both
// served by hostd, booted at once; A dials B with guestlib through the
// host's routing and conntrack. The connection must reach the fast path,
// which between two such VMs is each VM's stretch bridged by its own room
// onto the flow's ring pair (docs/vsock.md, "VM to VM"); `hostd flows`
// must show it on the rings via vsock. Then 4 MiB of seeded bytes each
// way at once, with a half-close each way: both VMs' SHA-256 of both
// directions must match the seeds', both VMs' libraries must have moved
// bytes on the rings both ways, at least half the stream each way, and
// each VM's vsock device at least what its rings carried
// (shunt_vsock_bytes_total).
func TestVsockVMToVM(t *testing.T) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	p := startVMPair(t, ctx, vm2vmLen, fmt.Sprintf("gdial:%d:%d:%d", vm2vmPort, vm2vmLen, vmASeed))
	p.onRings(ctx)
	p.tellB()
	fa, fb := p.line(p.a, "gdial"), p.line(p.b, "glisten")
	aSum, bSum := seededSum(vmASeed, vm2vmLen), seededSum(vmBSeed, vm2vmLen)
	n := strconv.Itoa(vm2vmLen)
	if fa["sent"] != aSum || fb["recv"] != aSum || fb["bytes"] != n {
		p.fail("A to B: A sent sum %s, B got %s bytes sum %s; want %d bytes sum %s", fa["sent"], fb["bytes"], fb["recv"], vm2vmLen, aSum)
	}
	if fb["sent"] != bSum || fa["recv"] != bSum || fa["bytes"] != n {
		p.fail("B to A: B sent sum %s, A got %s bytes sum %s; want %d bytes sum %s", fb["sent"], fa["bytes"], fa["recv"], vm2vmLen, bSum)
	}
	if !pathCounts(fa, false) || !pathCounts(fb, false) {
		p.fail("per-path counts: A ring %s tcp %s, B ring %s tcp %s: want ring bytes both ways at both", fa["ring"], fa["tcp"], fb["ring"], fb["tcp"])
	}
	cs := counters(p.hostd, p.s.Admin)
	for g, f := range map[string]map[string]string{"vma": fa, "vmb": fb} {
		// A VM's first writes go by TCP, until hostd's ATTACHED says the
		// other VM's reader attached (attached end to end, docs/vsock.md:
		// 160 KiB of A's once here): the rings must have carried at least
		// half the stream each way, and the device at least what they
		// carried.
		var sent, recv float64
		if _, err := fmt.Sscanf(f["ring"], "%g/%g", &sent, &recv); err != nil || sent < vm2vmLen/2 || recv < vm2vmLen/2 {
			p.fail("%s's rings carried %s (sent/received, %v): want at least half the stream (%d bytes) each way", g, f["ring"], err, vm2vmLen)
		}
		for dir, n := range map[string]float64{"rx": sent, "tx": recv} {
			key := fmt.Sprintf("shunt_vsock_bytes_total{direction=%s,guest=%s}", dir, g)
			if v := counterValue(cs, key); v < n {
				p.fail("%s = %v: the device carried less than the rings (%v bytes)", key, v, n)
			}
		}
		if v := counterValue(cs, fmt.Sprintf("shunt_vsock_bad_packets_total{guest=%s}", g)); v != 0 {
			p.fail("%s's honest driver was refused %v times", g, v)
		}
	}
	t.Logf("A: ring %s tcp %s; B: ring %s tcp %s; boot %v, whole test %v", fa["ring"], fa["tcp"], fb["ring"], fb["tcp"],
		p.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// TestVsockVMToVMFlips: the VMs of TestVsockVMToVM stream seeded bytes
// both ways at once (64 KiB every 10 ms each) while the policy flips the
// connection to TCP and back vsockFlips times, each switch waited for in
// `hostd flows`. Between two vsock VMs a downgrade is a DOWN with the
// four bridges draining (docs/vsock.md, "VM to VM"). Then B ends its
// stream, A its own once it read to that end: both directions' lengths
// and SHA-256 must match at both VMs, and both must have moved bytes on
// the rings and on TCP both ways and taken a READY per stretch.
func TestVsockVMToVMFlips(t *testing.T) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	p := startVMPair(t, ctx, 0, fmt.Sprintf("gflip:%d:0:%d", vm2vmPort, vmASeed))
	p.onRings(ctx)
	p.tellB() // go
	for i := range vsockFlips {
		t0 := time.Now()
		if _, err := p.s.SetPolicy(stack.PolicyTCP); err != nil {
			p.fail("flip %d: %v", i, err)
		}
		p.waitPath(ctx, "tcp")
		t1 := time.Now()
		if _, err := p.s.SetPolicy(""); err != nil {
			p.fail("flip %d: %v", i, err)
		}
		p.waitPath(ctx, "rings")
		t.Logf("flip %d: to tcp in %v, back on the rings in %v", i, t1.Sub(t0).Round(time.Millisecond), time.Since(t1).Round(time.Millisecond))
		time.Sleep(300 * time.Millisecond) // bytes on the rings between flips
	}
	p.tellB() // end
	fb, fa := p.line(p.b, "glisten"), p.line(p.a, "gflip")
	aN, _ := strconv.ParseInt(fa["sentbytes"], 10, 64)
	bN, _ := strconv.ParseInt(fb["sentbytes"], 10, 64)
	aSum, bSum := seededSum(vmASeed, aN), seededSum(vmBSeed, bN)
	if aN == 0 || fa["sent"] != aSum || fb["recv"] != aSum || fb["bytes"] != fa["sentbytes"] {
		p.fail("A to B: A sent %d bytes (sum %s, seeded %s), B got %s (sum %s)", aN, fa["sent"], aSum, fb["bytes"], fb["recv"])
	}
	if bN == 0 || fb["sent"] != bSum || fa["recv"] != bSum || fa["bytes"] != fb["sentbytes"] {
		p.fail("B to A: B sent %d bytes (sum %s, seeded %s), A got %s (sum %s)", bN, fb["sent"], bSum, fa["bytes"], fa["recv"])
	}
	if !pathCounts(fa, true) || !pathCounts(fb, true) || atoi(fa["readies"]) < vsockFlips+1 || atoi(fb["readies"]) < vsockFlips+1 {
		p.fail("per-path counts: A ring %s tcp %s readies %s, B ring %s tcp %s readies %s: want ring and TCP bytes both ways at both, a READY per stretch",
			fa["ring"], fa["tcp"], fa["readies"], fb["ring"], fb["tcp"], fb["readies"])
	}
	t.Logf("A -> B %d bytes, B -> A %d bytes, checksums equal; A: ring %s tcp %s readies %s downs %s; B: ring %s tcp %s readies %s downs %s; boot %v, whole test %v",
		aN, bN, fa["ring"], fa["tcp"], fa["readies"], fa["downs"], fb["ring"], fb["tcp"], fb["readies"], fb["downs"], p.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// TestVsockVMToVMKilled: VM A's program writes to VM B over their
// stretches (64 KiB every 10 ms) and is SIGKILLed after 2 MiB (gkill, as
// in TestVsockKilled); B only reads. A's room resets the flow's ring, and
// B, whose read ring is in its own memory where no room can reset it, is
// told by RESUME(reset): B must read a prefix of A's seeded stream, then
// ECONNRESET, never a clean end of a stream cut short.
func TestVsockVMToVMKilled(t *testing.T) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	p := startVMPair(t, ctx, -1, fmt.Sprintf("gkill:%d:0:%d", vm2vmPort, vmASeed))
	p.onRings(ctx)
	p.tellB()
	if line, err := p.a.v.WaitAny(p.a.ctx, 0, "SHUNT-VSOCK KILLED", "SHUNT-VSOCK ERROR"); err != nil || !strings.HasPrefix(line, "SHUNT-VSOCK KILLED") {
		p.fail("A's program was not killed mid-stream: %q %v", line, err)
	}
	f := p.line(p.b, "glisten")
	n, _ := strconv.ParseInt(f["bytes"], 10, 64)
	if f["reset"] != "true" || f["recv"] != seededSum(vmASeed, n) {
		p.fail("B read %d bytes (a prefix of A's stream: %v), then ECONNRESET %s; want a prefix, then ECONNRESET", n, f["recv"] == seededSum(vmASeed, n), f["reset"])
	}
	t.Logf("B read %d bytes of A's stream, then ECONNRESET; boot %v, whole test %v", n, p.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}
