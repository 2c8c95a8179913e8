package integration

import (
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"testing"
	"time"
)

// BenchmarkPackagedAB: requests per second that ab -c 16 gets from nginx
// and Apache (event MPM) as Debian packages them (nginxPackagedCmd,
// apacheCmd), each in guest 2 both plain and with both ends under
// shunt-run (and under shunt-run with connections kept on TCP) at once,
// on their own ports, for Debian's index page
// (10.7 KB), with a connection per request and with keep-alive, 2 s each.
// The twelve runs are interleaved, round after round (benchRounds), and
// each reports its median and each pair its ratio, Shunt over plain:
//
//	flock -o /work/heavy.lock go test ./integration -run '^$' -bench BenchmarkPackagedAB -benchtime 1x
func BenchmarkPackagedAB(b *testing.B) {
	e := startEnv(b, "b", srvStackOptions())
	needPreload(b)
	g2 := e.rig.Guests[1].Addr.String()
	type run struct {
		srv, stack, mode string
		port             int
		preload, ka      bool
	}
	// Stacks: plain, Shunt, and, to tell the library's own cost from the
	// rings', Shunt with an open delay no connection outlives (the
	// library interposes everything, and no connection leaves TCP).
	stacks := []struct {
		name    string
		preload bool
		env     []string
	}{{"kernel", false, nil}, {"shunt", true, nil}, {"shunt-tcp", true, []string{"SHUNT_OPEN_DELAY_MS=60000"}}}
	var runs []run
	env := map[string][]string{}
	for i, srv := range []string{"nginx", "apache"} {
		for j, st := range stacks {
			port, preload := 8100+80*i+j, st.preload
			env[st.name] = st.env
			var cmd *exec.Cmd
			if srv == "nginx" {
				cmd = nginxPackagedCmd(b, e, 2, preload, servedDir(b), "/var/www/html", g2, port)
			} else {
				cmd = apacheCmd(b, e, 2, preload, servedDir(b), "/var/www/html", "event", port)
			}
			cmd.Env = append(cmd.Env, st.env...)
			p, err := startGuestProc(e, 2, cmd)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(p.stop)
			waitListening(b, e, 2, port)
			for _, ka := range []bool{false, true} {
				runs = append(runs, run{srv, st.name, map[bool]string{false: "close", true: "keepalive"}[ka], port, preload, ka})
			}
		}
	}
	rps := map[run][]float64{}
	for b.Loop() {
		for range benchRounds {
			for _, r := range runs {
				args := []string{"-q", "-t", "2", "-n", "1000000", "-c", "16"}
				if r.ka {
					args = append(args, "-k")
				}
				cmd := srvCommand(b, e, 1, r.preload, env[r.stack], "ab", append(args, fmt.Sprintf("http://%s:%d/index.html", g2, r.port))...)
				out := runBounded(b, e, 1, cmd, 30*time.Second)
				res := abResult(out)
				if res["Complete requests"] == 0 || res["Failed requests"]+res["Non-2xx responses"] > 0 {
					b.Fatalf("ab against %s (%s, %s): %v\n%s", r.srv, r.stack, r.mode, res, tailLines(out, 40))
				}
				rps[r] = append(rps[r], res["Requests per second"])
			}
		}
	}
	for _, r := range runs {
		b.ReportMetric(median(rps[r]), fmt.Sprintf("%s-%s-%s-req/s", r.srv, r.stack, r.mode))
		if r.preload {
			k := r
			k.preload, k.stack, k.port = false, "kernel", r.port-1
			if r.stack == "shunt-tcp" {
				k.port = r.port - 2
			}
			b.ReportMetric(median(rps[r])/median(rps[k]), fmt.Sprintf("%s-%s-%s/kernel", r.srv, r.mode, r.stack))
		}
		b.Logf("%s %s %s: %v", r.srv, r.stack, r.mode, rps[r])
	}
}

// runBounded runs cmd in guest i to its end within timeout and returns
// its output; past the deadline it fails t with the output and where each
// of the process's threads waits (with gdb's backtraces if gdb is there).
func runBounded(t testing.TB, e *env, i int, cmd *exec.Cmd, timeout time.Duration) string {
	t.Helper()
	p, err := startGuestProc(e, i, cmd)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.done:
		if p.err != nil {
			t.Fatalf("%s: %v\n%s", cmd.Args, p.err, p.out.String())
		}
		return p.out.String()
	case <-time.After(timeout):
	}
	where := threads(cmd.Process.Pid)
	if gdb, err := exec.LookPath("gdb"); err == nil {
		bt, _ := exec.Command(gdb, "-p", fmt.Sprint(cmd.Process.Pid), "-batch", "-ex", "thread apply all bt").CombinedOutput()
		where += string(bt)
	}
	p.stop()
	t.Fatalf("%s did not finish in %s\n%s\n%s", cmd.Args, timeout, tailLines(p.out.String(), 60), where)
	return ""
}

// benchRounds is how many interleaved rounds a server benchmark runs.
const benchRounds = 5

var pgbenchTPS = regexp.MustCompile(`(?m)^tps = ([0-9.]+)`)

// BenchmarkPackagedPgbench: transactions per second of pgbench against
// PostgreSQL run as user postgres (postgresCmd) in guest 2, plain and with
// both ends under shunt-run, side by side: -c 8 (eight connections for
// the run) and -C -c 8 (a connection per transaction), 2 s each, the four
// cells interleaved for benchRounds rounds, medians and ratios:
//
//	flock -o /work/heavy.lock go test ./integration -run '^$' -bench BenchmarkPackagedPgbench -benchtime 1x
func BenchmarkPackagedPgbench(b *testing.B) {
	e := startEnv(b, "b", srvStackOptions())
	needPreload(b)
	g2 := e.rig.Guests[1].Addr.String()
	type cell struct {
		stack, mode string
		preload     bool
		port        int
	}
	var cells []cell
	for j, preload := range []bool{false, true} {
		port := 5440 + j
		p, err := startGuestProc(e, 2, postgresCmd(b, e, 2, preload, servedDir(b), g2, port))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(p.stop)
		waitListening(b, e, 2, port)
		pg := []string{"-h", g2, "-p", fmt.Sprint(port), "-U", "postgres", "postgres"}
		runBounded(b, e, 1, srvCommand(b, e, 1, false, nil, "pgbench", append([]string{"-i", "-s", "1", "-q"}, pg...)...), time.Minute)
		stack := map[bool]string{false: "kernel", true: "shunt"}[preload]
		cells = append(cells, cell{stack, "c8", preload, port}, cell{stack, "C-c8", preload, port})
	}
	tps := map[cell][]float64{}
	for b.Loop() {
		for range benchRounds {
			for _, c := range cells {
				args := []string{"-n", "-c", "8", "-j", "2", "-T", "2"}
				if c.mode == "C-c8" {
					args = append(args, "-C")
				}
				args = append(args, "-h", g2, "-p", fmt.Sprint(c.port), "-U", "postgres", "postgres")
				out := runBounded(b, e, 1, srvCommand(b, e, 1, c.preload, nil, "pgbench", args...), 30*time.Second)
				m := pgbenchTPS.FindStringSubmatch(out)
				if m == nil {
					b.Fatalf("pgbench %v: no tps\n%s", args, tailLines(out, 30))
				}
				v, _ := strconv.ParseFloat(m[1], 64)
				tps[c] = append(tps[c], v)
			}
		}
	}
	for _, c := range cells {
		b.ReportMetric(median(tps[c]), fmt.Sprintf("%s-%s-tps", c.stack, c.mode))
		if c.preload {
			k := c
			k.preload, k.stack, k.port = false, "kernel", c.port-1
			b.ReportMetric(median(tps[c])/median(tps[k]), fmt.Sprintf("%s-shunt/kernel", c.mode))
		}
		b.Logf("pgbench %s %s: %v", c.stack, c.mode, tps[c])
	}
}
