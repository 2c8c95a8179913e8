package benchchart

import (
	"bytes"
	"encoding/xml"
	"errors"
	"io"
	"strings"
	"testing"
)

// TestWriteSVG draws every chart of every family: the SVG must be
// well-formed XML with an <svg> root, carry the title, every legend label,
// every axis category and the footnote, and be the same bytes twice.
func TestWriteSVG(t *testing.T) {
	for _, file := range []string{"shm.txt", "e2e.txt", "preload.txt", "vm.txt"} {
		charts, _ := Build(load(t, file), Specs, Rules, "make bench-x")
		for _, c := range charts {
			t.Run(c.Spec.File, func(t *testing.T) {
				var a, b bytes.Buffer
				if err := c.WriteSVG(&a); err != nil {
					t.Fatalf("WriteSVG: %v", err)
				}
				if err := c.WriteSVG(&b); err != nil {
					t.Fatalf("WriteSVG, second time: %v", err)
				}
				if !bytes.Equal(a.Bytes(), b.Bytes()) {
					t.Errorf("two renderings differ: %d and %d bytes", a.Len(), b.Len())
				}
				root, texts := parseSVG(t, a.Bytes())
				if root != "svg" {
					t.Errorf("root element: got %q, want svg", root)
				}
				want := []string{c.Spec.Title, c.Footnote, c.Spec.YLabel}
				for _, se := range c.Series {
					want = append(want, se.Label)
				}
				want = append(want, c.Cats...)
				all := strings.Join(texts, "\n")
				for _, w := range want {
					if !strings.Contains(all, w) {
						t.Errorf("no text %q in the SVG; texts:\n%s", w, all)
					}
				}
				if c.Bars() {
					for _, se := range c.Series {
						for _, p := range se.Points {
							if v := FormatValue(p.Y); !contains(texts, v) {
								t.Errorf("no value label %q for %s at %s", v, se.Label, p.Cat)
							}
						}
					}
				}
			})
		}
	}
}

// parseSVG decodes the whole document and returns the root element's
// name and the character data of every <text>.
func parseSVG(t *testing.T, doc []byte) (string, []string) {
	t.Helper()
	d := xml.NewDecoder(bytes.NewReader(doc))
	var root string
	var texts []string
	var in bool
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v", err)
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = tok.Name.Local
			}
			in = tok.Name.Local == "text"
		case xml.CharData:
			if in {
				texts = append(texts, strings.TrimSpace(string(tok)))
			}
		case xml.EndElement:
			in = false
		}
	}
	return root, texts
}

func contains(ss []string, s string) bool {
	for _, e := range ss {
		if e == s {
			return true
		}
	}
	return false
}

func TestLogTicks(t *testing.T) {
	for _, tc := range []struct {
		name   string
		lo, hi float64
		labels []string
	}{
		{"two decades: 1, 2, 5", 0.15, 30, []string{"0.2", "0.5", "1", "2", "5", "10", "20"}},
		{"five decades: powers of ten", 0.5, 20000, []string{"1", "10", "100", "1000", "10000"}},
		{"empty range", 5, 5, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, tk := range logTicks(tc.lo, tc.hi) {
				if tk.Label != "" {
					got = append(got, tk.Label)
				}
			}
			if strings.Join(got, " ") != strings.Join(tc.labels, " ") {
				t.Errorf("labels: got %v, want %v", got, tc.labels)
			}
		})
	}
}

func TestLinearTicks(t *testing.T) {
	for _, tc := range []struct {
		name   string
		lo, hi float64
		labels []string
	}{
		{"0 to 115", 0, 115, []string{"0", "20", "40", "60", "80", "100"}},
		{"0 to 7", 0, 7, []string{"0", "1", "2", "3", "4", "5", "6", "7"}},
		{"0 to 0.9", 0, 0.9, []string{"0.0", "0.2", "0.4", "0.6", "0.8"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, tk := range linearTicks(tc.lo, tc.hi) {
				got = append(got, tk.Label)
			}
			if strings.Join(got, " ") != strings.Join(tc.labels, " ") {
				t.Errorf("labels: got %v, want %v", got, tc.labels)
			}
		})
	}
}
