//go:build linux

package vm

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
)

// Kernel is a bootable kernel and its modules.
type Kernel struct {
	Vmlinux string // uncompressed ELF (PVH boot: no decompression under TCG)
	Modules string // /lib/modules/<version>
}

// FindKernel picks the newest /boot/vmlinuz-*, extracts its ELF image into
// cache (once), and returns it with its modules directory.
func FindKernel(cache string) (Kernel, error) {
	imgs, _ := filepath.Glob("/boot/vmlinuz-*")
	if len(imgs) == 0 {
		return Kernel{}, errors.New("no /boot/vmlinuz-*: apt-get install linux-image-amd64")
	}
	sort.Strings(imgs)
	img := imgs[len(imgs)-1]
	ver := strings.TrimPrefix(filepath.Base(img), "vmlinuz-")
	k := Kernel{Vmlinux: filepath.Join(cache, "vmlinux-"+ver), Modules: "/lib/modules/" + ver}
	if _, err := os.Stat(k.Modules); err != nil {
		return Kernel{}, fmt.Errorf("modules for %s: %w", ver, err)
	}
	if _, err := os.Stat(k.Vmlinux); err == nil {
		return k, nil
	}
	raw, err := os.ReadFile(img)
	if err != nil {
		return Kernel{}, err
	}
	// The bzImage carries an xz stream (magic FD 37 7A 58 5A 00); xz
	// complains about the trailing data, but the output is complete.
	at := bytes.Index(raw, []byte{0xfd, '7', 'z', 'X', 'Z', 0})
	if at < 0 {
		return Kernel{}, fmt.Errorf("%s has no xz stream", img)
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return Kernel{}, err
	}
	var out bytes.Buffer
	cmd := exec.Command("xz", "-dc")
	cmd.Stdin, cmd.Stdout = bytes.NewReader(raw[at:]), &out
	_ = cmd.Run()
	if !bytes.HasPrefix(out.Bytes(), []byte("\x7fELF")) {
		return Kernel{}, fmt.Errorf("decompressing %s gave no ELF image (is xz-utils installed?)", img)
	}
	// A temporary file of its own: test packages run in parallel, and two
	// writers of one ".tmp" could rename a half-written kernel.
	f, err := os.CreateTemp(cache, "vmlinux-*.tmp")
	if err != nil {
		return Kernel{}, err
	}
	_, err = f.Write(out.Bytes())
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(f.Name(), 0o644)
	}
	if err != nil {
		os.Remove(f.Name())
		return Kernel{}, err
	}
	return k, os.Rename(f.Name(), k.Vmlinux)
}

// modules the guest loads, in dependency order.
var modules = []string{"virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev", "virtio_pci",
	"virtio_console", "failover", "net_failover", "virtio_net", "netfs", "fscache", "9pnet", "9pnet_virtio", "9p"}

const initScript = `#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in %s; do insmod /lib/modules/$m.ko; done
arg() { sed -n "s/.*shunt\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
hostname $(arg ip | sed 's|/.*||')
mkdir -p /dev/shm && mount -t tmpfs shm /dev/shm
# With Options.ShareUsr the host's /usr comes over 9p (read-only): its
# programs and libraries run here unchanged (merged /usr: /lib64 and the
# multiarch libraries live under it).
if mount -t 9p -o trans=virtio,version=9p2000.L,ro hostusr /usr 2>/dev/null; then
  [ -e /lib64 ] || ln -s /usr/lib64 /lib64
  [ -e /lib/x86_64-linux-gnu ] || ln -s /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu
  export PATH=/bin:/sbin:/usr/bin:/usr/sbin
fi
ip link set lo up
ip addr add $(arg ip) dev eth0
ip link set eth0 up
ip route add default via $(arg gw)
echo "SHUNT-VM READY"
/agent $(arg args | tr , ' ')
echo "SHUNT-VM AGENT-EXIT $?"
reboot -f  # QEMU runs with -no-reboot, libvirt domains with on_reboot=destroy: both end
`

// BuildInitramfs writes a gzip-less newc cpio archive with busybox, the
// virtio modules, the init script and agent (a static binary) to path.
// Each of extra (dynamically linked programs and libraries) goes in at its
// own absolute path, with the shared libraries and loader ldd names for it.
func BuildInitramfs(path string, k Kernel, agent string, extra ...string) error {
	busybox, err := exec.LookPath("busybox")
	if err != nil {
		return errors.New("busybox not found: apt-get install busybox-static")
	}
	w := newCpio()
	for _, d := range []string{"bin", "sbin", "proc", "sys", "dev", "lib", "lib/modules", "tmp", "usr", "etc"} {
		w.dir(d)
	}
	// Who root is, for programs that ask (Open MPI names its session
	// directory after the user).
	w.data("etc/passwd", []byte("root:x:0:0:root:/tmp:/bin/sh\n"), 0o644)
	w.data("etc/group", []byte("root:x:0:\n"), 0o644)
	if err := w.file("bin/busybox", busybox, 0o755); err != nil {
		return err
	}
	for _, l := range []string{"sh", "mount", "insmod", "ip", "sed", "tr", "echo", "reboot", "cat", "ls", "sleep", "hostname", "mkdir", "ln"} {
		w.symlink("bin/"+l, "busybox")
	}
	for _, m := range modules {
		found, _ := filepath.Glob(filepath.Join(k.Modules, "kernel", "*", "*", m+".ko"))
		found2, _ := filepath.Glob(filepath.Join(k.Modules, "kernel", "*", "*", "*", m+".ko"))
		found = append(found, found2...)
		if len(found) == 0 {
			return fmt.Errorf("module %s not under %s", m, k.Modules)
		}
		if err := w.file("lib/modules/"+m+".ko", found[0], 0o644); err != nil {
			return err
		}
	}
	w.data("init", []byte(fmt.Sprintf(initScript, strings.Join(modules, " "))), 0o755)
	if err := w.file("agent", agent, 0o755); err != nil {
		return err
	}
	have := map[string]bool{"bin": true, "sbin": true, "proc": true, "sys": true, "dev": true, "lib": true, "lib/modules": true, "tmp": true, "usr": true, "etc": true}
	for _, e := range extra {
		files, err := withLibraries(e)
		if err != nil {
			return err
		}
		for _, f := range files {
			if err := w.fileAt(f, have); err != nil {
				return err
			}
		}
	}
	return os.WriteFile(path, w.close(), 0o644)
}

// BuildInitramfsFiles is BuildInitramfs with files copied in at their own
// absolute paths but without their libraries: for VMs that get the host's
// /usr (Options.ShareUsr), where the libraries already are.
func BuildInitramfsFiles(path string, k Kernel, agent string, files ...string) error {
	if err := BuildInitramfs(path, k, agent); err != nil {
		return err
	}
	// A cpio archive may be followed by another; the kernel unpacks both.
	w := newCpio()
	have := map[string]bool{"tmp": true}
	for _, f := range files {
		if err := w.fileAt(f, have); err != nil {
			return err
		}
	}
	out, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer out.Close()
	_, err = out.Write(w.close())
	return err
}

// fileAt adds the file at host path src under the same path, with the
// directories above it; have records what the archive holds already.
func (c *cpio) fileAt(src string, have map[string]bool) error {
	name := strings.TrimPrefix(src, "/")
	if have[name] {
		return nil
	}
	have[name] = true
	for _, d := range parents(name) {
		if !have[d] {
			have[d] = true
			c.dir(d)
		}
	}
	return c.file(name, src, 0o755)
}

// withLibraries returns path and what ldd says it loads.
func withLibraries(path string) ([]string, error) {
	out, err := exec.Command("ldd", path).Output()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w", path, err)
	}
	files := []string{path}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) >= 3 && f[1] == "=>" && strings.HasPrefix(f[2], "/"):
			files = append(files, f[2])
		case len(f) >= 1 && strings.HasPrefix(f[0], "/"):
			files = append(files, f[0]) // the loader
		}
	}
	return files, nil
}

// parents returns the directories above name, outermost first ("a/b/c"
// gives "a", "a/b"); the kernel creates no directories for cpio entries.
func parents(name string) []string {
	var out []string
	for i := 0; i < len(name); i++ {
		if name[i] == '/' {
			out = append(out, name[:i])
		}
	}
	return out
}

// cpio writes the "newc" format the kernel unpacks into its rootfs.
type cpio struct {
	buf bytes.Buffer
	ino int
}

func newCpio() *cpio { return &cpio{ino: 1} }

func (c *cpio) entry(name string, mode uint32, body []byte) {
	c.ino++
	fmt.Fprintf(&c.buf, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, mode, 0, 0, 1, 0, len(body), 0, 0, 0, 0, len(name)+1, 0)
	c.buf.WriteString(name)
	c.buf.WriteByte(0)
	c.pad()
	c.buf.Write(body)
	c.pad()
}

func (c *cpio) pad() {
	for c.buf.Len()%4 != 0 {
		c.buf.WriteByte(0)
	}
}

func (c *cpio) dir(name string)                            { c.entry(name, 0o040755, nil) }
func (c *cpio) symlink(name, target string)                { c.entry(name, 0o120777, []byte(target)) }
func (c *cpio) data(name string, body []byte, perm uint32) { c.entry(name, 0o100000|perm, body) }
func (c *cpio) close() []byte                              { c.entry("TRAILER!!!", 0, nil); return c.buf.Bytes() }

func (c *cpio) file(name, src string, perm uint32) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	b, err := io.ReadAll(f)
	if err != nil {
		return err
	}
	c.data(name, b, perm)
	return nil
}

// Images builds what a VM test boots, in dir: the guest kernel (FindKernel,
// cached under the system's temporary directory), the guest agent built
// from agentPkg (a go build path, e.g. "../cmd/shunt-vm-agent"; static) and
// an initramfs holding it.
func Images(dir, agentPkg string) (k Kernel, agent, initrd string, err error) {
	k, err = FindKernel(filepath.Join(os.TempDir(), "shunt-vm-cache"))
	if err != nil {
		return k, "", "", err
	}
	agent = filepath.Join(dir, "agent")
	build := exec.Command("go", "build", "-o", agent, agentPkg)
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return k, "", "", fmt.Errorf("build the guest agent: %v\n%s", err, out)
	}
	initrd = filepath.Join(dir, "initramfs")
	if err := BuildInitramfs(initrd, k, agent); err != nil {
		return k, "", "", err
	}
	return k, agent, initrd, nil
}
