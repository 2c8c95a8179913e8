package integration

import (
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/testenv"
)

// PostgreSQL with pgbench (issue 21): the server as user postgres, a
// backend forked per connection.

// asUser makes cmd run as the named user (and its group).
func asUser(t testing.TB, cmd *exec.Cmd, name string) (uid, gid int) {
	t.Helper()
	u, err := user.Lookup(name)
	if err != nil {
		testenv.Missing(t, "no user "+name, "apt-get install "+map[string]string{"postgres": "postgresql"}[name])
	}
	uid, _ = strconv.Atoi(u.Uid)
	gid, _ = strconv.Atoi(u.Gid)
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	return uid, gid
}

// pgBin is where Debian's PostgreSQL keeps its server programs.
func pgBin(t testing.TB, name string) string {
	t.Helper()
	ms, _ := filepath.Glob("/usr/lib/postgresql/*/bin/" + name)
	if len(ms) == 0 {
		testenv.Missing(t, name+" is not installed", "apt-get install postgresql (or: bash scripts/deps.sh test)")
	}
	sort.Strings(ms)
	return ms[len(ms)-1]
}

// postgresCmd makes a cluster in dir with Debian's initdb, as user
// postgres (clients from the rig's addresses trusted), and returns its
// postgres for guest i, run as user postgres, listening on addr:port.
func postgresCmd(t testing.TB, e *env, i int, preload bool, dir, addr string, port int) *exec.Cmd {
	t.Helper()
	initdb, postgres := pgBin(t, "initdb"), pgBin(t, "postgres")
	data := filepath.Join(dir, "data")
	cmd := exec.Command(initdb, "-D", data, "-U", "postgres", "--auth=trust", "--no-sync")
	uid, gid := asUser(t, cmd, "postgres")
	if err := os.Chown(dir, uid, gid); err != nil {
		t.Fatal(err)
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	hba, err := os.OpenFile(filepath.Join(data, "pg_hba.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(hba, "host all all 10.77.0.0/16 trust")
	hba.Close()
	srv := srvCommand(t, e, i, preload, nil, postgres, "-D", data, "-k", dir, "-c", "listen_addresses="+addr, "-c", fmt.Sprintf("port=%d", port))
	asUser(t, srv, "postgres")
	return srv
}

var pgbenchDone = regexp.MustCompile(`number of transactions actually processed: (\d+)/(\d+)`)

// TestServerPostgres: Debian's PostgreSQL, run as user postgres (a
// cluster made by its initdb, listening on guest 2's address, clients
// trusted from the rig's addresses), with pgbench in guest 1: -i loads
// the tables, -c 8 runs eight connections on the rings, and 20 short runs
// of -C (a connection per transaction) each finish within their deadline;
// every transaction is counted, and the balances add up (the accounts'
// sum equals the history's, which holds all 1800).
func TestServerPostgres(t *testing.T) {
	s := newSrvEnv(t, "pgbench", "psql")
	g2 := s.rig.Guests[1].Addr.String()
	srv := s.start(2, postgresCmd(t, s.env, 2, true, servedDir(t), g2, 5432))
	s.waitListening(2, 5432)
	pg := []string{"-h", g2, "-p", "5432", "-U", "postgres", "postgres"}
	bench := func(timeout time.Duration, args ...string) string {
		return s.run(1, timeout, s.command(1, true, nil, "pgbench", append(args, pg...)...))
	}
	bench(60*time.Second, "-i", "-s", "1", "-q")
	// -n: no vacuum, so pgbench_history keeps every run's transactions.
	out := bench(60*time.Second, "-n", "-c", "8", "-j", "2", "-t", "200")
	if m := pgbenchDone.FindStringSubmatch(out); m == nil || m[1] != m[2] || m[1] != "1600" {
		s.fatalf("pgbench -c 8 -t 200: want 1600/1600 transactions\n%s", tailLines(out, 30))
	}
	if fastLines(out) < 8 {
		s.fatalf("pgbench -c 8: %d of its 8 connections took the rings: %s", fastLines(out), pathSummary(out))
	}
	t.Logf("pgbench -c 8 -t 200: %s", pathSummary(out))
	start := time.Now()
	for run := range 20 {
		out := bench(30*time.Second, "-n", "-C", "-c", "2", "-j", "2", "-t", "5")
		if m := pgbenchDone.FindStringSubmatch(out); m == nil || m[1] != m[2] || m[1] != "10" {
			s.fatalf("pgbench -C run %d: want 10/10 transactions\n%s", run, tailLines(out, 30))
		}
	}
	t.Logf("20 runs of pgbench -C -c 2 -t 5 in %s", time.Since(start).Round(time.Millisecond))
	sum := s.run(1, 30*time.Second, s.command(1, false, nil, "psql", append([]string{"-tA", "-c",
		"select (select sum(abalance) from pgbench_accounts) = (select sum(delta) from pgbench_history), (select count(*) from pgbench_history)"}, pg...)...))
	if strings.TrimSpace(sum) != "t|1800" {
		s.fatalf("after the runs: balances equal to history, 1800 transactions: got %q", sum)
	}
	sout := srv.out.String()
	s.noRefusal("postgres", sout)
	if fastLines(sout) < 8 {
		s.fatalf("PostgreSQL's backends (user postgres) took the rings for %d connections, want 8 at least: %s", fastLines(sout), pathSummary(sout))
	}
	if m := regexp.MustCompile(`.*(PANIC|was terminated by signal).*`).FindString(sout); m != "" {
		s.fatalf("postgres: %s", m)
	}
	t.Logf("PostgreSQL as user postgres: %s", pathSummary(sout))
}
