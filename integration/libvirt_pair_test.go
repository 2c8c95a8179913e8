package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/virt"
	"github.com/shuntnet/shunt/integration/libvirtd"
	"github.com/shuntnet/shunt/integration/vm"
)

// libvirtPairGroup is the trust group of the libvirt test's domains with
// pair regions (vm_regions = "pair"): no <shmem> at boot, the group named
// in their metadata; each pair's region is hot-plugged by hostd through
// libvirt (attach-device <shmem>), 1 s after its last flow it goes
// (pair_region_linger). The group's own region (hostd makes it, no
// domain maps it), and the pair regions of lv3 and lv4 that a failed run
// left, are removed with the test.
func libvirtPairGroup(t *testing.T, kvm string) string {
	t.Cleanup(func() {
		left, _ := filepath.Glob("/dev/shm/" + virt.PairOf(203, 204) + "*")
		for _, f := range append(left, fmt.Sprintf("/dev/shm/shunt-lvp-%d", os.Getpid())) {
			os.Remove(f)
		}
	})
	return fmt.Sprintf(`pair_region_linger = "1s"
trust_group "p" {
  region           = "/dev/shm/shunt-lvp-%d"
  region_size      = "4MiB"
  slots            = 16
  region_group     = %q
  vm_regions       = "pair"
  pair_region_size = "16MiB"
  pair_slots       = 64
  guest_ring_bytes = "64MiB"
  guest_flows      = 64
}
`, os.Getpid(), kvm)
}

// pairRegionID is the id of the pair region that flow r is in ("p/p1/3.1"
// is in region 1).
func pairRegionID(t *testing.T, r broker.FlowInfo) uint32 {
	t.Helper()
	var group string
	var id uint32
	if _, err := fmt.Sscanf(strings.ReplaceAll(r.Name, "/", " "), "%s p%d", &group, &id); err != nil || id == 0 {
		t.Fatalf("flow %q is not in a pair region (%v)", r.Name, err)
	}
	return id
}

// shmems returns the <shmem> devices in domain name's live XML.
func shmems(t *testing.T, d *libvirtd.Daemon, name string) []virt.Shmem {
	t.Helper()
	x, err := d.Virsh("dumpxml", name)
	if err != nil {
		t.Fatal(err)
	}
	s, err := virt.Shmems([]byte(x))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// waitShmems waits (bound) until domain name's live XML has exactly the
// <shmem> devices named want, and returns them.
func (v *vmEnv) waitShmems(t *testing.T, d *libvirtd.Daemon, name, what string, bound time.Duration, want ...string) []virt.Shmem {
	t.Helper()
	for deadline := time.Now().Add(bound); ; {
		s := shmems(t, d, name)
		var got []string
		for _, x := range s {
			got = append(got, x.Name)
		}
		if slices.Equal(got, want) {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: domain %s has <shmem> devices %+v, want %v, within %s; hostd's flows:\n%s", what, name, s, want, bound, v.flowsJSON())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkPairFile checks the libvirt pair region's file: hostd's, mode
// 0660, group gid (region_group), so that QEMU as libvirt-qemu:kvm opens
// it and other users cannot.
func checkPairFile(t *testing.T, path, gid string) {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatalf("pair region file: %v", err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	if !fi.Mode().IsRegular() || fi.Mode().Perm() != 0o660 || st.Uid != 0 || fmt.Sprint(st.Gid) != gid {
		t.Fatalf("pair region %s is %v %d:%d, want a regular file 0660 root:%s", path, fi.Mode(), st.Uid, st.Gid, gid)
	}
}

// pairDomainXML turns a domain of vm.DomainXML into one of group p: its
// group region <shmem> taken out (hostd plugs the pair regions), and ACPI
// on, without which QEMU's pc machine takes no hot-plugged PCI device
// ("Bus 'pci.0' does not support hotplugging").
func pairDomainXML(x string, o vm.Options) (string, error) {
	sh, err := o.Attach.Region.LibvirtXML()
	if err != nil {
		return "", err
	}
	if !strings.Contains(x, sh) {
		return "", fmt.Errorf("domain XML has no %s", sh)
	}
	return withACPI(strings.Replace(x, sh, "", 1)), nil
}

// withACPI gives a domain of vm.DomainXML the ACPI feature (libvirt
// leaves it off unless asked), as a Debian guest defined by virt-install
// has it.
func withACPI(x string) string {
	return strings.Replace(x, "<on_reboot>", "<features><acpi/></features>\n<on_reboot>", 1)
}

// logPlugTimes logs hostd's plug and unplug lines (the time libvirt took
// for both domains) and the guests' "mapped from" lines.
func (v *vmEnv) logPlugTimes(t *testing.T, ms ...*vm.VM) {
	for _, s := range []string{"pair region plugged into its VMs", "pair region unplugged from its VMs"} {
		for _, l := range v.hostdLines(s) {
			t.Logf("hostd: %s", l)
		}
	}
	for _, m := range ms {
		for _, l := range strings.Split(m.Console(), "\n") {
			if strings.Contains(l, "mapped from") {
				t.Logf("%s: %s", m.Name, l)
			}
		}
	}
}
