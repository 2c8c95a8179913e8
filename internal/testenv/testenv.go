// Package testenv decides what a test does when the machine lacks something
// it needs: skip with the reason and the fix when run by hand, fail under
// CI=true, so a skip can never hide in CI.
package testenv

import (
	"os"
	"os/exec"
	"testing"
)

// CI reports whether the tests run in CI (CI=true).
func CI() bool { return os.Getenv("CI") == "true" }

// Missing skips or fails t: "what" is missing, "fix" says how to get it.
func Missing(t testing.TB, what, fix string) {
	t.Helper()
	if CI() {
		t.Fatalf("%s (CI=true, so this fails instead of skipping); fix: %s", what, fix)
	}
	t.Skipf("skipped: %s; fix: %s", what, fix)
}

// NeedRoot requires root.
func NeedRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		Missing(t, "needs root (network namespaces, conntrack, nftables)", "run as root, e.g. sudo -E make test")
	}
}

// NeedTool requires a program on PATH, installed by the Debian package pkg.
func NeedTool(t testing.TB, name, pkg string) {
	t.Helper()
	if _, err := exec.LookPath(name); err != nil {
		Missing(t, name+" is not installed", "apt-get install "+pkg)
	}
}
