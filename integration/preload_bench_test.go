package integration

import (
	"bytes"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
)

// Benchmarks of unmodified tools between the two guests, with and without
// the preload library, side by side (make bench-preload; root). Each
// iteration runs the tool once; the figures are the tools' own, reported
// with b.ReportMetric.

func metric(b *testing.B, out, re string) float64 {
	b.Helper()
	m := regexp.MustCompile(re).FindStringSubmatch(out)
	if m == nil {
		b.Fatalf("no %q in:\n%s", re, out)
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	return v
}

func BenchmarkPreloadSockperf(b *testing.B) {
	e := newEnv(b, 2, "")
	g2 := e.rig.Guests[1].Addr.String()
	for i, c := range []struct {
		name    string
		preload bool
		extra   []string
	}{{"kernel", false, nil}, {"kernel-busypoll", false, []string{"--nonblocked"}}, {"shunt", true, nil}} {
		b.Run(c.name, func(b *testing.B) {
			port := strconv.Itoa(11200 + i)
			srv := e.toolCmd(b, c.preload, 2, "sockperf", append([]string{"server", "--tcp", "-i", g2, "-p", port}, c.extra...)...)
			var so bytes.Buffer
			srv.Stdout, srv.Stderr = &so, &so
			if err := nsrig.Start(e.rig.Guests[1].NSPath(), srv); err != nil {
				b.Fatal(err)
			}
			defer func() { srv.Process.Kill(); srv.Wait() }()
			waitListening(b, e, 2, 11200+i)
			var lat, bw []float64
			for b.Loop() {
				pp := runIn(b, e.rig.Guests[0].NSPath(), e.toolCmd(b, c.preload, 1, "sockperf", append([]string{"ping-pong", "--tcp", "-i", g2, "-p", port, "-t", "2", "-m", "14", "--mps", "5000000"}, c.extra...)...), time.Minute)
				lat = append(lat, metric(b, pp, `percentile 50\.000 =\s+([0-9.]+)`))
				tp := runIn(b, e.rig.Guests[0].NSPath(), e.toolCmd(b, c.preload, 1, "sockperf", append([]string{"throughput", "--tcp", "-i", g2, "-p", port, "-t", "2", "-m", "64000", "--mps", "max"}, c.extra...)...), time.Minute)
				bw = append(bw, metric(b, tp, `BandWidth is ([0-9.]+) MBps`))
			}
			b.ReportMetric(median(lat), "us/oneway-p50")
			b.ReportMetric(median(bw), "MBps@64000")
		})
	}
}

func BenchmarkPreloadIperf3(b *testing.B) {
	e := newEnv(b, 2, "")
	g2 := e.rig.Guests[1].Addr.String()
	for i, c := range []struct {
		name    string
		preload bool
	}{{"kernel", false}, {"shunt", true}} {
		b.Run(c.name, func(b *testing.B) {
			var gbps []float64
			for b.Loop() {
				port := strconv.Itoa(5400 + i)
				srv := e.toolCmd(b, c.preload, 2, "iperf3", "-s", "-1", "-B", g2, "-p", port)
				if err := nsrig.Start(e.rig.Guests[1].NSPath(), srv); err != nil {
					b.Fatal(err)
				}
				time.Sleep(200 * time.Millisecond) // iperf3 -s has no readiness signal
				out := runIn(b, e.rig.Guests[0].NSPath(), e.toolCmd(b, c.preload, 1, "iperf3", "-c", g2, "-p", port, "-t", "3", "-J"), time.Minute)
				srv.Wait()
				res, _ := parseIperf3(out) // a failed round counts as 0
				gbps = append(gbps, res.BitsPerSecond/1e9)
			}
			b.ReportMetric(median(gbps), "Gbit/s")
		})
	}
}

func BenchmarkPreloadMPI(b *testing.B) {
	e := newEnv(b, 2, "")
	dir := b.TempDir()
	prog := filepath.Join(dir, "pingpong")
	if out, err := exec.Command("mpicc", "-O2", "-o", prog, "mpi/pingpong.c").CombinedOutput(); err != nil {
		b.Fatalf("mpicc: %v\n%s", err, out)
	}
	for _, c := range []string{"tcp-veth", "tcp-shunt", "vader"} {
		b.Run(c, func(b *testing.B) {
			var l0, l8, bw64, bw1m []float64
			for b.Loop() {
				var out string
				if c == "vader" { // both ranks in one guest: shared memory
					cmd := exec.Command("mpirun", "--allow-run-as-root", "-np", "2", "--mca", "pml", "ob1", "--mca", "btl", "self,vader",
						"--mca", "btl_vader_single_copy_mechanism", "none", "--bind-to", "none", prog)
					out = runIn(b, e.rig.Guests[0].NSPath(), cmd, time.Minute)
				} else {
					out = e.mpirun(b, dir, prog, c == "tcp-shunt")
				}
				l0 = append(l0, metric(b, out, `(?m)^lat 0 ([0-9.]+)`))
				l8 = append(l8, metric(b, out, `(?m)^lat 8 ([0-9.]+)`))
				bw64 = append(bw64, metric(b, out, `(?m)^bw 65536 ([0-9.]+)`))
				bw1m = append(bw1m, metric(b, out, `(?m)^bw 1048576 ([0-9.]+)`))
			}
			b.ReportMetric(median(l0), "us@0B")
			b.ReportMetric(median(l8), "us@8B")
			b.ReportMetric(median(bw64)/1e3, "GB/s@64KiB")
			b.ReportMetric(median(bw1m)/1e3, "GB/s@1MiB")
		})
	}
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}
