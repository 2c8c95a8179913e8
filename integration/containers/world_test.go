//go:build linux

package containers

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/container/cdi"
	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/testenv"
)

// Podman's storage, kept between runs so that the image is imported once
// (vfs: no overlay module needed); the runtime state must pair with it.
const (
	podmanRoot    = "/var/tmp/shunt-podman-test/root"
	podmanRunRoot = "/run/shunt-podman-test"
)

// step bounds every podman and hostd step.
const step = 60 * time.Second

// world is one test's host: a network namespace podman runs in (its
// veths' host ends and routes, and hostd's nftables table, are there),
// hostd with a container socket, a CNI network (ptp, then shunt) and a
// CDI device of the test's own. Cleanup removes all of it.
type world struct {
	t       *testing.T
	name    string // short and unique: the netns, the network, the CDI device
	dir     string
	hostNS  string
	subnet  string
	admin   string
	csock   string
	config  string
	device  string // the CDI device to ask for: shunt.net/guest=<name>
	sdevice string // the socket-only one
	cdiFile string
	image   string
	hostd   *exec.Cmd
	logs    *os.File
	onFail  func() string // more for state to show (the containers' logs)
}

var (
	seq       int
	imageOnce sync.Once
	imageTag  string
	imageErr  error
)

// needs skips (or fails under CI=true) without root or the tools.
func needs(t *testing.T) {
	t.Helper()
	testenv.NeedRoot(t)
	for _, tool := range []struct{ name, pkg string }{
		{"podman", "podman"}, {"runc", "runc"}, {"nsenter", "util-linux"}, {"nft", "nftables"},
		{"iperf3", "iperf3"}, {"redis-server", "redis-server"}, {"redis-benchmark", "redis-tools"}, {"busybox", "busybox-static"}, {"socat", "socat"},
	} {
		testenv.NeedTool(t, tool.name, tool.pkg)
	}
	if _, err := os.Stat("/usr/lib/cni/ptp"); err != nil {
		testenv.Missing(t, "the CNI plugin ptp", "apt-get install containernetworking-plugins")
	}
	if bin.err != nil {
		t.Fatal(bin.err)
	}
}

func newWorld(t *testing.T) *world {
	t.Helper()
	needs(t)
	seq++
	w := &world{t: t, name: fmt.Sprintf("shc%d%d", os.Getpid()%1000, seq), dir: t.TempDir()}
	w.hostNS = "/run/netns/" + w.name
	w.subnet = fmt.Sprintf("10.%d.%d.0/24", 200+seq%50, os.Getpid()%250)
	w.admin = filepath.Join(w.dir, "admin.sock")
	w.csock = filepath.Join(w.dir, "container", "control.sock")
	w.device, w.sdevice = cdi.Kind+"="+w.name, cdi.Kind+"="+w.name+"-socket"
	w.cdiFile = "/run/cdi/shunt-test-" + w.name + ".json"
	t.Cleanup(w.close)
	if out, err := exec.Command("ip", "netns", "add", w.name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	w.must("ip", "-n", w.name, "link", "set", "lo", "up")
	w.writeFiles()
	w.startHostd()
	w.image = w.ensureImage()
	return w
}

func (w *world) must(name string, args ...string) string {
	w.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), step)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		w.t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// writeFiles writes hostd's configuration, the CNI network, podman's
// containers.conf and the CDI spec (with the test's device names, and the
// test's preload library).
func (w *world) writeFiles() {
	t := w.t
	cfg := fmt.Sprintf(`log_level = "debug"
admin_socket = %q
metrics_address = ""
conntrack_netns = %q
state_dir = %q
region_dir = %q
container_socket = %q
trust_group "default" {
  region = "/dev/shm/shunt-%s"
  region_size = "8MiB"
  slots = 16
  pair_region_size = "64MiB"
  pair_slots = 256
  guest_ring_bytes = "256MiB"
  guest_flows = 256
}
policy {
}
`, w.admin, w.hostNS, filepath.Join(w.dir, "state"), filepath.Join(w.dir, "regions"), w.csock, w.name)
	w.config = filepath.Join(w.dir, "hostd.hcl")
	net := fmt.Sprintf(`{"cniVersion":"1.0.0","name":%q,"plugins":[
 {"type":"ptp","ipMasq":false,"ipam":{"type":"host-local","subnet":%q,"dataDir":%q}},
 {"type":"shunt","group":"default","admin_socket":%q}]}
`, w.name, w.subnet, filepath.Join(w.dir, "ipam"), w.admin)
	conf := fmt.Sprintf(`[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
[network]
network_backend = "cni"
cni_plugin_dirs = [%q, "/usr/lib/cni"]
network_config_dir = %q
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "none"
`, filepath.Dir(bin.cni), filepath.Join(w.dir, "cni"))
	spec, err := cdi.Make(w.csock, bin.preload)
	if err != nil {
		t.Fatal(err)
	}
	spec.Devices[0].Name, spec.Devices[1].Name = w.name, w.name+"-socket"
	specJSON, err := spec.JSON()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []struct {
		path string
		body []byte
	}{
		{w.config, []byte(cfg)},
		{filepath.Join(w.dir, "cni", w.name+".conflist"), []byte(net)},
		{filepath.Join(w.dir, "containers.conf"), []byte(conf)},
		{w.cdiFile, specJSON}, // podman 4.3 reads /etc/cdi and /run/cdi only
		{filepath.Join(w.dir, "data", ".keep"), nil},
	} {
		if err := os.MkdirAll(filepath.Dir(f.path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f.path, f.body, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Dir(w.csock), 0o755); err != nil {
		t.Fatal(err)
	}
}

func (w *world) startHostd() {
	t := w.t
	t.Helper()
	if w.logs == nil {
		f, err := os.Create(filepath.Join(w.dir, "hostd.log"))
		if err != nil {
			t.Fatal(err)
		}
		w.logs = f
	}
	cmd := exec.Command(bin.hostd, "agent", "-config", w.config)
	cmd.Stdout, cmd.Stderr = w.logs, w.logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.hostd = cmd
	deadline := time.Now().Add(10 * time.Second)
	for admin.Call(w.admin, admin.Request{Cmd: admin.CmdStatus}, nil) != nil {
		if time.Now().After(deadline) {
			t.Fatalf("hostd did not come up in 10s:\n%s", w.log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stopHostd stops hostd (SIGTERM, or SIGKILL if kill) and waits for it.
func (w *world) stopHostd(kill bool) {
	if w.hostd == nil {
		return
	}
	sig := syscall.SIGTERM
	if kill {
		sig = syscall.SIGKILL
	}
	_ = w.hostd.Process.Signal(sig)
	done := make(chan struct{})
	go func() { _ = w.hostd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = w.hostd.Process.Kill()
		<-done
	}
	w.hostd = nil
}

func (w *world) log() string {
	b, _ := os.ReadFile(filepath.Join(w.dir, "hostd.log"))
	return string(b)
}

// podmanCmd is podman in the world's namespace, with its configuration.
func (w *world) podmanCmd(ctx context.Context, args ...string) *exec.Cmd {
	all := append([]string{"--net=" + w.hostNS, "podman", "--root", podmanRoot, "--runroot", podmanRunRoot, "--storage-driver", "vfs"}, args...)
	cmd := exec.CommandContext(ctx, "nsenter", all...)
	cmd.Env = append(os.Environ(), "CONTAINERS_CONF="+filepath.Join(w.dir, "containers.conf"))
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// podman runs podman and returns its output, failing the test (with
// hostd's view) if it fails or outlives step.
func (w *world) podman(args ...string) string {
	w.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), step)
	defer cancel()
	out, err := w.podmanCmd(ctx, args...).CombinedOutput()
	if err != nil {
		w.t.Fatalf("podman %s: %v\n%s\n%s", strings.Join(args, " "), err, out, w.state())
	}
	return strings.TrimSpace(string(out))
}

// run starts a detached container on the world's network, labelled for
// cleanup, and returns its id.
func (w *world) run(name string, opts []string, cmd ...string) string {
	w.t.Helper()
	args := append([]string{"run", "-d", "--name", w.name + "-" + name, "--label", "shunt-test=" + w.name, "--network", w.name,
		"-v", filepath.Join(w.dir, "data") + ":/data"}, opts...)
	args = append(append(args, w.image), cmd...)
	return w.podman(args...)
}

// ensureImage imports the test image unless the storage has it already.
func (w *world) ensureImage() string {
	imageOnce.Do(func() {
		dir, err := os.MkdirTemp("", "shunt-rootfs")
		if err != nil {
			imageErr = err
			return
		}
		defer os.RemoveAll(dir)
		tar, tag, err := rootfs(dir)
		if err != nil {
			imageErr = err
			return
		}
		imageTag = "localhost/shunt-test:" + tag
		ctx, cancel := context.WithTimeout(context.Background(), step)
		defer cancel()
		// Containers an earlier run left (a killed test binary) go first.
		if out, err := w.podmanCmd(ctx, "ps", "-aq", "--filter", "label=shunt-test").Output(); err == nil {
			if ids := strings.Fields(string(out)); len(ids) > 0 {
				_ = w.podmanCmd(ctx, append([]string{"rm", "-f", "-t", "0"}, ids...)...).Run()
			}
		}
		if w.podmanCmd(ctx, "image", "exists", imageTag).Run() == nil {
			return
		}
		if out, err := w.podmanCmd(ctx, "import", tar, imageTag).CombinedOutput(); err != nil {
			imageErr = fmt.Errorf("podman import: %v: %s", err, out)
			return
		}
		// Older test images (of other binaries) go: one is kept.
		out, _ := w.podmanCmd(ctx, "images", "--format", "{{.Repository}}:{{.Tag}}", "localhost/shunt-test").Output()
		for _, img := range strings.Fields(string(out)) {
			if img != imageTag {
				_ = w.podmanCmd(ctx, "rmi", "-f", img).Run()
			}
		}
	})
	if imageErr != nil {
		w.t.Fatal(imageErr)
	}
	return imageTag
}

// guests are hostd's run-time guests.
func (w *world) guests() []admin.GuestSpec {
	w.t.Helper()
	var gs []admin.GuestSpec
	if err := admin.Call(w.admin, admin.Request{Cmd: admin.CmdGuestList}, &gs); err != nil {
		w.t.Fatalf("hostd guest list: %v", err)
	}
	return gs
}

// guestOf is the run-time guest of container id (nil if none).
func (w *world) guestOf(id string) *admin.GuestSpec {
	for _, g := range w.guests() {
		if g.Container == id {
			return &g
		}
	}
	return nil
}

// allGuests are all of hostd's guests, with their sessions and listeners.
func (w *world) allGuests() []broker.GuestInfo {
	var gs []broker.GuestInfo
	_ = admin.Call(w.admin, admin.Request{Cmd: admin.CmdGuests}, &gs)
	return gs
}

func (w *world) flows() []broker.FlowInfo {
	var fl []broker.FlowInfo
	_ = admin.Call(w.admin, admin.Request{Cmd: admin.CmdFlows}, &fl)
	return fl
}

// state is what a failing step shows: hostd's guests and flows, podman's
// containers and hostd's log.
func (w *world) state() string {
	var b strings.Builder
	var gs []admin.GuestSpec
	err := admin.Call(w.admin, admin.Request{Cmd: admin.CmdGuestList}, &gs)
	fmt.Fprintf(&b, "hostd guests (%v):\n", err)
	for _, g := range gs {
		fmt.Fprintf(&b, "  %+v\n", g)
	}
	fl, _ := json.MarshalIndent(w.flows(), "  ", " ")
	fmt.Fprintf(&b, "hostd flows: %s\n", fl)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, _ := w.podmanCmd(ctx, "ps", "-a").CombinedOutput()
	fmt.Fprintf(&b, "podman ps -a:\n%s\nhostd log:\n%s", out, w.log())
	if w.onFail != nil {
		f := w.onFail
		w.onFail = nil
		b.WriteString(f())
	}
	return b.String()
}

// waitFor polls cond every 50 ms until it holds, or fails after d with
// what and the world's state.
func (w *world) waitFor(d time.Duration, what string, cond func() bool) {
	w.t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			w.t.Fatalf("%s: not after %s\n%s", what, d, w.state())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// regionFiles are the pair regions in hostd's region_dir.
func (w *world) regionFiles() []string {
	ents, _ := os.ReadDir(filepath.Join(w.dir, "regions"))
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// markRules counts the guest rules in hostd's nftables table.
func (w *world) markRules() int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "nsenter", "--net="+w.hostNS, "nft", "list", "table", "inet", "shunt_hostd").CombinedOutput()
	if err != nil {
		return -1
	}
	return strings.Count(string(out), "iifname")
}

// hostdSockets counts hostd's open sockets.
func (w *world) hostdSockets() int {
	if w.hostd == nil {
		return -1
	}
	dir := fmt.Sprintf("/proc/%d/fd", w.hostd.Process.Pid)
	ents, _ := os.ReadDir(dir)
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && strings.HasPrefix(l, "socket:") {
			n++
		}
	}
	return n
}

func (w *world) close() {
	t := w.t
	if t.Failed() {
		t.Logf("state at the end:\n%s", w.state())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*step)
	defer cancel()
	if out, err := w.podmanCmd(ctx, "ps", "-aq", "--filter", "label=shunt-test="+w.name).Output(); err == nil {
		if ids := strings.Fields(string(out)); len(ids) > 0 {
			if out, err := w.podmanCmd(ctx, append([]string{"rm", "-f", "-t", "0"}, ids...)...).CombinedOutput(); err != nil {
				t.Errorf("podman rm: %v: %s", err, out)
			}
		}
	}
	w.stopHostd(false)
	if w.logs != nil {
		w.logs.Close()
	}
	_ = os.Remove(w.cdiFile)
	_ = exec.Command("ip", "netns", "del", w.name).Run()
	_ = os.Remove("/dev/shm/shunt-" + w.name)
}
