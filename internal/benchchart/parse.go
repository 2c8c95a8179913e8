package benchchart

import (
	"bufio"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// Key names one figure of one benchmark: the name without the
// GOMAXPROCS suffix ("BenchmarkPingPong/spin/8B") and a unit ("ns/oneway").
type Key struct {
	Name, Unit string
}

func (k Key) String() string { return k.Name + " " + k.Unit }

// A Set holds every round's value of every figure in one or more raw
// outputs, in the order they first appeared. It is not safe for concurrent
// use while Parse adds to it.
type Set struct {
	// Config holds the first value seen of each configuration line
	// ("goos", "goarch", "pkg", "cpu").
	Config map[string]string
	// Keys lists the figures in order of first appearance.
	Keys []Key
	// Values holds each figure's values, one per round, in input order.
	Values map[Key][]float64
}

// NewSet returns an empty Set.
func NewSet() *Set {
	return &Set{Config: map[string]string{}, Values: map[Key][]float64{}}
}

// A ParseError is a line that starts like a benchmark result but is not one.
type ParseError struct {
	Line int
	Text string
	Why  string
}

func (e *ParseError) Error() string {
	return fmt.Sprintf("line %d: %s: %q", e.Line, e.Why, e.Text)
}

var (
	procsSuffix = regexp.MustCompile(`-[0-9]+$`)
	configLine  = regexp.MustCompile(`^([a-z][^\s:]*): *(.*)$`)
)

// Parse adds the results in r to s. Configuration lines ("key: value" from
// the first column) and result lines are read; others (PASS, ok, indented
// log output) are skipped; lines that start with
// "Benchmark" and a capital letter or "/" but do not parse are returned as
// *ParseError values, and the rest of the input is still read. The error
// is only for a failed read.
func (s *Set) Parse(r io.Reader) ([]error, error) {
	var bad []error
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimRight(sc.Text(), " \t\r")
		if m := configLine.FindStringSubmatch(line); m != nil {
			if _, ok := s.Config[m[1]]; !ok {
				s.Config[m[1]] = strings.TrimSpace(m[2])
			}
			continue
		}
		if !isResult(line) {
			continue
		}
		if err := s.addLine(line); err != "" {
			bad = append(bad, &ParseError{Line: n, Text: line, Why: err})
		}
	}
	if err := sc.Err(); err != nil {
		return bad, fmt.Errorf("read benchmark output: %w", err)
	}
	return bad, nil
}

// isResult reports whether line starts like a result line: "Benchmark"
// followed by an upper-case letter, a digit, "/", "-" or a space.
func isResult(line string) bool {
	rest, ok := strings.CutPrefix(line, "Benchmark")
	if !ok {
		return false
	}
	if rest == "" {
		return true
	}
	c := rest[0]
	return c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '/' || c == '-' || c == ' ' || c == '\t'
}

// addLine parses one result line; it returns why it could not, or "".
func (s *Set) addLine(line string) string {
	f := strings.Fields(line)
	if len(f) < 4 || len(f)%2 != 0 {
		return "want a name, an iteration count and value-unit pairs"
	}
	if _, err := strconv.ParseUint(f[1], 10, 64); err != nil {
		return "iteration count is not a number"
	}
	name := procsSuffix.ReplaceAllString(f[0], "")
	type pair struct {
		k Key
		v float64
	}
	var ps []pair
	for i := 2; i < len(f); i += 2 {
		v, err := strconv.ParseFloat(f[i], 64)
		if err != nil {
			return fmt.Sprintf("value %q is not a number", f[i])
		}
		ps = append(ps, pair{Key{name, f[i+1]}, v})
	}
	for _, p := range ps {
		if _, ok := s.Values[p.k]; !ok {
			s.Keys = append(s.Keys, p.k)
		}
		s.Values[p.k] = append(s.Values[p.k], p.v)
	}
	return ""
}

// Median returns the median of k's values over the rounds and the number
// of rounds; with an even number it is the mean of the middle two, as in
// benchstat. It returns 0, 0 for a figure the Set does not hold.
func (s *Set) Median(k Key) (float64, int) {
	return median(s.Values[k]), len(s.Values[k])
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	v = slices.Clone(v)
	slices.Sort(v)
	if n := len(v); n%2 == 0 {
		return (v[n/2-1] + v[n/2]) / 2
	}
	return v[len(v)/2]
}
