package integration

import (
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Open MPI transports side by side (make bench-mpi; root): vader with both
// ranks in one guest (with its default single-copy mechanism, CMA, and
// without it), the TCP BTL across the two guests, the TCP BTL under
// shunt-run (the preload library), and btl/shunt across the guests. Each
// iteration runs one job; the make target runs whole rounds of every
// benchmark and benchstat takes medians, so the transports are compared
// within one run on this noisy machine. SHUNT_MPI_TRANSPORTS=a,b limits a
// run to some transports.

// mpiTransport is how a benchmark job is run.
type mpiTransport struct {
	name    string
	btl     string
	sameNS  bool
	preload bool
	mca     []string
}

// mpiRingPolicy is hostd's policy for the benchmarks: 4 MiB rings for the
// BTL's default test ports (7800-7899), as docs/mpi.md recommends for MPI
// traffic; ports 7900-7999 keep hostd's default (1 MiB), for "shunt-1MiB".
const mpiRingPolicy = `rule "mpi" {
  action    = "fastpath"
  ports     = ["7800-7899"]
  ring_size = "4MiB"
}`

var mpiTransports = []mpiTransport{
	{name: "vader", btl: "self,vader", sameNS: true},
	{name: "vader-nocma", btl: "self,vader", sameNS: true, mca: []string{"--mca", "btl_vader_single_copy_mechanism", "none"}},
	{name: "tcp", btl: "self,tcp"},
	{name: "tcp-shunt-run", btl: "self,tcp", preload: true},
	{name: "shunt", btl: "self,vader,shunt"},
	{name: "shunt-1MiB", btl: "self,vader,shunt", mca: []string{"--mca", "btl_shunt_port_min", "7900", "--mca", "btl_shunt_port_max", "7999"}},
}

// skip skips tr's sub-benchmark unless SHUNT_MPI_TRANSPORTS (a comma list
// of names; default all) names it.
func (tr mpiTransport) skip(b *testing.B) {
	if only := os.Getenv("SHUNT_MPI_TRANSPORTS"); only != "" && !slices.Contains(strings.Split(only, ","), tr.name) {
		b.Skipf("not in SHUNT_MPI_TRANSPORTS=%s", only)
	}
}

func (tr mpiTransport) job(np int, prog string, args ...string) mpiJob {
	mca := append([]string{"--mca", "btl_shunt_verbose", "0"}, tr.mca...)
	if np > 2 {
		// More ranks than the machine's two vCPUs: every transport polls,
		// so ranks yield when idle (Open MPI does so by itself when it
		// knows it is oversubscribed, which two orteds do not).
		mca = append(mca, "--mca", "mpi_yield_when_idle", "1")
	}
	return mpiJob{np: np, btl: tr.btl, sameNS: tr.sameNS, preload: tr.preload, mca: mca, prog: prog, args: args, timeout: 5 * time.Minute}
}

// sizeName is a message size as a metric unit suffix: 0B, 8B, 64KiB, 1MiB.
func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// BenchmarkMPIBTL: ping-pong latency from 0 B to 1 MiB and streaming
// bandwidth (64 outstanding sends) from 8 B to 4 MiB, mpi/mpibench.c, per
// transport; btl/shunt with 4 MiB rings (mpiRingPolicy) and with hostd's
// default 1 MiB. Metrics: us@SIZE (one-way) and MB/s@SIZE.
func BenchmarkMPIBTL(b *testing.B) {
	e := newEnv(b, 2, mpiRingPolicy)
	line := regexp.MustCompile(`(?m)^(lat|bw) (\d+) ([0-9.]+)$`)
	for _, tr := range mpiTransports {
		b.Run(tr.name, func(b *testing.B) {
			tr.skip(b)
			vals := map[string][]float64{}
			var keys []string
			for b.Loop() {
				out := e.runMPI(b, tr.job(2, "mpibench"))
				if !strings.Contains(out, "data ok") {
					b.Fatalf("mpibench over %s:\n%s", tr.name, out)
				}
				for _, m := range line.FindAllStringSubmatch(out, -1) {
					n, _ := strconv.Atoi(m[2])
					v, _ := strconv.ParseFloat(m[3], 64)
					unit := "us@" + sizeName(n)
					if m[1] == "bw" {
						unit = "MB/s@" + sizeName(n)
					}
					if _, ok := vals[unit]; !ok {
						keys = append(keys, unit)
					}
					vals[unit] = append(vals[unit], v)
				}
			}
			for _, k := range keys {
				b.ReportMetric(median(vals[k]), k)
			}
		})
	}
}

// BenchmarkMPIApp: mpi/stencil.c, a 2D heat stencil with a halo exchange
// per iteration, on 2 and 4 ranks (half in each guest; vader: all in one
// guest). Metrics: comm-us/iter (the slowest rank's time in the exchange)
// and total-ms. The checksums of all transports must agree. hostd's default
// rings (1 MiB): the halos are 4 KiB, and eight flows of 4 MiB rings would
// not fit the rig's region.
func BenchmarkMPIApp(b *testing.B) {
	e := newEnv(b, 2, "")
	re := regexp.MustCompile(`stencil \d+ \d+ \d+ comm_us ([0-9.]+) compute_us ([0-9.]+) total_s ([0-9.]+) checksum (\S+)`)
	sums := map[int]string{}
	for _, np := range []int{2, 4} {
		for _, tr := range mpiTransports {
			if tr.name == "vader-nocma" || tr.name == "shunt-1MiB" {
				continue
			}
			b.Run(fmt.Sprintf("%s/ranks=%d", tr.name, np), func(b *testing.B) {
				tr.skip(b)
				var comm, total []float64
				for b.Loop() {
					out := e.runMPI(b, tr.job(np, "stencil", "-n", "512", "-i", "400"))
					m := re.FindStringSubmatch(out)
					if m == nil {
						b.Fatalf("stencil over %s:\n%s", tr.name, out)
					}
					if s, ok := sums[np]; ok && s != m[4] {
						b.Fatalf("stencil over %s: checksum %s, other transports %s", tr.name, m[4], s)
					}
					sums[np] = m[4]
					c, _ := strconv.ParseFloat(m[1], 64)
					t, _ := strconv.ParseFloat(m[3], 64)
					comm, total = append(comm, c), append(total, t*1e3)
				}
				b.ReportMetric(median(comm), "comm-us/iter")
				b.ReportMetric(median(total), "total-ms")
			})
		}
	}
}
