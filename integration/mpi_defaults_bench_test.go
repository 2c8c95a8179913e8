package integration

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/testenv"
)

// BenchmarkMPIDefaults (make bench-mpi-defaults; root): btl/shunt with
// hostd's defaults, as a user who follows docs/mpi.md has them (no policy
// rule: 1 MiB rings; the trust group's default quota and pair regions, not
// the rig's roomy ones), against vader with all ranks in one guest (with
// its single-copy mechanism, CMA, and without) and the TCP BTL across the
// guests, at 2 and at 4 ranks (half in each guest). mpi/mpibench.c: the
// 8-byte ping-pong of every pair at once (rank i with rank i + N/2), an
// 8-byte MPI_Alltoall, an 8-byte MPI_Allreduce, and at 2 ranks the
// bandwidth at 64 KiB and 1 MiB and both ways at once at 64 KiB (osu_bibw).
// Metrics: us@8B (one-way), a2a-us@8B, ar-us@8B, MB/s@64KiB, MB/s@1MiB,
// bibw-MB/s@64KiB. A btl/shunt
// job fails the benchmark unless hostd counted every direction of it onto
// the rings.
func BenchmarkMPIDefaults(b *testing.B) {
	testenv.NeedRoot(b)
	testenv.NeedTool(b, "nft", "nftables")
	needBTL(b)
	e := startEnv(b, "d", stack.Options{Guests: 2, HostdBin: hostdBin, Group: "  # hostd's defaults\n"})
	line := regexp.MustCompile(`(?m)^(lat|bw|a2a|ar|bibw) (\d+) ([0-9.]+)$`)
	want := map[string]bool{"lat 8": true, "a2a 8": true, "ar 8": true, "bw 65536": true, "bw 1048576": true, "bibw 65536": true}
	for _, np := range []int{2, 4} {
		for _, tr := range mpiTransports {
			if tr.name == "tcp-shunt-run" || tr.name == "shunt-1MiB" {
				continue
			}
			b.Run(fmt.Sprintf("%s/ranks=%d", tr.name, np), func(b *testing.B) {
				tr.skip(b)
				args := []string{"-l", "8", "-a", "2000", "-A", "2000", "-b", "1048576", "-s", "65536", "-B", "65536"}
				if np > 2 {
					args = []string{"-l", "8", "-a", "2000", "-A", "2000", "-b", "0"}
				}
				vals := map[string][]float64{}
				var keys []string
				for b.Loop() {
					before := hostdCounter(b, e, firstSwitches)
					out := e.runMPI(b, tr.job(np, "mpibench", args...))
					if !strings.Contains(out, "data ok") {
						b.Fatalf("mpibench over %s:\n%s", tr.name, out)
					}
					if n := int(hostdCounter(b, e, firstSwitches) - before); tr.name == "shunt" && n != np*np/2 {
						b.Fatalf("%d ranks: hostd counted %d directions onto the rings, want %d\n%s\nhostd's flows: %s", np, n, np*np/2, out, e.flowsJSON())
					}
					for _, m := range line.FindAllStringSubmatch(out, -1) {
						if !want[m[1]+" "+m[2]] {
							continue
						}
						n, _ := strconv.Atoi(m[2])
						v, _ := strconv.ParseFloat(m[3], 64)
						unit := map[string]string{"lat": "us@", "a2a": "a2a-us@", "ar": "ar-us@", "bw": "MB/s@", "bibw": "bibw-MB/s@"}[m[1]] + sizeName(n)
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
}

// hostdCounter is the value of hostd's counter key (e.counter, for
// benchmarks too: env.t is only a test's).
func hostdCounter(tb testing.TB, e *env, key string) float64 {
	tb.Helper()
	var cs map[string]float64
	if err := admin.Call(e.Admin, admin.Request{Cmd: "counters"}, &cs); err != nil {
		tb.Fatalf("hostd counters: %v", err)
	}
	return cs[key]
}
