package integration

import (
	"context"
	"fmt"
	"math/rand/v2"
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
	dumped bool   // hostd's records were logged (on failure, once)
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
	return newVMEnvGroup(t, n, "", extra...)
}

// newVMEnvGroup is newVMEnv with more attributes for the trust group
// (region_group, say).
func newVMEnvGroup(t testing.TB, n int, group string, extra ...string) *vmEnv {
	dir, k, agent, initrd := vmImages(t)
	var conf strings.Builder
	for _, x := range extra {
		conf.WriteString(x)
	}
	for i := 1; i <= n; i++ {
		a, _ := vmAddr(i)
		fmt.Fprintf(&conf, "guest \"vm%d\" {\n  id = %d\n  group = \"t\"\n  control = %q\n  control_ports = %d\n  addresses = [%q]\n  shared_region = true\n}\n",
			i, 100+i, filepath.Join(dir, fmt.Sprintf("vm%d.sock", i)), vmPorts, a)
	}
	if group != "" {
		group = "  pair_region_size = \"64MiB\"\n  pair_slots = 1024\n  guest_ring_bytes = \"256MiB\"\n  guest_flows = 1024\n" + group
	}
	return &vmEnv{env: startVMStack(t, dir, conf.String(), group), tb: t, kernel: k, initrd: initrd, agent: agent}
}

// vmImages checks what VM tests need (root, QEMU, busybox, nft, a guest
// kernel) and makes the test's directory, the guest agent and an
// initramfs with it.
func vmImages(t testing.TB) (dir string, kernel vm.Kernel, agent, initrd string) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "qemu-system-x86_64", "qemu-system-x86")
	testenv.NeedTool(t, "busybox", "busybox-static")
	testenv.NeedTool(t, "nft", "nftables")
	if imgs, _ := filepath.Glob("/boot/vmlinuz-*"); len(imgs) == 0 {
		testenv.Missing(t, "no guest kernel in /boot", "apt-get install linux-image-amd64")
	}
	dir = t.TempDir()
	kernel, agent, initrd, err := vm.Images(dir, "../cmd/shunt-vm-agent")
	if err != nil {
		t.Fatal(err)
	}
	return dir, kernel, agent, initrd
}

// startVMStack starts hostd (one rig guest, the VMs in conf) in dir; it
// stops with the test, and shows hostd's log if the test failed.
func startVMStack(t testing.TB, dir, conf, group string) *env {
	rigSeq++
	s, err := stack.Start(stack.Options{Name: fmt.Sprintf("v%d%d", os.Getpid()%1000, rigSeq), Guests: 1, HostdBin: hostdBin,
		Dir: dir, Extra: conf, Group: group, Logf: t.Logf})
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
	return e
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
		v.failed(fmt.Sprintf("vm%d", i), m)
		m.Stop()
	})
	return m
}

// failed logs, if the test failed, m's console and (once, while the VMs
// still run) hostd's connection records.
func (v *vmEnv) failed(name string, m *vm.VM) {
	if !v.tb.Failed() {
		return
	}
	if !v.dumped {
		v.dumped = true
		v.tb.Logf("hostd's connection records:\n%s", v.flowsJSON())
	}
	v.tb.Logf("console of %s:\n%s", name, m.Console())
}

// TestVMFastPath: two QEMU VMs; vm2 connects to vm1 through the host's
// routing, firewall and conntrack, starts on TCP, gets the fast path over
// the ivshmem region (READY), and moves 64 MiB with matching checksums.
// The agents use guestlib with no settings (no SHUNT_CONTROL or
// SHUNT_REGION in their environment, no Options.Control or Region): each
// finds its VM's first control port and the ivshmem BAR itself
// (docs/vm.md, "Discovery").
func TestVMFastPath(t *testing.T) {
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a1, _ := vmAddr(1)
	srv, cli := v.bootPair(ctx, 0, []string{"server", "7000"}, []string{"client", a1.String() + ":7000", fmt.Sprint(64 << 20)})
	for _, m := range []*vm.VM{srv, cli} {
		if l := mustWait(t, ctx, m, "SHUNT-VM LOG shunt: control port "); !strings.HasPrefix(l, "SHUNT-VM LOG shunt: control port /dev/vport") {
			t.Fatalf("agent log %q: want the port it discovered, /dev/vportNpM (no udev in the test VMs)", l)
		}
	}
	sent := mustWait(t, ctx, cli, "SHUNT-VM SENT")
	recv := mustWait(t, ctx, srv, "SHUNT-VM RECV")
	if strings.TrimPrefix(sent, "SHUNT-VM SENT") != strings.TrimPrefix(recv, "SHUNT-VM RECV") {
		t.Fatalf("client %q, server %q: bytes or checksums differ", sent, recv)
	}
	t.Logf("%s / %s", sent, recv)
}

// bootPair boots vm1 with srvArgs, waits until it listens, boots vm2 with
// cliArgs, and waits until both ends are on the fast path (fastPair).
func (v *vmEnv) bootPair(ctx context.Context, port int, srvArgs, cliArgs []string) (*vm.VM, *vm.VM) {
	v.tb.Helper()
	srv := v.boot(1, srvArgs...)
	mustWait(v.tb, ctx, srv, "SHUNT-VM LISTENING")
	cli := v.boot(2, cliArgs...)
	v.fastPair(ctx, port, srv, cli)
	return srv, cli
}

// vmFastBound bounds the wait for READY after hostd's first answer: under
// TCG a VM's OPEN can come well after its peer's (that one is told
// TCP(no-intent) first, and READY follows).
const vmFastBound = 30 * time.Second

// fastPair waits until the connection is on the fast path in both VMs:
// each reported its path (the agent's PATH line, after hostd's first
// answer) and attached the rings (READY; guestlib logs "rings"), and, if
// port is not 0, hostd's record of the connection on port is on the
// rings with both ends attached. A connection starts on TCP and moves to
// the rings when READY comes.
func (v *vmEnv) fastPair(ctx context.Context, port int, ms ...*vm.VM) {
	v.tb.Helper()
	for _, m := range ms {
		mustWait(v.tb, ctx, m, "SHUNT-VM PATH")
	}
	var r broker.FlowInfo
	for deadline := time.Now().Add(vmFastBound); ; {
		all := true
		for _, m := range ms {
			all = all && vmTookRings(m)
		}
		if port != 0 {
			var ok bool
			r, ok = v.record(port)
			all = all && ok && r.Path == "rings" && r.Attached == "ab"
		}
		if all {
			return
		}
		if time.Now().After(deadline) {
			v.tb.Fatalf("not on the fast path in both VMs within %s; hostd's record: %+v", vmFastBound, r)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// vmTookRings reports whether m's agent logged a READY taken (guestlib's
// "shunt: A -> B: rings R/S.G").
func vmTookRings(m *vm.VM) bool {
	for _, l := range strings.Split(m.Console(), "\n") {
		if strings.HasPrefix(l, "SHUNT-VM LOG shunt: ") && strings.Contains(l, ": rings ") {
			return true
		}
	}
	return false
}

// record returns hostd's connection record for the connection on port.
func (v *vmEnv) record(port int) (broker.FlowInfo, bool) {
	v.tb.Helper()
	r, ok, err := v.ConnOn(port)
	if err != nil {
		v.tb.Fatal(err)
	}
	return r, ok
}

// waitRecord waits (bound) until hostd's record for port satisfies cond.
func (v *vmEnv) waitRecord(port int, bound time.Duration, what string, cond func(r broker.FlowInfo, ok bool) bool) broker.FlowInfo {
	v.tb.Helper()
	for deadline := time.Now().Add(bound); ; {
		r, ok := v.record(port)
		if cond(r, ok) {
			return r
		}
		if time.Now().After(deadline) {
			v.tb.Fatalf("%s: not within %s; hostd's record: %+v (present %v)", what, bound, r, ok)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// holdPair boots vm1 accepting and vm2 connecting on port, both blocked in
// Read on the fast path.
func (v *vmEnv) holdPair(ctx context.Context, port int) (*vm.VM, *vm.VM) {
	a1, _ := vmAddr(1)
	return v.bootPair(ctx, port, []string{"serve-hold", fmt.Sprint(port)}, []string{"hold", fmt.Sprintf("%s:%d", a1, port)})
}

// duplexPair boots vm1 and vm2 with a checked stream each way on port for
// secs (the agent's duplex modes), on the fast path.
func (v *vmEnv) duplexPair(ctx context.Context, port, secs int) (*vm.VM, *vm.VM) {
	a1, _ := vmAddr(1)
	return v.bootPair(ctx, port, []string{"duplex-server", fmt.Sprint(port), fmt.Sprint(secs)},
		[]string{"duplex-client", fmt.Sprintf("%s:%d", a1, port), fmt.Sprint(secs)})
}

// vmDuplexDone waits for both VMs' duplex results (an ERROR line fails the
// test) and checks that what each sent is what the other received, bytes
// and checksums.
func vmDuplexDone(t *testing.T, ctx context.Context, srv, cli *vm.VM) {
	t.Helper()
	var got [2][4]int64
	for i, m := range []*vm.VM{srv, cli} {
		line, err := m.WaitAny(ctx, 0, "SHUNT-VM DUPLEX", "SHUNT-VM ERROR")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := fmt.Sscanf(line, "SHUNT-VM DUPLEX SENT %d %d RECV %d %d", &got[i][0], &got[i][1], &got[i][2], &got[i][3]); err != nil {
			t.Fatalf("%s: %s", m.Name, line)
		}
	}
	if got[0][0] != got[1][2] || got[0][1] != got[1][3] || got[1][0] != got[0][2] || got[1][1] != got[0][3] {
		t.Fatalf("vm1 sent %d bytes (crc %d) and received %d (crc %d); vm2 sent %d (crc %d) and received %d (crc %d): they must match crosswise",
			got[0][0], got[0][1], got[0][2], got[0][3], got[1][0], got[1][1], got[1][2], got[1][3])
	}
	t.Logf("vm1 -> vm2 %d bytes, vm2 -> vm1 %d bytes, checksums equal", got[0][0], got[1][0])
}

// vmDowngraded checks that m's connection was moved to TCP for reason
// (guestlib logs "back to tcp(reason)") and that its blocked Read saw no
// error: a downgrade invents none.
func vmDowngraded(t *testing.T, ctx context.Context, m *vm.VM, reason string) {
	t.Helper()
	line := mustWait(t, ctx, m, "SHUNT-VM LOG shunt: ")
	for !strings.Contains(m.Console(), "back to tcp("+reason+")") {
		if ctx.Err() != nil {
			t.Fatalf("%s: no downgrade to tcp(%s) logged (%s)", m.Name, reason, line)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if m.Has(0, "SHUNT-VM READERR") || m.Has(0, "SHUNT-VM ERROR") {
		t.Fatalf("%s: the application saw an error after a downgrade:\n%s", m.Name, m.Console())
	}
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

// TestVMConntrackDeleteDowngrades: deleting a live connection's conntrack
// entry on the host moves it to TCP (conntrack-gone): the checked streams
// both ways between the VMs go on without an error, with equal checksums,
// and hostd freed the rings (the kernel and the firewall decide what
// happens to the connection next; here the next packet makes a new entry).
func TestVMConntrackDeleteDowngrades(t *testing.T) {
	testenv.NeedTool(t, "conntrack", "conntrack")
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	srv, cli := v.duplexPair(ctx, 7001, 10)
	v.waitRecord(7001, 30*time.Second, "ring bytes both ways", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.RingsAB > 0 && r.RingsBA > 0
	})
	v.hostCmd("conntrack", "-D", "-p", "tcp", "--dport", "7001")
	v.waitRecord(7001, 30*time.Second, "the record on TCP (conntrack-gone), its rings freed", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.Path == "tcp" && r.Reason == "conntrack-gone" && r.Ring == 0
	})
	vmDuplexDone(t, ctx, srv, cli)
	for _, m := range []*vm.VM{srv, cli} {
		if !strings.Contains(m.Console(), "back to tcp(conntrack-gone)") {
			t.Fatalf("%s: no downgrade (conntrack-gone) logged:\n%s", m.Name, m.Console())
		}
	}
}

// TestVMPowerOffDowngrades: a VM powered off mid-flow (QEMU killed) sends
// no FIN, and nothing else may invent one: its peer's connection moves to
// TCP (peer-gone), its Read goes on waiting with no error (the kernel
// would learn of the dead peer only from a retransmission or a
// keepalive), and hostd freed the rings. The record goes when the peer
// goes too.
func TestVMPowerOffDowngrades(t *testing.T) {
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	srv, cli := v.holdPair(ctx, 7002)
	srv.Stop()
	v.waitRecord(7002, 30*time.Second, "the record on TCP (peer-gone), its rings freed", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.Path == "tcp" && r.Reason == "peer-gone" && r.Ring == 0
	})
	vmDowngraded(t, ctx, cli, "peer-gone")
	cli.Stop()
	v.waitRecord(7002, 30*time.Second, "the record gone after both VMs went", func(_ broker.FlowInfo, ok bool) bool { return !ok })
}

// TestVMPolicyFlipLoop: checked streams both ways between two VMs while
// the test flips hostd's policy between tcp and fastpath every 50 to 200
// ms (TCG is slow): no error in either VM, equal checksums, and the
// connection took both paths (hostd's record counts its switches and the
// bytes its rings carried each way).
func TestVMPolicyFlipLoop(t *testing.T) {
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	srv, cli := v.duplexPair(ctx, 7005, 20)
	rng := rand.New(rand.NewPCG(7005, 0))
	var last broker.FlowInfo
	flips := 0
	ended := func(m *vm.VM) bool {
		return m.Has(0, "SHUNT-VM DUPLEX") || m.Has(0, "SHUNT-VM ERROR") || m.Has(0, "SHUNT-VM AGENT-EXIT")
	}
	for !ended(srv) && !ended(cli) && ctx.Err() == nil {
		policy := ""
		if flips%2 == 0 {
			policy = stack.PolicyTCP
		}
		if _, err := v.SetPolicy(policy); err != nil {
			t.Fatal(err)
		}
		flips++
		if r, ok := v.record(7005); ok {
			last = r
		}
		time.Sleep(time.Duration(50+rng.IntN(151)) * time.Millisecond)
	}
	if _, err := v.SetPolicy(""); err != nil {
		t.Fatal(err)
	}
	vmDuplexDone(t, ctx, srv, cli)
	t.Logf("%d flips; the record's last sample: %d switches, rings carried %d bytes vm2 -> vm1 and %d back", flips, last.Switches, last.RingsAB, last.RingsBA)
	if last.Switches < 2 || last.RingsAB == 0 || last.RingsBA == 0 {
		t.Fatalf("the connection did not take both paths: %+v", last)
	}
}

// TestVMProcessKilled: a process killed (SIGKILL) inside a VM that stays
// up, mid-stream on the rings. Its control port gives hostd no hangup
// (the port stays open in QEMU): hostd notices through the session
// keepalive (keepalive 1 s, silence 4 s here) and moves the connection
// to TCP (peer-gone). The peer in the other VM reads every byte the dead
// process wrote, checked, and then what the kernel reports on the lease:
// the dead process's guest kernel closed its socket, which had no unread
// data, so FIN: EOF (an RST would give ECONNRESET). In "reading" the peer
// reads all along (8 MiB through the 1 MiB ring); in "ring-full" it reads
// nothing until DOWN came, so what the process wrote (512 KiB) is all in
// the ring when hostd frees the dead end: the peer drains it first.
func TestVMProcessKilled(t *testing.T) {
	for _, tc := range []struct {
		name  string
		sink  []string
		bytes int
	}{
		{"reading", []string{"sink", "7006"}, 8 << 20},
		{"ring-full", []string{"sink", "7006", "after-down"}, 512 << 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const silence = 4 * time.Second
			v := newVMEnv(t, 2, fmt.Sprintf("limits {\n  keepalive = \"1s\"\n  silence = %q\n}\n", silence))
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			a1, _ := vmAddr(1)
			srv := v.boot(1, tc.sink...)
			mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
			cli := v.boot(2, "kill-writer", a1.String()+":7006", fmt.Sprint(tc.bytes))
			v.fastPair(ctx, 0, srv, cli) // the writer streams only once it is on the rings
			mustWait(t, ctx, cli, "SHUNT-VM FAST")
			killed := mustWait(t, ctx, cli, "SHUNT-VM KILLED")
			at := time.Now()
			var pid int
			var wrote int64
			if _, err := fmt.Sscanf(killed, "SHUNT-VM KILLED %d %d", &pid, &wrote); err != nil {
				t.Fatalf("vm2: %s", killed)
			}
			line, err := srv.WaitAny(ctx, 0, "SHUNT-VM SINK", "SHUNT-VM ERROR")
			if err != nil {
				t.Fatal(err)
			}
			took := time.Since(at)
			var got, sum int64
			var rest string
			if _, err := fmt.Sscanf(line, "SHUNT-VM SINK %d %d %s", &got, &sum, &rest); err != nil {
				t.Fatalf("vm1: %s", line)
			}
			end := line[strings.Index(line, rest):]
			t.Logf("writer (pid %d in vm2) killed after %d bytes; vm1 read %d, checked, then %q, %s after the kill", pid, wrote, got, end, took.Round(time.Millisecond))
			if got < wrote || !(end == "EOF" || strings.Contains(end, "connection reset by peer")) {
				t.Fatalf("vm1 read %d bytes then %q; want at least the %d the writer wrote, then EOF (or ECONNRESET)", got, end, wrote)
			}
			if took > silence+15*time.Second {
				t.Fatalf("vm1 learnt of the dead writer %s after the kill; want about silence (%s)", took, silence)
			}
			if !strings.Contains(srv.Console(), "back to tcp(peer-gone)") {
				t.Fatalf("vm1: no downgrade (peer-gone) logged:\n%s", srv.Console())
			}
			if tc.name == "ring-full" && !srv.Has(0, "SHUNT-VM DOWN peer-gone") {
				t.Fatalf("vm1 did not wait for DOWN(peer-gone) before reading:\n%s", srv.Console())
			}
			if !strings.Contains(v.Log(), "closing a silent control session: no answer to the keepalive") {
				t.Fatalf("hostd did not log closing the dead process's session for its silence")
			}
		})
	}
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
// and reattach, hostd lists the flow, and a downgrade (conntrack-gone)
// works again, with no error in either VM.
func TestVMHostdRestart(t *testing.T) {
	testenv.NeedTool(t, "conntrack", "conntrack")
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	srv, cli := v.holdPair(ctx, 7004)
	v.killHostd()
	v.startHostd()
	v.waitRecord(7004, 20*time.Second, "both VMs reattached to the restarted hostd", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.Attached == "ab" && r.State == "ready"
	})
	v.hostCmd("conntrack", "-D", "-p", "tcp", "--dport", "7004")
	v.waitRecord(7004, 30*time.Second, "the record on TCP (conntrack-gone), its rings freed", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.Path == "tcp" && r.Reason == "conntrack-gone" && r.Ring == 0
	})
	vmDowngraded(t, ctx, srv, "conntrack-gone")
	vmDowngraded(t, ctx, cli, "conntrack-gone")
}

// TestVMRebootInPlace: a VM that reboots in place keeps its QEMU and so its
// control channel. hostd must see the new guest behind the channel: the
// old boot's connection moves to TCP (peer-gone; the peer sees no error),
// the new boot's listener counts, and it gets the fast path again.
func TestVMRebootInPlace(t *testing.T) {
	v := newVMEnv(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a1, _ := vmAddr(1)
	srv := v.bootVM(1, true, "serve-hold", "7003")
	mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
	cli := v.boot(2, "hold", a1.String()+":7003")
	v.fastPair(ctx, 7003, srv, cli)
	mark := srv.Lines()
	if err := srv.Reset(); err != nil {
		t.Fatal(err)
	}
	// The old boot is gone without a FIN: vm2's connection moves to TCP
	// (peer-gone) and its Read sees no error.
	vmDowngraded(t, ctx, cli, "peer-gone")
	if _, err := srv.WaitFrom(ctx, mark, "SHUNT-VM LISTENING"); err != nil {
		t.Fatal(err)
	}
	between := func(a, b string) (broker.FlowInfo, bool) {
		for _, r := range v.flows() {
			if r.GuestA == a && r.GuestB == b || r.GuestA == b && r.GuestB == a {
				return r, true
			}
		}
		return broker.FlowInfo{}, false
	}
	eventually(t, 30*time.Second, "the old boot's connection on TCP (peer-gone), its rings freed", func() bool {
		r, ok := between("vm1", "vm2")
		return ok && r.Path == "tcp" && r.Reason == "peer-gone" && r.Ring == 0
	})
	if g := v.guest("vm1"); g.Sessions != 1 || len(g.Listening) != 1 || !strings.HasSuffix(g.Listening[0], ":7003") {
		t.Fatalf("vm1 after its reboot: %+v, want one session listening on 7003", g)
	}
	cli2 := v.boot(3, "hold", a1.String()+":7003")
	mustWait(t, ctx, cli2, "SHUNT-VM PATH")
	if _, err := srv.WaitFrom(ctx, mark, "SHUNT-VM PATH"); err != nil {
		t.Fatal(err)
	}
	eventually(t, vmFastBound, "the new boot and vm3 on the fast path", func() bool {
		r, ok := between("vm1", "vm3")
		return ok && r.Path == "rings" && r.Attached == "ab" && vmTookRings(cli2) &&
			strings.Contains(strings.Join(strings.Split(srv.Console(), "\n")[mark:], "\n"), ": rings ")
	})
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
