package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
)

// BenchmarkPreloadConnRate: short connections from a C program (connect,
// 8 bytes each way, close; integration/ctest/connrate.c) between the two
// guests, plain and under shunt-run, interleaved by the benchmark rounds
// (make bench-preload). Path switching is what makes them cheap: each
// connection starts on TCP at once, so Shunt adds only the OPEN and CLOSE
// it sends hostd without waiting.
func BenchmarkPreloadConnRate(b *testing.B) {
	e := newEnv(b, 2, "")
	dir := b.TempDir()
	prog := filepath.Join(dir, "shunt-connrate")
	if err := makeC(dir, prog); err != nil {
		b.Skip(err)
	}
	g2 := e.rig.Guests[1].Addr.String()
	for i, c := range []struct {
		name    string
		preload bool
	}{{"kernel", false}, {"shunt", true}} {
		b.Run(c.name, func(b *testing.B) {
			port := strconv.Itoa(11300 + i)
			srv := connrateCmd(b, e, c.preload, 2, prog, "serve", g2, port)
			if err := nsrig.Start(e.rig.Guests[1].NSPath(), srv); err != nil {
				b.Fatal(err)
			}
			defer func() { srv.Process.Kill(); srv.Wait() }()
			waitListening(b, e, 2, 11300+i)
			var setup, rate []float64
			for b.Loop() {
				out := runIn(b, e.rig.Guests[0].NSPath(), connrateCmd(b, e, c.preload, 1, prog, "client", g2, port, "2000"), time.Minute)
				setup = append(setup, metric(b, out, `setup_us ([0-9.]+)`))
				rate = append(rate, metric(b, out, `rate ([0-9.]+)`))
			}
			b.ReportMetric(median(setup), "us/setup")
			b.ReportMetric(median(rate), "conns/s")
		})
	}
}

// connrateCmd is prog with args in guest i, under shunt-run when preload.
func connrateCmd(b *testing.B, e *env, preload bool, i int, prog string, args ...string) *exec.Cmd {
	cmd := exec.Command(prog, args...)
	if preload {
		needPreload(b)
		cmd = exec.Command(shuntRun, append([]string{prog}, args...)...)
	}
	cmd.Env = append(os.Environ(), "SHUNT_CONTROL="+e.control(e.rig.Guests[i-1]), "SHUNT_PRELOAD="+preloadLib)
	return cmd
}
