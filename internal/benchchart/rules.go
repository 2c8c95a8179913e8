package benchchart

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

// A Spec is one chart: its file, its titles and how its axes read. Specs,
// Rules and Transports are tables: read-only once the program runs.
type Spec struct {
	// File is the output name without ".svg", e.g. "shm-latency".
	File string
	// Title is the chart's title.
	Title string
	// XLabel and YLabel name the axes, with units; a category chart
	// whose categories say it all may leave XLabel empty.
	XLabel, YLabel string
	// Sizes says the x values are message or buffer sizes in bytes, drawn
	// on a log axis; otherwise they are categories, drawn as bar groups.
	Sizes bool
	// LogY draws y on a log scale when the data spans at least 10x.
	LogY bool
}

// A Rule places figures in a chart. The first rule whose Name and Unit both
// match a figure decides; a rule with an empty Chart leaves the figures it
// matches out on purpose.
type Rule struct {
	// Name matches the benchmark name without the GOMAXPROCS suffix; its
	// groups "series" and "x" name the series and the x value.
	Name *regexp.Regexp
	// Unit matches the unit; it may have the group "x", as in "us@(?P<x>.+)".
	Unit *regexp.Regexp
	// Chart is the Spec.File the figures go to; "" charts nothing.
	Chart string
	// Series is the series' label: "{series}" stands for the transport
	// label of the group "series" (see Transports), "{series:size}" for
	// that group read as a size. Empty means "{series}".
	Series string
	// X is the x value when neither pattern has a group "x".
	X string
	// Scale multiplies the figure into the chart's unit; 0 means 1.
	Scale float64
}

// A Transport is how a series key is shown: its label and its colour
// (an index into the palette), the same in every chart.
type Transport struct {
	Label string
	Color int
}

// Palette colour indices for Transports (Okabe-Ito, safe for colour
// blindness); keys not in Transports take the unused ones in order.
const (
	blue = iota
	vermillion
	green
	skyBlue
	orange
	purple
	yellow
	black
)

// Transports maps the sub-benchmark names of the benchmark sources to
// legend labels. Transports of TCP between guests: kernel, busypoll,
// kernel-busypoll, tcp, tcp-veth, virtio-net (integration/bench_test.go,
// preload_bench_test.go, vm_test.go); Shunt: shunt, tcp-shunt; Open MPI's
// shared memory: vader. Wait modes and APIs of the rings (shm/bench_test.go):
// spin, adaptive, block, copy, zerocopy.
var Transports = map[string]Transport{
	"kernel":          {"kernel TCP", blue},
	"tcp":             {"kernel TCP", blue},
	"tcp-veth":        {"kernel TCP (TCP BTL)", blue},
	"virtio-net":      {"virtio-net TCP", blue},
	"busypoll":        {"kernel TCP, busy-polling", skyBlue},
	"kernel-busypoll": {"kernel TCP, busy-polling", skyBlue},
	"shunt":           {"Shunt", vermillion},
	"tcp-shunt":       {"Shunt (TCP BTL under shunt-run)", vermillion},
	"vader":           {"Open MPI vader (shared memory)", green},
	"vader-nocma":     {"Open MPI vader, no CMA", yellow},
	"tcp-shunt-run":   {"TCP BTL under shunt-run", orange},
	"shunt-1MiB":      {"btl/shunt, 1 MiB rings", purple},
	"spin":            {"spin", vermillion},
	"adaptive":        {"adaptive", purple},
	"block":           {"block", orange},
	"copy":            {"copy API (Write / Read)", blue},
	"zerocopy":        {"zero-copy (Reserve / Peek)", vermillion},
	"go-kernel":       {"Go, kernel TCP", blue},
	"go-shunt":        {"Go, Shunt", vermillion},
	"c-kernel":        {"C, kernel TCP", skyBlue},
	"c-shunt":         {"C under shunt-run, Shunt", orange},
}

// Specs lists every chart, in the order they are written.
var Specs = []Spec{
	// make bench-shm (shm/bench_test.go)
	{File: "shm-latency", Title: "Ring ping-pong across two processes: one-way latency",
		XLabel: "message size", YLabel: "one-way latency (ns)", Sizes: true, LogY: true},
	{File: "shm-bandwidth", Title: "Ring streaming across two processes, 1 MiB rings: throughput",
		XLabel: "message size", YLabel: "throughput (GB/s)", Sizes: true},
	{File: "shm-ringsize", Title: "Ring capacity against throughput, copy API",
		XLabel: "ring capacity", YLabel: "throughput (GB/s)", Sizes: true},
	{File: "shm-idle-cpu", Title: "CPU burnt waiting 300 ms on an idle peer",
		XLabel: "wait mode", YLabel: "CPU (% of one core)"},

	// make bench-e2e (integration/bench_test.go)
	{File: "e2e-latency", Title: "Guest to guest ping-pong: one-way latency",
		XLabel: "message size", YLabel: "one-way latency (us)", Sizes: true, LogY: true},
	{File: "e2e-bandwidth", Title: "Guest to guest streaming: throughput",
		XLabel: "message size", YLabel: "throughput (GB/s)", Sizes: true},
	{File: "e2e-setup", Title: "Guest to guest connection setup",
		YLabel: "setup time (us)"},

	// make bench-sizes and make bench-http (integration)
	{File: "sizes-read", Title: "Guest to guest streams by read size: Go, C under shunt-run, kernel TCP",
		XLabel: "read size (copy: io.Copy)", YLabel: "throughput (GB/s)"},
	{File: "sizes-write", Title: "Guest to guest streams by write size: Go, C under shunt-run, kernel TCP",
		XLabel: "write size", YLabel: "throughput (GB/s)"},
	{File: "http", Title: "net/http over guestlib vs kernel TCP: time per request",
		XLabel: "request and body size", YLabel: "time per request (us)", LogY: true},

	// make bench-preload (integration/preload_bench_test.go)
	{File: "preload-mpi-latency", Title: "Open MPI ping-pong (pingpong.c, ob1): latency",
		XLabel: "message size", YLabel: "latency (us)", Sizes: true, LogY: true},
	{File: "preload-mpi-bandwidth", Title: "Open MPI streaming (pingpong.c, ob1): bandwidth",
		XLabel: "message size", YLabel: "bandwidth (GB/s)", Sizes: true},
	{File: "preload-sockperf-latency", Title: "sockperf ping-pong, unmodified: one-way latency, p50",
		XLabel: "message size", YLabel: "one-way latency p50 (us)", Sizes: true, LogY: true},
	{File: "preload-sockperf-bandwidth", Title: "sockperf throughput, unmodified",
		XLabel: "message size", YLabel: "throughput (MB/s)", Sizes: true},
	{File: "preload-iperf3", Title: "iperf3, one stream, unmodified",
		YLabel: "throughput (Gbit/s)"},

	// make bench-mpi (integration/mpi_bench_test.go)
	{File: "mpi-latency", Title: "Open MPI across guests: btl/shunt vs vader and the TCP BTL, latency",
		XLabel: "message size", YLabel: "one-way latency (us)", Sizes: true, LogY: true},
	{File: "mpi-bandwidth", Title: "Open MPI across guests: btl/shunt vs vader and the TCP BTL, bandwidth",
		XLabel: "message size", YLabel: "bandwidth (MB/s)", Sizes: true, LogY: true},
	{File: "mpi-stencil", Title: "2D stencil halo exchange: communication time per iteration",
		XLabel: "ranks", YLabel: "communication (us per iteration)"},

	// make bench-mpi-defaults (integration/mpi_bench_test.go)
	{File: "mpi-defaults-latency", Title: "Open MPI with hostd's defaults: btl/shunt vs vader and the TCP BTL, 8 B",
		XLabel: "kernel, ranks", YLabel: "time (us)", LogY: true},
	{File: "mpi-defaults-bandwidth", Title: "Open MPI with hostd's defaults: btl/shunt vs vader and the TCP BTL, bandwidth",
		XLabel: "kernel, ranks", YLabel: "bandwidth (MB/s)", LogY: true},

	// make bench-cross-mpi (integration/crosshost/mpi_bench_test.go)
	{File: "cross-mpi-latency", Title: "Open MPI across two hosts: btl/shunt through the relays vs the TCP BTL, one-way latency",
		XLabel: "message size", YLabel: "one-way latency (us)"},
	{File: "cross-mpi-bandwidth", Title: "Open MPI across two hosts: btl/shunt through the relays vs the TCP BTL, bandwidth",
		XLabel: "message size", YLabel: "bandwidth (MB/s)"},

	// make bench-cross (integration/crosshost/bench_test.go)
	{File: "cross-latency", Title: "Across two hosts: kernel TCP vs Shunt through the relays, one-way latency",
		XLabel: "benchmark", YLabel: "one-way latency (us)"},
	{File: "cross-bandwidth", Title: "Across two hosts: kernel TCP vs Shunt through the relays, throughput",
		XLabel: "benchmark", YLabel: "throughput (GB/s)"},
	{File: "cross-setup", Title: "Across two hosts: connect and one 8 B round trip",
		XLabel: "benchmark", YLabel: "time per connection (us)"},

	// make bench-vm (integration/vm_test.go)
	{File: "vm-latency", Title: "Between two QEMU (TCG) VMs: one-way latency",
		XLabel: "program", YLabel: "one-way latency (us)", LogY: true},
	{File: "vm-bandwidth", Title: "Between two QEMU (TCG) VMs: throughput",
		XLabel: "program", YLabel: "throughput (MB/s)"},
}

func rule(name, unit, chart, series, x string, scale float64) Rule {
	return Rule{Name: regexp.MustCompile(name), Unit: regexp.MustCompile(unit),
		Chart: chart, Series: series, X: x, Scale: scale}
}

// Rules maps the benchmark names of shm/bench_test.go,
// integration/bench_test.go, integration/preload_bench_test.go and
// integration/vm_test.go to charts. See the package documentation.
var Rules = []Rule{
	// integration: read and write sizes, net/http (make bench-sizes, bench-http)
	rule(`^BenchmarkGuestSizes/read=(?P<x>[^/]+)/(?P<series>[^/]+)$`, `^GB/s$`, "sizes-read", "", "", 0),
	rule(`^BenchmarkGuestSizes/write=(?P<x>[^/]+)/(?P<series>[^/]+)$`, `^GB/s$`, "sizes-write", "", "", 0),
	rule(`^BenchmarkGuestHTTP/(?P<x>[^/]+)/(?P<series>[^/]+)$`, `^us/req$`, "http", "", "", 0),
	rule(`^BenchmarkGuestHTTP/`, `^GB/s$`, "", "", "", 0), // the body size over the time: the time, restated
	// shm: BenchmarkAtomicPingPong moves one 8-byte word.
	rule(`^BenchmarkAtomicPingPong$`, `^ns/oneway$`, "shm-latency", "bare atomic word (floor)", "8B", 0),
	rule(`^BenchmarkPingPong/(?P<series>[^/]+)/(?P<x>[^/]+)$`, `^ns/oneway$`, "shm-latency", "ring, {series}", "", 0),
	rule(`^BenchmarkPingPong/`, `^MB/s$`, "", "", "", 0), // SetBytes over a round trip: the latency, restated
	rule(`^BenchmarkStream/(?P<series>[^/]+)/(?P<x>[^/]+)$`, `^GB/s$`, "shm-bandwidth", "", "", 0),
	rule(`^BenchmarkStream/`, `^MB/s$`, "", "", "", 0), // bytes written, not yet consumed; GB/s counts the reader's
	rule(`^BenchmarkRingSize/msg(?P<series>[^/]+)/ring(?P<x>[^/]+)$`, `^GB/s$`, "shm-ringsize", "{series:size} messages", "", 0),
	rule(`^BenchmarkRingSize/`, `^MB/s$`, "", "", "", 0),
	rule(`^BenchmarkIdleCPU/(?P<x>[^/]+)$`, `^%core$`, "shm-idle-cpu", "reader (child process)", "", 0),

	// e2e
	rule(`^BenchmarkGuestPingPong(?P<x>[0-9][0-9A-Za-z]*)/(?P<series>[^/]+)$`, `^us/oneway$`, "e2e-latency", "", "", 0),
	rule(`^BenchmarkGuestStream(?P<x>[0-9][0-9A-Za-z]*)/(?P<series>[^/]+)$`, `^GB/s$`, "e2e-bandwidth", "", "", 0),
	rule(`^BenchmarkGuestStream`, `^MB/s$`, "", "", "", 0), // written by the sender; GB/s counts the reader's
	rule(`^BenchmarkGuestSetup/(?P<series>[^/]+)$`, `^us/setup$`, "e2e-setup", "", "connect + accept + one 8 B round trip", 0),

	// preload
	rule(`^BenchmarkPreloadMPI/(?P<series>[^/]+)$`, `^us@(?P<x>.+)$`, "preload-mpi-latency", "", "", 0),
	rule(`^BenchmarkPreloadMPI/(?P<series>[^/]+)$`, `^GB/s@(?P<x>.+)$`, "preload-mpi-bandwidth", "", "", 0),
	rule(`^BenchmarkPreloadSockperf/(?P<series>[^/]+)$`, `^us/oneway-p50$`, "preload-sockperf-latency", "", "14B", 0),
	rule(`^BenchmarkPreloadSockperf/(?P<series>[^/]+)$`, `^MBps@(?P<x>.+)$`, "preload-sockperf-bandwidth", "", "", 0),
	rule(`^BenchmarkPreloadIperf3/(?P<series>[^/]+)$`, `^Gbit/s$`, "preload-iperf3", "", "one TCP stream, 3 s", 0),

	// mpi: in BenchmarkMPIBTL "shunt" has 4 MiB rings (a policy rule), as
	// docs/mpi.md recommends for MPI ports.
	rule(`^BenchmarkMPIBTL/(?P<series>[^/]+)$`, `^us@(?P<x>.+)$`, "mpi-latency", "", "", 0),
	rule(`^BenchmarkMPIBTL/(?P<series>[^/]+)$`, `^MB/s@(?P<x>.+)$`, "mpi-bandwidth", "", "", 0),
	rule(`^BenchmarkMPIApp/(?P<series>[^/]+)/ranks=(?P<x>[0-9]+)$`, `^comm-us/iter$`, "mpi-stencil", "", "", 0),
	rule(`^BenchmarkMPIApp/`, `^total-ms$`, "", "", "", 0), // compute included: the communication time is the figure

	// mpi with hostd's defaults: 8 B kernels at 2 and 4 ranks, bandwidth at 2
	rule(`^BenchmarkMPIDefaults/(?P<series>[^/]+)/(?P<x>ranks=[0-9]+)$`, `^us@8B$`, "mpi-defaults-latency", "", "one-way, {x}", 0),
	rule(`^BenchmarkMPIDefaults/(?P<series>[^/]+)/(?P<x>ranks=[0-9]+)$`, `^a2a-us@8B$`, "mpi-defaults-latency", "", "alltoall, {x}", 0),
	rule(`^BenchmarkMPIDefaults/(?P<series>[^/]+)/(?P<x>ranks=[0-9]+)$`, `^ar-us@8B$`, "mpi-defaults-latency", "", "allreduce, {x}", 0),
	rule(`^BenchmarkMPIDefaults/(?P<series>[^/]+)/(?P<x>ranks=[0-9]+)$`, `^MB/s@64KiB$`, "mpi-defaults-bandwidth", "", "64 KiB, {x}", 0),
	rule(`^BenchmarkMPIDefaults/(?P<series>[^/]+)/(?P<x>ranks=[0-9]+)$`, `^MB/s@1MiB$`, "mpi-defaults-bandwidth", "", "1 MiB, {x}", 0),
	rule(`^BenchmarkMPIDefaults/(?P<series>[^/]+)/(?P<x>ranks=[0-9]+)$`, `^bibw-MB/s@64KiB$`, "mpi-defaults-bandwidth", "", "both ways, 64 KiB, {x}", 0),

	// mpi across two hosts
	rule(`^BenchmarkMPICross/(?P<series>[^/]+)$`, `^us@(?P<x>.+)$`, "cross-mpi-latency", "", "", 0),
	rule(`^BenchmarkMPICross/(?P<series>[^/]+)$`, `^MB/s@(?P<x>.+)$`, "cross-mpi-bandwidth", "", "", 0),

	// cross: two hosts of a fabric (shunt-rig -hosts 2)
	rule(`^BenchmarkCrossPingPong8B/(?P<series>[^/]+)$`, `^us/oneway$`, "cross-latency", "", "8 B ping-pong", 0),
	rule(`^BenchmarkCrossStream64K/(?P<series>[^/]+)$`, `^GB/s$`, "cross-bandwidth", "", "64 KiB stream", 0),
	rule(`^BenchmarkCrossStream64K/`, `^MB/s$`, "", "", "", 0), // written by the sender; GB/s counts what was sent, acknowledged by the sink
	rule(`^BenchmarkCrossConcurrent16/(?P<series>[^/]+)$`, `^GB/s$`, "cross-bandwidth", "", "16 streams, aggregate", 0),
	rule(`^BenchmarkCrossConcurrent16/`, `^min-share$`, "", "", "", 0), // fairness: in the table
	rule(`^BenchmarkCrossSetup/(?P<series>[^/]+)$`, `^us/conn$`, "cross-setup", "", "connect + one 8 B round trip", 0),

	// vm: the Go agent's ping-pong is 8 B, sockperf's 14 B; the Go and
	// iperf3 streams move 64 MiB.
	rule(`^BenchmarkVM/(?P<series>[^/]+)$`, `^us/oneway$`, "vm-latency", "", "Go library, 8 B", 0),
	rule(`^BenchmarkVMPreload/(?P<series>[^/]+)$`, `^us/oneway$`, "vm-latency", "", "sockperf, 14 B, p50", 0),
	rule(`^BenchmarkVMMPI/(?P<series>[^/]+)$`, `^us@(?P<x>.+)$`, "vm-latency", "", "Open MPI, {x}", 0),
	rule(`^BenchmarkVM/(?P<series>[^/]+)$`, `^MB/s$`, "vm-bandwidth", "", "Go library, 64 MiB stream", 0),
	rule(`^BenchmarkVMPreload/(?P<series>[^/]+)$`, `^MB/s$`, "vm-bandwidth", "", "iperf3, 64 MiB", 0),
	rule(`^BenchmarkVMMPI/(?P<series>[^/]+)$`, `^MB/s@(?P<x>.+)$`, "vm-bandwidth", "", "Open MPI, {x}", 0),
}

// implicit are the units left out without a rule: the loop's own time and
// allocations. Every benchmark charted here reports its domain figure with
// b.ReportMetric.
var implicit = map[string]bool{"ns/op": true, "B/op": true, "allocs/op": true}

var sizeRE = regexp.MustCompile(`^(?:size=)?([0-9]+(?:\.[0-9]+)?)\s*([KMG]?)(?:i?B)?$`)

// ParseSize reads a size as the benchmarks write it: "8B", "64K", "4KiB",
// "1MiB", "64000", "size=64". K, M and G are powers of 1024, with or
// without "iB" or "B"; sizes in decimal units are written out in digits.
func ParseSize(s string) (float64, error) {
	m := sizeRE.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return 0, fmt.Errorf("%q is not a size such as 8B, 64K, 4KiB or 64000", s)
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		return 0, fmt.Errorf("%q is not a size: %w", s, err)
	}
	switch m[2] {
	case "K":
		v *= 1 << 10
	case "M":
		v *= 1 << 20
	case "G":
		v *= 1 << 30
	}
	return v, nil
}

// HumanSize writes a size in bytes as "8 B", "4 KiB", "1 MiB", or in plain
// bytes when it is not a whole number of KiB or MiB ("64000 B").
func HumanSize(v float64) string {
	n := int64(v)
	switch {
	case float64(n) != v:
		return strconv.FormatFloat(v, 'g', -1, 64) + " B"
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}
