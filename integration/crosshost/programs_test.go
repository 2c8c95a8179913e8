//go:build linux

package crosshost_test

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

var (
	runOnce            sync.Once
	runLib, runWrapper string
	runErr             error
)

// shuntRunBuilt builds libshunt-preload.so and shunt-run once per run,
// with the Makefile's flags (make preload).
func shuntRunBuilt(t *testing.T) (lib, wrapper string) {
	t.Helper()
	testenv.NeedTool(t, "make", "make")
	testenv.NeedTool(t, "gcc", "gcc")
	runOnce.Do(func() {
		dir, err := os.MkdirTemp("", "shunt-crosshost-preload")
		if err != nil {
			runErr = err
			return
		}
		os.Chmod(dir, 0o755) // servers that drop privileges load it too
		cmd := exec.Command("make", "-s", "-C", "../..", "BIN="+dir, "preload")
		cmd.Env = append(os.Environ(), "MAKEFLAGS=")
		if out, err := cmd.CombinedOutput(); err != nil {
			runErr = fmt.Errorf("make preload: %w\n%s", err, out)
			return
		}
		runLib, runWrapper = filepath.Join(dir, "libshunt-preload.so"), filepath.Join(dir, "shunt-run")
	})
	if runErr != nil {
		t.Fatal(runErr)
	}
	return runLib, runWrapper
}

// program is an unmodified program in host k's guest under shunt-run -v.
func (e *pairEnv) program(t *testing.T, k int, name string, args ...string) *exec.Cmd {
	t.Helper()
	lib, wrapper := shuntRunBuilt(t)
	pkg := map[string]string{"iperf3": "iperf3", "redis-server": "redis-server", "redis-benchmark": "redis-tools",
		"nginx": "nginx", "curl": "curl", "ab": "apache2-utils", "sockperf": "sockperf"}[name]
	path := name
	if p, err := exec.LookPath(name); err == nil {
		path = p
	} else if _, err := os.Stat("/usr/sbin/" + name); err == nil {
		path = "/usr/sbin/" + name
	} else {
		testenv.Missing(t, name+" is not installed", "apt-get install "+pkg)
	}
	cmd := exec.Command(wrapper, append([]string{"-v", path}, args...)...)
	cmd.Env = append(os.Environ(), "SHUNT_CONTROL="+e.hosts[k].Control(e.f.Hosts[k].Guests[0]), "SHUNT_PRELOAD="+lib)
	return cmd
}

// serve starts a server program in host k's guest until the test ends.
func (e *pairEnv) serve(t *testing.T, k int, cmd *exec.Cmd) *syncOut {
	t.Helper()
	out := &syncOut{}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.WaitDelay = 2 * time.Second // a server's children may hold its output open
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	if err := nsrig.Start(e.f.Hosts[k].Guests[0].NSPath(), cmd); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // the server and its workers
		cmd.Wait()
		if t.Failed() {
			t.Logf("%s (tail):\n%s", cmd.Args[2], tail(out.String(), 30))
		}
	})
	return out
}

// runIn runs a client program in host k's guest to its end (at most d),
// and counts the most connections hostd listed on the rings through the
// relay, with ring bytes, on both hosts at once.
func (e *pairEnv) runIn(t *testing.T, k int, cmd *exec.Cmd, d time.Duration) (string, int) {
	t.Helper()
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = 2 * time.Second
	if err := nsrig.Start(e.f.Hosts[k].Guests[0].NSPath(), cmd); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	most := 0
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(d)
	for {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("%s: %v\n%s\n%s", strings.Join(cmd.Args[2:], " "), err, out.String(), e.flows())
			}
			return out.String(), most
		case <-timeout:
			cmd.Process.Kill()
			t.Fatalf("%s did not end within %s\n%s\n%s", strings.Join(cmd.Args[2:], " "), d, out.String(), e.flows())
		case <-tick.C:
			n := 0
			for h := range 2 {
				fl, _ := e.hosts[h].Conns()
				for _, f := range fl {
					if f.Path == "rings" && strings.HasPrefix(f.Via, "relay ") && f.RingsAB+f.RingsBA > 0 {
						n++
					}
				}
			}
			most = max(most, n)
		}
	}
}

// waitPort waits until something listens on port in host k's guest.
func (e *pairEnv) waitPort(t *testing.T, k, port int) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		out, _ := nsrig.Run(e.f.Hosts[k].Guests[0].NSPath(), "ss", "-Hltn", fmt.Sprintf("sport = :%d", port))
		if strings.TrimSpace(out) != "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing listens on port %d in h%d's guest within 15 s", port, k+1)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestAcrossHostsPrograms: unmodified programs under shunt-run, the
// server on h2's guest and the client on h1's, their connections on the
// rings through both relays (both hosts' hostd list them with ring
// bytes), and their own checks passing: iperf3; redis-benchmark against
// redis-server; curl (a file checked by SHA-256) and ab -k against nginx
// as packaged (Debian's nginx.conf, workers as www-data).
func TestAcrossHostsPrograms(t *testing.T) {
	e := relayPairNetns(t, true)
	g2 := e.f.Hosts[1].Guests[0].Addr.String()

	t.Run("iperf3", func(t *testing.T) {
		e.serve(t, 1, e.program(t, 1, "iperf3", "-s", "-1", "-B", g2, "-p", "5301"))
		e.waitPort(t, 1, 5301)
		out, relayed := e.runIn(t, 0, e.program(t, 0, "iperf3", "-c", g2, "-p", "5301", "-t", "2"), 60*time.Second)
		bw := regexp.MustCompile(`([0-9.]+) ([GM])bits/sec.*receiver`).FindStringSubmatch(out)
		if bw == nil || relayed < 2 {
			t.Fatalf("iperf3 across hosts: %v, %d relayed at once (want its data connection on both hosts):\n%s\n%s", bw, relayed, out, e.flows())
		}
		t.Logf("iperf3 across hosts through the relays: %s %sbit/s", bw[1], bw[2])
	})

	t.Run("redis", func(t *testing.T) {
		e.serve(t, 1, e.program(t, 1, "redis-server", "--bind", g2, "--port", "6390", "--save", "", "--appendonly", "no", "--protected-mode", "no"))
		e.waitPort(t, 1, 6390)
		out, relayed := e.runIn(t, 0, e.program(t, 0, "redis-benchmark", "-h", g2, "-p", "6390", "-n", "2000", "-c", "4", "-t", "set,get", "-q"), 120*time.Second)
		rps := regexp.MustCompile(`GET: ([0-9.]+) requests per second`).FindStringSubmatch(out)
		if rps == nil || relayed < 2 {
			t.Fatalf("redis-benchmark across hosts: %v, %d relayed at once:\n%s\n%s", rps, relayed, out, e.flows())
		}
		t.Logf("redis GET across hosts through the relays: %s requests/s", rps[1])
	})

	t.Run("nginx", func(t *testing.T) {
		dir, err := os.MkdirTemp("", "shunt-crosshost-nginx") // www-data reads it: no 0700 parent
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		os.Chmod(dir, 0o755)
		www := filepath.Join(dir, "www")
		if err := os.Mkdir(www, 0o755); err != nil {
			t.Fatal(err)
		}
		os.Chmod(www, 0o755)
		big := make([]byte, 8<<20)
		rng := rand.New(rand.NewPCG(11, 11))
		for i := range big {
			big[i] = byte(rng.Uint32())
		}
		if err = os.WriteFile(filepath.Join(www, "big.bin"), big, 0o644); err != nil {
			t.Fatal(err)
		}
		var b []byte
		b, err = os.ReadFile("/etc/nginx/nginx.conf")
		if err != nil {
			testenv.Missing(t, "Debian's /etc/nginx/nginx.conf is missing", "apt-get install nginx")
		}
		conf := string(b)
		if !strings.Contains(conf, "user www-data;") {
			t.Fatalf("Debian's nginx.conf no longer says user www-data")
		}
		for old, repl := range map[string]string{
			`pid /run/nginx.pid;`:                      fmt.Sprintf("pid %s/nginx.pid;", dir),
			`error_log /var/log/nginx/error.log;`:      "error_log stderr notice;",
			`\s*access_log /var/log/nginx/access.log;`: "\taccess_log off;",
			`\s*include /etc/nginx/sites-enabled/\*;`:  fmt.Sprintf("\tserver { listen %s:8081; root %s; }", g2, www),
		} {
			conf = regexp.MustCompile(old).ReplaceAllString(conf, repl)
		}
		path := filepath.Join(dir, "nginx.conf")
		if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
			t.Fatal(err)
		}
		e.serve(t, 1, e.program(t, 1, "nginx", "-g", "daemon off;", "-p", dir, "-c", path, "-e", "stderr"))
		e.waitPort(t, 1, 8081)
		url := fmt.Sprintf("http://%s:8081/big.bin", g2)
		got := filepath.Join(dir, "big.got")
		out, relayed := e.runIn(t, 0, e.program(t, 0, "curl", "-sS", "-f", "-o", got, url), 60*time.Second)
		if b, err := os.ReadFile(got); err != nil || sha256.Sum256(b) != sha256.Sum256(big) {
			t.Fatalf("curl across hosts from nginx's www-data worker: %d bytes, not the file (%v):\n%s", len(b), err, out)
		}
		out, relayed2 := e.runIn(t, 0, e.program(t, 0, "ab", "-k", "-t", "3", "-n", "1000000", "-c", "8", url[:len(url)-len("big.bin")]), 120*time.Second)
		rps := regexp.MustCompile(`Requests per second:\s+([0-9.]+)`).FindStringSubmatch(out)
		if rps == nil || strings.Contains(out, "Failed requests:        1") || max(relayed, relayed2) < 2 {
			t.Fatalf("ab -k across hosts: %v, %d/%d relayed at once:\n%s\n%s", rps, relayed, relayed2, out, e.flows())
		}
		t.Logf("nginx across hosts through the relays: curl 8 MiB checked; ab -k -c 8: %s requests/s", rps[1])
	})
}
