package benchchart

import (
	"bytes"
	"fmt"
	"image/color"
	"io"
	"math"
	"strconv"
	"strings"

	xfont "golang.org/x/image/font"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgsvg"
)

// palette is Okabe-Ito's, in the order of the colour constants.
var palette = []color.RGBA{
	{0x00, 0x72, 0xB2, 0xff}, // blue
	{0xD5, 0x5E, 0x00, 0xff}, // vermillion
	{0x00, 0x9E, 0x73, 0xff}, // green
	{0x56, 0xB4, 0xE9, 0xff}, // sky blue
	{0xE6, 0x9F, 0x00, 0xff}, // orange
	{0xCC, 0x79, 0xA7, 0xff}, // reddish purple
	{0xF0, 0xE4, 0x42, 0xff}, // yellow
	{0x00, 0x00, 0x00, 0xff}, // black
}

// glyphs go with the palette, so a series can be told apart in grey too.
var glyphs = []draw.GlyphDrawer{
	draw.CircleGlyph{}, draw.PyramidGlyph{}, draw.BoxGlyph{}, draw.TriangleGlyph{},
	draw.RingGlyph{}, draw.SquareGlyph{}, draw.CrossGlyph{}, draw.PlusGlyph{},
}

// Size of every chart.
const (
	Width  = 9 * vg.Inch
	Height = 5 * vg.Inch
)

var (
	grey      = color.Gray{0x55}
	gridColor = color.Gray{0xdd}
)

// style is Liberation Sans (Arial's metrics) of the given size.
func style(size vg.Length, bold bool, c color.Color) text.Style {
	f := font.Font{Typeface: "Liberation", Variant: "Sans"}
	if bold {
		f.Weight = xfont.WeightBold
	}
	return text.Style{Color: c, Font: font.From(f, size), Handler: plot.DefaultTextHandler}
}

// WriteSVG draws c as an SVG document: the title, the plot, a legend on
// the right and the footnote at the bottom. The same chart always gives
// the same bytes.
func (c *Chart) WriteSVG(w io.Writer) error {
	cv := vgsvg.New(Width, Height)
	dc := draw.New(cv)
	dc.SetColor(color.White)
	dc.Fill(dc.Rectangle.Path())

	const pad = vg.Length(10)
	title := style(13, true, color.Black)
	title.XAlign, title.YAlign = draw.XCenter, draw.YTop
	dc.FillText(title, vg.Point{X: dc.Center().X, Y: dc.Max.Y - pad}, c.Spec.Title)
	titleH := title.Height(c.Spec.Title) + 2*pad

	foot := style(8.5, false, grey)
	foot.YAlign = draw.YBottom
	dc.FillText(foot, vg.Point{X: dc.Min.X + pad, Y: dc.Min.Y + pad/2}, c.Footnote)
	footH := foot.Height(c.Footnote) + 2*pad

	p, leg, xlabel, ylabel, err := c.plot()
	if err != nil {
		return err
	}
	lr := leg.Rectangle(dc)
	legW := lr.Size().X + 2*pad
	area := draw.Crop(dc, pad/2, -legW, footH, -titleH)
	leg.Draw(draw.Crop(dc, dc.Size().X-legW+pad, -pad, footH, -titleH-pad))

	// The axis titles are drawn here, centred on the data area: gonum
	// centres them on the arithmetic middle of the range, which is off
	// on a log scale.
	xl, yl := style(10.5, false, color.Black), style(10.5, false, color.Black)
	xl.XAlign, xl.YAlign = draw.XCenter, draw.YBottom
	yl.XAlign, yl.YAlign, yl.Rotation = draw.XCenter, draw.YTop, math.Pi/2
	var xh vg.Length
	if xlabel != "" {
		xh = xl.Height(xlabel) + pad/2
	}
	inner := draw.Crop(area, yl.Height(ylabel)+pad/2, 0, xh, 0)
	p.Draw(inner)
	data := p.DataCanvas(inner)
	if xlabel != "" {
		area.FillText(xl, vg.Point{X: data.Center().X, Y: area.Min.Y}, xlabel)
	}
	area.FillText(yl, vg.Point{X: area.Min.X, Y: data.Center().Y}, ylabel)

	var buf bytes.Buffer
	if _, err := cv.WriteTo(&buf); err != nil {
		return fmt.Errorf("render %s: %w", c.Spec.File, err)
	}
	// The SVG names the font it was measured with; fall back to the faces
	// with the same metrics, then to any sans-serif.
	out := strings.ReplaceAll(buf.String(), "font-family:Liberation Sans;",
		"font-family:'Liberation Sans',Arial,Helvetica,sans-serif;")
	_, err = io.WriteString(w, out)
	return err
}

// plot builds the plot, its legend and its axis titles, which are drawn
// apart from it.
func (c *Chart) plot() (p *plot.Plot, leg *plot.Legend, xlabel, ylabel string, err error) {
	p = plot.New()
	p.BackgroundColor = nil
	for _, a := range []*plot.Axis{&p.X, &p.Y} {
		a.Tick.Label.Font = style(9.5, false, color.Black).Font
	}
	lg := plot.NewLegend()
	leg = &lg
	leg.TextStyle = style(10, false, color.Black)
	leg.Top, leg.Left = true, true
	leg.Padding = 4

	ys := c.values()
	logY := c.Spec.LogY && ys.min > 0 && ys.max/ys.min >= 10
	xlabel, ylabel = c.Spec.XLabel, c.Spec.YLabel
	p.Y.Tick.Marker = plot.TickerFunc(linearTicks)
	if logY {
		ylabel += ", log scale"
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = plot.TickerFunc(logTicks)
	}

	if c.Bars() {
		if !logY {
			p.Y.Min, p.Y.Max = 0, ys.max*1.15
		} else {
			p.Y.Min = math.Pow(10, math.Floor(math.Log10(ys.min/2)))
			p.Y.Max = ys.max * 2
		}
		p.NominalX(c.Cats...)
		p.X.Min, p.X.Max = -0.5, float64(len(c.Cats))-0.5
		grid := plotter.NewGrid()
		grid.Vertical.Color = nil
		grid.Horizontal.Color = gridColor
		p.Add(grid)
		for i, se := range c.Series {
			b := &bars{chart: c, series: i, label: style(8.5, false, color.Black)}
			p.Add(b)
			leg.Add(se.Label, b)
		}
		return p, leg, xlabel, ylabel, nil
	}

	// Lines over a log size axis. A size of 0 cannot sit on it: it is
	// drawn an eighth of the smallest other size away, labelled "0 B".
	zero := 1.0
	xmin, xmax := math.Inf(1), math.Inf(-1)
	for _, se := range c.Series {
		for _, pt := range se.Points {
			if pt.X > 0 {
				xmin, xmax = min(xmin, pt.X), max(xmax, pt.X)
			}
		}
	}
	if !math.IsInf(xmin, 0) {
		zero = xmin / 8
	} else {
		xmin, xmax = zero, zero
	}
	pos := func(x float64) float64 {
		if x <= 0 {
			return zero
		}
		return x
	}
	var ticks []plot.Tick
	for _, se := range c.Series {
		for _, pt := range se.Points {
			t := plot.Tick{Value: pos(pt.X), Label: HumanSize(pt.X)}
			if !containsTick(ticks, t) {
				ticks = append(ticks, t)
			}
		}
	}
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.ConstantTicks(ticks)
	p.X.Min, p.X.Max = min(pos(0), xmin)/1.6, xmax*1.6
	if !c.hasZero() {
		p.X.Min = xmin / 1.6
	}
	xlabel += ", log scale"
	if logY {
		p.Y.Min, p.Y.Max = ys.min/1.6, ys.max*1.6
	} else {
		p.Y.Min, p.Y.Max = 0, ys.max*1.1
	}
	grid := plotter.NewGrid()
	grid.Vertical.Color, grid.Horizontal.Color = gridColor, gridColor
	p.Add(grid)
	for _, se := range c.Series {
		xys := make(plotter.XYs, len(se.Points))
		for i, pt := range se.Points {
			xys[i] = plotter.XY{X: pos(pt.X), Y: pt.Y}
		}
		l, s, lerr := plotter.NewLinePoints(xys)
		if lerr != nil {
			return nil, nil, "", "", fmt.Errorf("chart %s, series %s: %w", c.Spec.File, se.Label, lerr)
		}
		col := palette[se.Color%len(palette)]
		l.Color, l.Width = col, vg.Points(1.6)
		s.Color, s.Radius, s.Shape = col, vg.Points(3.5), glyphs[se.Color%len(glyphs)]
		p.Add(l, s)
		leg.Add(se.Label, l, s)
	}
	return p, leg, xlabel, ylabel, nil
}

func containsTick(ts []plot.Tick, t plot.Tick) bool {
	for _, u := range ts {
		if u.Value == t.Value {
			return true
		}
	}
	return false
}

func (c *Chart) hasZero() bool {
	for _, se := range c.Series {
		for _, p := range se.Points {
			if p.X <= 0 {
				return true
			}
		}
	}
	return false
}

type span struct{ min, max float64 }

// values is the span of the positive y values (all of them if none is).
func (c *Chart) values() span {
	s := span{math.Inf(1), math.Inf(-1)}
	for _, se := range c.Series {
		for _, p := range se.Points {
			if p.Y > 0 {
				s.min = min(s.min, p.Y)
			}
			s.max = max(s.max, p.Y)
		}
	}
	if math.IsInf(s.min, 0) {
		s.min = 0
	}
	if s.max <= 0 {
		s.max = 1
	}
	return s
}

// logTicks labels 1, 2 and 5 times the powers of ten over at most three
// decades, and only the powers of ten beyond.
func logTicks(lo, hi float64) []plot.Tick {
	if lo <= 0 || hi <= lo {
		return nil
	}
	first, last := int(math.Floor(math.Log10(lo))), int(math.Ceil(math.Log10(hi)))
	dense := last-first <= 3
	var ts []plot.Tick
	for e := first; e <= last; e++ {
		for m := 1; m <= 9; m++ {
			v, _ := strconv.ParseFloat(fmt.Sprintf("%de%d", m, e), 64)
			if v < lo || v > hi {
				continue
			}
			t := plot.Tick{Value: v}
			if m == 1 || dense && (m == 2 || m == 5) {
				t.Label = strconv.FormatFloat(v, 'f', -1, 64)
			}
			ts = append(ts, t)
		}
	}
	return ts
}

// linearTicks labels steps of 1, 2 or 5 times a power of ten, four to ten
// of them over the range.
func linearTicks(lo, hi float64) []plot.Tick {
	if hi <= lo {
		return nil
	}
	e := math.Floor(math.Log10((hi - lo) / 5))
	step := math.Pow(10, e)
	for _, m := range []float64{1, 2, 5, 10} {
		if (hi-lo)/(m*step) <= 8 {
			step *= m
			break
		}
	}
	prec := max(0, -int(math.Floor(math.Log10(step))))
	var ts []plot.Tick
	for i := math.Ceil(lo / step); i*step <= hi*(1+1e-9); i++ {
		v, _ := strconv.ParseFloat(strconv.FormatFloat(i*step, 'f', prec, 64), 64)
		ts = append(ts, plot.Tick{Value: v, Label: strconv.FormatFloat(v, 'f', prec, 64)})
	}
	return ts
}

// FormatValue writes a figure with three significant digits, or all of
// its integer digits, and no exponent: 0.362, 21.4, 100, 1375.
func FormatValue(v float64) string {
	if v == 0 || math.IsInf(v, 0) || math.IsNaN(v) {
		return strconv.FormatFloat(v, 'f', -1, 64)
	}
	digits := func(v float64) int { return max(0, 2-int(math.Floor(math.Log10(math.Abs(v))))) }
	scale := math.Pow10(digits(v))
	r := math.Round(v*scale) / scale // halves away from zero, as in the tables
	return strconv.FormatFloat(r, 'f', digits(r), 64)
}

// bars draws one series of a grouped bar chart, with its values on top.
// A bar rises from the bottom of the y axis, so it works on a log axis.
type bars struct {
	chart  *Chart
	series int
	label  text.Style
}

func (b *bars) color() color.Color {
	return palette[b.chart.Series[b.series].Color%len(palette)]
}

// Plot implements plot.Plotter.
func (b *bars) Plot(c draw.Canvas, p *plot.Plot) {
	trX, trY := p.Transforms(&c)
	n := len(b.chart.Series)
	slot := (c.Max.X - c.Min.X) / vg.Length(len(b.chart.Cats))
	w := min(slot*0.8/vg.Length(n), 70)
	off := (vg.Length(b.series) - vg.Length(n-1)/2) * w
	lab := b.label
	lab.XAlign, lab.YAlign = draw.XCenter, draw.YBottom
	for _, pt := range b.chart.Series[b.series].Points {
		i := indexOf(b.chart.Cats, pt.Cat)
		if i < 0 || pt.Y <= 0 && p.Y.Min > 0 {
			continue
		}
		x := trX(float64(i)) + off
		y0, y1 := trY(p.Y.Min), trY(pt.Y)
		r := vg.Rectangle{Min: vg.Point{X: x - w/2 + 1, Y: y0}, Max: vg.Point{X: x + w/2 - 1, Y: y1}}
		c.SetColor(b.color())
		c.Fill(r.Path())
		c.FillText(lab, vg.Point{X: x, Y: y1 + 2}, FormatValue(pt.Y))
	}
}

// Thumbnail implements plot.Thumbnailer.
func (b *bars) Thumbnail(c *draw.Canvas) {
	c.SetColor(b.color())
	c.Fill(c.Rectangle.Path())
}

func indexOf(s []string, v string) int {
	for i, e := range s {
		if e == v {
			return i
		}
	}
	return -1
}
