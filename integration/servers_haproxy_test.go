package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// HAProxy as packaged in front of nginx (issue 21): chroot, user haproxy,
// and a process limit of 0 that leaves the library no threads.

// TestServerHAProxy: Debian's haproxy.cfg (chroot /var/lib/haproxy, user
// haproxy, its process limit of 0), with a frontend on guest 2 added in
// front of Debian's nginx in guest 1: a file through both hops checked
// byte for byte, and ab -c 16 with and without keep-alive, every request
// answered; both of HAProxy's hops take the rings.
func TestServerHAProxy(t *testing.T) {
	s := newSrvEnv(t, "haproxy", "nginx", "curl", "ab")
	dir := servedDir(t)
	www := filepath.Join(dir, "www")
	if err := os.Mkdir(www, 0o755); err != nil {
		t.Fatal(err)
	}
	bigSum := writeRandom(t, filepath.Join(www, "big.bin"), 16<<20, 21)
	writeRandom(t, filepath.Join(www, "small.bin"), 4096, 22)
	os.Chmod(filepath.Join(www, "big.bin"), 0o644)
	os.Chmod(filepath.Join(www, "small.bin"), 0o644)
	g1, g2 := s.rig.Guests[0].Addr.String(), s.rig.Guests[1].Addr.String()
	s.start(1, nginxPackagedCmd(t, s.env, 1, true, dir, www, g1, 8081))
	s.waitListening(1, 8081)
	conf := packagedConf(t, "/etc/haproxy/haproxy.cfg", map[string]string{
		`\s*stats socket /run/haproxy/admin.sock mode 660 level admin`: fmt.Sprintf("\tstats socket %s/admin.sock mode 660 level admin", dir),
	})
	if !strings.Contains(conf, "chroot /var/lib/haproxy") || !strings.Contains(conf, "user haproxy") {
		t.Fatalf("Debian's haproxy.cfg no longer has chroot and user haproxy:\n%s", conf)
	}
	conf += fmt.Sprintf("\nfrontend web\n\tbind %s:8080\n\tdefault_backend nginx\n\nbackend nginx\n\tserver n1 %s:8081\n", g2, g1)
	path := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	// -db: in the foreground (the configuration says daemon).
	hap := s.start(2, s.command(2, true, nil, "haproxy", "-db", "-f", path))
	s.waitListening(2, 8080)
	url := fmt.Sprintf("http://%s:8080/", g2)
	dst := filepath.Join(dir, "big.got")
	out := s.run(1, 30*time.Second, s.command(1, true, []string{"SHUNT_STATS=1"}, "curl", "-sS", "-f", "-o", dst, url+"big.bin"))
	if sum, n := fileSHA256(t, dst); sum != bigSum {
		s.fatalf("curl through HAProxy got %d bytes of the 16 MiB file with SHA-256 %s, want %s", n, sum, bigSum)
	}
	for _, c := range []struct {
		name string
		args []string
		n    float64
	}{{"close", []string{"-n", "2000"}, 2000}, {"keep-alive", []string{"-n", "5000", "-k"}, 5000}} {
		out := s.run(1, 60*time.Second, s.command(1, true, nil, "ab", append(append([]string{"-q", "-c", "16"}, c.args...), url+"small.bin")...))
		r := abResult(out)
		if r["Complete requests"] != c.n || r["Failed requests"] != 0 || r["Non-2xx responses"] != 0 {
			s.errorf("ab -c 16 (%s) through HAProxy: %v, want %v complete and none failed\n%s", c.name, r, c.n, tailLines(out, 30))
		}
		t.Logf("ab -c 16 (%s) through HAProxy: %.0f req/s; ab: %s", c.name, r["Requests per second"], pathSummary(out))
	}
	hout := hap.out.String()
	s.noRefusal("haproxy", hout)
	if hap.exited() {
		s.fatalf("haproxy exited: %v", hap.err)
	}
	if fastLines(hout) < 1 {
		s.fatalf("HAProxy's hops did not take the rings: haproxy: %s; curl: %s", pathSummary(hout), pathSummary(out))
	}
	// Under its process limit of 0 the library has no threads: it must
	// say so once, not once per connection.
	if n := strings.Count(hout, "cannot start the leaver thread"); n > 1 {
		s.fatalf("haproxy: the library said %d times that it cannot start its thread, want once at most", n)
	}
	t.Logf("HAProxy as packaged (chroot, user haproxy): %s; curl: %s", pathSummary(hout), pathSummary(out))
}
