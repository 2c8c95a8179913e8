package main

import (
	"fmt"
	"regexp"
)

var (
	// v1.2.3, v1.2.3-4-gabc1234, either with -dirty.
	describeTag = regexp.MustCompile(`^v?([0-9]+(?:\.[0-9]+)*)(?:-([0-9]+)-g([0-9a-f]+))?(-dirty)?$`)
	// abc1234 or abc1234-dirty: no tag yet.
	describeHash = regexp.MustCompile(`^([0-9a-f]{4,40})(-dirty)?$`)
)

// debVersion turns `git describe --tags --always --dirty` output into a
// Debian version that sorts the way the commits do: v1.2.3 is 1.2.3, four
// commits later 1.2.3+4.gabc1234, and a tree without tags 0.0.0+gabc1234.
// Uncommitted changes add ".dirty" (or "+dirty").
func debVersion(describe string) (string, error) {
	if m := describeTag.FindStringSubmatch(describe); m != nil {
		v, extra := m[1], ""
		if m[2] != "" {
			extra = m[2] + ".g" + m[3]
		}
		if m[4] != "" {
			extra = join(extra, "dirty")
		}
		if extra != "" {
			v += "+" + extra
		}
		return v, nil
	}
	if m := describeHash.FindStringSubmatch(describe); m != nil {
		v := "0.0.0+g" + m[1]
		if m[2] != "" {
			v += ".dirty"
		}
		return v, nil
	}
	return "", fmt.Errorf("version %q: want git describe output (v1.2.3, v1.2.3-4-gabc1234, abc1234, each optionally -dirty); set one with make deb VERSION=1.2.3", describe)
}

func join(a, b string) string {
	if a == "" {
		return b
	}
	return a + "." + b
}
