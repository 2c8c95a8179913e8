package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/goreleaser/nfpm/v2"
	"github.com/goreleaser/nfpm/v2/deb"
)

func main() {
	version := flag.String("version", "", "`git describe --tags --always --dirty` output or a Debian version (default: run git describe)")
	bin := flag.String("bin", "bin", "directory holding the built hostd, libshunt-preload.so and shunt-run")
	out := flag.String("out", "", "directory for the .deb files (default: -bin)")
	root := flag.String("root", ".", "the repository")
	maint := flag.String("maintainer", "Shunt maintainers <maintainers@shuntnet.invalid>", "the packages' Maintainer field")
	flag.Parse()
	if *out == "" {
		*out = *bin
	}
	paths, err := run(*root, *bin, *out, *version, *maint)
	if err != nil {
		fmt.Fprintln(os.Stderr, "packaging:", err)
		os.Exit(1)
	}
	for _, p := range paths {
		fmt.Println(p)
	}
}

// run builds both packages into out and returns their paths.
func run(root, bin, out, describe, maintainer string) ([]string, error) {
	if describe == "" {
		b, err := exec.Command("git", "-C", root, "describe", "--tags", "--always", "--dirty").Output()
		if err != nil {
			return nil, fmt.Errorf("git describe: %w (pass -version)", err)
		}
		describe = strings.TrimSpace(string(b))
	}
	v, err := debVersion(describe)
	if err != nil {
		return nil, err
	}
	infos, err := build{Root: root, Bin: bin, Version: v, Maintainer: maintainer}.packages()
	if err != nil {
		return nil, err
	}
	var paths []string
	for _, info := range infos {
		p, err := writeDeb(info, out)
		if err != nil {
			return nil, err
		}
		paths = append(paths, p)
	}
	return paths, nil
}

// writeDeb packages info into dir under Debian's file name convention,
// through a temporary file, so a failed build leaves no partial package.
func writeDeb(info *nfpm.Info, dir string) (_ string, err error) {
	path := filepath.Join(dir, deb.Default.ConventionalFileName(info))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	f, err := os.CreateTemp(dir, ".shunt-deb-*")
	if err != nil {
		return "", err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if err := deb.Default.Package(info, f); err != nil {
		return "", fmt.Errorf("package %s: %w", info.Name, err)
	}
	if err := f.Chmod(0o644); err != nil {
		return "", err
	}
	if err := f.Close(); err != nil {
		return "", err
	}
	return path, os.Rename(f.Name(), path)
}
