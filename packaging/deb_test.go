//go:build linux

package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hclwrite"
	"github.com/zclconf/go-cty/cty"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/dist"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestDebInstall installs both packages with dpkg, checks the unit with
// systemd-analyze verify, runs the installed hostd with the installed
// example configuration through one fast-path connection between two
// namespace guests (the client an unmodified C program under the installed
// shunt-run), scrapes its metrics for every metric the installed dashboard
// queries, and purges the packages, checking that nothing is left.
func TestDebInstall(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "dpkg", "dpkg")
	testenv.NeedTool(t, "systemd-analyze", "systemd")
	testenv.NeedTool(t, "nft", "nftables")
	testenv.NeedTool(t, "bash", "bash")
	for _, p := range []string{"shunt-host", "shunt-guest"} {
		if err := exec.Command("dpkg-query", "-W", p).Run(); err == nil {
			testenv.Missing(t, p+" is installed on this machine, and this test would purge it", "dpkg --purge "+p+", or run the test elsewhere")
		}
	}
	debs := buildDebs(t)
	_, err := user.LookupGroup("shunt")
	hadGroup := err == nil
	t.Cleanup(func() {
		if out, err := exec.Command("dpkg", "--purge", "shunt-host", "shunt-guest").CombinedOutput(); err != nil {
			t.Errorf("dpkg --purge: %v\n%s", err, out)
		}
		// shunt-guest leaves its group on purge, as Debian packages do;
		// the test leaves the machine as it found it.
		if !hadGroup {
			if out, err := exec.Command("groupdel", "shunt").CombinedOutput(); err != nil {
				t.Errorf("groupdel shunt: %v\n%s", err, out)
			}
		}
		for _, p := range []string{hostdPath, unitPath, vsockdPath, vsockdUnit, configPath, "/etc/shunt", dashboardPath, "/usr/share/shunt",
			shuntRunPath, preloadPath, filepath.Dir(preloadPath), udevRulePath} {
			if _, err := os.Lstat(p); err == nil {
				t.Errorf("%s is still there after dpkg --purge", p)
			}
		}
	})
	if out, err := exec.Command("dpkg", "-i", debs["shunt-host"], debs["shunt-guest"]).CombinedOutput(); err != nil {
		t.Fatalf("dpkg -i: %v\n%s", err, out)
	}

	t.Run("files", func(t *testing.T) {
		for _, p := range []string{hostdPath, unitPath, vsockdPath, vsockdUnit, configPath, dashboardPath, shuntRunPath, preloadPath, udevRulePath} {
			if _, err := os.Stat(p); err != nil {
				t.Errorf("after dpkg -i: %v", err)
			}
		}
		if _, err := user.LookupGroup("shunt"); err != nil {
			t.Errorf("shunt-guest's postinst did not create group shunt: %v", err)
		}
	})

	// systemd-analyze verify needs no running systemd. It also loads the
	// units ours names (network-online.target, ...) and reports their
	// problems, which belong to the machine: only lines about our unit
	// fail the test. Warnings exit 0, so the output counts, not the status.
	for _, unit := range []string{unitPath, vsockdUnit} {
		t.Run("unit "+filepath.Base(unit), func(t *testing.T) {
			out, err := exec.Command("systemd-analyze", "verify", unit).CombinedOutput()
			var ours []string
			name := strings.TrimSuffix(filepath.Base(unit), ".service")
			for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
				if strings.Contains(l, name) {
					ours = append(ours, l)
				} else if l != "" {
					t.Logf("systemd-analyze, about another unit: %s", l)
				}
			}
			if err != nil || len(ours) > 0 {
				t.Errorf("systemd-analyze verify %s: %v\n%s", unit, err, strings.Join(ours, "\n"))
			}
		})
	}

	t.Run("fastpath", func(t *testing.T) { fastPath(t) })
}

// fastPath runs the installed hostd with the installed example
// configuration on a namespace rig of two guests; see templateConfig for
// what changes.
func fastPath(t *testing.T) {
	rig, err := nsrig.New(fmt.Sprintf("k%d", os.Getpid()%100000), 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := rig.Create(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := rig.Destroy(); err != nil {
			t.Errorf("remove rig: %v", err)
		}
	})
	dir := t.TempDir()
	c := templateConfig(t, configPath, dir, rig)
	t.Cleanup(func() { os.Remove(c.region) })

	logs, err := os.Create(filepath.Join(dir, "hostd.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logs.Close()
	hostd := exec.Command(hostdPath, "agent", "-config", c.path)
	hostd.Stdout, hostd.Stderr = logs, logs
	if err := hostd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		hostd.Process.Kill()
		hostd.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(logs.Name())
			t.Logf("hostd's log:\n%s", b)
		}
	})
	waitFor(t, "hostd's admin socket", func() bool { return admin.Call(c.admin, admin.Request{Cmd: admin.CmdStatus}, nil) == nil })

	// The server: guestlib in vm2's namespace.
	g1, g2 := rig.Guests[0], rig.Guests[1]
	cl, err := guestlib.NewClient(guestlib.Options{Control: c.control["vm2"]})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var l *guestlib.Listener
	err = nsrig.In(g2.NSPath(), func() error {
		var err error
		l, err = (&guestlib.ListenConfig{Client: cl}).Listen(ctx, "tcp4", net.JoinHostPort(g2.Addr.String(), "5201"))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() { <-ctx.Done(); l.Close() }() // bounds Accept

	// The client: an unmodified C program in vm1's namespace under the
	// installed shunt-run, which must find the installed library by itself.
	bin := filepath.Join(dir, "client")
	if out, err := exec.Command("gcc", "-O2", "-Wall", "-Werror", "-o", bin, "testdata/client.c").CombinedOutput(); err != nil {
		t.Fatalf("gcc testdata/client.c: %v\n%s", err, out)
	}
	client := exec.CommandContext(ctx, shuntRunPath, "-v", bin, g2.Addr.String(), "5201")
	client.Env = append(withoutPreload(os.Environ()), "SHUNT_CONTROL="+c.control["vm1"])
	var stderr strings.Builder
	client.Stderr = &stderr
	stdout, err := client.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := nsrig.Start(g1.NSPath(), client); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if client.ProcessState == nil {
			client.Process.Kill()
			client.Wait()
		}
	}()

	conn, err := l.AcceptShunt()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	// The connection starts on TCP and moves to the rings once hostd has
	// paired it (nothing waits for that): wait for it, bounded.
	for deadline := time.Now().Add(10 * time.Second); !conn.Path().Fast && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if p := conn.Path(); !p.Fast {
		t.Fatalf("accepted connection: path %+v, want the fast path", p)
	}
	r := bufio.NewReader(conn)
	if line, err := r.ReadString('\n'); err != nil || line != "ping\n" {
		t.Fatalf("server read %q, %v; want ping", line, err)
	}
	if _, err := io.WriteString(conn, "pong\n"); err != nil {
		t.Fatal(err)
	}
	out := bufio.NewReader(stdout)
	if line, err := out.ReadString('\n'); err != nil || line != "got pong\n" {
		t.Fatalf("client printed %q, %v; want got pong (stderr: %s)", line, err, stderr.String())
	}

	// While the flow is live: per-flow and per-guest bytes exist.
	scraped := scrape(t, c.metrics)

	// Move it back to TCP with the installed CLI: the connection lives on
	// (Shunt invents no error), and ends as the kernel says: the server's
	// close reaches the client as EOF.
	var flows []struct{ Name string }
	if err := json.Unmarshal(hostdCLI(t, ctx, "flows", "-admin", c.admin, "-json"), &flows); err != nil || len(flows) != 1 {
		t.Fatalf("hostd flows: %+v, %v; want one flow", flows, err)
	}
	hostdCLI(t, ctx, "downgrade", "-admin", c.admin, flows[0].Name)
	for deadline := time.Now().Add(10 * time.Second); conn.Path().Fast && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if p := conn.Path(); p.Fast || p.Reason != "admin" {
		t.Fatalf("accepted connection after hostd downgrade: path %+v, want tcp(admin)", p)
	}
	conn.Close()
	if line, err := out.ReadString('\n'); err != nil || line != "closed: eof\n" {
		t.Fatalf("client printed %q, %v after the downgrade and the server's close; want closed: eof", line, err)
	}
	if err := client.Wait(); err != nil {
		t.Fatalf("client: %v\n%s", err, stderr.String())
	}
	// The client's end reports that it took the rings, and left them.
	for _, re := range []string{`: shunt \(slot `, `: down \(admin\)`} {
		if !regexp.MustCompile(re).MatchString(stderr.String()) {
			t.Errorf("shunt-run -v did not report %s:\n%s", re, stderr.String())
		}
	}

	after := scrape(t, c.metrics)
	for name := range after {
		scraped[name] = true
	}
	js, err := os.ReadFile(dashboardPath)
	if err != nil {
		t.Fatal(err)
	}
	names, err := dist.DashboardMetrics(js)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		if !scraped[name] {
			t.Errorf("the installed dashboard queries %s, which the installed hostd did not export", name)
		}
	}
}

// config is the test's copy of the example configuration.
type config struct {
	path, admin, metrics, region string
	control                      map[string]string // by guest
}

// templateConfig copies the installed example configuration into dir,
// changing only what names this example host's things or would collide
// with a real hostd: the sockets (admin_socket, each guest's control) go
// into dir; metrics_address takes a free port; conntrack_netns is the rig's
// host namespace; the region gets the rig's name; the first guest's
// interface becomes the rig's first host veth, the second guest's
// addresses the rig's second guest. Guest names, ids, ct_mark (1 for the
// first guest, as the rig marks it), the policy and everything else stay
// as installed.
func templateConfig(t *testing.T, example, dir string, rig *nsrig.Rig) config {
	t.Helper()
	src, err := os.ReadFile(example)
	if err != nil {
		t.Fatal(err)
	}
	f, diags := hclwrite.ParseConfig(src, example, hcl.InitialPos)
	if diags.HasErrors() {
		t.Fatalf("parse %s: %s", example, diags)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := config{
		path: filepath.Join(dir, "hostd.hcl"), admin: filepath.Join(dir, "admin.sock"),
		metrics: l.Addr().String(), region: "/dev/shm/shunt-" + rig.Name, control: map[string]string{},
	}
	l.Close()
	body := f.Body()
	body.SetAttributeValue("admin_socket", cty.StringVal(c.admin))
	body.SetAttributeValue("metrics_address", cty.StringVal(c.metrics))
	body.SetAttributeValue("conntrack_netns", cty.StringVal(rig.HostNSPath()))
	var groups, guests int
	for _, b := range body.Blocks() {
		switch b.Type() {
		case "trust_group":
			groups++
			b.Body().SetAttributeValue("region", cty.StringVal(c.region))
		case "guest":
			if guests == len(rig.Guests) {
				t.Fatalf("%s has more than %d guests", example, len(rig.Guests))
			}
			g, name := rig.Guests[guests], b.Labels()[0]
			guests++
			c.control[name] = filepath.Join(dir, name+".sock")
			gb := b.Body()
			gb.SetAttributeValue("control", cty.StringVal(c.control[name]))
			if gb.GetAttribute("interface") != nil {
				gb.SetAttributeValue("interface", cty.StringVal(g.HostIf))
			}
			if gb.GetAttribute("addresses") != nil {
				gb.SetAttributeValue("addresses", cty.ListVal([]cty.Value{cty.StringVal(g.Addr.String())}))
			}
		}
	}
	if groups != 1 || guests != 2 || c.control["vm1"] == "" || c.control["vm2"] == "" {
		t.Fatalf("%s: %d trust groups, guests %v; want one group and guests vm1, vm2 (the test maps them onto the rig)", example, groups, c.control)
	}
	if err := os.WriteFile(c.path, f.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Logf("hostd runs with:\n%s", f.Bytes())
	return c
}

// hostdCLI runs the installed hostd as a client and returns its output.
func hostdCLI(t *testing.T, ctx context.Context, args ...string) []byte {
	t.Helper()
	out, err := exec.CommandContext(ctx, hostdPath, args...).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("hostd %s: %v\n%s", strings.Join(args, " "), err, ee.Stderr)
		}
		t.Fatalf("hostd %s: %v", strings.Join(args, " "), err)
	}
	return out
}

// scrape returns the sample names at hostd's /metrics.
func scrape(t *testing.T, addr string) map[string]bool {
	t.Helper()
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %s", resp.Status)
	}
	names, err := dist.SampleNames(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// waitFor polls cond until it holds, for at most 10 seconds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(10 * time.Second)
	for !cond() {
		select {
		case <-tick.C:
		case <-deadline:
			t.Fatalf("%s: not ready after 10s", what)
		}
	}
}
