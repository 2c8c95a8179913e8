//go:build linux

package containers

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// cnitool runs cnitool (the CNI project's own runtime for tests) in the
// world's namespace: action on network net for the namespace at netns.
func (w *world) cnitool(action, net, netns string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), step)
	defer cancel()
	cmd := exec.CommandContext(ctx, "nsenter", "--net="+w.hostNS, bin.cnitool, action, net, netns)
	cmd.Env = append(os.Environ(), "NETCONFPATH="+filepath.Join(w.dir, "cni"), "CNI_PATH="+filepath.Dir(bin.cni)+":/usr/lib/cni")
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// plugin runs the shunt plugin alone as a runtime does (CNI_* in the
// environment, the configuration on stdin) and returns its stdout and
// whether it exited 0.
func plugin(t *testing.T, command, netns, conf string) (map[string]any, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), step)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin.cni)
	cmd.Env = append(os.Environ(), "CNI_COMMAND="+command, "CNI_CONTAINERID=conformance1", "CNI_NETNS="+netns, "CNI_IFNAME=eth0", "CNI_PATH=/usr/lib/cni")
	cmd.Stdin = strings.NewReader(conf)
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	err := cmd.Run()
	var m map[string]any
	if jerr := json.Unmarshal(stdout.Bytes(), &m); jerr != nil && stdout.Len() > 0 {
		t.Errorf("%s printed no JSON: %q", command, stdout.String())
	}
	return m, err == nil
}

// TestCNIConformance drives the plugin chained after ptp with cnitool, and
// alone with the spec's environment and stdin: ADD registers the container
// with the address ptp gave it, CHECK passes while hostd has it (also
// after a hostd restart, which keeps run-time guests), DEL removes it and
// may come again, DEL with hostd down succeeds (hostd drops the guest once
// its namespace is gone), VERSION lists the versions, and errors are the
// spec's JSON with its codes.
func TestCNIConformance(t *testing.T) {
	w := newWorld(t)
	ns := w.name + "c"
	netns := "/run/netns/" + ns
	w.must("ip", "netns", "add", ns)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })

	// VERSION
	v, ok := plugin(t, "VERSION", "", `{"cniVersion":"1.0.0"}`)
	if vs, _ := v["supportedVersions"].([]any); !ok || !slices.Contains(vs, any("1.0.0")) || !slices.Contains(vs, any("0.4.0")) {
		t.Errorf("VERSION: %v, want supportedVersions with 0.4.0 and 1.0.0", v)
	}

	// ADD, CHECK
	out, err := w.cnitool("add", w.name, netns)
	if err != nil {
		t.Fatalf("cnitool add: %v\n%s\n%s", err, out, w.state())
	}
	gs := w.guests()
	if len(gs) != 1 || gs[0].Netns != netns || len(gs[0].Addresses) != 1 || !strings.Contains(out, gs[0].Addresses[0]+"/") {
		t.Fatalf("after ADD hostd has %+v; want one guest of %s with the address in ptp's result:\n%s", gs, netns, out)
	}
	if gs[0].Interface == "" {
		t.Errorf("ptp's host veth end was not given as the guest's interface")
	}
	if out, err := w.cnitool("check", w.name, netns); err != nil {
		t.Errorf("cnitool check: %v\n%s", err, out)
	}

	// A hostd restart keeps the guest: CHECK still passes, DEL removes it.
	w.stopHostd(false)
	w.startHostd()
	if out, err := w.cnitool("check", w.name, netns); err != nil {
		t.Errorf("cnitool check after a hostd restart: %v\n%s\n%s", err, out, w.state())
	}
	if out, err := w.cnitool("del", w.name, netns); err != nil {
		t.Fatalf("cnitool del after a hostd restart: %v\n%s", err, out)
	}
	if gs := w.guests(); len(gs) != 0 {
		t.Errorf("after DEL hostd has %+v", gs)
	}
	if out, err := w.cnitool("del", w.name, netns); err != nil {
		t.Errorf("a repeated DEL: %v\n%s", err, out)
	}
	if out, err := w.cnitool("check", w.name, netns); err == nil {
		t.Errorf("CHECK after DEL passed: %s", out)
	}

	// DEL with hostd down succeeds; the restarted hostd finds the guest's
	// interface gone (ptp's DEL removed it) and drops the guest.
	if out, err := w.cnitool("add", w.name, netns); err != nil {
		t.Fatalf("cnitool add: %v\n%s", err, out)
	}
	w.stopHostd(true)
	if out, err := w.cnitool("del", w.name, netns); err != nil {
		t.Errorf("DEL with hostd down: %v\n%s", err, out)
	}
	w.startHostd()
	if gs := w.guests(); len(gs) != 0 {
		t.Errorf("the restarted hostd has %+v, want no guest (its interface went at the DEL it missed)", gs)
	}
	// A runtime that dies before its DEL: hostd drops the guest once its
	// namespace is gone.
	if out, err := w.cnitool("add", w.name, netns); err != nil {
		t.Fatalf("cnitool add: %v\n%s", err, out)
	}
	w.must("ip", "netns", "del", ns)
	w.waitFor(15*time.Second, "the guest of a namespace that went dropped", func() bool { return len(w.guests()) == 0 })

	// STATUS (1.1): ready while hostd answers.
	status := fmt.Sprintf(`{"cniVersion":"1.1.0","name":"x","type":"shunt","admin_socket":%q}`, w.admin)
	if m, ok := plugin(t, "STATUS", "", status); !ok {
		t.Errorf("STATUS with hostd up: %v", m)
	}

	// Errors: the spec's JSON error and a non-zero exit.
	noPrev := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"x","type":"shunt","admin_socket":%q}`, w.admin)
	withPrev := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"x","type":"shunt","interface":"none","admin_socket":%%q,"prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.250.1.2/24"}]}}`)
	for _, c := range []struct {
		name, cmd, netns, conf string
		code                   float64
	}{
		{"ADD without prevResult", "ADD", netns, noPrev, 7},
		{"an unknown version", "ADD", netns, strings.Replace(noPrev, "1.0.0", "9.9.9", 1), 1},
		{"CHECK of an unknown container", "CHECK", "/proc/self/ns/net", fmt.Sprintf(withPrev, w.admin), 3},
		{"ADD with hostd down", "ADD", "/proc/self/ns/net", fmt.Sprintf(withPrev, filepath.Join(w.dir, "nobody.sock")), 11},
		{"ADD of hostd's own namespace", "ADD", "/proc/self/ns/net", fmt.Sprintf(withPrev, w.admin), 100},
		{"STATUS with hostd down", "STATUS", "", strings.Replace(status, w.admin, filepath.Join(w.dir, "nobody.sock"), 1), 50},
	} {
		m, ok := plugin(t, c.cmd, c.netns, c.conf)
		if ok || m["code"] != c.code || m["msg"] == "" {
			t.Errorf("%s: exit 0 = %v, %v; want a failure with code %v and a msg", c.name, ok, m, c.code)
		}
	}
}
