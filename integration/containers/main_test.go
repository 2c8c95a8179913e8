//go:build linux

package containers

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// The binaries the tests use, built once by TestMain into bin.
var bin struct {
	dir     string
	hostd   string
	cni     string // the plugin, as bin/cni/shunt
	preload string // libshunt-preload.so
	probe   string // probe/, static
	cnitool string
	err     error // why they could not be built (tests then fail or skip)
}

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "shunt-containers-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin.dir = dir
	bin.err = build(dir)
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func build(dir string) error {
	bin.hostd = filepath.Join(dir, "hostd")
	bin.cni = filepath.Join(dir, "cni", "shunt")
	bin.preload = filepath.Join(dir, "libshunt-preload.so")
	bin.probe = filepath.Join(dir, "probe")
	bin.cnitool = filepath.Join(dir, "cnitool")
	for _, b := range []struct {
		out, pkg string
		static   bool
	}{
		{bin.hostd, "../../cmd/hostd", false},
		{bin.cni, "../../cmd/shunt-cni", false},
		{bin.probe, "./probe", true},
		{bin.cnitool, "github.com/containernetworking/cni/cnitool", false},
	} {
		cmd := exec.Command("go", "build", "-o", b.out, b.pkg)
		if b.static {
			// Static, and the same bytes from commit to commit (no VCS
			// stamp), so that the image it goes into stays cached.
			cmd = exec.Command("go", "build", "-buildvcs=false", "-trimpath", "-o", b.out, b.pkg)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("build %s: %v\n%s", b.pkg, err, out)
		}
	}
	cmd := exec.Command("make", "-s", "-C", "../..", "BIN="+dir, "preload")
	cmd.Env = append(os.Environ(), "MAKEFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("make preload: %v\n%s", err, out)
	}
	return nil
}

// imageFiles are the programs the test image holds, with the libraries
// ldd finds for them (and for the preload library, which CDI mounts).
var imageFiles = []string{"/bin/busybox", "/usr/bin/iperf3", "/usr/bin/redis-server", "/usr/bin/redis-cli", "/usr/bin/redis-benchmark", "/usr/bin/socat"}

// busyboxApplets get links in the image's /bin.
var busyboxApplets = []string{"sh", "sha256sum", "cat", "sleep", "head", "ls", "kill", "wc", "sync"}

// rootfs writes the test image's root file system as a tar file in dir and
// returns its path and a tag that changes when its content would.
func rootfs(dir string) (string, string, error) {
	files := append([]string{}, imageFiles...)
	libs := map[string]bool{}
	for _, f := range append(append([]string{}, imageFiles...), bin.preload) {
		out, err := exec.Command("ldd", f).Output()
		if err != nil {
			if f == "/bin/busybox" {
				continue // static
			}
			return "", "", fmt.Errorf("ldd %s: %v", f, err)
		}
		for _, w := range strings.Fields(string(out)) {
			if strings.HasPrefix(w, "/") {
				libs[w] = true
			}
		}
	}
	for l := range libs {
		files = append(files, l)
	}
	sort.Strings(files)
	root := filepath.Join(dir, "rootfs")
	h := sha256.New()
	for _, f := range files {
		src, err := filepath.EvalSymlinks(f)
		if err != nil {
			return "", "", err
		}
		dst := filepath.Join(root, f)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return "", "", err
		}
		if err := copyFile(src, dst, h); err != nil {
			return "", "", err
		}
		fmt.Fprintf(h, "%s\n", f)
	}
	if err := copyFile(bin.probe, filepath.Join(root, "bin/probe"), h); err != nil {
		return "", "", err
	}
	for _, a := range busyboxApplets {
		if err := os.Symlink("busybox", filepath.Join(root, "bin", a)); err != nil {
			return "", "", err
		}
	}
	for _, d := range []string{"tmp", "data", "etc"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o1777); err != nil {
			return "", "", err
		}
	}
	tar := filepath.Join(dir, "rootfs.tar")
	if out, err := exec.Command("tar", "-C", root, "-cf", tar, ".").CombinedOutput(); err != nil {
		return "", "", fmt.Errorf("tar: %v: %s", err, out)
	}
	return tar, hex.EncodeToString(h.Sum(nil))[:16], nil
}

func copyFile(src, dst string, h io.Writer) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(io.MultiWriter(out, h), in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
