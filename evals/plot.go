package evals

import (
	"fmt"
	"image/color"
	"path/filepath"
	"sort"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

// Bars draws values as a bar chart, one bar per label, and saves it to
// path (.png or .svg, by the extension).
func Bars(path, title, ylabel string, labels []string, values []float64) error {
	if len(labels) != len(values) || len(values) == 0 {
		return fmt.Errorf("plot %s: %d labels for %d values", path, len(labels), len(values))
	}
	p := plot.New()
	p.Title.Text, p.Y.Label.Text = title, ylabel
	bars, err := plotter.NewBarChart(plotter.Values(values), vg.Points(max(2, 600/float64(len(values)))))
	if err != nil {
		return fmt.Errorf("plot %s: %w", path, err)
	}
	bars.Color = color.RGBA{R: 70, G: 110, B: 180, A: 255}
	bars.LineStyle.Width = 0
	p.Add(bars)
	// Label every k-th bar so the names stay readable.
	k := max(1, len(labels)/24)
	shown := make([]string, len(labels))
	for i := range labels {
		if i%k == 0 {
			shown[i] = labels[i]
		}
	}
	p.NominalX(shown...)
	p.X.Tick.Label.Rotation = 1.2
	p.X.Tick.Label.XAlign, p.X.Tick.Label.YAlign = -0.9, -0.5
	return save(p, path, 10*vg.Inch, 6*vg.Inch)
}

// Histogram draws counts over bins of the given width from 0 (log-scaled
// counts) with a vertical line for each named threshold, and saves it.
func Histogram(path, title, xlabel string, counts []int64, width float64, thresholds map[string]float64) error {
	if len(counts) == 0 || width <= 0 {
		return fmt.Errorf("plot %s: an empty histogram", path)
	}
	p := plot.New()
	p.Title.Text, p.X.Label.Text, p.Y.Label.Text = title, xlabel, "count (log)"
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	xy := make(plotter.XYs, 0, len(counts))
	for i, c := range counts {
		if c > 0 {
			xy = append(xy, plotter.XY{X: (float64(i) + 0.5) * width, Y: float64(c)})
		}
	}
	if len(xy) == 0 {
		return fmt.Errorf("plot %s: no counts", path)
	}
	line, err := plotter.NewLine(xy)
	if err != nil {
		return fmt.Errorf("plot %s: %w", path, err)
	}
	p.Add(line)
	names := make([]string, 0, len(thresholds))
	for n := range thresholds {
		names = append(names, n)
	}
	sort.Strings(names)
	palette := []color.Color{color.RGBA{R: 200, A: 255}, color.RGBA{G: 150, A: 255}, color.RGBA{B: 200, A: 255}, color.RGBA{R: 150, B: 150, A: 255}}
	ymax := 0.0
	for _, c := range counts {
		ymax = max(ymax, float64(c))
	}
	for i, n := range names {
		l, err := plotter.NewLine(plotter.XYs{{X: thresholds[n], Y: 1}, {X: thresholds[n], Y: ymax}})
		if err != nil {
			return err
		}
		l.Color = palette[i%len(palette)]
		l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		p.Add(l)
		p.Legend.Add(fmt.Sprintf("%s %.3g", n, thresholds[n]), l)
	}
	p.Legend.Top = true
	return save(p, path, 8*vg.Inch, 5*vg.Inch)
}

func save(p *plot.Plot, path string, w, h vg.Length) error {
	switch strings.ToLower(filepath.Ext(path)) {
	case ".png", ".svg":
	default:
		return fmt.Errorf("plot %s: want a .png or .svg file", path)
	}
	if err := p.Save(w, h, path); err != nil {
		return fmt.Errorf("plot %s: %w", path, err)
	}
	return nil
}
