package benchchart

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name   string
		in     string
		keys   []Key
		values map[Key][]float64
		config map[string]string
		bad    []int // lines of the ParseErrors
	}{{
		name: "one line, two figures",
		in:   "cpu: AMD EPYC\nBenchmarkPingPong/spin/8B-2 \t 311665\t 749.8 ns/op\t 10.67 MB/s\t 374.9 ns/oneway\n",
		keys: []Key{{"BenchmarkPingPong/spin/8B", "ns/op"}, {"BenchmarkPingPong/spin/8B", "MB/s"}, {"BenchmarkPingPong/spin/8B", "ns/oneway"}},
		values: map[Key][]float64{
			{"BenchmarkPingPong/spin/8B", "ns/op"}:     {749.8},
			{"BenchmarkPingPong/spin/8B", "MB/s"}:      {10.67},
			{"BenchmarkPingPong/spin/8B", "ns/oneway"}: {374.9},
		},
		config: map[string]string{"cpu": "AMD EPYC"},
	}, {
		name: "rounds append in order, GOMAXPROCS suffix dropped, dashes in names kept",
		in: `goos: linux
BenchmarkPreloadSockperf/kernel-busypoll-2 	1	8673089416 ns/op	574.6 MBps@64000	9.502 us/oneway-p50
PASS
goos: darwin
BenchmarkPreloadSockperf/kernel-busypoll-2 	1	8633027013 ns/op	937.6 MBps@64000	11.47 us/oneway-p50
BenchmarkPreloadSockperf/kernel-busypoll 	1	8633027013 ns/op	940.7 MBps@64000	11.13 us/oneway-p50
ok  	github.com/shuntnet/shunt/integration	60.1s
`,
		keys: []Key{{"BenchmarkPreloadSockperf/kernel-busypoll", "ns/op"}, {"BenchmarkPreloadSockperf/kernel-busypoll", "MBps@64000"}, {"BenchmarkPreloadSockperf/kernel-busypoll", "us/oneway-p50"}},
		values: map[Key][]float64{
			{"BenchmarkPreloadSockperf/kernel-busypoll", "ns/op"}:         {8673089416, 8633027013, 8633027013},
			{"BenchmarkPreloadSockperf/kernel-busypoll", "MBps@64000"}:    {574.6, 937.6, 940.7},
			{"BenchmarkPreloadSockperf/kernel-busypoll", "us/oneway-p50"}: {9.502, 11.47, 11.13},
		},
		config: map[string]string{"goos": "linux"},
	}, {
		name: "malformed result lines are reported, the rest is read",
		in: `BenchmarkX-2 	abc	1 ns/op
BenchmarkY-2 	10	1 ns/op	2
BenchmarkZ-2 	10	fast ns/op
BenchmarkOK-2 	10	5 ns/op
Benchmarking is fun
--- FAIL: BenchmarkW
`,
		keys:   []Key{{"BenchmarkOK", "ns/op"}},
		values: map[Key][]float64{{"BenchmarkOK", "ns/op"}: {5}},
		config: map[string]string{},
		bad:    []int{1, 2, 3},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewSet()
			bad, err := s.Parse(strings.NewReader(tc.in))
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if !slices.Equal(s.Keys, tc.keys) {
				t.Errorf("keys:\n got %v\nwant %v", s.Keys, tc.keys)
			}
			for k, want := range tc.values {
				if got := s.Values[k]; !slices.Equal(got, want) {
					t.Errorf("values of %v: got %v, want %v", k, got, want)
				}
			}
			if len(s.Values) != len(tc.values) {
				t.Errorf("got %d figures, want %d", len(s.Values), len(tc.values))
			}
			for k, want := range tc.config {
				if got := s.Config[k]; got != want {
					t.Errorf("config %s: got %q, want %q", k, got, want)
				}
			}
			var lines []int
			for _, e := range bad {
				var pe *ParseError
				if !errors.As(e, &pe) {
					t.Fatalf("error %v is not a *ParseError", e)
				}
				lines = append(lines, pe.Line)
			}
			if !slices.Equal(lines, tc.bad) {
				t.Errorf("bad lines: got %v, want %v (%v)", lines, tc.bad, bad)
			}
		})
	}
}

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []float64
		want float64
	}{
		{"none", nil, 0},
		{"one", []float64{3}, 3},
		{"odd, unsorted", []float64{21.35, 25.42, 20.58}, 21.35},
		{"even: mean of the middle two", []float64{4, 1, 3, 2}, 2.5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := slices.Clone(tc.in)
			if got := median(in); got != tc.want {
				t.Errorf("median(%v) = %v, want %v", tc.in, got, tc.want)
			}
			if !slices.Equal(in, tc.in) {
				t.Errorf("median sorted its input: %v", in)
			}
		})
	}
}

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want float64
		err  bool
	}{
		{"0B", 0, false},
		{"8B", 8, false},
		{"64K", 64 << 10, false},
		{"4KiB", 4 << 10, false},
		{"4KB", 4 << 10, false},
		{"1MiB", 1 << 20, false},
		{"64000", 64000, false},
		{"size=64", 64, false},
		{"2G", 2 << 30, false},
		{"kernel", 0, true},
		{"", 0, true},
		{"8 bytes", 0, true},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := ParseSize(tc.in)
			if (err != nil) != tc.err {
				t.Fatalf("ParseSize(%q) error %v, want error: %v", tc.in, err, tc.err)
			}
			if got != tc.want {
				t.Errorf("ParseSize(%q) = %v, want %v", tc.in, got, tc.want)
			}
		})
	}
}

func TestHumanSize(t *testing.T) {
	for _, tc := range []struct {
		in   float64
		want string
	}{
		{0, "0 B"}, {8, "8 B"}, {14, "14 B"}, {1024, "1 KiB"}, {64 << 10, "64 KiB"},
		{1 << 20, "1 MiB"}, {4 << 20, "4 MiB"}, {64000, "64000 B"}, {1536, "1536 B"}, {0.5, "0.5 B"},
	} {
		if got := HumanSize(tc.in); got != tc.want {
			t.Errorf("HumanSize(%v) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestFormatValue(t *testing.T) {
	for _, tc := range []struct {
		in   float64
		want string
	}{
		{0, "0"}, {0.355, "0.355"}, {0.0012345, "0.00123"}, {3.6213, "3.62"}, {21.04, "21.0"},
		{99.97, "100"}, {128.9, "129"}, {744.5, "745"}, {1375, "1375"}, {6284.4, "6284"}, {-2.5, "-2.50"},
	} {
		if got := FormatValue(tc.in); got != tc.want {
			t.Errorf("FormatValue(%v) = %q, want %q", tc.in, got, tc.want)
		}
	}
}
