package main

import (
	"debug/elf"
	"fmt"
	"strconv"
	"strings"
)

// glibcDepends returns the libc6 dependency of the ELF files: the newest
// GLIBC_x.y symbol version any of them imports, as dpkg-shlibdeps would
// derive it ("libc6 (>= 2.34)"), or "" if none of them links libc.
func glibcDepends(paths ...string) (string, error) {
	var newest []int
	for _, p := range paths {
		f, err := elf.Open(p)
		if err != nil {
			return "", fmt.Errorf("read %s: %w", p, err)
		}
		syms, err := f.ImportedSymbols()
		f.Close()
		if err != nil && err != elf.ErrNoSymbols {
			return "", fmt.Errorf("imported symbols of %s: %w", p, err)
		}
		for _, s := range syms {
			v, ok := glibcVersion(s.Version)
			if ok && versionLess(newest, v) {
				newest = v
			}
		}
	}
	if newest == nil {
		return "", nil
	}
	parts := make([]string, len(newest))
	for i, n := range newest {
		parts[i] = strconv.Itoa(n)
	}
	return "libc6 (>= " + strings.Join(parts, ".") + ")", nil
}

// glibcVersion parses "GLIBC_2.34"; GLIBC_PRIVATE and other libraries'
// versions are not versions of libc6.
func glibcVersion(s string) ([]int, bool) {
	rest, ok := strings.CutPrefix(s, "GLIBC_")
	if !ok {
		return nil, false
	}
	var v []int
	for _, f := range strings.Split(rest, ".") {
		n, err := strconv.Atoi(f)
		if err != nil {
			return nil, false
		}
		v = append(v, n)
	}
	return v, true
}

func versionLess(a, b []int) bool {
	for i := 0; i < len(a) && i < len(b); i++ {
		if a[i] != b[i] {
			return a[i] < b[i]
		}
	}
	return len(a) < len(b)
}
