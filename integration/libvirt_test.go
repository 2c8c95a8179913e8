package integration

import (
	"context"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/agent"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/virt"
	"github.com/shuntnet/shunt/integration/libvirtd"
	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/vhost"
	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// TestLibvirtDomains: hostd follows a real libvirtd (started by the test,
// with virtlogd), which runs QEMU unprivileged, as Debian's default
// libvirt-qemu:kvm. Two TCG domains defined with Shunt's devices and
// metadata are registered as guests when they start (their QEMUs map the
// region and connect to the control sockets by the trust group's
// region_group, kvm) and get the fast path between them, which survives a
// hostd restart; a stopped domain is released and its peer's connection
// moves to TCP; after libvirtd restarts (one domain's QEMU died meanwhile)
// hostd resyncs and releases that one.
//
// lv3 and lv4 are of a trust group with pair regions (vm_regions =
// "pair", no <shmem> at boot): their first connection gets a region of
// the pair's own, which hostd hot-plugs into both domains through libvirt
// (attach-device <shmem>), seen in both domains' live XML and by both
// guests (the device's region header); a checked stream each way takes
// the rings, survives the hostd restart (the region adopted, its device
// still in both domains), and once it ended the device goes from both
// domains (detach by alias) and the file from /dev/shm.
func TestLibvirtDomains(t *testing.T) {
	testenv.NeedTool(t, "libvirtd", "libvirt-daemon-system")
	testenv.NeedTool(t, "virtlogd", "libvirt-daemon-system")
	testenv.NeedTool(t, "virsh", "libvirt-clients")
	qemuUser, err := user.Lookup(libvirtd.QEMUUser)
	if err != nil {
		testenv.Missing(t, "no libvirt-qemu user", "apt-get install libvirt-daemon-system")
	}
	kvm, err := user.LookupGroup(libvirtd.QEMUGroup)
	if err != nil {
		testenv.Missing(t, "no kvm group", "apt-get install libvirt-daemon-system")
	}
	dir, err := os.MkdirTemp("", "shunt-lv")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "run", "libvirt-sock")
	v := newVMEnvGroup(t, 0, fmt.Sprintf("  region_group = %q\n", libvirtd.QEMUGroup), fmt.Sprintf("libvirt {\n  socket = %q\n}\n", sock),
		libvirtPairGroup(t, libvirtd.QEMUGroup))
	// QEMU, as libvirt-qemu, opens the kernel, the initramfs and the
	// control sockets in the test's directory (t.TempDir's are 0700):
	// traversable, not listable.
	for _, p := range []string{filepath.Dir(v.Dir), v.Dir} {
		if err := os.Chmod(p, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	d, err := libvirtd.Start(dir, v.rig.HostNSPath())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("libvirt daemons:\n%s", d.Log())
		}
		d.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	a1, _ := vmAddr(1)
	srv := v.define(d, 1, "serve-hold", "7000")
	v.waitGuests(d, "lv1")
	mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
	cli := v.define(d, 2, "hold", a1.String()+":7000")
	v.waitGuests(d, "lv1", "lv2")
	v.fastPair(ctx, 7000, srv, cli)
	// Unprivileged for real: QEMU runs as libvirt-qemu, and reaches the
	// control sockets by their group.
	for _, n := range []string{"lv1", "lv2"} {
		pid, err := d.QEMUPid(n)
		if err != nil {
			t.Fatal(err)
		}
		if uid := procUID(t, pid); uid != qemuUser.Uid {
			t.Fatalf("%s's QEMU runs as uid %s, want %s (%s)", n, uid, qemuUser.Uid, libvirtd.QEMUUser)
		}
		fi, err := os.Stat(filepath.Join(v.Dir, n+".sock"))
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if fi.Mode().Perm() != 0o660 || st.Uid != 0 || fmt.Sprint(st.Gid) != kvm.Gid {
			t.Fatalf("%s's control socket is %v %d:%d, want 0660 root:%s (%s)", n, fi.Mode().Perm(), st.Uid, st.Gid, kvm.Gid, kvm.Name)
		}
	}
	for _, g := range v.libvirtGuests() {
		if g.Group != "t" || g.ID != map[string]uint32{"lv1": 201, "lv2": 202}[g.Name] || g.Flows != 1 {
			t.Fatalf("guest %+v: want group t, the metadata's id and one flow", g)
		}
	}

	// lv3 and lv4 (pair regions): the first connection plugs the pair's
	// region into both domains; a checked stream each way for 15 s, so
	// that it runs through the hostd restart below.
	a3, _ := vmAddr(3)
	const pairSecs = 15
	l3 := v.defineIn(d, 3, "p", "bars", "duplex-servers", "7001", fmt.Sprint(pairSecs))
	mustWait(t, ctx, l3, "SHUNT-VM LISTENING")
	waitBars(t, ctx, l3, "at boot: no ivshmem device")
	l4 := v.defineIn(d, 4, "p", "bars", "timed-client", fmt.Sprintf("%s:7001", a3), fmt.Sprint(pairSecs))
	fast := mustWait(t, ctx, l4, "SHUNT-VM FAST 0 ")
	rec := v.waitRecord(7001, vmFastBound, "lv3-lv4 on the rings", func(r broker.FlowInfo, ok bool) bool { return ok && r.Path == "rings" && r.Attached == "ab" })
	pairShm := virt.PairShmem(203, 204, pairRegionID(t, rec))
	for _, n := range []string{"lv3", "lv4"} {
		s := v.waitShmems(t, d, n, "plugged", 0, pairShm)
		if !strings.HasPrefix(s[0].Alias, "ua-shunt-p") || s[0].Size != 16<<20 {
			t.Fatalf("%s's pair device %+v: want alias ua-shunt-p..., 16 MiB", n, s[0])
		}
	}
	checkPairFile(t, "/dev/shm/"+pairShm, kvm.Gid)
	waitBars(t, ctx, l3, "lv3-lv4 plugged", "203-204")
	waitBars(t, ctx, l4, "lv3-lv4 plugged", "203-204")

	// hostd restarts under both live flows: it learns the domains from
	// libvirtd before it adopts the flows from the regions, so both flows
	// (group region, pair region) are adopted and both sides reattach;
	// the pair's device stays in both domains. The new hostd moves them to
	// TCP until their leases show packets past the firewall since its
	// start (docs/SECURITY.md): the streaming lv3-lv4 flow shows them at
	// once, the idle lv1-lv2 flow at its next keepalive (15 s), so the
	// bound is 40 s. The lv3-lv4 stream runs 15 s from its start and may
	// end before the idle flow is back: its checks come first, and each
	// flow must be seen back on the rings, not both at the same moment.
	v.killHostd()
	v.startHostd()
	restarted := time.Now()
	back := map[string]bool{}
	backOnRings := func(port string) func() bool {
		return func() bool {
			for _, f := range v.flows() {
				if f.Path == "rings" && f.Attached == "ab" && f.State == "ready" {
					back[f.Dst[strings.LastIndexByte(f.Dst, ':')+1:]] = true
				}
			}
			return back[port]
		}
	}
	eventually(t, 20*time.Second, "the streaming lv3-lv4 flow adopted, reattached and back on the rings after a hostd restart", backOnRings("7001"))
	if len(v.hostdLines("adopted live flows from a pair region")) != 1 {
		t.Fatalf("hostd did not adopt the pair region once:\n%s", v.Log())
	}
	for _, n := range []string{"lv3", "lv4"} {
		v.waitShmems(t, d, n, "after the restart", 0, pairShm)
	}
	eventually(t, 40*time.Second-time.Since(restarted), "the idle lv1-lv2 flow adopted, reattached and back on the rings after a hostd restart", backOnRings("7000"))

	// A stopped domain is released: its guest and control socket go, and
	// its peer's connection moves to TCP (peer-gone) with no error.
	if _, err := d.Virsh("destroy", "lv2"); err != nil {
		t.Fatal(err)
	}
	vmDowngraded(t, ctx, srv, "peer-gone")
	v.waitGuests(d, "lv1", "lv3", "lv4")
	if _, err := d.Virsh("destroy", "lv1"); err != nil {
		t.Fatal(err)
	}
	v.waitGuests(d, "lv3", "lv4")
	for _, n := range []string{"lv1", "lv2"} {
		if _, err := os.Stat(filepath.Join(v.Dir, n+".sock")); !os.IsNotExist(err) {
			t.Fatalf("%s's control socket still exists (%v)", n, err)
		}
	}

	// The pair's stream ends with equal checksums; after the linger its
	// device goes from both domains and its file from /dev/shm.
	crosswise(t, "lv3-lv4", duplexResult(t, ctx, l3, "DUPLEX-7001"), duplexResult(t, ctx, l4, "DUPLEX"))
	ended := time.Now()
	for _, n := range []string{"lv3", "lv4"} {
		v.waitShmems(t, d, n, "unplugged after the last flow", 20*time.Second)
	}
	unplugged := time.Now()
	waitBars(t, ctx, l3, "lv3-lv4 unplugged")
	waitBars(t, ctx, l4, "lv3-lv4 unplugged")
	// The file goes once hostd has seen the unplug through (libvirt's
	// detach completes before hostd's removal of the file).
	for gone := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		_, err := os.Lstat("/dev/shm/" + pairShm)
		if os.IsNotExist(err) {
			break
		}
		if time.Now().After(gone) {
			t.Fatalf("pair region file still there 10 s after the unplug (%v)", err)
		}
	}
	for _, m := range []*vm.VM{l3, l4} {
		if m.Has(0, "SHUNT-VM ERROR") || m.Has(0, "SHUNT-VM READERR") {
			t.Fatalf("%s: the application saw an error:\n%s", m.Name, m.Console())
		}
	}
	t.Logf("lv3-lv4: connect to the rings (libvirt plug included) %s ms; device out of both domains %v after the stream ended (pair_region_linger 1s included)",
		strings.TrimPrefix(fast, "SHUNT-VM FAST 0 "), unplugged.Sub(ended).Round(time.Millisecond))
	v.logPlugTimes(t, l3, l4)

	// libvirtd crashes; meanwhile lv4's QEMU dies. hostd keeps both
	// guests while libvirtd is away, and resyncs when it is back.
	v.waitGuests(d, "lv3", "lv4")
	syncs := v.libvirtStatus().Syncs
	d.StopLibvirtd()
	eventually(t, 10*time.Second, "hostd sees libvirtd gone", func() bool { return !v.libvirtStatus().Connected })
	if got := guestNames(v.libvirtGuests()); !slices.Equal(got, []string{"lv3", "lv4"}) {
		t.Fatalf("while libvirtd is down hostd has %v, want both guests kept", got)
	}
	pid, err := d.QEMUPid("lv4")
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := d.StartLibvirtd(); err != nil {
		t.Fatal(err)
	}
	v.waitGuests(d, "lv3")
	if st := v.libvirtStatus(); !st.Connected || st.Syncs <= syncs || !slices.Equal(st.Domains, []string{"lv3"}) {
		t.Fatalf("libvirt status %+v: want connected and resynced to lv3", st)
	}
	if c, d := v.counter("shunt_libvirt_connected"), v.counter("shunt_libvirt_domains"); c != 1 || d != 1 {
		t.Fatalf("metrics: shunt_libvirt_connected %v, shunt_libvirt_domains %v; want 1 and 1", c, d)
	}
	// Events flow again after the reconnect.
	if _, err := d.Virsh("destroy", "lv3"); err != nil {
		t.Fatal(err)
	}
	v.waitGuests(d)
}

// define defines and starts libvirt domain lv<i> of trust group t (its
// group region as a <shmem>) running the VM agent with args, and follows
// its console.
func (v *vmEnv) define(d *libvirtd.Daemon, i int, args ...string) *vm.VM {
	v.tb.Helper()
	return v.defineIn(d, i, "t", args...)
}

// defineIn is define in trust group group: "t", or "p" (pair regions: no
// <shmem>, ACPI hot-plug on).
func (v *vmEnv) defineIn(d *libvirtd.Daemon, i int, group string, args ...string) *vm.VM {
	v.tb.Helper()
	name := fmt.Sprintf("lv%d", i)
	a, h := vmAddr(i)
	o := vm.Options{
		Name: name, Kernel: v.kernel, Initramfs: v.initrd, Tap: fmt.Sprintf("shlv%d-%d", rigSeq, i), Addr: a, Host: h, Args: args,
		HostNS: v.rig.HostNSPath(),
		Attach: vhost.Attachment{
			Region:  ivshmem.Device{ID: "shunt0", Path: v.RegionPath(), Size: 32 << 20},
			Control: vserial.Port{ID: "shunt0", Socket: filepath.Join(v.Dir, name+".sock")},
		},
	}
	id := uint32(200 + i)
	console := filepath.Join(d.Dir, name+".console")
	x, err := vm.DomainXML(o, console, virt.Metadata{ID: &id, Group: group, Addresses: []string{a.String()}}.XML())
	if err == nil && group == "p" {
		x, err = pairDomainXML(x, o)
	}
	if err != nil {
		v.tb.Fatal(err)
	}
	file := filepath.Join(d.Dir, name+".xml")
	if err := os.WriteFile(file, []byte(x), 0o600); err != nil {
		v.tb.Fatal(err)
	}
	if _, err := d.Virsh("define", file); err != nil {
		v.tb.Fatal(err)
	}
	if _, err := d.Virsh("start", name); err != nil {
		v.tb.Fatal(err)
	}
	if err := vm.HostSide(o); err != nil {
		v.tb.Fatal(err)
	}
	m := vm.Follow(name, console)
	v.tb.Cleanup(func() {
		v.failed(name, m)
		m.Stop()
	})
	return m
}

// procUID is the real uid of process pid, from /proc.
func procUID(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "Uid:" {
			return f[1]
		}
	}
	t.Fatalf("no Uid in /proc/%d/status", pid)
	return ""
}

// libvirtGuests returns hostd's guests that came from libvirt.
func (v *vmEnv) libvirtGuests() []broker.GuestInfo {
	v.tb.Helper()
	var gs, out []broker.GuestInfo
	if err := admin.Call(v.Admin, admin.Request{Cmd: "guests"}, &gs); err != nil {
		v.tb.Fatalf("hostd guests: %v", err)
	}
	for _, g := range gs {
		if g.Source == "libvirt" {
			out = append(out, g)
		}
	}
	return out
}

func (v *vmEnv) libvirtStatus() virt.Status {
	v.tb.Helper()
	var st agent.Status
	if err := admin.Call(v.Admin, admin.Request{Cmd: "status"}, &st); err != nil {
		v.tb.Fatalf("hostd status: %v", err)
	}
	if st.Libvirt == nil {
		v.tb.Fatal("hostd status has no libvirt part")
	}
	return *st.Libvirt
}

// waitGuests waits until hostd's libvirt guests are exactly names (the
// rig's own namespace guests aside).
func (v *vmEnv) waitGuests(d *libvirtd.Daemon, names ...string) {
	v.tb.Helper()
	var got []string
	for deadline := time.Now().Add(30 * time.Second); ; {
		if got = guestNames(v.libvirtGuests()); slices.Equal(got, names) {
			return
		}
		if time.Now().After(deadline) {
			out, _ := d.Virsh("list", "--all")
			v.tb.Fatalf("hostd's libvirt guests are %v, want %v; libvirt says:\n%s\nhostd log:\n%s", got, names, out, v.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func guestNames(gs []broker.GuestInfo) []string {
	var out []string
	for _, g := range gs {
		out = append(out, g.Name)
	}
	slices.Sort(out)
	return out
}
