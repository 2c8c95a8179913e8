package dist

import (
	"bufio"
	_ "embed"
	"encoding/json"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
)

// Dashboard is grafana-dashboard.json.
//
//go:embed grafana-dashboard.json
var Dashboard []byte

// dashboard is the part of a Grafana dashboard that holds queries.
type dashboard struct {
	Panels     []panel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type panel struct {
	Title   string  `json:"title"`
	Panels  []panel `json:"panels"` // a collapsed row's
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
}

// DashboardMetrics returns the metric names that a Grafana dashboard's
// PromQL queries (panel targets and query variables) select, sorted, each
// once. Histogram series keep their suffix (_bucket, _count, _sum), as
// they appear in a scrape.
func DashboardMetrics(js []byte) ([]string, error) {
	var d dashboard
	if err := json.Unmarshal(js, &d); err != nil {
		return nil, fmt.Errorf("parse dashboard: %w", err)
	}
	var names []string
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, t := range p.Targets {
				names = append(names, ExprMetrics(t.Expr)...)
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct{ Query string }
		if err := json.Unmarshal(v.Query, &q); err != nil {
			// Older dashboards hold the query as a plain string.
			if err := json.Unmarshal(v.Query, &q.Query); err != nil {
				return nil, fmt.Errorf("variable %s: query is neither a string nor an object", v.Name)
			}
		}
		names = append(names, ExprMetrics(labelValues.ReplaceAllString(q.Query, "$1"))...)
	}
	slices.Sort(names)
	return slices.Compact(names), nil
}

var (
	// Grafana's label_values(selector, label) variable query.
	labelValues = regexp.MustCompile(`label_values\(\s*([^,]*),[^)]*\)`)
	// What cannot hold a metric name: strings, label matchers, ranges and
	// the label lists of aggregations and vector matching.
	noNames = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|\{[^}]*\}|\[[^\]]*\]|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	ident   = regexp.MustCompile(`[A-Za-z_:][A-Za-z0-9_:]*`)
	// PromQL keywords that are not followed by "(".
	keywords = map[string]bool{"and": true, "or": true, "unless": true, "bool": true, "offset": true,
		"inf": true, "nan": true, "Inf": true, "NaN": true}
)

// ExprMetrics returns the metric names a PromQL expression selects: the
// identifiers that are not functions, aggregations, keywords, labels,
// durations or parts of numbers.
func ExprMetrics(expr string) []string {
	s := noNames.ReplaceAllString(expr, " ")
	var names []string
	for _, m := range ident.FindAllStringIndex(s, -1) {
		name := s[m[0]:m[1]]
		if m[0] > 0 && strings.ContainsAny(s[m[0]-1:m[0]], "0123456789.$") {
			continue // 1e9, 5m, a Grafana $variable
		}
		if next := strings.TrimLeft(s[m[1]:], " \t\n"); strings.HasPrefix(next, "(") {
			continue // a function or an aggregation
		}
		if keywords[name] {
			continue
		}
		names = append(names, name)
	}
	return names
}

// SampleNames returns the sample names in a Prometheus text exposition (a
// scrape of /metrics): histograms as name_bucket, name_sum, name_count.
func SampleNames(r io.Reader) (map[string]bool, error) {
	names := map[string]bool{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		if i := strings.IndexAny(line, "{ "); i > 0 {
			names[line[:i]] = true
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read scrape: %w", err)
	}
	return names, nil
}
