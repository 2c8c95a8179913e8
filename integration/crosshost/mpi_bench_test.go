//go:build linux

package crosshost_test

import (
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkMPICross (make bench-cross-mpi): Open MPI across the two hosts,
// one rank in h1/g1 and one in h2/g1, btl/tcp (kernel TCP through both
// hosts' forwarding) against btl/shunt (rings through both relays), with
// mpi/mpibench.c as osu_latency and osu_bw do it: 8 B ping-pong (one-way
// time) and 1 MiB streaming (64 outstanding sends, then an ack). Each
// iteration is one job; the make target interleaves rounds. Metrics:
// us@8B and MB/s@1MiB.
func BenchmarkMPICross(b *testing.B) {
	needMPI(b)
	e := newPair(b, 1, [2][]string{{"10.78.0.0/16"}, {"10.77.0.0/16"}}, [2]bool{true, true})
	e.within(10*time.Second, "both channels up", func() bool {
		a, c := e.peersOf(0), e.peersOf(1)
		return state(a) == "up" && state(c) == "up" && a[0].Announced >= 1 && c[0].Announced >= 1
	})
	line := regexp.MustCompile(`(?m)^(lat|bw) (\d+) ([0-9.]+)$`)
	for _, tr := range []struct{ name, btl string }{{"tcp", "self,vader,tcp"}, {"shunt", "self,vader,shunt"}} {
		b.Run(tr.name, func(b *testing.B) {
			var lat, bw []float64
			for b.Loop() {
				out := e.mpiCross(b, crossJob{slots: [2][]int{{1}, {1}}, btl: tr.btl, prog: "mpibench",
					args: []string{"-l", "8", "-b", "1048576", "-s", "1048576", "-n", "2000", "-w", "1"}, timeout: 3 * time.Minute})
				if !strings.Contains(out, "data ok") {
					b.Fatalf("mpibench over %s:\n%s", tr.name, out)
				}
				if n := strings.Count(out, ": relayed ring (slot "); tr.name == "shunt" && n != 2 {
					b.Fatalf("%d directions took relayed rings, want 2:\n%s\n%s", n, out, e.flows())
				}
				for _, m := range line.FindAllStringSubmatch(out, -1) {
					n, _ := strconv.Atoi(m[2])
					v, _ := strconv.ParseFloat(m[3], 64)
					switch {
					case m[1] == "lat" && n == 8:
						lat = append(lat, v)
					case m[1] == "bw" && n == 1<<20:
						bw = append(bw, v)
					}
				}
			}
			b.ReportMetric(medianOf(lat), "us@8B")
			b.ReportMetric(medianOf(bw), "MB/s@1MiB")
		})
	}
}

func medianOf(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}
