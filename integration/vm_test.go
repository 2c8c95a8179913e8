package integration

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/vhost"
	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// vmEnv is a stack whose guests are QEMU VMs on taps in the rig's host
// namespace (the rig's own namespace guests stay idle).
type vmEnv struct {
	*env
	tb     testing.TB
	kernel vm.Kernel
	initrd string
	agent  string // the static guest agent
}

// vmPorts is how many control ports each test VM has: two processes in a
// VM can use Shunt at once.
const vmPorts = 2

func vmAddr(i int) (netip.Addr, netip.Addr) {
	return netip.AddrFrom4([4]byte{10, 77, byte(100 + i), 2}), netip.AddrFrom4([4]byte{10, 77, byte(100 + i), 1})
}

// newVMEnv starts a stack for n VMs configured in hostd.hcl; extra goes
// into the configuration too.
func newVMEnv(t testing.TB, n int, extra ...string) *vmEnv {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "qemu-system-x86_64", "qemu-system-x86")
	testenv.NeedTool(t, "busybox", "busybox-static")
	testenv.NeedTool(t, "nft", "nftables")
	if imgs, _ := filepath.Glob("/boot/vmlinuz-*"); len(imgs) == 0 {
		testenv.Missing(t, "no guest kernel in /boot", "apt-get install linux-image-amd64")
	}
	dir := t.TempDir()
	k, err := vm.FindKernel(filepath.Join(os.TempDir(), "shunt-vm-cache"))
	if err != nil {
		t.Fatal(err)
	}
	agent := filepath.Join(dir, "agent")
	build := exec.Command("go", "build", "-o", agent, "../cmd/shunt-vm-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the guest agent: %v\n%s", err, out)
	}
	initrd := filepath.Join(dir, "initramfs")
	if err := vm.BuildInitramfs(initrd, k, agent); err != nil {
		t.Fatal(err)
	}
	var conf strings.Builder
	for _, x := range extra {
		conf.WriteString(x)
	}
	for i := 1; i <= n; i++ {
		a, _ := vmAddr(i)
		fmt.Fprintf(&conf, "guest \"vm%d\" {\n  id = %d\n  group = \"t\"\n  control = %q\n  control_ports = %d\n  addresses = [%q]\n  shared_region = true\n}\n",
			i, 100+i, filepath.Join(dir, fmt.Sprintf("vm%d.sock", i)), vmPorts, a)
	}
	rigSeq++
	s, err := stack.Start(stack.Options{Name: fmt.Sprintf("v%d%d", os.Getpid()%1000, rigSeq), Guests: 1, HostdBin: hostdBin,
		Dir: dir, Extra: conf.String(), Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	e := &env{Stack: s, rig: s.Rig}
	if tt, ok := t.(*testing.T); ok {
		e.t = tt
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("hostd log:\n%s", s.Log())
		}
		s.Close()
	})
	return &vmEnv{env: e, tb: t, kernel: k, initrd: initrd, agent: agent}
}

// boot starts VM i with the agent's arguments; it is stopped with the test.
func (v *vmEnv) boot(i int, args ...string) *vm.VM {
	v.tb.Helper()
	return v.bootVM(i, false, args...)
}

// bootVM is boot, optionally of a VM that can be reset (rebooted in place).
func (v *vmEnv) bootVM(i int, resettable bool, args ...string) *vm.VM {
	v.tb.Helper()
	return v.bootWith(i, vm.Options{Resettable: resettable}, args...)
}

// bootWith is boot with options (Resettable, ShareUsr) set in o.
func (v *vmEnv) bootWith(i int, o vm.Options, args ...string) *vm.VM {
	v.tb.Helper()
	a, h := vmAddr(i)
	m, err := vm.Boot(vm.Options{
		Name: fmt.Sprintf("vm%d", i), Kernel: v.kernel, Initramfs: v.initrd, HostNS: v.rig.HostNSPath(),
		Tap: fmt.Sprintf("shvm%d-%d", rigSeq, i), Addr: a, Host: h, Args: args, Resettable: o.Resettable, ShareUsr: o.ShareUsr,
		Attach: vhost.Attachment{
			Region:  ivshmem.Device{ID: "shunt0", Path: v.RegionPath(), Size: 32 << 20},
			Control: vserial.Port{ID: "shunt0", Socket: filepath.Join(v.Dir, fmt.Sprintf("vm%d.sock", i)), Ports: vmPorts},
		},
	}, func(c *exec.Cmd) error { return nsrig.Start(v.rig.HostNSPath(), c) })
	if err != nil {
		v.tb.Fatal(err)
	}
	v.tb.Cleanup(func() {
		if v.tb.Failed() {
			v.tb.Logf("console of vm%d:\n%s", i, m.Console())
		}
		m.Stop()
	})
	return m
}

// TestVMFastPath: two QEMU VMs; vm2 connects to vm1 through the host's
// routing, firewall and conntrack, gets the fast path over the ivshmem
// region, and moves 64 MiB with matching checksums.
func TestVMFastPath(t *testing.T) {
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a1, _ := vmAddr(1)
	srv, cli := v.bootPair(ctx, []string{"server", "7000"}, []string{"client", a1.String() + ":7000", fmt.Sprint(64 << 20)})
	sent := mustWait(t, ctx, cli, "SHUNT-VM SENT")
	recv := mustWait(t, ctx, srv, "SHUNT-VM RECV")
	if strings.TrimPrefix(sent, "SHUNT-VM SENT") != strings.TrimPrefix(recv, "SHUNT-VM RECV") {
		t.Fatalf("client %q, server %q: bytes or checksums differ", sent, recv)
	}
	t.Logf("%s / %s", sent, recv)
}

// bootPair boots vm1 with srvArgs, waits until it listens, boots vm2 with
// cliArgs, and checks that both ends took the fast path.
func (v *vmEnv) bootPair(ctx context.Context, srvArgs, cliArgs []string) (*vm.VM, *vm.VM) {
	v.tb.Helper()
	srv := v.boot(1, srvArgs...)
	mustWait(v.tb, ctx, srv, "SHUNT-VM LISTENING")
	cli := v.boot(2, cliArgs...)
	for _, m := range []*vm.VM{srv, cli} {
		if line := mustWait(v.tb, ctx, m, "SHUNT-VM PATH"); line != "SHUNT-VM PATH shunt" {
			v.tb.Fatalf("%s: %s, want the fast path", m.Name, line)
		}
	}
	return srv, cli
}

// holdPair boots vm1 accepting and vm2 connecting on port, both blocked in
// Read on the fast path.
func (v *vmEnv) holdPair(ctx context.Context, port int) (*vm.VM, *vm.VM) {
	a1, _ := vmAddr(1)
	return v.bootPair(ctx, []string{"serve-hold", fmt.Sprint(port)}, []string{"hold", fmt.Sprintf("%s:%d", a1, port)})
}

// mustWait waits for a console line of m starting with prefix.
func mustWait(t testing.TB, ctx context.Context, m *vm.VM, prefix string) string {
	t.Helper()
	line, err := m.Wait(ctx, prefix)
	if err != nil {
		t.Fatal(err)
	}
	return line
}

func expectVMReset(t *testing.T, ctx context.Context, m *vm.VM) {
	t.Helper()
	line := mustWait(t, ctx, m, "SHUNT-VM READERR")
	if !strings.Contains(line, "connection reset by peer") {
		t.Fatalf("%s: %s, want ECONNRESET", m.Name, line)
	}
}

// TestVMConntrackDeleteRevokes: deleting the connection's conntrack entry
// on the host gives ECONNRESET inside both VMs.
func TestVMConntrackDeleteRevokes(t *testing.T) {
	testenv.NeedTool(t, "conntrack", "conntrack")
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	srv, cli := v.holdPair(ctx, 7001)
	v.hostCmd("conntrack", "-D", "-p", "tcp", "--dport", "7001")
	expectVMReset(t, ctx, srv)
	expectVMReset(t, ctx, cli)
}

// TestVMPowerOffRevokes: a VM killed mid-flow gives its peer ECONNRESET,
// and hostd reclaims the ring pair once the peer has gone too.
func TestVMPowerOffRevokes(t *testing.T) {
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	srv, cli := v.holdPair(ctx, 7002)
	if len(v.flows()) != 1 {
		t.Fatalf("hostd lists %d flows, want 1", len(v.flows()))
	}
	srv.Stop()
	expectVMReset(t, ctx, cli)
	eventually(t, 30*time.Second, "ring pair reclaimed after both VMs went", func() bool { return len(v.flows()) == 0 })
}

// TestVMFirewallReject: a firewall rule rejecting the port means no
// connection and no fast path.
func TestVMFirewallReject(t *testing.T) {
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	if err := v.rig.Firewall("tcp dport 7003 reject with tcp reset"); err != nil {
		t.Fatal(err)
	}
	a1, _ := vmAddr(1)
	srv := v.boot(1, "server", "7003")
	mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
	cli := v.boot(2, "client", a1.String()+":7003", "1024")
	line := mustWait(t, ctx, cli, "SHUNT-VM ERROR")
	if !strings.Contains(line, "connection refused") {
		t.Fatalf("client: %s, want connection refused", line)
	}
	if fl := v.flows(); len(fl) != 0 {
		t.Fatalf("a rejected connection has flows: %+v", fl)
	}
}

// BenchmarkVM: ping-pong and a 64 MiB stream between two VMs, over the
// VMs' kernel TCP (virtio-net through the host) and over Shunt, in the same
// run (make bench-vm; root). TCG is far from KVM speed: reported, not a
// target.
func BenchmarkVM(b *testing.B) {
	for _, stack := range []string{"virtio-net", "shunt"} {
		b.Run(stack, func(b *testing.B) {
			var oneway, mbps []float64
			for b.Loop() {
				b.StopTimer()
				v := newVMEnv(b, 2)
				ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
				a1, _ := vmAddr(1)
				var pre []string
				if stack == "virtio-net" {
					pre = []string{"tcp"}
				}
				srv := v.boot(1, append(pre, "pp-server", "7100")...)
				mustWait(b, ctx, srv, "SHUNT-VM LISTENING")
				cli := v.boot(2, append(pre, "pp-client", a1.String()+":7100", "2000")...)
				pp := mustWait(b, ctx, cli, "SHUNT-VM PINGPONG")
				st := mustWait(b, ctx, cli, "SHUNT-VM STREAM")
				var ns, rate float64
				fmt.Sscanf(pp, "SHUNT-VM PINGPONG %g", &ns)
				fmt.Sscanf(st, "SHUNT-VM STREAM %g", &rate)
				oneway, mbps = append(oneway, ns/1e3), append(mbps, rate)
				cancel()
				b.StartTimer()
			}
			b.ReportMetric(median(oneway), "us/oneway")
			b.ReportMetric(median(mbps), "MB/s")
		})
	}
}

// newPreloadVMEnv is newVMEnv with an initramfs that also carries the
// preload library and the given dynamically linked programs (found on
// PATH), whose paths it returns in order.
func newPreloadVMEnv(tb testing.TB, progs ...string) (*vmEnv, []string) {
	tb.Helper()
	var paths []string
	for _, p := range progs {
		testenv.NeedTool(tb, p, p)
		path, _ := exec.LookPath(p)
		paths = append(paths, path)
	}
	needPreload(tb)
	v := newVMEnv(tb, 2)
	initrd := filepath.Join(tb.TempDir(), "initramfs-preload")
	if err := vm.BuildInitramfs(initrd, v.kernel, v.agent, append([]string{preloadLib}, paths...)...); err != nil {
		tb.Fatal(err)
	}
	v.initrd = initrd
	return v, paths
}

// guest returns what hostd says of guest name (zero if it has none).
func (v *vmEnv) guest(name string) broker.GuestInfo {
	var gs []broker.GuestInfo
	_ = admin.Call(v.Admin, admin.Request{Cmd: "guests"}, &gs)
	for _, g := range gs {
		if g.Name == name {
			return g
		}
	}
	return broker.GuestInfo{}
}

// TestVMMPI: an MPI job across two VMs, its ranks under the preload
// library. The VMs see the host's /usr over 9p, so Open MPI runs in them
// unchanged; mpirun runs on the host (in the rig's host namespace, which
// routes to the VMs) and starts orted in each VM through the agent's exec
// server (the VMs have no ssh). Each rank takes a control port of its VM,
// and the TCP BTL's connection between the ranks takes the fast path.
func TestVMMPI(t *testing.T) {
	out := vmMPI(t, true)
	if !strings.Contains(out, "data ok") || fastLines(out) < 2 {
		t.Fatalf("MPI between the VMs over the fast path:\n%s", out)
	}
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "lat 8 ") || strings.HasPrefix(l, "bw ") {
			t.Log(l)
		}
	}
}

// vmMPI boots two VMs and runs mpi/pingpong.c (up to 64 KiB) across them,
// its ranks under the preload library if preload; it returns mpirun's
// output.
func vmMPI(tb testing.TB, preload bool) string {
	tb.Helper()
	testenv.NeedTool(tb, "mpicc", "libopenmpi-dev openmpi-bin")
	testenv.NeedTool(tb, "mpirun", "openmpi-bin")
	needPreload(tb)
	v := newVMEnv(tb, 2)
	dir := tb.TempDir()
	prog := filepath.Join(dir, "pingpong")
	if out, err := exec.Command("mpicc", "-O2", "-o", prog, "mpi/pingpong.c").CombinedOutput(); err != nil {
		tb.Fatalf("mpicc: %v\n%s", err, out)
	}
	rsh := filepath.Join(dir, "rsh")
	script := fmt.Sprintf("#!/bin/sh\n# plm_rsh_agent: rsh HOST CMD -> CMD in that VM\nexec %s rsh 7777 \"$@\"\n", v.agent)
	if err := os.WriteFile(rsh, []byte(script), 0o755); err != nil {
		tb.Fatal(err)
	}
	// The program, the library and the rsh agent (orted checks that it
	// exists) go into the image as they are; what they load comes from
	// the shared /usr.
	initrd := filepath.Join(dir, "initramfs-mpi")
	if err := vm.BuildInitramfsFiles(initrd, v.kernel, v.agent, prog, preloadLib, rsh); err != nil {
		tb.Fatal(err)
	}
	v.initrd = initrd
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for i := 1; i <= 2; i++ {
		mustWait(tb, ctx, v.bootWith(i, vm.Options{ShareUsr: true}, "exec-server", "7777"), "SHUNT-VM LISTENING")
	}
	a1, _ := vmAddr(1)
	a2, _ := vmAddr(2)
	args := []string{"--allow-run-as-root", "-np", "2", "--host", a1.String() + ":1," + a2.String() + ":1",
		"--mca", "routed", "direct", "--mca", "plm_rsh_agent", rsh, "--mca", "pml", "ob1", "--mca", "btl", "self,tcp",
		"--mca", "btl_tcp_if_include", "10.77.0.0/16", "--mca", "oob_tcp_if_include", "10.77.0.0/16",
		"--mca", "rtc", "^hwloc", "--bind-to", "none"}
	if preload {
		args = append(args, "-x", "LD_PRELOAD="+preloadLib, "-x", "SHUNT_VERBOSE=1")
	}
	return runIn(tb, v.rig.HostNSPath(), exec.Command("mpirun", append(args, prog, "65536")...), 3*time.Minute)
}

// BenchmarkVMMPI: mpi/pingpong.c across two TCG VMs, Open MPI's TCP BTL
// over the VMs' virtio-net and under the preload library (Shunt).
func BenchmarkVMMPI(b *testing.B) {
	for _, stack := range []string{"virtio-net", "shunt"} {
		b.Run(stack, func(b *testing.B) {
			var lat, bw []float64
			for b.Loop() {
				b.StopTimer()
				out := vmMPI(b, stack == "shunt")
				var l8, b64 float64
				for _, line := range strings.Split(out, "\n") {
					fmt.Sscanf(line, "lat 8 %g", &l8)
					fmt.Sscanf(line, "bw 65536 %g", &b64)
				}
				if l8 == 0 || b64 == 0 {
					b.Fatalf("no results:\n%s", out)
				}
				lat, bw = append(lat, l8), append(bw, b64)
				b.StartTimer()
			}
			b.ReportMetric(median(lat), "us@8B")
			b.ReportMetric(median(bw), "MB/s@64KiB")
		})
	}
}

// BenchmarkVMPreload: unmodified programs in two TCG VMs, plain (the VMs'
// virtio-net TCP) and under the preload library (Shunt): sockperf
// ping-pong (14 B, one-way p50) and then an iperf3 stream of 64 MiB.
func BenchmarkVMPreload(b *testing.B) {
	for _, stack := range []string{"virtio-net", "shunt"} {
		b.Run(stack, func(b *testing.B) {
			var oneway, mbps []float64
			for b.Loop() {
				b.StopTimer()
				v, progs := newPreloadVMEnv(b, "sockperf", "iperf3")
				sockperf, iperf3 := progs[0], progs[1]
				lib := preloadLib
				if stack == "virtio-net" {
					lib = "none"
				}
				ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
				a1, _ := vmAddr(1)
				srv := v.boot(1, "run", lib, sockperf, "server", "--tcp", "-i", a1.String(), "-p", "11111",
					"+", iperf3, "-s", "-1", "-p", "5201", "--forceflush")
				mustWait(b, ctx, srv, "SHUNT-VM OUT1 Server listening")
				time.Sleep(time.Second) // sockperf prints nothing when ready
				// --mps sizes sockperf's table of replies; TCG stays far
				// below 20000 a second, and the VM has 256 MiB.
				cli := v.boot(2, "run", lib, sockperf, "ping-pong", "--tcp", "-i", a1.String(), "-p", "11111", "-t", "3", "-m", "14", "--mps", "20000",
					"then", iperf3, "-c", a1.String(), "-p", "5201", "-n", "64M", "-f", "m", "--forceflush")
				for i := range 2 {
					if line := mustWait(b, ctx, cli, fmt.Sprintf("SHUNT-VM EXIT%d", i)); line != fmt.Sprintf("SHUNT-VM EXIT%d 0", i) {
						b.Fatalf("%s:\n%s", line, cli.Console())
					}
				}
				out := cli.Console()
				if want := map[string]int{"virtio-net": 0, "shunt": 3}[stack]; strings.Count(out, ": shunt (slot") != want {
					b.Fatalf("%s: want %d fast-path connections:\n%s", stack, want, out)
				}
				p50 := regexp.MustCompile(`percentile 50\.000 =\s+([0-9.]+)`).FindStringSubmatch(out)
				rx := regexp.MustCompile(`([0-9.]+) Mbits/sec\s+receiver`).FindStringSubmatch(out)
				if p50 == nil || rx == nil {
					b.Fatalf("no results:\n%s", out)
				}
				us, _ := strconv.ParseFloat(p50[1], 64)
				mbit, _ := strconv.ParseFloat(rx[1], 64)
				oneway, mbps = append(oneway, us), append(mbps, mbit/8)
				cancel()
				b.StartTimer()
			}
			b.ReportMetric(median(oneway), "us/oneway")
			b.ReportMetric(median(mbps), "MB/s")
		})
	}
}

// TestVMHostdRestart: hostd is killed and restarted under two VMs with a
// live flow. QEMU reconnects the control ports, the guests say HELLO again
// and reattach, hostd lists the flow, and revocation works again.
func TestVMHostdRestart(t *testing.T) {
	testenv.NeedTool(t, "conntrack", "conntrack")
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	srv, cli := v.holdPair(ctx, 7004)
	v.killHostd()
	v.startHostd()
	eventually(t, 20*time.Second, "both VMs reattached to the restarted hostd", func() bool {
		fl := v.flows()
		return len(fl) == 1 && fl[0].Attached == "ab" && fl[0].State == "ready"
	})
	v.hostCmd("conntrack", "-D", "-p", "tcp", "--dport", "7004")
	expectVMReset(t, ctx, srv)
	expectVMReset(t, ctx, cli)
}

// TestVMRebootInPlace: a VM that reboots in place keeps its QEMU and so its
// control channel. hostd must see the new guest behind the channel: the
// old boot's flow is revoked (the peer gets ECONNRESET), the new boot's
// listener counts, and it gets the fast path again.
func TestVMRebootInPlace(t *testing.T) {
	v := newVMEnv(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a1, _ := vmAddr(1)
	srv := v.bootVM(1, true, "serve-hold", "7003")
	mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
	cli := v.boot(2, "hold", a1.String()+":7003")
	for _, m := range []*vm.VM{srv, cli} {
		if line := mustWait(t, ctx, m, "SHUNT-VM PATH"); line != "SHUNT-VM PATH shunt" {
			t.Fatalf("%s: %s, want the fast path", m.Name, line)
		}
	}
	mark := srv.Lines()
	if err := srv.Reset(); err != nil {
		t.Fatal(err)
	}
	expectVMReset(t, ctx, cli)
	if _, err := srv.WaitFrom(ctx, mark, "SHUNT-VM LISTENING"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the old boot's flow released", func() bool { return len(v.flows()) == 0 })
	if g := v.guest("vm1"); g.Sessions != 1 || len(g.Listening) != 1 || !strings.HasSuffix(g.Listening[0], ":7003") {
		t.Fatalf("vm1 after its reboot: %+v, want one session listening on 7003", g)
	}
	cli2 := v.boot(3, "hold", a1.String()+":7003")
	if line := mustWait(t, ctx, cli2, "SHUNT-VM PATH"); line != "SHUNT-VM PATH shunt" {
		t.Fatalf("vm3: %s, want the fast path", line)
	}
	if line, err := srv.WaitFrom(ctx, mark, "SHUNT-VM PATH"); err != nil || line != "SHUNT-VM PATH shunt" {
		t.Fatalf("vm1 after its reboot: %q %v, want the fast path", line, err)
	}
}

// TestVMPreloadIperf3: unmodified, dynamically linked programs (iperf3)
// under the C preload library in two VMs, two at once in each VM. The
// library finds a free control port and the ivshmem BAR on its own, and all
// of iperf3's connections take the fast path, waking across VMs through
// hostd.
func TestVMPreloadIperf3(t *testing.T) {
	v, progs := newPreloadVMEnv(t, "iperf3")
	iperf3 := progs[0]
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a1, _ := vmAddr(1)
	server := func(port string) []string { return []string{iperf3, "-s", "-1", "-p", port, "--forceflush"} }
	client := func(port string) []string {
		return []string{iperf3, "-c", a1.String(), "-p", port, "-n", "8M", "-f", "m", "--forceflush"}
	}
	srv := v.boot(1, slices.Concat([]string{"run", preloadLib}, server("5201"), []string{"+"}, server("5202"))...)
	// Each iperf3's listen() reaches hostd through the library, on its
	// own control port.
	eventually(t, time.Minute, "both of vm1's iperf3s listening in hostd", func() bool {
		g := v.guest("vm1")
		return g.Sessions == 2 && len(g.Listening) == 2
	})
	cli := v.boot(2, slices.Concat([]string{"run", preloadLib}, client("5201"), []string{"+"}, client("5202"))...)
	for _, m := range []*vm.VM{cli, srv} {
		for i := range 2 {
			if line := mustWait(t, ctx, m, fmt.Sprintf("SHUNT-VM EXIT%d", i)); line != fmt.Sprintf("SHUNT-VM EXIT%d 0", i) {
				t.Fatalf("%s: iperf3 %s", m.Name, line)
			}
		}
	}
	console := cli.Console()
	for i := range 2 {
		if !strings.Contains(console, fmt.Sprintf("SHUNT-VM OUT%d [", i)) || strings.Count(console, "receiver") != 2 {
			t.Fatalf("the iperf3 clients did not both report:\n%s", console)
		}
	}
	for _, m := range []*vm.VM{cli, srv} {
		if n := strings.Count(m.Console(), ": shunt (slot"); n != 4 {
			t.Fatalf("%s: %d connections on the fast path, want 4 (control and data of both iperf3s):\n%s", m.Name, n, m.Console())
		}
	}
	for _, l := range strings.Split(console, "\n") {
		if strings.Contains(l, "receiver") {
			t.Log(l)
		}
	}
}

// TestVMPreloadHostdRestart: hostd is killed and restarted under a VM whose
// iperf3 server (under the C library) idles in accept. The port reads EOF
// when QEMU loses hostd; the library reopens it, says HELLO to the new
// hostd and announces its listener, so a client started afterwards gets the
// fast path.
func TestVMPreloadHostdRestart(t *testing.T) {
	v, progs := newPreloadVMEnv(t, "iperf3")
	iperf3 := progs[0]
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a1, _ := vmAddr(1)
	listening := func() bool {
		g := v.guest("vm1")
		return len(g.Listening) == 1 && strings.HasSuffix(g.Listening[0], ":5201")
	}
	srv := v.boot(1, "run", preloadLib, iperf3, "-s", "-p", "5201", "--forceflush")
	eventually(t, time.Minute, "vm1's iperf3 listening in hostd", listening)
	v.killHostd()
	v.startHostd()
	eventually(t, 30*time.Second, "vm1's iperf3 listening in the new hostd", listening)
	cli := v.boot(2, "run", preloadLib, iperf3, "-c", a1.String(), "-p", "5201", "-n", "8M", "--forceflush")
	if line := mustWait(t, ctx, cli, "SHUNT-VM EXIT"); line != "SHUNT-VM EXIT 0" {
		t.Fatalf("iperf3 client: %s", line)
	}
	if n := strings.Count(cli.Console(), ": shunt (slot"); n != 2 {
		t.Fatalf("client: %d connections on the fast path after the restart, want 2:\n%s", n, cli.Console())
	}
	if !strings.Contains(srv.Console(), "shunt: reconnected to hostd") {
		t.Fatalf("vm1's library did not notice the new hostd:\n%s", srv.Console())
	}
}
