package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/preflight"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestCheckExampleConfig runs the real `hostd check` on this host against
// the example configuration, with its host-specific names moved into a
// temporary directory (region, sockets), onto a free port (metrics) and
// onto an interface every host has (lo for vnet0). It must find no
// problem: the example and the host setup of `.ci/run` agree.
func TestCheckExampleConfig(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "go", "golang")
	dir := t.TempDir()
	bin := buildHostd(t, dir)
	src, err := os.ReadFile("../../hostd/dist/hostd.hcl")
	if err != nil {
		t.Fatal(err)
	}
	cfg := string(src)
	for _, r := range []struct{ old, new string }{
		{`"/dev/shm/shunt-tenant-a"`, strconv.Quote(filepath.Join(dir, "shm", "shunt-tenant-a"))},
		{`"/run/shunt/`, `"` + filepath.Join(dir, "run") + "/"},
		{`"127.0.0.1:9469"`, `"127.0.0.1:0"`},
		{`"vnet0"`, `"lo"`},
	} {
		if !strings.Contains(cfg, r.old) {
			t.Fatalf("the example config has no %s any more: update this test", r.old)
		}
		cfg = strings.ReplaceAll(cfg, r.old, r.new)
	}
	path := filepath.Join(dir, "hostd.hcl")
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}

	text, code := runCheckBinary(t, bin, "check", "-config", path)
	t.Logf("hostd check -config %s:\n%s", path, text)
	if code != 0 {
		t.Fatalf("hostd check: exit %d, want 0", code)
	}
	lines := strings.Split(strings.TrimSpace(text), "\n")
	if last := lines[len(lines)-1]; !strings.HasPrefix(last, "0 problems, ") {
		t.Errorf("summary: want 0 problems, got %q", last)
	}

	out, code := runCheckBinary(t, bin, "check", "-json", "-config", path)
	var r preflight.Report
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("hostd check -json: %v\n%s", err, out)
	}
	if code != 0 || r.Problems != 0 || r.Config != path || len(r.Findings) != len(lines)-1 {
		t.Errorf("hostd check -json: exit %d, %d problems, config %q, %d findings (text had %d)", code, r.Problems, r.Config, len(r.Findings), len(lines)-1)
	}
}

// buildHostd builds this command into dir.
func buildHostd(t *testing.T, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, "hostd")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// runCheckBinary runs bin with args and returns its stdout and exit code.
func runCheckBinary(t *testing.T, bin string, args ...string) (string, int) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("run %s: %v", bin, err)
	}
	if stderr.Len() > 0 {
		t.Logf("stderr: %s", stderr.String())
	}
	return stdout.String(), cmd.ProcessState.ExitCode()
}

// TestCheckExitCode: a problem makes `hostd check` exit 1, and it prints
// the problem with its fix; a config that cannot be read is a problem.
func TestCheckExitCode(t *testing.T) {
	testenv.NeedTool(t, "go", "golang")
	dir := t.TempDir()
	bin := buildHostd(t, dir)
	out, code := runCheckBinary(t, bin, "check", "-config", filepath.Join(dir, "missing.hcl"))
	if code != 1 || !strings.Contains(out, "problem") || !strings.Contains(out, "fix: edit ") || !strings.HasSuffix(out, "1 problem, 0 warnings\n") {
		t.Errorf("hostd check of a missing file: exit %d, want 1; output:\n%s", code, out)
	}
}
