package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// OpenSSH under shunt-run: sshd in guest 2 (root, key authentication),
// ssh and scp from guest 1, 256 MiB each way through each, every copy
// checked by its SHA-256.
//
// sshd forks per connection and the child re-executes sshd with the
// accepted socket as its stdin and stdout; its pre-authentication child
// is chrooted to /run/sshd. The library of the re-executed image never
// saw the accept, and a chrooted process cannot reach hostd's socket, so
// the fast path is expected only where the process that serves the
// connection can reach hostd; otherwise the connection stays on TCP with
// a reason in the -v lines of one end or both (sshd's library says why at
// the fork; the client hears hostd's pairing timeout). It must work either
// way: the test checks the data, asserts that bytes on the rings had an
// sshd process at the other end and that TCP had a logged reason, and
// logs which path each copy took and why.

const sshPort = 2222

// sshServer starts sshd in guest 2 under shunt-run with host keys, a
// configuration and an authorized_keys of root made in dir; it returns
// the client's private key.
func sshServer(s *srvEnv, dir string) (*guestProc, string) {
	t := s.t
	t.Helper()
	keygen := toolPath(t, "ssh-keygen")
	hostKey, key := filepath.Join(dir, "host_ed25519"), filepath.Join(dir, "id_ed25519")
	for _, k := range []string{hostKey, key} {
		s.run(2, 30*time.Second, s.command(2, false, nil, keygen, "-q", "-t", "ed25519", "-N", "", "-C", "shunt-test", "-f", k))
	}
	pub, err := os.ReadFile(key + ".pub")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "authorized_keys"), pub, 0o600); err != nil {
		t.Fatal(err)
	}
	// sshd's privilege separation directory, compiled in; the Debian unit
	// makes it (RuntimeDirectory=sshd).
	if err := os.MkdirAll("/run/sshd", 0o755); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, "sshd_config")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(`Port %d
ListenAddress %s
HostKey %s
PidFile %s/sshd.pid
AuthorizedKeysFile %s/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
Subsystem sftp internal-sftp
LogLevel VERBOSE
`, sshPort, s.rig.Guests[1].Addr, hostKey, dir, dir)), 0o600); err != nil {
		t.Fatal(err)
	}
	srv := s.start(2, s.command(2, true, []string{"SHUNT_STATS=1"}, "sshd", "-D", "-e", "-f", conf))
	s.waitListening(2, sshPort)
	return srv, key
}

func TestServerOpenSSH(t *testing.T) {
	s := newSrvEnv(t, "sshd", "ssh", "scp", "ssh-keygen")
	dir := t.TempDir()
	srv, key := sshServer(s, dir)
	src := filepath.Join(dir, "big.bin")
	sum := writeRandom(t, src, 256<<20, 2)
	g2 := s.rig.Guests[1].Addr.String()
	opts := []string{"-F", "/dev/null", "-i", key, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
		"-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
		"-c", "aes128-gcm@openssh.com"}
	ssh := slices.Concat(opts, []string{"-p", fmt.Sprint(sshPort), "root@" + g2})
	scp := slices.Concat(opts, []string{"-P", fmt.Sprint(sshPort)})

	for _, c := range []struct {
		name string
		args []string
		got  string // the file that must end up equal to src
		in   bool   // src is the client's stdin
		out  bool   // got is the client's stdout
		prog string
	}{
		{"ssh upload", slices.Concat(ssh, []string{"cat > " + filepath.Join(dir, "up.ssh")}), filepath.Join(dir, "up.ssh"), true, false, "ssh"},
		{"ssh download", slices.Concat(ssh, []string{"cat " + src}), filepath.Join(dir, "down.ssh"), false, true, "ssh"},
		{"scp upload", slices.Concat(scp, []string{src, "root@" + g2 + ":" + filepath.Join(dir, "up.scp")}), filepath.Join(dir, "up.scp"), false, false, "scp"},
		{"scp download", slices.Concat(scp, []string{"root@" + g2 + ":" + src, filepath.Join(dir, "down.scp")}), filepath.Join(dir, "down.scp"), false, false, "scp"},
	} {
		before := srv.out.String()
		cmd := s.command(1, true, []string{"SHUNT_STATS=1"}, c.prog, c.args...)
		if c.in {
			f, err := os.Open(src)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			cmd.Stdin = f
		}
		if c.out {
			f, err := os.Create(c.got)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			cmd.Stdout = f
		}
		start := time.Now()
		out := s.run(1, 60*time.Second, cmd)
		took := time.Since(start)
		if got, n := fileSHA256(t, c.got); got != sum {
			s.fatalf("%s: %d bytes with SHA-256 %s, want 256 MiB with %s", c.name, n, got, sum)
		}
		os.Remove(c.got)
		// The server's lines for this connection: what sshd (the listener
		// and the processes it forked and re-executed) logged meanwhile.
		// The client's SHUNT_STATS line says which path its bytes took.
		server := strings.TrimPrefix(srv.out.String(), before)
		ring, tcp := ringBytes(out)
		if !statsLine.MatchString(out) {
			s.fatalf("%s: the client's library printed no stats line (SHUNT_STATS=1) for its connection", c.name)
		}
		var path string
		switch {
		case ring > 0 && fastLines(server) == 0:
			s.fatalf("%s: the client moved %s through the rings, but no sshd process attached them: %s", c.name, mib(ring), pathSummary(server))
		case ring > 0:
			path = fmt.Sprintf("the rings (%s of %s)", mib(ring), mib(ring+tcp))
		case tcpReason.MatchString(out) || tcpReason.MatchString(server):
			// The client hears hostd's verdict only after hostd's
			// pairing timeout (a connection that ended sooner never
			// does); sshd's library says why at the fork.
			path = "TCP, reasons: client " + reasons(out) + ", sshd " + reasons(server)
		default:
			s.fatalf("%s: on TCP, but neither end's library logged why: client: %s; sshd: %s", c.name, pathSummary(out), pathSummary(server))
		}
		t.Logf("%s: 256 MiB checked in %s, on %s; client: %s; sshd: %s", c.name, took.Round(time.Millisecond), path, pathSummary(out), pathSummary(server))
	}
}

// reasons lists the reasons of the tcp (...) lines in a process's -v
// lines, or says there are none.
func reasons(out string) string {
	var rs []string
	for _, m := range tcpReason.FindAllStringSubmatch(out, -1) {
		rs = append(rs, strconv.Quote(m[1]))
	}
	if len(rs) == 0 {
		return "none"
	}
	return strings.Join(rs, ", ")
}
