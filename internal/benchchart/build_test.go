package benchchart

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// pt is a wanted point: category (or size as HumanSize writes it), median,
// rounds.
type pt struct {
	cat    string
	y      float64
	rounds int
}

type wantSeries struct {
	label  string
	points []pt
}

type wantChart struct {
	bars     bool
	series   []wantSeries
	footnote string
}

func load(t *testing.T, name string) *Set {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s := NewSet()
	bad, err := s.Parse(f)
	if err != nil || len(bad) != 0 {
		t.Fatalf("parse %s: %v %v", name, bad, err)
	}
	return s
}

// TestBuild feeds each benchmark family's raw output (real line shapes,
// from docs/bench-*.raw.txt) and checks every chart, series and median.
func TestBuild(t *testing.T) {
	for _, tc := range []struct {
		file    string
		command string
		want    map[string]wantChart
	}{{
		file: "shm.txt", command: "make bench-shm",
		want: map[string]wantChart{
			"shm-latency": {series: []wantSeries{
				{"bare atomic word (floor)", []pt{{"8 B", 160.95, 2}}},
				{"ring, spin", []pt{{"8 B", 255.6, 2}, {"64 KiB", 12177.5, 2}}},
				{"ring, adaptive", []pt{{"8 B", 287, 2}, {"64 KiB", 12054, 2}}},
			}, footnote: "make bench-shm · linux/amd64 · AMD EPYC · median of 2 rounds"},
			"shm-bandwidth": {series: []wantSeries{
				{"copy API (Write / Read)", []pt{{"4 KiB", 19.879, 2}, {"64 KiB", 18.0945, 2}}},
				{"zero-copy (Reserve / Peek)", []pt{{"64 KiB", 26.77, 2}}},
			}},
			"shm-ringsize": {series: []wantSeries{
				{"64 KiB messages", []pt{{"64 KiB", 9, 2}, {"4 MiB", 6, 2}}},
			}},
			"shm-idle-cpu": {bars: true, series: []wantSeries{
				{"reader (child process)", []pt{{"spin", 100, 2}, {"adaptive", 0.5, 2}, {"block", 0.4, 2}}},
			}},
		},
	}, {
		file: "e2e.txt", command: "make bench-e2e",
		want: map[string]wantChart{
			"e2e-latency": {bars: true, series: []wantSeries{
				{"kernel TCP", []pt{{"8 B", 21.35, 3}}},
				{"kernel TCP, busy-polling", []pt{{"8 B", 38.30, 3}}},
				{"Shunt", []pt{{"8 B", 0.7160, 3}}},
			}, footnote: "make bench-e2e · linux/amd64 · AMD EPYC · median of 3 rounds"},
			"e2e-bandwidth": {bars: true, series: []wantSeries{
				{"kernel TCP", []pt{{"64 KiB", 0.8192, 3}}},
				{"Shunt", []pt{{"64 KiB", 13.11, 3}}},
			}},
			"e2e-setup": {bars: true, series: []wantSeries{
				{"kernel TCP", []pt{{"connect + accept + one 8 B round trip", 310.0, 3}}},
				{"Shunt", []pt{{"connect + accept + one 8 B round trip", 1100, 3}}},
			}},
		},
	}, {
		file: "preload.txt", command: "make bench-preload",
		want: map[string]wantChart{
			"preload-mpi-latency": {series: []wantSeries{
				{"kernel TCP (TCP BTL)", []pt{{"0 B", 13.065, 2}, {"8 B", 13.795, 2}}},
				{"Shunt (TCP BTL under shunt-run)", []pt{{"0 B", 3.873, 2}, {"8 B", 3.8075, 2}}},
				{"Open MPI vader (shared memory)", []pt{{"0 B", 0.1845, 2}, {"8 B", 0.2445, 2}}},
			}},
			"preload-mpi-bandwidth": {series: []wantSeries{
				{"kernel TCP (TCP BTL)", []pt{{"64 KiB", 0.9487, 2}, {"1 MiB", 1.1674, 2}}},
				{"Shunt (TCP BTL under shunt-run)", []pt{{"64 KiB", 4.9475, 2}, {"1 MiB", 7.21, 2}}},
				{"Open MPI vader (shared memory)", []pt{{"64 KiB", 11.70, 2}, {"1 MiB", 11.03, 2}}},
			}},
			"preload-sockperf-latency": {bars: true, series: []wantSeries{
				{"kernel TCP", []pt{{"14 B", 76.91, 2}}},
				{"kernel TCP, busy-polling", []pt{{"14 B", 10.486, 2}}},
				{"Shunt", []pt{{"14 B", 0.3725, 2}}},
			}},
			"preload-sockperf-bandwidth": {bars: true, series: []wantSeries{
				{"kernel TCP", []pt{{"64000 B", 755.8, 2}}},
				{"kernel TCP, busy-polling", []pt{{"64000 B", 756.1, 2}}},
				{"Shunt", []pt{{"64000 B", 6284, 2}}},
			}},
			"preload-iperf3": {bars: true, series: []wantSeries{
				{"kernel TCP", []pt{{"one TCP stream, 3 s", 8.5625, 2}}},
				{"Shunt", []pt{{"one TCP stream, 3 s", 123.85, 2}}},
			}},
		},
	}, {
		file: "vm.txt", command: "make bench-vm",
		want: map[string]wantChart{
			"vm-latency": {bars: true, series: []wantSeries{
				{"virtio-net TCP", []pt{{"Go library, 8 B", 1375, 3}, {"Open MPI, 8 B", 827.7, 3}, {"sockperf, 14 B, p50", 488.7, 3}}},
				{"Shunt", []pt{{"Go library, 8 B", 128.9, 3}, {"Open MPI, 8 B", 36.91, 3}, {"sockperf, 14 B, p50", 3.621, 3}}},
			}, footnote: "make bench-vm · linux/amd64 · AMD EPYC · median of 3 rounds"},
			"vm-bandwidth": {bars: true, series: []wantSeries{
				{"virtio-net TCP", []pt{{"Go library, 64 MiB stream", 91.00, 3}, {"Open MPI, 64 KiB", 81.40, 3}, {"iperf3, 64 MiB", 129.12, 3}}},
				{"Shunt", []pt{{"Go library, 64 MiB stream", 99.10, 3}, {"Open MPI, 64 KiB", 587.2, 3}, {"iperf3, 64 MiB", 744.50, 3}}},
			}},
		},
	}} {
		t.Run(tc.file, func(t *testing.T) {
			charts, notes := Build(load(t, tc.file), Specs, Rules, tc.command)
			if len(notes) != 0 {
				t.Errorf("notes: got %q, want none", notes)
			}
			got := map[string]*Chart{}
			for _, c := range charts {
				got[c.Spec.File] = c
			}
			if len(got) != len(tc.want) {
				var names []string
				for _, c := range charts {
					names = append(names, c.Spec.File)
				}
				t.Errorf("charts: got %v, want %d of them", names, len(tc.want))
			}
			for file, want := range tc.want {
				c := got[file]
				if c == nil {
					t.Errorf("chart %s: missing", file)
					continue
				}
				if c.Bars() != want.bars {
					t.Errorf("%s: Bars() = %v, want %v", file, c.Bars(), want.bars)
				}
				if want.footnote != "" && c.Footnote != want.footnote {
					t.Errorf("%s: footnote\n got %q\nwant %q", file, c.Footnote, want.footnote)
				}
				if g, w := describe(c.Series), describeWant(want.series); g != w {
					t.Errorf("%s: series\n got %s\nwant %s", file, g, w)
				}
			}
		})
	}
}

// describe writes series as text with six significant digits, so a
// failure shows the whole difference and float noise does not count.
func describe(ss []*Series) string {
	var b strings.Builder
	for _, s := range ss {
		fmt.Fprintf(&b, "\n  %s:", s.Label)
		for _, p := range s.Points {
			fmt.Fprintf(&b, " [%s %.6g n=%d]", p.Cat, p.Y, p.Rounds)
		}
	}
	return b.String()
}

func describeWant(ss []wantSeries) string {
	var b strings.Builder
	for _, s := range ss {
		fmt.Fprintf(&b, "\n  %s:", s.label)
		for _, p := range s.points {
			fmt.Fprintf(&b, " [%s %.6g n=%d]", p.cat, p.y, p.rounds)
		}
	}
	return b.String()
}

// TestBuildNotes: what cannot be charted is said, and the rest is charted.
func TestBuildNotes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		in    string
		notes []string // substrings, one per note, in order
		chart string   // a chart that must have the series
		label string
	}{{
		name:  "unknown benchmark",
		in:    "BenchmarkNew/kernel-2 \t 10 \t 5 ns/op \t 3 us/thing\n",
		notes: []string{"BenchmarkNew/kernel us/thing: no rule for this unit"},
	}, {
		name:  "only ns/op",
		in:    "BenchmarkOnlyLoop-2 \t 10 \t 5 ns/op\n",
		notes: []string{"BenchmarkOnlyLoop: no rule for any of its units"},
	}, {
		name:  "new transport is charted under its own name",
		in:    "BenchmarkGuestPingPong8B/rdma-2 \t 10 \t 5 ns/op \t 3.5 us/oneway\n",
		notes: []string{`series "rdma" is not in benchchart.Transports`},
		chart: "e2e-latency", label: "rdma",
	}, {
		name:  "new size needs no rule",
		in:    "BenchmarkGuestPingPong64KiB/shunt-2 \t 10 \t 5 ns/op \t 3.5 us/oneway\nBenchmarkGuestPingPong8B/shunt-2 \t 10 \t 5 ns/op \t 0.5 us/oneway\n",
		chart: "e2e-latency", label: "Shunt",
	}, {
		name:  "x that is not a size",
		in:    "BenchmarkPingPong/spin/huge-2 \t 10 \t 5 ns/op \t 3 ns/oneway\n",
		notes: []string{`BenchmarkPingPong/spin/huge ns/oneway: x: "huge" is not a size`},
	}, {
		name:  "duplicate point",
		in:    "BenchmarkPreloadMPI/tcp-veth-2 \t 1 \t 5 ns/op \t 3 us@8B \t 3 us@8\n",
		notes: []string{"already has a point at 8 B"},
		chart: "preload-mpi-latency", label: "kernel TCP (TCP BTL)",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewSet()
			if _, err := s.Parse(strings.NewReader(tc.in)); err != nil {
				t.Fatal(err)
			}
			charts, notes := Build(s, Specs, Rules, "")
			if len(notes) != len(tc.notes) {
				t.Fatalf("notes: got %q, want %d matching %q", notes, len(tc.notes), tc.notes)
			}
			for i, n := range notes {
				if !strings.Contains(n, tc.notes[i]) {
					t.Errorf("note %d: got %q, want it to contain %q", i, n, tc.notes[i])
				}
			}
			if tc.chart == "" {
				return
			}
			for _, c := range charts {
				if c.Spec.File != tc.chart {
					continue
				}
				for _, se := range c.Series {
					if se.Label == tc.label {
						return
					}
				}
				t.Fatalf("chart %s: no series %q in %s", tc.chart, tc.label, describe(c.Series))
			}
			t.Fatalf("no chart %s", tc.chart)
		})
	}
}

func TestFootnote(t *testing.T) {
	cfg := map[string]string{"goos": "linux", "goarch": "amd64", "cpu": "AMD EPYC"}
	for _, tc := range []struct {
		name    string
		config  map[string]string
		command string
		lo, hi  int
		want    string
	}{
		{"even rounds", cfg, "make bench-shm", 8, 8, "make bench-shm · linux/amd64 · AMD EPYC · median of 8 rounds"},
		{"uneven rounds", cfg, "make bench-vm", 2, 3, "make bench-vm · linux/amd64 · AMD EPYC · median of 2-3 rounds"},
		{"one round, no config, no command", nil, "", 1, 1, "go test -bench · median of 1 round"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := footnote(tc.config, tc.command, tc.lo, tc.hi); got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

// TestTables checks the tables against each other: every rule names a
// Spec, every Spec has a rule, series colours are in the palette.
func TestTables(t *testing.T) {
	files := map[string]bool{}
	for _, s := range Specs {
		if files[s.File] {
			t.Errorf("Spec %s: listed twice", s.File)
		}
		files[s.File] = true
	}
	used := map[string]bool{}
	for i, r := range Rules {
		if r.Chart != "" && !files[r.Chart] {
			t.Errorf("Rules[%d] (%s): chart %q has no Spec", i, r.Name, r.Chart)
		}
		used[r.Chart] = true
	}
	for f := range files {
		if !used[f] {
			t.Errorf("Spec %s: no rule fills it", f)
		}
	}
	for k, tr := range Transports {
		if tr.Color < 0 || tr.Color >= len(palette) {
			t.Errorf("Transports[%q]: colour %d outside the palette", k, tr.Color)
		}
	}
}

// TestRawOutputsCharted: every figure of the committed raw outputs behind
// docs/BENCHMARKS.md lands in a chart, or is left out by a rule.
func TestRawOutputsCharted(t *testing.T) {
	raws, _ := filepath.Glob("../../docs/bench-*.raw.txt")
	if len(raws) == 0 {
		t.Fatal("no docs/bench-*.raw.txt: the committed raw outputs are gone")
	}
	for _, raw := range raws {
		t.Run(filepath.Base(raw), func(t *testing.T) {
			f, err := os.Open(raw)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			s := NewSet()
			bad, err := s.Parse(f)
			if err != nil || len(bad) != 0 {
				t.Fatalf("parse: %v %v", bad, err)
			}
			charts, notes := Build(s, Specs, Rules, "")
			if len(notes) != 0 {
				t.Errorf("notes: got %q, want none", notes)
			}
			if len(charts) == 0 {
				t.Errorf("no charts")
			}
			for _, c := range charts {
				for _, se := range c.Series {
					for _, p := range se.Points {
						if math.IsNaN(p.Y) || p.Rounds == 0 {
							t.Errorf("%s %s %s: %v over %d rounds", c.Spec.File, se.Label, p.Cat, p.Y, p.Rounds)
						}
					}
				}
			}
		})
	}
}
