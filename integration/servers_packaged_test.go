package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// Servers as Debian packages them (issue 21): their own configuration
// files with the fewest edits a test needs (where it listens, its pid
// file, logs on stderr so that the library's -v lines are seen), and their
// own users: the processes that serve connections drop root, and must
// keep the fast path (each guest's netns is in hostd.hcl: srvEnv).

// servedDir makes a directory the servers' unprivileged users can read
// (a test's TempDir is root's alone), removed when the test ends.
func servedDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "shunt-served")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// packagedConf returns the packaged configuration file at path with each
// line that matches a key of edits replaced by its value ("" drops it),
// and fails if one of them matched nothing (the package changed).
func packagedConf(t *testing.T, path string, edits map[string]string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("the packaged configuration: %v", err)
	}
	out := string(b)
	for re, repl := range edits {
		r := regexp.MustCompile(`(?m)^` + re + `$`)
		if !r.MatchString(out) {
			t.Fatalf("%s has no line %q any more: the test's edits need updating", path, re)
		}
		out = r.ReplaceAllLiteralString(out, repl)
	}
	return out
}

// noRefusal fails if a process's output says the library could not reach
// hostd, or hostd refused it: the fast path must survive the privilege
// drop.
func (s *srvEnv) noRefusal(who, out string) {
	s.t.Helper()
	if m := regexp.MustCompile(`.*(hostd unreachable|not-guest|no-hostd).*`).FindString(out); m != "" {
		s.fatalf("%s: %s", who, m)
	}
}

// TestServerNginxPackaged: nginx with Debian's nginx.conf (user www-data,
// worker_processes auto, sendfile): its workers run as www-data and must
// take the rings, for a file checked byte for byte and for ab with and
// without keep-alive.
func TestServerNginxPackaged(t *testing.T) {
	s := newSrvEnv(t, "nginx", "curl", "ab")
	dir := servedDir(t)
	www := filepath.Join(dir, "www")
	if err := os.Mkdir(www, 0o755); err != nil {
		t.Fatal(err)
	}
	bigSum := writeRandom(t, filepath.Join(www, "big.bin"), 32<<20, 7)
	writeRandom(t, filepath.Join(www, "small.bin"), 4096, 8)
	if err := os.Chmod(filepath.Join(www, "big.bin"), 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chmod(filepath.Join(www, "small.bin"), 0o644)
	g2 := s.rig.Guests[1].Addr.String()
	const port = 8081
	conf := packagedConf(t, "/etc/nginx/nginx.conf", map[string]string{
		`pid /run/nginx.pid;`:                      fmt.Sprintf("pid %s/nginx.pid;", dir),
		`error_log /var/log/nginx/error.log;`:      "error_log stderr notice;",
		`\s*access_log /var/log/nginx/access.log;`: "\taccess_log off;",
		`\s*include /etc/nginx/sites-enabled/\*;`:  fmt.Sprintf("\tserver { listen %s:%d; root %s; }", g2, port, www),
	})
	if !strings.Contains(conf, "user www-data;") {
		t.Fatalf("Debian's nginx.conf no longer says user www-data:\n%s", conf)
	}
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	srv := s.start(2, s.command(2, true, nil, "nginx", "-g", "daemon off;", "-p", dir, "-c", path, "-e", "stderr"))
	s.waitListening(2, port)
	url := fmt.Sprintf("http://%s:%d/", g2, port)
	eventually(t, 10*time.Second, "nginx workers as www-data", func() bool {
		for _, pid := range descendants(srv.cmd.Process.Pid)[1:] {
			if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil && regexp.MustCompile(`(?m)^Uid:\s+33\s`).Match(b) {
				return true
			}
		}
		return false
	})

	dst := filepath.Join(dir, "big.got")
	out := s.run(1, 30*time.Second, s.command(1, true, []string{"SHUNT_STATS=1"}, "curl", "-sS", "-f", "-o", dst, url+"big.bin"))
	if sum, n := fileSHA256(t, dst); sum != bigSum {
		s.fatalf("curl got %d bytes of the 32 MiB file with SHA-256 %s, want %s", n, sum, bigSum)
	}
	ring, tcp := ringBytes(out)
	if fastLines(out) < 1 || ring < 16<<20 {
		s.fatalf("the download from a www-data worker did not take the rings (%s on rings, %s on TCP): curl: %s", mib(ring), mib(tcp), pathSummary(out))
	}
	for _, c := range []struct {
		name string
		args []string
	}{{"close", []string{"-c", "16", "-n", "2000"}}, {"keep-alive", []string{"-c", "32", "-n", "5000", "-k"}}} {
		args := append([]string{"-q"}, c.args...)
		out := s.run(1, 60*time.Second, s.command(1, true, nil, "ab", append(args, url+"small.bin")...))
		r := abResult(out)
		want := map[string]float64{"close": 2000, "keep-alive": 5000}[c.name]
		if r["Complete requests"] != want || r["Failed requests"] != 0 || r["Non-2xx responses"] != 0 {
			s.errorf("ab %v (%s): %v, want %v complete and none failed\n%s", c.args, c.name, r, want, tailLines(out, 30))
		}
		// hostd's default quotas leave each guest room for 32
		// connections: every one of ab's must be on the rings.
		if c.name == "keep-alive" && fastLines(out) < 32 {
			s.errorf("ab -k -c 32: %d of its 32 connections took the rings, want all (hostd's defaults leave room for 32 per guest): %s", fastLines(out), pathSummary(out))
		}
		t.Logf("ab %v: %.0f req/s; ab: %s", c.args, r["Requests per second"], pathSummary(out))
	}
	sout := srv.out.String()
	s.noRefusal("nginx", sout)
	if fastLines(sout) < 1 {
		s.fatalf("no nginx worker (www-data) took the rings: %s", pathSummary(sout))
	}
	if m := regexp.MustCompile(`\[(alert|crit|emerg)\].*`).FindString(sout); m != "" {
		s.fatalf("nginx logged: %s", m)
	}
	t.Logf("nginx as packaged (workers as www-data): %s", pathSummary(sout))
}
