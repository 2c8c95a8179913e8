package preflight

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/shuntnet/shunt/hostd/config"
)

// Severity says how bad a finding is.
type Severity int

const (
	// OK reports what a check verified.
	OK Severity = iota
	// Warning: hostd starts, but something will not work as configured.
	Warning
	// Problem: hostd would not start, or would start unsafe.
	Problem
)

func (s Severity) String() string {
	switch s {
	case OK:
		return "ok"
	case Warning:
		return "warning"
	case Problem:
		return "problem"
	}
	return fmt.Sprintf("severity(%d)", int(s))
}

// MarshalText writes the severity as its name.
func (s Severity) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText reads a severity's name.
func (s *Severity) UnmarshalText(b []byte) error {
	for _, v := range []Severity{OK, Warning, Problem} {
		if string(b) == v.String() {
			*s = v
			return nil
		}
	}
	return fmt.Errorf("severity %q: want ok, warning or problem", b)
}

// Finding is one result of a check: what it found and, unless the
// severity is OK, how to fix it.
type Finding struct {
	Severity Severity `json:"severity"`
	Check    string   `json:"check"`
	What     string   `json:"what"`
	Fix      string   `json:"fix,omitempty"`
}

// check is one named check. It reports through e.
type check struct {
	name string
	run  func(ctx context.Context, e *env)
}

// checks run in this order after the configuration loaded.
var checks = []check{
	{"privileges", checkPrivileges},
	{"conntrack", checkConntrack},
	{"nftables", checkNftables},
	{"witness", checkWitness},
	{"interfaces", checkInterfaces},
	{"space", checkSpace},
	{"regions", checkRegions},
	{"quotas", checkQuotas},
	{"sockets", checkSockets},
	{"netns", checkNetns},
	{"libvirt", checkLibvirt},
	{"qmp", checkQMP},
	{"vsock", checkVsock},
	{"metrics", checkMetrics},
	{"peering", checkPeering},
	{"rdma", checkRDMA},
}

// env is what a check sees: the configuration, the probes, and the
// findings so far.
type env struct {
	cfg   *config.Config
	p     Probes
	check string
	out   []Finding
	seen  map[string]bool // findings about a directory shared by several paths, reported once
	// running is the admin socket a hostd answers on, if one does.
	running string
	// nsMissing: conntrack_netns does not exist (reported once).
	nsMissing bool
}

func (e *env) add(s Severity, what, fix string) {
	e.out = append(e.out, Finding{Severity: s, Check: e.check, What: what, Fix: fix})
}
func (e *env) ok(format string, args ...any) { e.add(OK, fmt.Sprintf(format, args...), "") }
func (e *env) warn(what, fix string)         { e.add(Warning, what, fix) }
func (e *env) problem(what, fix string)      { e.add(Problem, what, fix) }

// once reports whether key is new, and remembers it.
func (e *env) once(key string) bool {
	if e.seen[key] {
		return false
	}
	e.seen[key] = true
	return true
}

// Run loads the configuration at path and, if it is valid, checks the host
// for it with p. It returns every finding, in the order of the checks. Run
// is safe for concurrent use if p's probes are.
func Run(ctx context.Context, path string, p Probes) []Finding {
	e := &env{p: p, check: "config", seen: map[string]bool{}}
	cfg, err := config.Load(path)
	if err != nil {
		for _, line := range strings.Split(err.Error(), "\n") {
			e.problem(line, "edit "+path+"; docs/config.md is the reference")
		}
		return e.out
	}
	e.cfg = cfg
	e.ok("%s: %s, %s, %s, policy default %s", path, plural(len(cfg.Groups), "trust group"),
		plural(len(cfg.Guests), "guest"), plural(len(cfg.Policy.Rules), "policy rule"), or(cfg.Policy.Default, "fastpath"))
	for _, c := range checks {
		e.check = c.name
		c.run(ctx, e)
	}
	return e.out
}

// Count returns the number of problems and warnings in fs.
func Count(fs []Finding) (problems, warnings int) {
	for _, f := range fs {
		switch f.Severity {
		case Problem:
			problems++
		case Warning:
			warnings++
		}
	}
	return problems, warnings
}

// Summary is the last line of the report: "3 problems, 1 warning".
func Summary(fs []Finding) string {
	p, w := Count(fs)
	return plural(p, "problem") + ", " + plural(w, "warning")
}

// WriteText writes fs aligned, one per line (severity, check, what, fix),
// and the summary.
func WriteText(w io.Writer, fs []Finding) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, f := range fs {
		fix := ""
		if f.Fix != "" {
			fix = "fix: " + f.Fix
		}
		if fix == "" {
			fmt.Fprintf(tw, "%s\t%s\t%s\n", f.Severity, f.Check, oneLine(f.What))
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", f.Severity, f.Check, oneLine(f.What), oneLine(fix))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintln(w, Summary(fs))
	return err
}

// Report is the JSON form of a run.
type Report struct {
	Config   string    `json:"config"`
	Findings []Finding `json:"findings"`
	Problems int       `json:"problems"`
	Warnings int       `json:"warnings"`
}

// WriteJSON writes fs as a Report for the configuration at path.
func WriteJSON(w io.Writer, path string, fs []Finding) error {
	r := Report{Config: path, Findings: fs}
	if r.Findings == nil {
		r.Findings = []Finding{}
	}
	r.Problems, r.Warnings = Count(fs)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func or(s, dflt string) string {
	if s == "" {
		return dflt
	}
	return s
}

// size formats a byte count in binary units, like the configuration.
func size(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	if n%div == 0 {
		return fmt.Sprintf("%d %ciB", n/div, "KMGTPE"[exp])
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
