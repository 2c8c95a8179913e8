package benchchart

import (
	"fmt"
	"slices"
	"strings"
)

// A Chart is the data of one Spec: medians placed in series. Build makes
// it and nothing changes it afterwards, so WriteSVG may run concurrently.
type Chart struct {
	Spec   Spec
	Series []*Series
	// Cats lists the categories in order of first appearance; on a size
	// chart, the sizes as HumanSize writes them, in ascending order.
	Cats []string
	// MinRounds and MaxRounds bound the number of rounds behind the
	// medians.
	MinRounds, MaxRounds int
	// Footnote names the command, the machine and the rounds.
	Footnote string
}

// A Series is one transport's (or mode's) line or bars; part of a Chart.
type Series struct {
	Label string
	// Color is an index into the palette; see Transports.
	Color  int
	Points []Point
}

// A Point is the median of one figure over the rounds.
type Point struct {
	// X is the size in bytes on a size chart; Cat is the category, or the
	// size as HumanSize writes it.
	X   float64
	Cat string
	// Y is the median in the chart's unit.
	Y float64
	// Rounds is the number of values behind the median.
	Rounds int
	// From is the figure the point was made from.
	From Key
}

// Bars reports whether the chart is drawn as grouped bars: a category
// chart, or a size chart with fewer than two sizes.
func (c *Chart) Bars() bool {
	return !c.Spec.Sizes || len(c.Cats) < 2
}

// Build places the medians of s in the charts of specs by rules, and
// returns the charts that have data, in the order of specs. command names
// how the data was made, for the footnote ("make bench-shm"). The notes
// say what was not charted and why: figures no rule matches, x values that
// are not sizes, series keys missing from Transports, duplicates.
func Build(s *Set, specs []Spec, rules []Rule, command string) ([]*Chart, []string) {
	var notes []string
	byFile := map[string]*Chart{}
	for _, sp := range specs {
		byFile[sp.File] = &Chart{Spec: sp}
	}
	charted := map[string]bool{}  // benchmark names with a charted figure
	unplaced := map[string]bool{} // benchmark names with a figure no rule matched
	var names []string
	seenKey := map[string]bool{}
	for _, k := range s.Keys {
		if !seenKey[k.Name] {
			seenKey[k.Name] = true
			names = append(names, k.Name)
		}
		r, nm, um := match(rules, k)
		if r == nil {
			if !implicit[k.Unit] {
				notes = append(notes, fmt.Sprintf("%s: no rule for this unit: not charted (add one to benchchart.Rules)", k))
				unplaced[k.Name] = true
			}
			continue
		}
		if r.Chart == "" {
			continue
		}
		c := byFile[r.Chart]
		if c == nil {
			notes = append(notes, fmt.Sprintf("%s: rule names chart %q, which has no Spec", k, r.Chart))
			continue
		}
		charted[k.Name] = true
		groups := map[string]string{}
		for _, m := range []struct {
			names, vals []string
		}{{r.Name.SubexpNames(), nm}, {r.Unit.SubexpNames(), um}} {
			for i, n := range m.names {
				if n != "" && m.vals[i] != "" {
					groups[n] = m.vals[i]
				}
			}
		}
		notes = append(notes, c.add(s, k, r, groups)...)
	}
	for _, n := range names {
		if !charted[n] && !unplaced[n] {
			notes = append(notes, fmt.Sprintf("%s: no rule for any of its units: not charted (add one to benchchart.Rules)", n))
		}
	}

	var out []*Chart
	for _, sp := range specs {
		c := byFile[sp.File]
		if len(c.Series) == 0 {
			continue
		}
		c.finish(s.Config, command)
		out = append(out, c)
	}
	return out, notes
}

func match(rules []Rule, k Key) (*Rule, []string, []string) {
	for i := range rules {
		r := &rules[i]
		nm := r.Name.FindStringSubmatch(k.Name)
		if nm == nil {
			continue
		}
		if um := r.Unit.FindStringSubmatch(k.Unit); um != nil {
			return r, nm, um
		}
	}
	return nil, nil, nil
}

// add places the median of k in c. It returns notes: why the figure was
// not charted, or that its series key is missing from Transports.
func (c *Chart) add(s *Set, k Key, r *Rule, groups map[string]string) []string {
	var notes []string
	key := groups["series"]
	label := r.Series
	if label == "" {
		label = "{series}"
	}
	color := -1
	if strings.Contains(label, "{series}") {
		tr, ok := Transports[key]
		if ok {
			color = tr.Color
		} else {
			tr.Label = key
			notes = append(notes, fmt.Sprintf("%s: series %q is not in benchchart.Transports: charted under its own name", k, key))
		}
		label = strings.ReplaceAll(label, "{series}", tr.Label)
	}
	if strings.Contains(label, "{series:size}") {
		v, err := ParseSize(key)
		if err != nil {
			return append(notes, fmt.Sprintf("%s: series: %v: not charted", k, err))
		}
		label = strings.ReplaceAll(label, "{series:size}", HumanSize(v))
	}
	if label == "" {
		return append(notes, fmt.Sprintf("%s: the rule gives no series: not charted", k))
	}

	p := Point{From: k}
	p.Y, p.Rounds = s.Median(k)
	if r.Scale != 0 {
		p.Y *= r.Scale
	}
	x, hasX := groups["x"]
	if c.Spec.Sizes {
		if !hasX {
			x = r.X
		}
		v, err := ParseSize(x)
		if err != nil {
			return append(notes, fmt.Sprintf("%s: x: %v: not charted", k, err))
		}
		p.X, p.Cat = v, HumanSize(v)
	} else {
		if hasX {
			if v, err := ParseSize(x); err == nil {
				x = HumanSize(v)
			}
		}
		switch {
		case r.X != "":
			p.Cat = strings.ReplaceAll(r.X, "{x}", x)
		case hasX:
			p.Cat = x
		default:
			return append(notes, fmt.Sprintf("%s: the rule gives no x value: not charted", k))
		}
	}

	var se *Series
	for _, e := range c.Series {
		if e.Label == label {
			se = e
		}
	}
	if se == nil {
		se = &Series{Label: label, Color: color}
		c.Series = append(c.Series, se)
	}
	for _, q := range se.Points {
		if q.Cat == p.Cat {
			return append(notes, fmt.Sprintf("%s: %s already has a point at %s (from %s): not charted", k, label, p.Cat, q.From))
		}
	}
	se.Points = append(se.Points, p)
	if !slices.Contains(c.Cats, p.Cat) {
		c.Cats = append(c.Cats, p.Cat)
	}
	return notes
}

// finish sorts the points, gives colours to series without one and writes
// the footnote.
func (c *Chart) finish(config map[string]string, command string) {
	if c.Spec.Sizes {
		var xs []float64
		for _, se := range c.Series {
			slices.SortFunc(se.Points, func(a, b Point) int {
				switch {
				case a.X < b.X:
					return -1
				case a.X > b.X:
					return 1
				}
				return 0
			})
			for _, p := range se.Points {
				if !slices.Contains(xs, p.X) {
					xs = append(xs, p.X)
				}
			}
		}
		slices.Sort(xs)
		c.Cats = c.Cats[:0]
		for _, x := range xs {
			c.Cats = append(c.Cats, HumanSize(x))
		}
	}
	used := map[int]bool{}
	for _, se := range c.Series {
		if se.Color >= 0 {
			used[se.Color] = true
		}
	}
	next := 0
	for _, se := range c.Series {
		if se.Color >= 0 {
			continue
		}
		for used[next%len(palette)] && next < 2*len(palette) {
			next++
		}
		se.Color = next % len(palette)
		used[se.Color] = true
	}
	c.MinRounds, c.MaxRounds = 0, 0
	for _, se := range c.Series {
		for _, p := range se.Points {
			if c.MinRounds == 0 || p.Rounds < c.MinRounds {
				c.MinRounds = p.Rounds
			}
			c.MaxRounds = max(c.MaxRounds, p.Rounds)
		}
	}
	c.Footnote = footnote(config, command, c.MinRounds, c.MaxRounds)
}

func footnote(config map[string]string, command string, lo, hi int) string {
	if command == "" {
		command = "go test -bench"
	}
	parts := []string{command}
	if config["goos"] != "" && config["goarch"] != "" {
		parts = append(parts, config["goos"]+"/"+config["goarch"])
	}
	if config["cpu"] != "" {
		parts = append(parts, config["cpu"])
	}
	rounds := fmt.Sprint(lo)
	if hi != lo {
		rounds = fmt.Sprintf("%d-%d", lo, hi)
	}
	noun := "rounds"
	if hi == 1 {
		noun = "round"
	}
	parts = append(parts, fmt.Sprintf("median of %s %s", rounds, noun))
	return strings.Join(parts, " · ")
}
