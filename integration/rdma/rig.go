//go:build linux

package rdma

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/internal/testenv"
)

// needRig checks what two TCG VMs with SoftRoCE need on this host and
// returns the guest kernel.
func needRig(t *testing.T) vm.Kernel {
	t.Helper()
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "qemu-system-x86_64", "qemu-system-x86")
	testenv.NeedTool(t, "busybox", "busybox-static")
	testenv.NeedTool(t, "ib_write_bw", "perftest")
	testenv.NeedTool(t, "ibv_rc_pingpong", "ibverbs-utils")
	testenv.NeedTool(t, "rdma", "iproute2")
	for _, f := range []string{"/usr/include/infiniband/verbs.h", "/etc/libibverbs.d/rxe.driver"} {
		if _, err := os.Stat(f); err != nil {
			testenv.Missing(t, f+" is missing", "apt-get install libibverbs-dev ibverbs-providers")
		}
	}
	if imgs, _ := filepath.Glob("/boot/vmlinuz-*"); len(imgs) == 0 {
		testenv.Missing(t, "no guest kernel in /boot", "apt-get install linux-image-amd64")
	}
	kernel, err := vm.FindKernel(filepath.Join(os.TempDir(), "shunt-vm-cache"))
	if err != nil {
		t.Fatal(err)
	}
	if m, _ := filepath.Glob(filepath.Join(kernel.Modules, "kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko*")); len(m) == 0 {
		testenv.Missing(t, "the guest kernel "+kernel.Modules+" has no rdma_rxe", "a Debian linux-image-amd64")
	}
	return kernel
}

// goBuild builds pkg (relative to this directory) with the tag rdma into
// dir and returns the binary's path.
func goBuild(t *testing.T, dir, pkg string) string {
	t.Helper()
	bin := filepath.Join(dir, filepath.Base(pkg))
	out, err := exec.Command("go", "build", "-tags", "rdma", "-o", bin, pkg).CombinedOutput()
	if err != nil {
		t.Fatalf("build %s with the rdma tag: %v\n%s", pkg, err, out)
	}
	return bin
}

// bootPair boots the two guests, "server" (10.98.0.1, QEMU's end of the
// stream socket) and "client" (10.98.0.2), joined by a -netdev stream
// over a Unix socket: one vCPU each (-cpu max: rxe's CRC uses PCLMUL),
// 512 MiB, the host's /usr over 9p. The agent gets role, the peer's
// address, then args. Each is stopped when the test ends, its console
// logged if the test failed.
func bootPair(t *testing.T, kernel vm.Kernel, initrd string, args ...string) (server, client *vm.VM) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "link.sock")
	boot := func(i int, role, netdev string) *vm.VM {
		a := netip.AddrFrom4([4]byte{10, 98, 0, byte(i)})
		peer := netip.AddrFrom4([4]byte{10, 98, 0, byte(3 - i)})
		m, err := vm.Boot(vm.Options{
			Name: role, Kernel: kernel, Initramfs: initrd, Addr: a, Host: netip.MustParseAddr("10.98.0.254"),
			Args:     append([]string{role, peer.String()}, args...),
			ShareUsr: true, MemMB: 512, Accel: "tcg,thread=single", CPU: "max",
			Net: []string{"-netdev", netdev + ",id=n0",
				"-device", fmt.Sprintf("virtio-net-pci,netdev=n0,mac=52:54:00:98:00:%02x", i)},
		}, func(c *exec.Cmd) error { return c.Start() })
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("console of %s:\n%s", role, m.Console())
			}
			m.Stop()
		})
		return m
	}
	server = boot(1, "server", "stream,server=on,addr.type=unix,addr.path="+sock)
	for end := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("QEMU made no socket %s in 30 s", sock)
		}
	}
	return server, boot(2, "client", "stream,server=off,addr.type=unix,addr.path="+sock)
}

// logStages logs the agents' STAGE lines (PREFIX STAGE name at=UPTIME)
// as each stage's seconds, so a slow stage shows in the log.
func logStages(t *testing.T, prefix string, ms ...*vm.VM) {
	t.Helper()
	for _, m := range ms {
		var b strings.Builder
		var last float64
		var name string
		for _, l := range strings.Split(m.Console(), "\n") {
			f := strings.Fields(strings.TrimSpace(l))
			if len(f) != 4 || f[0] != prefix || f[1] != "STAGE" || !strings.HasPrefix(f[3], "at=") {
				continue
			}
			at, err := strconv.ParseFloat(strings.TrimPrefix(f[3], "at="), 64)
			if err != nil {
				continue
			}
			if name != "" {
				fmt.Fprintf(&b, " %s %.1fs", name, at-last)
			}
			name, last = f[2], at
		}
		t.Logf("%s stages:%s", m.Name, b.String())
	}
}
