// Command shunt-charts draws SVG charts from the raw output of
// `go test -bench`, as the Makefile's bench-* targets collect it:
//
//	shunt-charts [-o docs/charts] [-cmd 'make bench-shm'] bin/bench-shm.txt
//
// It writes one SVG per chart that has data (see internal/benchchart for
// the charts and how benchmark names map to them) and prints each file it
// wrote. Figures it cannot place are listed on stderr; they do not make it
// fail, so a new benchmark never breaks a bench target.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/shuntnet/shunt/internal/benchchart"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "shunt-charts:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("shunt-charts", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("o", "docs/charts", "directory to write the SVG files to")
	command := fs.String("cmd", "", "command that made the input, for the footnote (default \"go test -bench\")")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: shunt-charts [-o dir] [-cmd text] bench-output.txt...")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return fmt.Errorf("no input: give the raw go test -bench output, e.g. bin/bench-shm.txt")
	}

	set := benchchart.NewSet()
	for _, name := range fs.Args() {
		f, err := os.Open(name)
		if err != nil {
			return err
		}
		bad, err := set.Parse(f)
		f.Close()
		for _, e := range bad {
			fmt.Fprintf(stderr, "shunt-charts: %s: %v\n", name, e)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	if len(set.Keys) == 0 {
		return fmt.Errorf("no benchmark results in %v", fs.Args())
	}

	charts, notes := benchchart.Build(set, benchchart.Specs, benchchart.Rules, *command)
	for _, n := range notes {
		fmt.Fprintln(stderr, "shunt-charts:", n)
	}
	if len(charts) == 0 {
		return fmt.Errorf("no chart has data: see the notes above")
	}
	if err := os.MkdirAll(*dir, 0o755); err != nil {
		return fmt.Errorf("create chart directory: %w", err)
	}
	for _, c := range charts {
		var buf bytes.Buffer
		if err := c.WriteSVG(&buf); err != nil {
			return err
		}
		path := filepath.Join(*dir, c.Spec.File+".svg")
		if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
			return fmt.Errorf("write chart: %w", err)
		}
		fmt.Fprintln(stdout, "wrote", path)
	}
	return nil
}
