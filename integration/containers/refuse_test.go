//go:build linux

package containers

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/internal/proto"
)

// ctxT is a step's context, cancelled when the test ends.
func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), step)
	t.Cleanup(cancel)
	return ctx
}

// probe runs the probe in container id against control and returns what
// hostd answered.
func (w *world) probe(id, control string) string {
	w.t.Helper()
	return w.podman("exec", "-e", "SHUNT_CONTROL="+control, id, "/bin/probe")
}

// TestContainerRefused: hostd serves a process only as the guest of its
// own network namespace. A container that is no guest is refused on the
// container socket; one that mounts another guest's own control socket is
// refused there and is itself (never the other) on the container socket;
// a second guest for a namespace, or hostd's own namespace, is refused;
// and a removed guest's processes are refused again.
func TestContainerRefused(t *testing.T) {
	w := newWorld(t)
	// A network without the shunt plugin: its containers are no guests.
	plain := w.name + "p"
	conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":%q,"plugins":[{"type":"ptp","ipMasq":false,"ipam":{"type":"host-local","subnet":"10.%d.%d.0/24","dataDir":%q}}]}`,
		plain, 150+seq%50, os.Getpid()%250, filepath.Join(w.dir, "ipam"))
	if err := os.WriteFile(filepath.Join(w.dir, "cni", plain+".conflist"), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	own := filepath.Join(w.dir, "own")
	if err := os.MkdirAll(own, 0o755); err != nil {
		t.Fatal(err)
	}
	sleep := []string{"/bin/sleep", "600"}
	u := w.podman(append([]string{"run", "-d", "--label", "shunt-test=" + w.name, "--network", plain, "--device", w.sdevice, "-v", own + ":/own", w.image}, sleep...)...)
	a := w.podman(append([]string{"run", "-d", "--label", "shunt-test=" + w.name, "--network", plain, "--device", w.sdevice, "-v", own + ":/own", w.image}, sleep...)...)
	b := w.run("b", []string{"--device", w.sdevice, "-v", own + ":/own"}, sleep...)
	bg := w.waitGuest(b)

	// Not registered: refused, and told why.
	if got := w.probe(u, w.csock); !strings.HasPrefix(got, "ERROR not-guest") || !strings.Contains(got, "no guest's") {
		t.Errorf("an unregistered container on the container socket: %q, want ERROR not-guest (no guest's namespace)", got)
	}

	// A registered by hand, with a control socket of its own in /own.
	netns := w.podman("inspect", "-f", "{{.NetworkSettings.SandboxKey}}", a)
	out := w.must(bin.hostd, "guest", "add", "-admin", w.admin, "-name", "a", "-group", "default", "-netns", netns,
		"-addr", "10.250.0.9", "-control", filepath.Join(own, "control.sock"))
	t.Logf("hostd guest add: %s", strings.TrimSpace(out))
	var aID string
	for _, g := range w.guests() {
		if g.Name == "a" {
			aID = strconv.FormatUint(uint64(g.ID), 10)
		}
	}
	if got := w.probe(a, "/own/control.sock"); got != "WELCOME "+aID {
		t.Errorf("A on its own socket: %q, want WELCOME %s", got, aID)
	}
	if got := w.probe(a, w.csock); got != "WELCOME "+aID {
		t.Errorf("A on the container socket: %q, want WELCOME %s", got, aID)
	}

	// B, a guest, forges A's socket (it has it mounted): refused there,
	// and on the container socket it is B, never A.
	if got := w.probe(b, "/own/control.sock"); !strings.HasPrefix(got, "ERROR not-guest") || !strings.Contains(got, "guest a's control socket") {
		t.Errorf("B on A's socket: %q, want ERROR not-guest (on guest a's control socket)", got)
	}
	if got, want := w.probe(b, w.csock), "WELCOME "+strconv.FormatUint(uint64(bg.ID), 10); got != want {
		t.Errorf("B on the container socket: %q, want %q", got, want)
	}
	// hostd also serves each run-time guest inside its own namespace, on
	// the abstract socket the libraries fall back to: no mount needed.
	if got, want := w.probe(b, "@"+proto.NetnsControl), "WELCOME "+strconv.FormatUint(uint64(bg.ID), 10); got != want {
		t.Errorf("B on the abstract socket in its namespace: %q, want %q", got, want)
	}
	if out, err := w.podmanCmd(ctxT(t), "exec", "-e", "SHUNT_CONTROL=@"+proto.NetnsControl, u, "/bin/probe").CombinedOutput(); err == nil {
		t.Errorf("an unregistered container found an abstract socket in its namespace: %s", out)
	}
	// So is an unregistered container that forges A's socket.
	if got := w.probe(u, "/own/control.sock"); !strings.HasPrefix(got, "ERROR not-guest") {
		t.Errorf("an unregistered container on A's socket: %q, want ERROR not-guest", got)
	}

	// A namespace is one guest's; hostd's own is nobody's.
	for _, c := range []struct{ name, netns, want string }{
		{"a2", netns, "is guest a's already"},
		{"h", "/proc/self/ns/net", "hostd's own network namespace"},
		{"x", filepath.Join(w.dir, "hostd.hcl"), "not a namespace file"},
	} {
		cmd := exec.Command(bin.hostd, "guest", "add", "-admin", w.admin, "-name", c.name, "-group", "default", "-netns", c.netns, "-addr", "10.250.0.10")
		if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), c.want) {
			t.Errorf("hostd guest add -netns %s: %v %q, want refused: %s", c.netns, err, out, c.want)
		}
	}

	// A removed: its socket goes, and its processes are refused.
	w.must(bin.hostd, "guest", "remove", "-admin", w.admin, "a")
	if _, err := os.Stat(filepath.Join(own, "control.sock")); !os.IsNotExist(err) {
		t.Errorf("A's socket after its remove: %v, want it gone", err)
	}
	if got := w.probe(a, w.csock); !strings.HasPrefix(got, "ERROR not-guest") {
		t.Errorf("A after its remove: %q, want ERROR not-guest", got)
	}
	if out, err := exec.Command(bin.hostd, "guest", "remove", "-admin", w.admin, "a").CombinedOutput(); err == nil {
		t.Errorf("hostd guest remove of a guest that is gone: %q, want an error", out)
	}
	if got := len(w.guests()); got != 1 {
		t.Errorf("%d run-time guests left, want B's alone", got)
	}
}
